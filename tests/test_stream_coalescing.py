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
