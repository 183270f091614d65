"""OpenAI request translation and error mapping, without a server."""

from __future__ import annotations

import asyncio
import json
import math
from types import SimpleNamespace

import pytest

from twinplane.controlplane.api import Limits, RequestOutput, TokenLogprobs
from twinplane.controlplane.errors import InvalidRequest, NotReady, Overloaded, StepFailed
from twinplane.controlplane.openai_api import detokenize_ids, parse_request, tokenize_prompt
from twinplane.controlplane.openai_http import NotFound, Unauthenticated, response_of
from twinplane.controlplane.openai_stream import Choices, ResponseBuilder
from twinplane.controlplane.sequence import FinishReason
from twinplane.controlplane.tls import parse_listen
from twinplane.controlplane.tokenizer import ChatOptions

LIMITS = Limits(vocab_size=1000, max_model_len=512)
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def parse(body: dict, chat: bool = True):
    return parse_request(body, LIMITS, "rid", chat)


def test_fields_map_onto_request_params():
    req = parse({**CHAT, "max_completion_tokens": 9, "max_tokens": 5, "temperature": 0.5, "top_p": 0.9,
                 "top_k": 4, "min_p": 0.1, "seed": 3, "stop": "END", "presence_penalty": 0.5,
                 "frequency_penalty": -0.5, "logprobs": True, "top_logprobs": 2,
                 "stream": True, "stream_options": {"include_usage": True}})
    (call,) = req.calls
    p, s = call.params, call.params.sampling
    assert (p.max_tokens, p.stop, p.logprobs) == (9, ("END",), 2)
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.5, pytest.approx(0.9), 4, pytest.approx(0.1), 3)
    assert (s.presence_penalty, s.frequency_penalty) == (0.5, -0.5)
    assert req.stream and req.include_usage and req.logprobs and req.chat
    assert call.request_id == "rid"


def test_priority_reaches_the_params_where_the_policy_allows_it():
    by_priority = Limits(vocab_size=1000, max_model_len=512, by_priority=True)
    (call,) = parse_request({**CHAT, "priority": -5}, by_priority, "rid", True).calls
    assert call.params.priority == -5 and parse(CHAT).calls[0].params.priority == 0
    with pytest.raises(InvalidRequest, match=r"priority must be in \[-2147483648, 2147483647\], got 2147483648"):
        parse_request({**CHAT, "priority": 2 ** 31}, by_priority, "rid", True)


def test_chat_options_reach_the_prompt():
    (call,) = parse({**CHAT, "add_generation_prompt": False, "continue_final_message": True,
                     "chat_template_kwargs": {"enable_thinking": False, "n": 2}}).calls
    assert call.prompt.chat_options == ChatOptions(False, True, {"enable_thinking": False, "n": 2})
    assert parse(CHAT).calls[0].prompt.chat_options == ChatOptions()
    assert tokenize_prompt({**CHAT, "add_generation_prompt": False}, LIMITS).chat_options == ChatOptions(False)
    deepest = {"x": json.loads("[" * 15 + "]" * 15)}  # 16 levels with the top object: allowed
    assert parse({**CHAT, "chat_template_kwargs": deepest}).calls[0].prompt.chat_options.template_kwargs == deepest


def test_content_parts_and_developer_role():
    req = parse({"messages": [{"role": "developer", "content": "be brief"},
                              {"role": "user", "content": [{"type": "text", "text": "a"},
                                                           {"type": "text", "text": "b"}]}]})
    assert req.calls[0].prompt.messages == [{"role": "system", "content": "be brief"},
                                            {"role": "user", "content": "a\nb"}]  # joined as vLLM joins them


def test_an_assistants_reasoning_reaches_the_template_under_both_names():
    """vLLM's reasoning and DeepSeek's reasoning_content name the same thing: a template may read either."""
    for name in ("reasoning", "reasoning_content"):
        req = parse({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", name: "r"},
                                  {"role": "user", "content": "again"}]})
        assert req.calls[0].prompt.messages[1] == {"role": "assistant", "content": "a", "reasoning_content": "r",
                                                   "reasoning": "r"}, name
    assert parse(CHAT).calls[0].prompt.messages == CHAT["messages"]  # none sent: none set
    with pytest.raises(InvalidRequest, match=r"messages\[0\].reasoning must be a string"):
        parse({"messages": [{"role": "assistant", "content": "a", "reasoning": 3}]})


def test_a_signed_seed_is_taken_as_its_64_bits():
    """OpenAI's seed is an int64, the gRPC API's a uint64: a negative one is the same bits unsigned."""
    seeds = [parse({**CHAT, "seed": s}).calls[0].params.sampling.seed for s in (-1, 2**64 - 1, -2**63, 7)]
    assert seeds == [2**64 - 1, 2**64 - 1, 2**63, 7]


def test_n_gives_distinct_seeds_and_ids():
    req = parse({**CHAT, "n": 3, "seed": 11})
    assert [c.name for c in req.calls] == ["rid-0", "rid-1", "rid-2"]
    assert [(c.request_id, c.choice) for c in req.calls] == [("rid", 0), ("rid", 1), ("rid", 2)]
    seeds = [c.params.sampling.seed for c in req.calls]
    assert seeds[0] == 11 and len(set(seeds)) == 3
    assert [c.params.sampling.seed for c in parse({**CHAT, "n": 2}).calls] == [None, None]


def test_echo_with_logprobs_scores_each_prompt_once():
    """The prompt's log-probabilities are asked of each prompt's first choice only (its siblings share them
    and its cached blocks), and only with echo."""
    req = parse({"prompt": ["a", "b"], "n": 2, "echo": True, "logprobs": 3}, chat=False)
    assert [c.params.prompt_logprobs for c in req.calls] == [3, None, 3, None]
    assert parse({"prompt": "a", "logprobs": 3}, chat=False).calls[0].params.prompt_logprobs is None
    assert parse({"prompt": "a", "echo": True}, chat=False).calls[0].params.prompt_logprobs is None


def test_prompt_forms():
    assert parse({"prompt": "hello"}, chat=False).calls[0].prompt.text == "hello"
    assert parse({"prompt": [1, 2, 3]}, chat=False).calls[0].prompt.token_ids == [1, 2, 3]
    assert parse({"prompt": ["hello"]}, chat=False).calls[0].prompt.text == "hello"
    assert parse({"prompt": "x", "logprobs": 3}, chat=False).calls[0].params.logprobs == 3
    # what the error for a prompt that does not fit advises
    assert parse({"prompt": [1, 2, 3], "truncate_prompt_tokens": 2}, chat=False).calls[0].truncate_prompt_tokens == 2


@pytest.mark.parametrize("body, chat, words", [
    ({**CHAT, "temperature": -1}, True, "temperature must be"),
    ({**CHAT, "temperature": "hot"}, True, "temperature must be a number"),
    ({**CHAT, "max_tokens": True}, True, "max_tokens must be an integer"),
    ({**CHAT, "max_tokens": 0}, True, "max_tokens must be in [1, 512]"),
    ({**CHAT, "n": 0}, True, "n must be in [1, 16]"),
    ({**CHAT, "top_logprobs": 2}, True, "top_logprobs needs logprobs"),
    ({**CHAT, "logprobs": True, "top_logprobs": 50}, True, "top_logprobs must be in [0, 20]"),
    ({**CHAT, "tools": [{"type": "function"}]}, True, "tools[0] must be {\"type\": \"function\""),
    ({**CHAT, "tools": []}, True, "tools must not be an empty array"),
    ({**CHAT, "functions": [{"name": "f"}]}, True, "functions is not supported"),
    ({**CHAT, "stop": ["a", 3]}, True, "stop must be a string or a list of strings"),
    ({**CHAT, "seed": -2**63 - 1}, True, "seed must be a 64-bit integer, in [-2**63, 2**64)"),
    ({**CHAT, "seed": 2**64}, True, "seed must be a 64-bit integer"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, True,
     "messages[0].role must be one of system, user, assistant, tool or developer (as system), got 'wizard'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, True, "only text input"),
    ({}, True, "messages is required"),
    ({}, False, "prompt is required"),
    ({"prompt": []}, False, "prompt must not be empty"),
    ({"prompt": ["a", []]}, False, "prompt[1] must not be empty"),
    ({"prompt": ["a", [5000]]}, False, "prompt[1] must be in [0, 1000)"),
    ({"prompt": ["a", [1, None]]}, False, "prompt[1] must be a string or a list of token ids"),
    ({"prompt": ["a"] * 33}, False, "prompt: a batch holds at most 32 prompts, got 33"),
    ({"prompt": [5000]}, False, "prompt must be in [0, 1000)"),
    ({"prompt": "x", "echo": "yes"}, False, "echo must be true or false"),
    ({**CHAT, "top_k": 2**31}, True, "top_k must be in [-1, 2147483647]"),  # an int32 on the data plane
    ({**CHAT, "top_p": 1e-300}, True, "0 as the 32-bit float"),  # 0 on the data plane
    ({**CHAT, "repetition_penalty": 1e-300}, True, "repetition_penalty must be a finite number > 0"),  # 0 as sent
    ({**CHAT, "temperature": 1e300}, True, "temperature must be a finite number"),  # inf on the data plane
    ({"prompt": "a\ud800"}, False, "prompt is not valid Unicode"),  # a lone surrogate: valid JSON, no text
    ({"messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": "\udc00"}]}, True,
     "messages[1].content is not valid Unicode"),
    ({**CHAT, "min_tokens": -1}, True, "min_tokens must be in [0, 512]"),
    ({**CHAT, "max_completion_tokens": 600}, True, "max_completion_tokens must be in [1, 512]"),
    ({"prompt": [1, 2.5]}, False, "prompt must be a string or a list of token ids"),
    ({"prompt": [None]}, False, "prompt must be a string or a list of token ids"),
    ({"prompt": "x", "truncate_prompt_tokens": 512}, False,
     "truncate_prompt_tokens must be -1 (the longest that fits) or in [0, 511]"),
    ({**CHAT, "truncate_prompt_tokens": -2}, True,
     "truncate_prompt_tokens must be -1 (the longest that fits) or in [0, 511] (below max_model_len), 0 for no "
     "truncation; got -2"),
    ({**CHAT, "stream_options": {"include_usage": True}}, True, "stream_options is only allowed with stream: true"),
    ({**CHAT, "stream": True, "stream_options": True}, True, "stream_options must be an object"),
    ({**CHAT, "skip_special_tokens": "false"}, True, "skip_special_tokens must be true or false, got str"),
    ({**CHAT, "logit_bias": [1, 2]}, True, "logit_bias must be an object from token ids to biases, got list"),
    ({**CHAT, "logit_bias": {"the": 5}}, True, "logit_bias keys must be token ids (integers), got 'the'"),
    ({**CHAT, "logit_bias": {"7" * 5000: 5}}, True, "logit_bias keys must be token ids (integers), got '7777"),
    ({**CHAT, "logit_bias": {"7": "5"}}, True, "logit_bias[7] must be a number, got \"5\""),
    ({**CHAT, "logit_bias": {"7": 101}}, True, "logit_bias[7] must be in [-100.0, 100.0], got 101"),
    ({**CHAT, "logit_bias": {"1000": 1}}, True, "logit_bias token ids must be in [0, 1000); got [1000]"),
    ({**CHAT, "logit_bias": {"-3": 1}}, True, "logit_bias token ids must be in [0, 1000); got [-3]"),
    ({**CHAT, "logit_bias": {str(i): 1 for i in range(1025)}}, True, "logit_bias may hold at most 1024"),
    ({**CHAT, "priority": 2}, True, "priority 2 needs a server started with --scheduling-policy priority"),
    ({**CHAT, "priority": "high"}, True, "priority must be an integer"),
    ({**CHAT, "add_generation_prompt": 0}, True, "add_generation_prompt must be true or false, got int"),
    ({**CHAT, "continue_final_message": True}, True, "continue_final_message needs add_generation_prompt false"),
    ({**CHAT, "chat_template_kwargs": ["x"]}, True, "chat_template_kwargs must be an object of template variables"),
    ({**CHAT, "chat_template_kwargs": {"messages": []}}, True, "chat_template_kwargs may not set messages"),
    ({**CHAT, "chat_template_kwargs": {"x": "\ud800"}}, True, "chat_template_kwargs is not valid Unicode"),
    ({**CHAT, "chat_template_kwargs": {"x": json.loads("[" * 16 + "]" * 16)}}, True,
     "chat_template_kwargs nests objects and lists more than 16 levels deep"),
    ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, True,
     ('response_format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": '
      '{"name": ..., "schema": {...}}}')),
    ({**CHAT, "response_format": {"type": "json_schema"}}, True, '"json_schema": {"name": ..., "schema": {...}}'),
    # a bool is no integer in JSON: never read as 1
    ({**CHAT, "stop_token_ids": [True]}, True, "stop_token_ids must be a list of integers"),
    ({**CHAT, "allowed_token_ids": [3, True]}, True, "allowed_token_ids must be a list of integers"),
    ({"prompt": [1, True]}, False, "prompt must be a string or a list of token ids (integers)"),
    ({"prompt": ["a", [1, True]]}, False, "prompt[1] must be a string or a list of token ids (integers)"),
    ({**CHAT, "logit_bias": {"7": True}}, True, "logit_bias[7] must be a number, got true"),
    ({**CHAT, "logit_bias": {"7": 1, "07": -1}}, True, "logit_bias names token id 7 twice, as '7' and '07'"),
    ({"prompt": "x", "best_of": 2}, False, "best_of is not supported by this server (leave it unset or equal to n)"),
    ({"prompt": "x", "best_of": 3, "n": 2}, False, "best_of is not supported by this server"),
    ({"prompt": "x", "best_of": "2"}, False, "best_of must be an integer, got str"),
    ({"prompt": "x", "best_of": 3, "n": "3"}, False, "n must be an integer, got str"),  # the cause, not best_of
    ({"prompt": "x", "best_of": 0, "n": 0}, False, "n must be in [1, 16], got 0"),
    ({"prompt": "x", "suffix": "end"}, False, "suffix is not supported by this server"),
    ({**CHAT, "audio": {"voice": "alloy", "format": "wav"}}, True, "audio is not supported by this server"),
    ({**CHAT, "prediction": {"type": "content", "content": "x"}}, True, "prediction is not supported by this server"),
    ({**CHAT, "modalities": ["text", "audio"]}, True,
     'modalities must be ["text"] (this server writes text alone), got ["text", "audio"]'),
    ({**CHAT, "modalities": "text"}, True, 'modalities must be ["text"]'),
    # a value of the wrong type is no empty list, however falsy
    ({**CHAT, "stop_token_ids": False}, True, "stop_token_ids must be a list of integers"),
    ({**CHAT, "allowed_token_ids": 0}, True, "allowed_token_ids must be a list of integers"),
    ({**CHAT, "bad_words": ""}, True, "bad_words must be a list of strings"),
    ({"prompt": "x", "echo": True, "max_tokens": 0, "min_tokens": 3}, False,
     "min_tokens (3) must not exceed max_tokens (0), which with echo gives the prompt alone"),
    ({**CHAT, "structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, True,
     "structured_outputs must hold one of json (a JSON Schema), regex (a string) or choice (strings)"),
    ({**CHAT, "structured_outputs": {"json": None, "regex": None}}, True, "structured_outputs must hold one of"),
    ({**CHAT, "structured_outputs": {"grammar": "root ::= x", "json": None}}, True,
     "structured_outputs must hold one of"),
    ({**CHAT, "structured_outputs": {"grammar": "root ::= x"}}, True, "; grammar is not supported by this server"),
    ({**CHAT, "structured_outputs": {"structural_tag": "{}"}}, True, "; structural_tag is not supported"),
    ({**CHAT, "structured_outputs": {"json_object": "yes"}}, True, "structured_outputs must hold one of"),
    ({**CHAT, "structured_outputs": {"json": {}, "disable_any_whitespace": True}}, True,
     "structured_outputs.disable_any_whitespace: true is not supported"),
    ({**CHAT, "structured_outputs": {"json_object": True, "whitespace_pattern": "[ ]*"}}, True,
     "structured_outputs.whitespace_pattern is not supported"),
    ({**CHAT, "structured_outputs": {"json": {}, "disable_fallback": "no"}}, True,
     "structured_outputs.disable_fallback must be true or false, got str"),
    ({**CHAT, "structured_outputs": {"json": {}, "strict": True}}, True,
     "structured_outputs has no field 'strict'; its fields are json, regex, choice, json_object"),
    ({**CHAT, "guided_whitespace_pattern": " "}, True, "guided_whitespace_pattern is not supported by this server"),
    ({"prompt": "x", "use_beam_search": True}, False, "use_beam_search is not supported by this server"),
    ({"prompt": "x", "include_reasoning": False}, False, "include_reasoning: false is only for /v1/chat/completions"),
    ({"prompt": "x", "reasoning_effort": "low"}, False, "reasoning_effort is only for /v1/chat/completions"),
    ({**CHAT, "include_reasoning": "no"}, True, "include_reasoning must be true or false, got str"),
    ({**CHAT, "reasoning_effort": "extreme"}, True,
     "reasoning_effort must be one of none, minimal, low, medium, high, xhigh, max, got 'extreme'"),
    ({**CHAT, "stream": True, "stream_options": {"continuous_usage_stats": 1}}, True,
     "stream_options.continuous_usage_stats must be true or false, got int"),
    ({"prompt": "x", "add_special_tokens": "yes"}, False, "add_special_tokens must be true or false, got str"),
    ({**CHAT, "add_special_tokens": 1}, True, "add_special_tokens must be true or false, got int"),
    ({**CHAT, "spaces_between_special_tokens": "no"}, True, "spaces_between_special_tokens must be true or false"),
])
def test_invalid_fields_name_the_field(body, chat, words):
    with pytest.raises(InvalidRequest) as error:
        parse(body, chat)
    assert words in str(error.value)


@pytest.mark.parametrize("body, chat, taken", [
    ({"prompt": ["a"] * 32}, False, lambda req: len(req.calls) == 32),
    ({**CHAT, "n": 16}, True, lambda req: len(req.calls) == 16),
    ({"messages": [{"role": "user", "content": "hi"}] * 1024}, True,
     lambda req: len(req.calls[0].prompt.messages) == 1024),
    ({**CHAT, "stop": [f"s{i}" for i in range(16)]}, True, lambda req: len(req.calls[0].params.stop) == 16),
    ({**CHAT, "stop": ["x" * 256]}, True, lambda req: req.calls[0].params.stop == ("x" * 256,)),
    ({**CHAT, "stop_token_ids": list(range(64))}, True, lambda req: len(req.calls[0].params.stop_token_ids) == 64),
    ({**CHAT, "bad_words": [f"w{i}" for i in range(64)]}, True, lambda req: len(req.calls[0].params.bad_words) == 64),
    ({**CHAT, "logit_bias": {str(i): 1 for i in range(1024)}}, True,
     lambda req: len(req.calls[0].params.logit_bias) == 1024),
    ({**CHAT, "logprobs": True, "top_logprobs": 20}, True, lambda req: req.calls[0].params.logprobs == 20),
    ({**CHAT, "max_completion_tokens": 512}, True, lambda req: req.calls[0].params.max_tokens == 512),
    ({"prompt": "x", "truncate_prompt_tokens": 511}, False, lambda req: req.calls[0].truncate_prompt_tokens == 511),
], ids=["prompts", "n", "messages", "stop", "stop-length", "stop-token-ids", "bad-words", "logit-bias",
        "top-logprobs", "max-tokens", "truncate"])
def test_each_bound_takes_its_limit(body, chat, taken):
    """A request at a limit whose next value is refused (above) is taken whole."""
    wide = Limits(vocab_size=2048, max_model_len=512)  # room for 1024 logit_bias token ids
    assert taken(parse_request(body, wide, "rid", chat))


@pytest.mark.parametrize("body, chat", [
    ({"prompt": "x", "best_of": 1}, False),
    ({"prompt": "x", "best_of": 3, "n": 3}, False),
    ({"prompt": "x", "suffix": ""}, False),  # empty or null: as if unset
    ({**CHAT, "audio": None, "functions": []}, True),
    ({**CHAT, "modalities": ["text"]}, True),
    ({**CHAT, "modalities": None, "stop_token_ids": None, "bad_words": None, "allowed_token_ids": None}, True),
])
def test_unsupported_fields_are_taken_where_they_ask_nothing(body, chat):
    assert len(parse(body, chat).calls) == body.get("n", 1)


def test_truncate_prompt_tokens_minus_1_is_the_longest_that_fits():
    """As vLLM's: -1 truncates to what max_model_len holds, here the most that is taken (as if it were sent)."""
    for body, chat in (({"prompt": [1, 2, 3]}, False), (CHAT, True)):
        (call,) = parse({**body, "truncate_prompt_tokens": -1}, chat).calls
        assert call.truncate_prompt_tokens == 511 == parse({**body, "truncate_prompt_tokens": 511}, chat).calls[
            0].truncate_prompt_tokens


def test_an_empty_stream_options_is_taken_without_stream():
    """As vLLM's: stream_options without stream is refused only when it asks for something."""
    for body in ({**CHAT, "stream_options": {}}, {**CHAT, "stream": False, "stream_options": {}},
                 {"prompt": "x", "stream": False, "stream_options": {}}):
        req = parse(body, "messages" in body)
        assert not (req.stream or req.include_usage or req.continuous_usage)
    with pytest.raises(InvalidRequest, match="stream_options is only allowed with stream: true"):
        parse({**CHAT, "stream": False, "stream_options": {"include_usage": False}})


def test_echo_with_max_tokens_0_gives_the_prompt_alone():
    req = parse({"prompt": "x", "echo": True, "max_tokens": 0, "min_tokens": 0}, chat=False)
    assert req.prompt_only and req.calls[0].params.max_tokens == 1  # one token drawn, left unshown
    with pytest.raises(InvalidRequest, match=r"min_tokens \(1\) must not exceed max_tokens \(0\)"):
        parse({"prompt": "x", "echo": True, "max_tokens": 0, "min_tokens": 1}, chat=False)
    with pytest.raises(InvalidRequest, match=r"max_tokens must be in \[1, 512\] \(max_model_len\), got 0"):  # no echo
        parse({"prompt": "x", "max_tokens": 0, "min_tokens": 3}, chat=False)


def test_detokenize_takes_no_bools_for_token_ids():
    assert detokenize_ids({"tokens": [1, 0]}, LIMITS) == [1, 0]
    with pytest.raises(InvalidRequest, match=r"tokens is required: a list of token ids \(integers\)"):
        detokenize_ids({"tokens": [1, True]}, LIMITS)


def test_structured_outputs_read_null_fields_as_unset():
    """As vLLM's: a client that sends every field, the unused ones null, constrains the output by the one set."""
    regex = parse({**CHAT, "structured_outputs": {"regex": "a+"}}).calls[0].params.regex
    assert regex and parse({**CHAT, "structured_outputs": {"json": None, "regex": "a+", "choice": None,
                                                           "grammar": None}}).calls[0].params.regex == regex
    choice = parse({**CHAT, "structured_outputs": {"choice": ["yes", "no"], "json": None}}).calls[0].params.regex
    assert choice == parse({**CHAT, "guided_choice": ["yes", "no"]}).calls[0].params.regex


def test_structured_outputs_take_options_at_their_defaults_and_those_the_json_keeps_anyway():
    """A client that sends vLLM's whole StructuredOutputsParams (its options false or null, its backend
    fields) gets the constraint alone; disable_fallback and disable_additional_properties true ask for what
    the JSON is anyway, and the JSON layout's options ask nothing of a regex."""
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    alone = parse({**CHAT, "structured_outputs": {"json": schema}}).calls[0].params.regex
    full = {"json": schema, "regex": None, "choice": None, "grammar": None, "json_object": None,
            "structural_tag": None, "disable_fallback": False, "disable_any_whitespace": False,
            "disable_additional_properties": False, "whitespace_pattern": None, "_backend": None,
            "_backend_was_auto": False}
    for outputs in (full, {**full, "disable_fallback": True, "disable_additional_properties": True},
                    {**full, "_backend": "xgrammar", "_backend_was_auto": True, "backend": "guidance"}):
        assert parse({**CHAT, "structured_outputs": outputs}).calls[0].params.regex == alone
    any_object = parse({**CHAT, "response_format": {"type": "json_object"}}).calls[0].params.regex
    assert parse({**CHAT, "structured_outputs": {"json_object": True}}).calls[0].params.regex == any_object
    regex = parse({**CHAT, "structured_outputs": {"regex": "a+"}}).calls[0].params.regex
    assert parse({**CHAT, "structured_outputs": {"regex": "a+", "json_object": False, "disable_any_whitespace": True,
                                                 "whitespace_pattern": " "}}).calls[0].params.regex == regex


def test_top_logprobs_0_asks_for_nothing_without_logprobs():
    """vLLM's default, which its clients send: taken, and no log-probabilities come back."""
    req = parse({**CHAT, "logprobs": False, "top_logprobs": 0})
    assert not req.logprobs and req.calls[0].params.logprobs is None


def test_logit_bias_arrives_as_sorted_token_id_and_float_pairs():
    params = parse({**CHAT, "logit_bias": {"9": 100, "3": -2.5}, "n": 2}).calls[1].params
    assert params.logit_bias == ((3, -2.5), (9, 100.0)) and not params.plain_sampling
    assert parse({**CHAT, "logit_bias": None}).calls[0].params.logit_bias == ()
    assert parse({**CHAT, "include_stop_str_in_output": True}).calls[0].params.include_stop_str_in_output
    with pytest.raises(InvalidRequest, match="include_stop_str_in_output must be true or false"):
        parse({**CHAT, "include_stop_str_in_output": "yes"})


def test_a_tiny_temperature_samples_greedily():
    # dividing the logits by it would overflow them; vLLM too samples greedily below 1e-5
    for temperature in (1e-40, 1e-6):
        assert parse({**CHAT, "temperature": temperature}).calls[0].params.sampling.temperature == 0.0
    assert parse({**CHAT, "temperature": 1e-4}).calls[0].params.sampling.temperature == 1e-4


@pytest.mark.parametrize("exc, status, kind", [
    (InvalidRequest("temperature must be a finite number"), 400, "invalid_request_error"),
    (Unauthenticated("missing or wrong API key"), 401, "invalid_request_error"),
    (NotFound("no such model", "model_not_found"), 404, "invalid_request_error"),
    (Overloaded("too many waiting requests"), 429, "rate_limit_error"),
    (NotReady("no data plane"), 503, "service_unavailable"),
    (StepFailed("the data plane failed"), 500, "server_error"),
])
def test_errors_become_openai_error_objects(exc, status, kind):
    response = response_of(exc)
    error = json.loads(response.body)["error"]
    assert response.status_code == status
    assert (error["message"], error["type"]) == (str(exc), kind)
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == ("temperature" if status == 400 else None)
    assert error["code"] == {404: "model_not_found", 401: "invalid_api_key"}.get(status)  # OpenAI's codes


def test_unexpected_errors_leak_no_details():
    error = json.loads(response_of(RuntimeError("secret path /etc/x")).body)["error"]
    assert "secret" not in error["message"] and "RuntimeError" in error["message"]


def test_listen_addresses():
    assert parse_listen("8000") == ("127.0.0.1", 8000)
    assert parse_listen("0.0.0.0:80") == ("0.0.0.0", 80)
    assert parse_listen("[::1]:0") == ("::1", 0)
    with pytest.raises(ValueError):
        parse_listen("localhost:http")


def test_the_command_line_passes_http_listen_on(monkeypatch):
    from twinplane.clients.cli import _controlplane, build_parser

    monkeypatch.delenv("TWINPLANE_API_KEY", raising=False)
    args = build_parser().parse_args(["serve", "--http-listen", "8000", "--api-key", "k"])
    config, security = _controlplane(args, "unix:///tmp/dp.sock", None)
    assert (config.http_listen, security.api_key) == ("8000", "k")
    off, _ = _controlplane(build_parser().parse_args(["controlplane"]), "127.0.0.1:50061", None)
    assert off.http_listen is None  # off unless asked for


def test_a_batch_of_prompts_gets_n_choices_each_in_prompt_order():
    """A completion's batch: choice p * n + j is prompt p's choice j, seeded as that prompt alone
    would be; each choice has an id of its own."""
    from twinplane.controlplane.openai_api import choice_seed

    req = parse({"prompt": ["a", [7, 8], "c"], "n": 2, "seed": 5}, chat=False)
    assert req.n == 2 and len(req.calls) == 6
    assert [c.prompt.text or c.prompt.token_ids for c in req.calls] == ["a", "a", [7, 8], [7, 8], "c", "c"]
    assert [c.params.sampling.seed for c in req.calls] == [5, choice_seed(5, 1)] * 3
    assert len({c.choice for c in req.calls}) == len({c.name for c in req.calls}) == 6
    alone = parse({"prompt": [7, 8], "n": 2, "seed": 5}, chat=False)
    assert [c.params for c in alone.calls] == [c.params for c in req.calls[2:4]]
    assert parse({"prompt": [[7, 8]]}, chat=False).calls[0].prompt.token_ids == [7, 8]  # a batch of one


def test_usage_counts_each_prompt_once_and_every_completion():
    from twinplane.controlplane.api import RequestOutput
    from twinplane.controlplane.openai_api import usage_json

    finals = [RequestOutput("x", prompt_tokens=p, completion_tokens=c, cached_prompt_tokens=k)
              for p, c, k in [(10, 3, 0), (10, 4, 8), (6, 5, 2), (6, 1, 4)]]
    assert usage_json(finals, n=2) == {"prompt_tokens": 16, "completion_tokens": 13, "total_tokens": 29,
                                       "prompt_tokens_details": {"cached_tokens": 2}}
    assert usage_json(finals[:1]) == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                                      "prompt_tokens_details": {"cached_tokens": 0}}


def test_an_infinite_logprob_goes_out_as_a_number_json_can_hold():
    """A token the sampler could not draw (banned, masked) has log-probability -inf, which JSON cannot hold:
    each form of logprobs gives -9999.0 for it."""
    from twinplane.controlplane.api import TokenLogprobs
    from twinplane.controlplane.openai_api import logprobs_json, prompt_logprobs_json

    entries = [TokenLogprobs(5, -math.inf, top=[(6, -0.5), (5, -math.inf)], rank=2)]
    chat, text, prompt = (logprobs_json(True, entries, None), logprobs_json(False, entries, None),
                          prompt_logprobs_json([None, *entries], None))
    for out in (chat, text, prompt):
        assert json.loads(json.dumps(out, allow_nan=False)) == out
    assert chat["content"][0]["logprob"] == chat["content"][0]["top_logprobs"][1]["logprob"] == -9999.0
    assert text["token_logprobs"] == [-9999.0] and text["top_logprobs"] == [{"token_id:5": -9999.0,
                                                                            "token_id:6": -0.5}]
    assert prompt[1]["5"] == {"logprob": -9999.0, "rank": 2, "decoded_token": "token_id:5"}


def test_chat_logprobs_bytes_join_the_parts_of_a_character(smollm2_dir):
    """OpenAI's ``bytes``: tokens that each hold part of a character give that part's bytes (their text alone is
    a replacement character), so that joined they are the character; a whole token's are its text's."""
    from twinplane.controlplane.api import TokenLogprobs
    from twinplane.controlplane.openai_api import logprobs_json
    from twinplane.controlplane.tokenizer import Tokenizer

    tokenizer = Tokenizer(smollm2_dir)
    for text in ("🙂", "日本語"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert "\ufffd" in "".join(tokenizer.token_texts(ids))  # parts of characters among them
        content = logprobs_json(True, [TokenLogprobs(i, -0.5, top=[(i, -0.5)]) for i in ids], tokenizer)["content"]
        assert b"".join(bytes(entry["bytes"]) for entry in content).decode() == text
        assert all(entry["top_logprobs"][0]["bytes"] == entry["bytes"] for entry in content)
    (paris,) = tokenizer.encode(" Paris", add_special_tokens=False)
    entry = logprobs_json(True, [TokenLogprobs(paris, -0.1)], tokenizer)["content"][0]
    assert entry["token"] == " Paris" and bytes(entry["bytes"]) == b" Paris"


def test_completion_logprobs_name_the_parts_of_a_character_apart_and_offset_by_whole_characters(smollm2_dir):
    """Tokens that each hold part of a character are named by their bytes ("bytes:\\xf0\\x9f", as OpenAI's), so
    that in top_logprobs they do not share one key and the sampled token's value stands; text_offset counts a
    character once it is whole, also across the chunks of a stream."""
    from twinplane.controlplane.api import TokenLogprobs
    from twinplane.controlplane.openai_api import TextOffsets, logprobs_json
    from twinplane.controlplane.tokenizer import Tokenizer

    tokenizer = Tokenizer(smollm2_dir)
    text = " 🙂 日本"
    ids = tokenizer.encode(text, add_special_tokens=False)
    parts = [i for i, t in zip(ids, tokenizer.token_texts(ids)) if "\ufffd" in t]
    assert len(parts) >= 2
    entries = [TokenLogprobs(i, -1.0, top=[(p, -0.5 - k) for k, p in enumerate(parts)]) for i in ids]
    whole = logprobs_json(False, entries, tokenizer)
    names = [name for name, i in zip(whole["tokens"], ids) if i in parts]
    assert all(name.startswith("bytes:\\x") for name in names) and len(set(names)) == len(parts)
    for name, i, position in zip(whole["tokens"], ids, whole["top_logprobs"]):
        assert position[name] == -1.0 and len(position) == len({i, *parts})  # the sampled token's, and each part's
    # the whole characters before each token
    assert whole["text_offset"] == [len(tokenizer.decode(ids[:k]).rstrip("\ufffd")) for k in range(len(ids))]
    streamed, offsets = [], TextOffsets()  # one token a chunk
    for entry in entries:
        streamed += logprobs_json(False, [entry], tokenizer, offsets)["text_offset"]
    assert streamed == whole["text_offset"]


# ---- a request's choices read through a stand-in engine -----------------------------------------


class _ScriptedEngine:
    """Stands in for the engine: each choice (a call of the request) gets its own outputs, in order."""

    def __init__(self, calls: list, outputs):
        """outputs(choice, prompt): that choice's outputs."""
        self.calls, self.outputs_of = calls, outputs
        self.tokenizer = SimpleNamespace(decode=lambda ids, skip: "".join(f"<{i}>" for i in ids))
        self.added, self.aborted = [], []
        self.arrivals = {}  # the arrival time each choice was added with (None: the engine's clock)

    def check_room(self, count: int = 1) -> None:
        pass

    async def in_tokenizer_pool(self, function, *args):
        return function(*args)

    async def add(self, call, room_checked: bool = False, arrival_time: float | None = None):
        choice = next(i for i, c in enumerate(self.calls) if c is call)
        self.added.append(choice)
        self.arrivals[choice] = arrival_time
        return SimpleNamespace(choice=choice, prompt=list(call.prompt.token_ids or (1, 2, 3)),  # chat: any prompt
                               arrival_time=1000.0 + choice if arrival_time is None else arrival_time)

    async def add_all(self, calls: list, room_checked: bool = False, arrival_time: float | None = None):
        return [await self.add(call, room_checked, arrival_time) for call in calls]

    async def outputs(self, state):
        for out in self.outputs_of(state.choice, state.prompt):
            yield out

    def abort(self, state) -> None:
        self.aborted.append(state.choice)


def _run_choices(request, outputs) -> tuple[list[tuple[int, RequestOutput]], _ScriptedEngine, dict]:
    engine = _ScriptedEngine(request.calls, outputs)

    async def read():
        choices = Choices(engine, request)
        await choices.open()
        return [item async for item in choices], choices.usage()

    got, usage = asyncio.run(read())
    return got, engine, usage


def _scored_outputs(calls: list):
    """Each choice's one output: token 40 + its index; a prompt's first choice scores the prompt (its top
    three, more than asked for)."""
    def outputs(choice: int, prompt: list[int]) -> list[RequestOutput]:
        scored = None
        if calls[choice].params.prompt_logprobs is not None:
            scored = [None, *(TokenLogprobs(t, -1.0, [(t, -1.0), (99, -2.0), (98, -3.0)]) for t in prompt[1:])]
        token = 40 + choice
        return [RequestOutput("r", [token], f"t{choice}", [TokenLogprobs(token, -0.5, [(token, -0.5), (97, -4.0)])],
                              scored, FinishReason.LENGTH, prompt_tokens=len(prompt), completion_tokens=1)]
    return outputs


def test_echo_with_logprobs_starts_each_choice_of_a_batch_with_its_own_prompt():
    """Every choice of every prompt echoes that prompt: its text, and its tokens' log-probabilities (the first
    null, the others with as many top tokens as asked) before those of the tokens drawn."""
    request = parse({"prompt": [[5, 6, 7], [8, 9]], "n": 2, "echo": True, "logprobs": 1, "max_tokens": 1},
                    chat=False)
    got, engine, usage = _run_choices(request, _scored_outputs(request.calls))
    assert sorted(engine.added) == [0, 1, 2, 3] and sorted(i for i, _ in got) == [0, 1, 2, 3]
    builder = ResponseBuilder(request, "cmpl-r", "m", None)
    for index, out in got:
        builder.add(index, out)
    choices = builder.response(usage)["choices"]
    for c, prompt in enumerate([[5, 6, 7], [5, 6, 7], [8, 9], [8, 9]]):
        logprobs, token = choices[c]["logprobs"], f"token_id:{40 + c}"
        assert choices[c]["text"] == "".join(f"<{t}>" for t in prompt) + f"t{c}"
        assert logprobs["tokens"] == [f"token_id:{t}" for t in prompt] + [token]
        assert logprobs["token_logprobs"] == [None] + [-1.0] * (len(prompt) - 1) + [-0.5]
        assert logprobs["top_logprobs"] == [None, *({f"token_id:{t}": -1.0} for t in prompt[1:]),
                                            {token: -0.5, "token_id:97": -4.0}][:len(prompt) + 1]
    assert usage["prompt_tokens"] == 5 and usage["completion_tokens"] == 4


def test_echo_of_token_ids_without_a_tokenizer_is_refused_before_any_prompt_is_added():
    """Showing token ids as text needs the tokenizer: without one the request is refused whole, before its
    first prompt (which would echo fine) is added."""
    request = parse({"prompt": ["Once", [5, 6, 7]], "echo": True, "max_tokens": 1}, chat=False)
    engine = _ScriptedEngine(request.calls, _scored_outputs(request.calls))
    engine.tokenizer = None
    with pytest.raises(InvalidRequest, match="echo needs the model's tokenizer"):
        asyncio.run(Choices(engine, request).open())
    assert engine.added == []


def test_a_prompts_later_choices_are_timed_from_its_first_choices_arrival():
    """A prompt's later choices start once its first has its first token, but the client waits for them from
    the first's arrival: the engine times them from then (time to first token, end to end), as vLLM does."""
    request = parse({"prompt": [[5, 6, 7], [8, 9]], "n": 3, "max_tokens": 1}, chat=False)
    _, engine, _ = _run_choices(request, _scored_outputs(request.calls))
    assert engine.arrivals == {0: None, 1: 1000.0, 2: 1000.0, 3: None, 4: 1003.0, 5: 1003.0}


def test_echo_with_max_tokens_0_shows_each_choice_its_prompt_alone():
    """The token drawn after the prompt is neither shown nor counted; its log-probability is left out too."""
    request = parse({"prompt": [5, 6, 7], "n": 2, "echo": True, "logprobs": 1, "max_tokens": 0}, chat=False)
    got, _, usage = _run_choices(request, _scored_outputs(request.calls))
    builder = ResponseBuilder(request, "cmpl-r", "m", None)
    for index, out in got:
        builder.add(index, out)
    response = builder.response(usage)
    for choice in response["choices"]:
        assert (choice["text"], choice["finish_reason"]) == ("<5><6><7>", "length")
        assert choice["logprobs"]["tokens"] == ["token_id:5", "token_id:6", "token_id:7"]
        assert choice["logprobs"]["token_logprobs"] == [None, -1.0, -1.0]
    assert usage == {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3,
                     "prompt_tokens_details": {"cached_tokens": 0}}


def _two_outputs(calls: list):
    """Each choice's two outputs: tokens 40 + its index then 50 + its index, one text character each; the
    first choice scores the prompt (its top three, more than asked for)."""
    def outputs(choice: int, prompt: list[int]) -> list[RequestOutput]:
        first, last = (_scored_outputs(calls)(choice, prompt)[0], RequestOutput("r", [50 + choice], "y"))
        first.text, first.finish_reason, first.completion_tokens = "x", None, 0
        last.logprobs = [TokenLogprobs(50 + choice, -0.75, [(50 + choice, -0.75)])]
        last.finish_reason, last.prompt_tokens, last.completion_tokens = FinishReason.LENGTH, len(prompt), 2
        return [first, last]
    return outputs


def test_prompt_logprobs_and_logprobs_of_every_output_reach_the_whole_response():
    """Each choice's prompt_logprobs keep as many top tokens as asked, whatever the first choice computed, and
    are kept past the outputs after the first; logprobs add up over the outputs."""
    request = parse({"prompt": [5, 6, 7], "n": 2, "prompt_logprobs": 1, "logprobs": 0, "max_tokens": 2}, chat=False)
    got, _, usage = _run_choices(request, _two_outputs(request.calls))
    builder = ResponseBuilder(request, "cmpl-r", "m", None)
    for index, out in got:
        builder.add(index, out)
    response = builder.response(usage)
    for c, choice in enumerate(response["choices"]):
        assert choice["text"] == "xy" and choice["logprobs"]["tokens"] == [f"token_id:{40 + c}", f"token_id:{50 + c}"]
        assert choice["logprobs"]["text_offset"] == [0, len(f"token_id:{40 + c}")]  # named by id: no tokenizer
        assert choice["prompt_logprobs"] == [None, *({str(t): {"logprob": -1.0, "rank": 1,
                                                                "decoded_token": f"token_id:{t}"}} for t in (6, 7))]
    assert usage["completion_tokens"] == 4


def test_streamed_completions_offset_each_choices_tokens_by_its_own_text():
    """text_offset goes on from the choice's own text sent before, whichever choices' chunks came between."""
    request = parse({"prompt": [5, 6, 7], "n": 2, "logprobs": 0, "max_tokens": 2, "stream": True}, chat=False)
    got, _, _ = _run_choices(request, _two_outputs(request.calls))
    builder = ResponseBuilder(request, "cmpl-r", "m", None)
    offsets = {0: [], 1: []}
    for index, out in got:
        (chunk,) = builder.chunks(index, out)
        assert chunk["object"] == "text_completion" and chunk["choices"][0]["index"] == index
        offsets[index] += chunk["choices"][0]["logprobs"]["text_offset"]
    assert offsets == {0: [0, len("token_id:40")], 1: [0, len("token_id:41")]}  # named by id: no tokenizer


def test_a_chat_stream_begins_each_choice_with_its_role_once_and_ends_with_the_usage_alone():
    """With include_usage, every chunk carries a null usage, and a last chunk with no choices the usage."""
    request = parse({**CHAT, "n": 2, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}})
    got, _, usage = _run_choices(request, _two_outputs(request.calls))
    builder = ResponseBuilder(request, "chatcmpl-r", "m", None)
    chunks = [chunk for index, out in got for chunk in builder.chunks(index, out)] + [builder.usage_chunk(usage)]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert all("usage" in chunk and chunk["usage"] is None for chunk in chunks[:-1])
    for c in (0, 1):
        deltas = [chunk["choices"][0]["delta"] for chunk in chunks[:-1] if chunk["choices"][0]["index"] == c]
        assert deltas == [{"role": "assistant", "content": ""}, {"content": "x"}, {"content": "y"}]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


def _service_over_an_engine(**config):
    """The HTTP routes over an engine that has had a data plane (described), with no core behind it."""
    from starlette.testclient import TestClient

    from twinplane.controlplane.config import ControlPlaneConfig
    from twinplane.controlplane.engine import Engine
    from twinplane.controlplane.openai_http import OpenAIService
    from twinplane.proto import dataplane_pb2 as dp

    engine = Engine(ControlPlaneConfig(dataplane="unix:///nowhere", **config))
    engine.describe, engine.limits = dp.DescribeResponse(model="m", max_model_len=512), LIMITS
    return engine, TestClient(OpenAIService(engine).app())


def test_a_generation_is_refused_at_once_while_the_data_plane_is_stalled_or_lost():
    engine, http = _service_over_an_engine()
    engine._connected = True
    engine._set_stalled("data plane", True)
    answer = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert answer.status_code == 503 and answer.json()["error"]["message"] == "the data plane stalled; retry later"
    engine._set_stalled("data plane", False)
    engine.lost()
    answer = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
    assert answer.status_code == 503 and "it was lost" in answer.json()["error"]["message"]
    engine._tokenizer_pool.shutdown()


def test_a_generation_is_refused_for_the_queue_before_it_is_parsed():
    """A request that finds the queue full gets 429 without taking a tokenizer thread for its parse."""
    engine, http = _service_over_an_engine(max_waiting_requests=1)
    engine._connected = True
    engine._update_ready()
    engine.num_waiting_ready = 1  # one call waits already

    async def parse(*args):
        raise AssertionError("parsed")

    engine.parse = parse
    answer = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert answer.status_code == 429 and "too many waiting requests (1" in answer.json()["error"]["message"]
    engine._tokenizer_pool.shutdown()


def test_a_request_id_in_the_body_names_the_request_unless_the_header_does():
    """As vLLM's: a chat or completion body's request_id is the request's id (the response's, the header sent
    back, the engine request's) when no x-request-id header is sent; the header's wins. Either is checked."""
    engine, http = _service_over_an_engine()
    engine._connected = True
    engine._update_ready()
    added = []

    async def add_all(calls, room_checked=False, arrival_time=None):
        added.extend(call.request_id for call in calls)
        return [SimpleNamespace(prompt=[1], arrival_time=0.0) for _ in calls]

    async def outputs(state):
        yield RequestOutput("r", [5], "x", finish_reason=FinishReason.LENGTH, prompt_tokens=1, completion_tokens=1)

    engine.add_all, engine.outputs, engine.abort = add_all, outputs, lambda state: None
    for path, prefix, body in (("/v1/chat/completions", "chatcmpl-", CHAT),
                               ("/v1/completions", "cmpl-", {"prompt": "hi"})):
        for headers, rid in (({}, "body-id"), ({"x-request-id": "header-id"}, "header-id")):
            answer = http.post(path, json={**body, "max_tokens": 1, "request_id": "body-id"}, headers=headers)
            assert answer.status_code == 200, answer.text
            assert (answer.json()["id"], answer.headers["x-request-id"]) == (prefix + rid, rid)
    assert added == ["body-id", "header-id"] * 2
    for request_id, words in ((7, "request_id must be a string, got int"),
                              ("x" * 257, "request_id must be at most 256 characters, got 257")):
        answer = http.post("/v1/completions", json={"prompt": "hi", "request_id": request_id},
                           headers={"x-request-id": "header-id"})
        error = answer.json()["error"]
        assert answer.status_code == 400 and words in error["message"] and error["param"] == "request_id", error
    answer = http.post("/v1/chat/completions", json={**CHAT, "tools": []})  # the usual error body
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "tools"
    assert "tools must not be an empty array" in answer.json()["error"]["message"]
    assert added == ["body-id", "header-id"] * 2
    engine._tokenizer_pool.shutdown()


def _tokenizer_folder(smollm2_dir, folder, **changes):
    """SmolLM2's tokenizer files in folder, with changes to tokenizer.json's top-level fields."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        data = json.loads((smollm2_dir / name).read_text())
        (folder / name).write_text(json.dumps({**data, **changes} if name == "tokenizer.json" else data))
    return folder


# a post-processor that starts each text with <|endoftext|> (id 0), as a BOS
BOS = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                                                {"Sequence": {"id": "A", "type_id": 0}}],
       "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
       "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}}}
EFFORT_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %} effort={{ reasoning_effort }} " \
                  "thinking={{ enable_thinking }}"


def test_add_special_tokens_and_reasoning_effort_reach_the_tokenizer_and_the_template(smollm2_dir, tmp_path):
    """As vLLM's: add_special_tokens adds the tokenizer's own (a BOS) to a text by default and to the rendered
    messages when asked; reasoning_effort is the template's variable, with enable_thinking false for "none"
    unless chat_template_kwargs set it. /tokenize shows what a generation's prompt would be."""
    from twinplane.controlplane.tokenizer import Tokenizer

    engine, http = _service_over_an_engine()
    engine.tokenizer = Tokenizer(_tokenizer_folder(smollm2_dir, tmp_path, post_processor=BOS), EFFORT_TEMPLATE)

    def tokens(**body) -> list[int]:
        answer = http.post("/tokenize", json=body)
        assert answer.status_code == 200, answer.text
        return answer.json()["tokens"]

    text = tokens(prompt="hi")
    assert text[0] == 0 and tokens(prompt="hi", add_special_tokens=False) == text[1:]
    chat = tokens(**CHAT)
    assert chat[0] != 0 and tokens(**CHAT, add_special_tokens=True) == [0, *chat]
    for body, rendered in [({}, "hi effort= thinking="), ({"reasoning_effort": "low"}, "hi effort=low thinking=True"),
                           ({"reasoning_effort": "none"}, "hi effort=none thinking=False"),
                           ({"reasoning_effort": "none", "chat_template_kwargs": {
                               "enable_thinking": True, "reasoning_effort": "high"}}, "hi effort=none thinking=True")]:
        assert engine.tokenizer.decode(tokens(**CHAT, **body), False) == rendered
    refused = http.post("/tokenize", json={**CHAT, "reasoning_effort": "extreme"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "reasoning_effort"
    engine._tokenizer_pool.shutdown()
    assert parse({"prompt": "hi", "add_special_tokens": False}, chat=False).calls[0].prompt.add_special_tokens is False
    (call,) = parse({**CHAT, "add_special_tokens": True, "reasoning_effort": "low"}).calls
    assert call.prompt.add_special_tokens is True
    assert call.prompt.chat_options.template_kwargs == {"enable_thinking": True, "reasoning_effort": "low"}


def test_spaces_between_special_tokens_false_is_refused_where_decoding_spaces_them(smollm2_dir, tmp_path):
    """A tokenizer that decodes two special tokens with a space between them cannot honour false (vLLM's fast
    tokenizers' way); one that joins them as they are (byte-level, SentencePiece) already does."""
    from twinplane.controlplane.tokenizer import Tokenizer

    assert not Tokenizer(smollm2_dir).spaces_special_tokens
    spaced = Tokenizer(_tokenizer_folder(smollm2_dir, tmp_path, decoder=None))  # joins every token with a space
    assert spaced.spaces_special_tokens and spaced.decode([1, 2], False) == "<|im_start|> <|im_end|>"
    body = {**CHAT, "spaces_between_special_tokens": False, "skip_special_tokens": False}
    with pytest.raises(InvalidRequest, match="^spaces_between_special_tokens: false is not supported"):
        parse_request(body, LIMITS, "r", True, spaced_special_tokens=True)
    parse_request(body, LIMITS, "r", True, spaced_special_tokens=False)
    parse_request({**body, "skip_special_tokens": True}, LIMITS, "r", True, spaced_special_tokens=True)  # none shown
    engine, http = _service_over_an_engine()  # over HTTP, the served tokenizer decides
    engine.tokenizer, engine._connected = spaced, True
    engine._update_ready()

    async def add(*args, **kwargs):
        raise AssertionError("added")

    engine.add = add
    answer = http.post("/v1/chat/completions", json=body)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "spaces_between_special_tokens"
    engine._tokenizer_pool.shutdown()


def test_a_value_named_in_a_message_is_encoded_only_as_far_as_the_message_shows_it():
    """json_excerpt writes json.dumps's text, cut to the limit, and stops encoding there: an item past
    the limit is never reached (here one that JSON cannot encode at all)."""
    from twinplane.controlplane.errors import json_excerpt

    for value in ({"a": [1, 2.5, None, True, "é\ud800"]}, "x" * 100, list(range(50)), 7, None, {}):
        for limit in (1, 10, 40, 1000):
            assert json_excerpt(value, limit) == json.dumps(value)[:limit]
    assert json_excerpt(list(range(100)) + [object()], 40) == json.dumps(list(range(100)))[:40]
    assert json_excerpt({"k": ["v"] * 10, "never": object()}, 20) == '{"k": ["v", "v", "v"'
