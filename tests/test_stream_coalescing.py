"""A stream that falls behind gets its queued outputs merged into one message."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

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


def test_a_request_that_asks_for_no_logprobs_gets_none_from_a_step_that_scored_every_token():
    """A data plane scores every token of a step once any request in it asks for log-probabilities: a
    request that did not ask gets its tokens without them, the one that asked gets its own."""
    from twinplane.controlplane.api import TokenLogprobs
    from twinplane.controlplane.config import ControlPlaneConfig
    from twinplane.controlplane.messages import TokenOutput

    engine = Engine(ControlPlaneConfig(dataplane="unix:///nowhere"))
    plain = RequestState(1, "plain", [1, 2], RequestParams(max_tokens=8), None, 1, engine.metrics, 0.0, engine.unsent)
    scored = RequestState(2, "scored", [1, 2], RequestParams(max_tokens=8, logprobs=0), None, 1, engine.metrics, 0.0,
                          engine.unsent)
    engine.requests.update({1: plain, 2: scored})
    engine.step([TokenOutput(1, 5, 2, TokenLogprobs(5, -0.5), None, 0),
                 TokenOutput(2, 6, 2, TokenLogprobs(6, -0.25), None, 0)], engine.core_snapshot)
    assert [out.logprobs for out in plain.outputs] == [[]]
    assert [out.logprobs for out in scored.outputs] == [[TokenLogprobs(6, -0.25)]]
    engine._tokenizer_pool.shutdown()


def _engine_and_request(params: RequestParams = RequestParams(max_tokens=8), tokenizer=None, **config):
    from twinplane.controlplane.config import ControlPlaneConfig

    engine = Engine(ControlPlaneConfig(dataplane="unix:///nowhere", **config))
    state = RequestState(7, "r7", [1, 2], params, tokenizer, engine.config.stream_interval, engine.metrics, 0.0,
                         engine.unsent)
    engine.requests[state.seq_id] = state
    return engine, state


def _step(engine: Engine, token: int, position: int, reason: str | None = None, num_cached: int = 0) -> None:
    from twinplane.controlplane.messages import TokenOutput

    engine.step([TokenOutput(7, token, position, None, reason, num_cached)], engine.core_snapshot)


def test_the_first_token_goes_out_at_once_and_the_others_stream_interval_at_a_time():
    """The last output goes out with what it has, and carries the usage with the prompt's cached tokens."""
    engine, state = _engine_and_request(stream_interval=3)
    for i, token in enumerate((5, 6, 7, 8, 9)):
        _step(engine, token, 2 + i, "length" if token == 9 else None, num_cached=1)
    got = list(state.outputs)
    assert [out.token_ids for out in got] == [[5], [6, 7, 8], [9]]
    assert (got[-1].finish_reason, got[-1].prompt_tokens, got[-1].completion_tokens) == (FinishReason.LENGTH, 2, 5)
    assert got[-1].cached_prompt_tokens == 1
    engine._tokenizer_pool.shutdown()


def test_a_stream_not_read_is_ended_past_its_limit_and_its_reader_gets_the_error():
    """Past max_unsent_tokens_per_stream tokens unread, the request is aborted and what waited is dropped: the
    reader (an HTTP stream, which has no call to end) gets the error next."""
    from twinplane.controlplane.errors import StreamNotRead

    engine, state = _engine_and_request(max_unsent_tokens_per_stream=2)
    for i in range(3):
        _step(engine, 5 + i, 2 + i)
    assert state.finished and not engine.requests and engine.unsent.total == 0
    with pytest.raises(StreamNotRead, match=r"3 tokens waited .*max_unsent_tokens_per_stream 2"):
        asyncio.run(asyncio.wait_for(state.next_output(), 5))
    engine._tokenizer_pool.shutdown()


def test_a_finished_request_is_counted_once_however_its_stream_ends():
    """Read to its end, or left unread past the limit once finished: one ending, as it finished, and no abort
    goes to the engine core, which ended it."""
    from twinplane.controlplane.messages import Abort

    for read in (True, False):
        engine, state = _engine_and_request(max_unsent_tokens_per_stream=1)
        sent = []
        engine.supervisor.send = sent.append
        _step(engine, 5, 2, "length")
        if read:
            async def read_all():
                return [out async for out in engine.outputs(state)]
            assert [out.token_ids for out in asyncio.run(read_all())] == [[5]]
        else:
            state.push(RequestOutput("r7", [6, 7]), 2)  # as if more had waited
            engine._end_unread(state, "max_unsent_tokens_per_stream 1")
        assert {k: v for k, v in engine.metrics.finished.items() if v} == {"length": 1}
        assert not any(isinstance(m, Abort) for m in sent)
        engine._tokenizer_pool.shutdown()


def test_a_stop_string_ends_the_request_in_the_engine_core_too():
    """The core ends a request at a stop token or max_tokens itself; one a stop string ends here, it is told of."""
    from tests.test_finish_rules import CharTokenizer
    from twinplane.controlplane.messages import Abort

    engine, state = _engine_and_request(RequestParams(max_tokens=8, stop=("c",)), CharTokenizer())
    sent = []
    engine.supervisor.send = sent.append
    _step(engine, 0, 2)
    _step(engine, 2, 3)  # "c"
    assert state.outputs[-1].finish_reason is FinishReason.STOP_STRING
    assert [m.seq_id for m in sent if isinstance(m, Abort)] == [7]
    engine._tokenizer_pool.shutdown()


def test_over_the_total_streams_are_ended_until_the_rest_fit():
    from twinplane.controlplane.config import ControlPlaneConfig

    engine = Engine(ControlPlaneConfig(dataplane="unix:///nowhere", max_unsent_tokens=4))
    for i, unsent in enumerate((3, 4, 2)):
        state = RequestState(i, f"r{i}", [1], RequestParams(max_tokens=8), None, 1, EngineMetrics(), 0.0,
                             engine.unsent)
        state.finished, state.end_call = True, lambda error: None
        state.push(RequestOutput(state.request_id, [7] * unsent), unsent)
    engine._bound_unsent()
    assert engine.unsent.total == 2 and [s.request_id for s in engine.unsent.streams] == ["r2"]
    engine._tokenizer_pool.shutdown()


def test_a_structured_outputs_first_output_leaves_the_prompt_out_of_its_reasoning_split():
    """The grammar reads the text as the reasoning parser does by default, whatever the prompt opened; so does the
    split of its text (the first output carries the prompt's ids only for other requests)."""
    outputs = []
    for regex in (None, "a+"):
        state = RequestState(1, "r", [1, 2], RequestParams(max_tokens=8, regex=regex), None, 1, EngineMetrics(), 0.0,
                             Unsent())
        state.record_token(5, 2, None, 0)
        state.emit()
        outputs.append(state.outputs.popleft())
    assert [out.prompt_ids for out in outputs] == [[1, 2], None]
