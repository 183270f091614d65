"""Property-based fuzzing of the public API: random GenerateRequests, random cancellations, raw garbage.

Whatever arrives, no process dies and every call ends in a complete stream or a
clean status; afterwards nothing is left in flight and every KV block is free.
"""

from __future__ import annotations

import json
import math
from collections import Counter

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reliability import all_blocks_free, wait_until
from twinplane.controlplane.tokenizer import CHAT_ROLES
from twinplane.proto import generation_pb2 as pb
from twinplane.proto import generation_pb2_grpc as pb_grpc

UINT32, UINT64 = 2**32 - 1, 2**64 - 1
FUZZ = settings(max_examples=1000, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
OUTCOMES: Counter[str] = Counter()  # how the fuzzed calls ended, checked by the last test
CLEAN_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}


def mostly(valid: st.SearchStrategy, anything: st.SearchStrategy) -> st.SearchStrategy:
    """Valid values five times in six, so that enough requests reach the model; anything otherwise."""
    return st.sampled_from(range(6)).flatmap(lambda i: anything if i == 5 else valid)


any_float = st.floats(allow_nan=True, allow_infinity=True, width=32)


def float_field(low: float, high: float) -> st.SearchStrategy[float | None]:
    return mostly(st.none() | st.floats(low, high, width=32), any_float)


text = st.text(max_size=120)
token_ids = mostly(st.lists(st.integers(3, 49151), min_size=1, max_size=100),
                   st.lists(st.integers(0, UINT32), max_size=600))
# tools and tool calls: names and JSON objects as the API allows them, or anything
names = mostly(st.from_regex(r"[a-z_]{1,12}", fullmatch=True), st.text(max_size=70))
json_objects = mostly(st.dictionaries(st.text(max_size=5), st.integers() | text, max_size=3).map(json.dumps),
                      st.text(max_size=40))
tool_calls = mostly(st.just([]), st.lists(st.builds(pb.ToolCall, id=st.text(max_size=10), name=names,
                                                    arguments=json_objects), max_size=2))
tools = mostly(st.lists(st.builds(pb.Tool, name=names, description=text, parameters=json_objects), max_size=2),
               st.lists(st.builds(pb.Tool, name=names), min_size=120, max_size=130))
messages = mostly(st.lists(st.builds(pb.ChatMessage, role=st.sampled_from(CHAT_ROLES), content=text,
                                     tool_calls=tool_calls, tool_call_id=st.text(max_size=10)), min_size=1, max_size=3),
                  st.lists(st.builds(pb.ChatMessage, role=st.text(max_size=8), content=text), max_size=4))
# structured output: constraints that compile (now and then none), or any text in their fields
structured = st.none() | mostly(
    st.sampled_from([pb.StructuredOutput(regex=r"[a-z]{1,6}( [a-z]{1,6}){0,3}"), pb.StructuredOutput(json_object=True),
                     pb.StructuredOutput(choice=pb.Choices(choices=["yes", "no"])),
                     pb.StructuredOutput(json_schema='{"type": "object", "properties": {"n": {"type": "integer"}}}')]),
    st.builds(pb.StructuredOutput, regex=st.text(max_size=30))
    | st.builds(pb.StructuredOutput, json_schema=json_objects)
    | st.builds(pb.StructuredOutput, choice=st.builds(pb.Choices, choices=st.lists(st.text(max_size=5), max_size=3))))
sampling = st.builds(
    pb.SamplingParams,
    temperature=float_field(0, 2), top_p=float_field(0.25, 1), min_p=float_field(0, 1),
    top_k=mostly(st.none() | st.integers(-1, 100), st.integers(-(2**31), 2**31 - 1)),
    repetition_penalty=float_field(0.5, 2.0), presence_penalty=float_field(-2, 2),
    frequency_penalty=float_field(-2, 2), seed=st.none() | st.integers(0, UINT64))


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        request_id=draw(mostly(st.sampled_from(["", "", "fuzz"]), st.text(max_size=300))),
        sampling=draw(sampling),
        max_tokens=draw(mostly(st.none() | st.integers(1, 40), st.integers(0, UINT32))),
        min_tokens=draw(mostly(st.just(0) | st.integers(0, 4), st.integers(0, UINT32))),
        stop=draw(mostly(st.lists(st.text(min_size=1, max_size=8), max_size=3),
                         st.lists(st.text(max_size=300), max_size=20))),
        stop_token_ids=draw(mostly(st.lists(st.integers(0, 49151), max_size=4), st.lists(st.integers(0, UINT32),
                                                                                          max_size=70))),
        ignore_eos=draw(st.booleans()),
        logprobs=draw(mostly(st.none() | st.integers(0, 20), st.integers(0, UINT32))),
        truncate_prompt_tokens=draw(mostly(st.just(0) | st.integers(1, 500), st.integers(0, UINT32))),
        skip_special_tokens=draw(st.none() | st.booleans()),
        parse_output=draw(mostly(st.just(False), st.booleans())),
        logit_bias=draw(mostly(st.dictionaries(st.integers(0, 49151), st.floats(-100, 100, width=32), max_size=4),
                               st.dictionaries(st.integers(0, UINT32), any_float, max_size=1100))))
    constraint = draw(structured)
    if constraint is not None:
        req.structured_output.CopyFrom(constraint)
    kind = draw(mostly(st.sampled_from(["text", "token_ids", "chat"]), st.just("none")))
    if kind == "text":
        req.text = draw(mostly(st.text(min_size=1, max_size=120), text))
    elif kind == "token_ids":
        req.token_ids.ids.extend(draw(token_ids))
    elif kind == "chat":
        req.chat.messages.extend(draw(messages))
        req.chat.tools.extend(draw(tools))
    return req


@pytest.fixture(scope="module")
def stub(shared_planes):
    with grpc.insecure_channel(shared_planes.address) as channel:
        yield pb_grpc.GenerationStub(channel)


def run_call(stub, req: pb.GenerateRequest, cancel_after: int | None) -> str:
    """Runs one call; returns how it ended, or raises AssertionError for anything unclean."""
    call = stub.Generate(req, timeout=30)
    seen = 0
    try:
        for response in call:
            seen += 1
            if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                assert response.usage.completion_tokens >= 0
                return "finished"
            if cancel_after is not None and seen > cancel_after:
                call.cancel()
    except grpc.RpcError as error:
        if error.code() == grpc.StatusCode.CANCELLED and cancel_after is not None:
            return "cancelled"
        assert error.code() in CLEAN_CODES, (error.code(), error.details(), req)
        assert error.details(), "a refusal must say why"
        return error.code().name
    raise AssertionError(f"the stream ended without a final message: {req}")


@FUZZ
@given(req=generate_requests(), cancel_after=st.none() | st.integers(0, 5))
def test_random_requests_end_cleanly(stub, shared_planes, req, cancel_after):
    if cancel_after is None and (not req.HasField("max_tokens") or req.max_tokens > 64):
        cancel_after = 8  # long generations are cut short, to keep the run to about a minute
    OUTCOMES[run_call(stub, req, cancel_after)] += 1
    assert shared_planes.dataplane.poll() is None


@settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=st.binary(max_size=2000))
def test_raw_garbage_bytes_end_cleanly(shared_planes, payload):
    with grpc.insecure_channel(shared_planes.address) as channel:
        call = channel.unary_stream("/twinplane.v1.Generation/Generate", request_serializer=None,
                                    response_deserializer=None)(payload, timeout=30)
        try:
            for _ in call:  # bytes that happen to parse are a request like any other
                pass
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error  # bad bytes or a bad request


def test_after_fuzzing_everything_is_free_and_serving(stub, shared_planes):
    print("fuzzed calls ended:", dict(OUTCOMES))
    if OUTCOMES:  # the fuzz ran in this session: it reached the model, not only the validation
        assert OUTCOMES["finished"] + OUTCOMES["cancelled"] >= 20, OUTCOMES
    wait_until(lambda: all_blocks_free(shared_planes), 10, "every KV block to be free")
    assert shared_planes.dataplane.poll() is None
    responses = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6]), max_tokens=4,
                                                      sampling=pb.SamplingParams(temperature=0)), timeout=30))
    assert sum(len(r.token_ids) for r in responses) >= 1
    assert math.isfinite(responses[-1].usage.completion_tokens)
