"""Pure parts of the Python client: request building and response conversion (no server)."""

from __future__ import annotations

import pytest

from twinplane.clients.client import (
    GenerateChunk,
    PositionLogprobs,
    Usage,
    build_request,
    build_tokenize_request,
    chunk_from_pb,
    model_info_from_pb,
)
from twinplane.proto import generation_pb2 as pb

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                   "presence_penalty", "frequency_penalty", "seed")


def test_text_prompt_leaves_every_optional_field_unset() -> None:
    request = build_request("Hello")
    assert request.WhichOneof("input") == "text"
    assert request.text == "Hello"
    for name in ("sampling", "max_tokens", "logprobs", "skip_special_tokens"):
        assert not request.HasField(name), name
    assert (request.request_id, request.min_tokens, request.truncate_prompt_tokens) == ("", 0, 0)
    assert list(request.stop) == [] and list(request.stop_token_ids) == [] and not request.ignore_eos


def test_token_ids_and_messages_set_their_oneof_member() -> None:
    request = build_request(token_ids=[5, 0, 7])
    assert request.WhichOneof("input") == "token_ids"
    assert list(request.token_ids.ids) == [5, 0, 7]
    request = build_request(messages=[{"role": "system", "content": "Be brief."}, ("user", "Hi")])
    assert request.WhichOneof("input") == "chat"
    assert [(m.role, m.content) for m in request.chat.messages] == [("system", "Be brief."), ("user", "Hi")]


def test_empty_inputs_still_count_as_given() -> None:
    assert build_request("").WhichOneof("input") == "text"
    assert build_request(token_ids=[]).WhichOneof("input") == "token_ids"
    assert build_request(messages=[]).WhichOneof("input") == "chat"


@pytest.mark.parametrize("inputs", [
    {},
    {"prompt": "a", "token_ids": [1]},
    {"prompt": "a", "messages": [("user", "b")]},
    {"token_ids": [1], "messages": [("user", "b")]},
])
def test_rejects_zero_or_several_inputs(inputs: dict) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        build_request(**inputs)


@pytest.mark.parametrize("field, value", [("max_tokens", -1), ("max_tokens", 2**32 + 2), ("top_k", 2**32 + 1),
                                          ("seed", 2**64), ("temperature", "hot"), ("logit_bias", {5: "up"})])
def test_a_value_its_field_cannot_hold_is_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"^{field}="):
        build_request("Hi", **{field: value})


def test_a_misspelled_argument_is_refused_as_unknown() -> None:
    with pytest.raises(TypeError, match="unknown argument max_token$"):
        build_request("Hi", max_token=3)
    with pytest.raises(TypeError, match="given without messages"):
        build_request("Hi", add_generation_prompt=False)


@pytest.mark.parametrize("messages", [[("user",)], [{"role": "user"}], ["hi"], [("user", 3)]])
def test_rejects_malformed_messages(messages: list) -> None:
    with pytest.raises(ValueError, match="chat"):
        build_request(messages=messages)


def test_tool_calls_and_tools_take_the_openai_form() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    request = build_request(messages=[{"role": "assistant", "content": None, "tool_calls": [call]},
                                      {"role": "tool", "tool_call_id": "c1", "content": "ok"}],
                            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    assert request.chat.messages[0].tool_calls[0] == pb.ToolCall(id="c1", name="f", arguments='{"a": 1}')
    assert (request.chat.messages[0].content, request.chat.messages[1].tool_call_id) == ("", "c1")
    assert (request.chat.tools[0].name, request.chat.tools[0].parameters) == ("f", '{"type": "object"}')
    for bad in ({"id": "c1"}, "f", {"function": {"arguments": "{}"}}):
        with pytest.raises(ValueError, match="a tool call is"):
            build_request(messages=[{"role": "assistant", "tool_calls": [bad]}])


def test_rejects_negative_token_ids() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        build_request(token_ids=[1, -2])


def test_zero_values_are_set_not_unset() -> None:
    request = build_request("x", temperature=0.0, top_k=0, seed=0, max_tokens=0, logprobs=0,
                            skip_special_tokens=False)
    assert request.HasField("sampling")
    for name in ("temperature", "top_k", "seed"):
        assert request.sampling.HasField(name), name
    for name in ("top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        assert not request.sampling.HasField(name), name
    for name in ("max_tokens", "logprobs", "skip_special_tokens"):
        assert request.HasField(name), name
    assert (request.max_tokens, request.logprobs, request.skip_special_tokens) == (0, 0, False)


def test_every_argument_reaches_its_field() -> None:
    values = dict(temperature=0.5, top_p=0.75, top_k=40, min_p=0.125, repetition_penalty=1.25,
                  presence_penalty=-0.5, frequency_penalty=1.5, seed=2**63 + 1)
    request = build_request(
        "x", request_id="r-1", max_tokens=16, min_tokens=2, stop=["\n\n", "END"],
        stop_token_ids=[2, 0], ignore_eos=True, logprobs=5, truncate_prompt_tokens=100,
        skip_special_tokens=True, **values,
    )
    assert {name: getattr(request.sampling, name) for name in SAMPLING_FIELDS} == values
    assert (request.request_id, request.max_tokens, request.min_tokens) == ("r-1", 16, 2)
    assert list(request.stop) == ["\n\n", "END"] and list(request.stop_token_ids) == [2, 0]
    assert request.ignore_eos and request.logprobs == 5 and request.truncate_prompt_tokens == 100
    assert request.skip_special_tokens


def test_a_single_stop_string_is_not_split_into_characters() -> None:
    assert list(build_request("x", stop="END").stop) == ["END"]


def test_tokenize_request() -> None:
    assert build_tokenize_request("abc").WhichOneof("input") == "text"
    chat = build_tokenize_request(messages=[("user", "hi")])
    assert chat.WhichOneof("input") == "chat" and chat.chat.messages[0].content == "hi"
    with pytest.raises(ValueError):
        build_tokenize_request()
    with pytest.raises(ValueError):
        build_tokenize_request("a", [("user", "b")])


def test_running_chunk_has_no_finish_reason_or_usage() -> None:
    chunk = chunk_from_pb(pb.GenerateResponse(request_id="r", token_ids=[11, 12], text="ab"))
    assert chunk == GenerateChunk(request_id="r", token_ids=[11, 12], text="ab", logprobs=[],
                                  finish_reason=None, usage=None, matched_stop="")


@pytest.mark.parametrize(("reason", "expected"), [
    (pb.FINISH_REASON_STOP_TOKEN, "stop_token"),
    (pb.FINISH_REASON_STOP_STRING, "stop_string"),
    (pb.FINISH_REASON_LENGTH, "length"),
    (pb.FINISH_REASON_ABORTED, "aborted"),
])
def test_finish_reason_mapping(reason: int, expected: str) -> None:
    chunk = chunk_from_pb(pb.GenerateResponse(finish_reason=reason, usage=pb.Usage()))
    assert chunk.finish_reason == expected
    assert chunk.usage == Usage(0, 0, 0)  # a set but all-zero Usage is still present


def test_last_chunk_carries_usage_and_matched_stop() -> None:
    response = pb.GenerateResponse(
        request_id="r", finish_reason=pb.FINISH_REASON_STOP_STRING, matched_stop="END",
        usage=pb.Usage(prompt_tokens=7, completion_tokens=3, cached_prompt_tokens=4),
    )
    chunk = chunk_from_pb(response)
    assert chunk.usage == Usage(prompt_tokens=7, completion_tokens=3, cached_prompt_tokens=4)
    assert chunk.matched_stop == "END"


def test_logprobs_conversion() -> None:
    position = pb.PositionLogprobs(
        sampled=pb.TokenLogprob(token_id=9, logprob=-0.5),
        top=[pb.TokenLogprob(token_id=9, logprob=-0.5), pb.TokenLogprob(token_id=4, logprob=-1.25)],
    )
    bare = pb.PositionLogprobs(sampled=pb.TokenLogprob(token_id=3, logprob=-2.0))
    chunk = chunk_from_pb(pb.GenerateResponse(token_ids=[9, 3], logprobs=[position, bare]))
    assert chunk.logprobs == [
        PositionLogprobs(token_id=9, logprob=-0.5, top=[(9, -0.5), (4, -1.25)]),
        PositionLogprobs(token_id=3, logprob=-2.0, top=[]),
    ]


def test_model_info_conversion() -> None:
    info = model_info_from_pb(pb.ModelInfo(
        model="default", architecture="LlamaForCausalLM", vocab_size=49152, max_model_len=8192,
        dtype="bfloat16", block_size=256, num_kv_blocks=100, tensor_parallel_size=1,
        attention_backend="torch", eos_token_ids=[2, 0], max_logprobs=20, has_chat_template=True,
        generation_defaults=pb.GenerationDefaults(temperature=0.0, top_k=20),
    ))
    assert info.eos_token_ids == [2, 0] and isinstance(info.eos_token_ids, list)
    assert info.generation_defaults == {"temperature": 0.0, "top_k": 20}  # only those set, a 0 included
    assert (info.architecture, info.vocab_size, info.max_model_len) == ("LlamaForCausalLM", 49152, 8192)
    assert (info.block_size, info.num_kv_blocks, info.max_logprobs, info.has_chat_template) == (256, 100, 20, True)
