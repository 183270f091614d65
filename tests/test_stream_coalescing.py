"""A stream that falls behind gets its queued outputs merged into one message."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace


from twinplane.controlplane.api import RequestOutput
from twinplane.controlplane.engine import Engine
from twinplane.controlplane.errors import ServiceError
from twinplane.controlplane.metrics import EngineMetrics
from twinplane.controlplane.request_state import RequestState, Unsent
from twinplane.controlplane.sequence import FinishReason, RequestParams


def _collect(items: list) -> tuple[list[RequestOutput], Exception | None, list]:
    """Queues every item before the reader starts (a reader that fell behind), then reads them all."""
    aborted = []
    engine = SimpleNamespace(abort=aborted.append)
    unsent = Unsent()
    state = RequestState(1, "r", [1, 2], RequestParams(max_tokens=8), None, 1, EngineMetrics(), 0.0, unsent)

    async def read():
        for item in items:
            state.push(item, 0 if isinstance(item, Exception) else len(item.token_ids))
        got = []
        try:
            async for out in Engine.outputs(engine, state):
                got.append(out)
        except ServiceError as exc:
            return got, exc
        return got, None

    got, error = asyncio.run(read())
    return got, error, aborted


def test_queued_outputs_go_out_as_one_message_with_the_final_usage():
    items = [RequestOutput("r", [1], "a"), RequestOutput("r", [2], "b"),
             RequestOutput("r", [3], "c", finish_reason=FinishReason.LENGTH, prompt_tokens=5, completion_tokens=3)]
    got, error, aborted = _collect(items)
    assert error is None and len(got) == 1
    assert got[0].token_ids == [1, 2, 3] and got[0].text == "abc"
    assert got[0].finish_reason is FinishReason.LENGTH and (got[0].prompt_tokens, got[0].completion_tokens) == (5, 3)
    assert len(aborted) == 1  # the reader's exit always reaches abort (a no-op once finished)


def test_outputs_before_an_error_are_delivered_then_the_error_raised():
    failure = ServiceError("the data plane failed")
    got, error, _ = _collect([RequestOutput("r", [1], "a"), RequestOutput("r", [2], "b"), failure])
    assert [out.token_ids for out in got] == [[1, 2]] and error is failure


def test_nothing_is_read_past_the_final_output():
    later = RequestOutput("r", [9], "z")
    got, _, _ = _collect([RequestOutput("r", [1], "a", finish_reason=FinishReason.STOP_TOKEN), later])
    assert [out.token_ids for out in got] == [[1]]


def test_unsent_tokens_are_counted_until_read():
    unsent = Unsent()
    state = RequestState(1, "r", [1, 2], RequestParams(max_tokens=8), None, 1, EngineMetrics(), 0.0, unsent)
    state.push(RequestOutput("r", [1, 2]), 2)
    state.push(RequestOutput("r", [3]), 1)
    assert (state.unsent, unsent.total, unsent.furthest_behind()) == (3, 3, state)
    assert asyncio.run(state.next_output()).token_ids == [1, 2, 3]
    assert (state.unsent, unsent.total) == (0, 0)
    state.push(RequestOutput("r", [4]), 1)
    state.stream_closed()  # the call ended with this unsent: it no longer counts
    assert (state.unsent, unsent.total, unsent.streams) == (0, 0, set())


def test_over_the_total_the_streams_furthest_behind_are_ended():
    from twinplane.controlplane.config import ControlPlaneConfig
    from twinplane.controlplane.errors import StreamNotRead

    engine = Engine(ControlPlaneConfig(dataplane="unix:///nowhere", max_unsent_tokens=5))
    ended = []
    for i, unsent in enumerate((1, 4, 2)):  # finished requests whose clients stopped reading
        state = RequestState(i, f"r{i}", [1], RequestParams(max_tokens=8), None, 1, EngineMetrics(), 0.0,
                             engine.unsent)
        state.finished, state.end_call = True, ended.append
        state.push(RequestOutput(state.request_id, [7] * unsent), unsent)
    engine._bound_unsent()
    assert engine.unsent.total == 3 and len(ended) == 1 and isinstance(ended[0], StreamNotRead)
    assert "4 tokens" in str(ended[0]) and "max_unsent_tokens 5" in str(ended[0])
    assert sorted(s.request_id for s in engine.unsent.streams) == ["r0", "r2"]
    engine._tokenizer_pool.shutdown()


def test_a_backlog_of_engine_core_messages_lets_a_reading_stream_keep_up():
    """The engine core's messages can pile up while the frontend's event loop is busy elsewhere
    (another thread holding the GIL, a loaded machine). Applying that backlog gives every stream
    its turn between messages, so a client that reads is never taken for one that does not,
    however far the frontend itself fell behind."""
    import socket

    from twinplane.controlplane.config import ControlPlaneConfig
    from twinplane.controlplane.ipc import Channel
    from twinplane.controlplane.messages import StepOutputs, TokenOutput

    limit, backlog = 16, 200

    async def run():
        engine = Engine(ControlPlaneConfig(dataplane="unix:///nowhere", max_unsent_tokens_per_stream=limit))
        state = RequestState(7, "r7", [1, 2], RequestParams(max_tokens=backlog), None, 1, EngineMetrics(), 0.0,
                             engine.unsent)
        ended = []
        state.end_call = ended.append
        engine.requests[state.seq_id] = state
        a, b = socket.socketpair()
        core, frontend = Channel(a), Channel(b)
        await core.open()
        await frontend.open()
        for i in range(backlog):  # all of it waiting before the frontend reads any
            reason = FinishReason.LENGTH.value if i == backlog - 1 else None
            core.send(StepOutputs([TokenOutput(state.seq_id, 100 + i, 2 + i, None, reason, 0)], engine.core_snapshot))
        await core.writer.drain()

        async def read():
            return [t for out in [o async for o in engine.outputs(state)] for t in out.token_ids]

        reader = asyncio.create_task(read())
        await asyncio.sleep(0)  # the client is waiting for its next message
        serving = asyncio.create_task(engine.supervisor._serve(frontend))  # the frontend's side of the core
        tokens = await asyncio.wait_for(reader, 30)
        core.close()
        await asyncio.wait_for(serving, 10)
        engine._tokenizer_pool.shutdown()
        return tokens, ended

    tokens, ended = asyncio.run(run())
    assert ended == [] and tokens == [100 + i for i in range(backlog)]
