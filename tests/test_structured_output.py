"""Structured output through both planes with the real SmolLM2: JSON Schemas, any JSON object, regexes,
choices and forced tool calls over gRPC, the OpenAI chat API and the Responses API; constrained and
free requests side by side; what is refused."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import random
import re
import subprocess
import sys
import threading
from types import SimpleNamespace
from typing import NamedTuple

import grpc
import jsonschema
import numpy as np
import openai
import pytest

from tests.conftest import NODE_CLIENT, Planes
from twinplane.clients.messages import build_request
from twinplane.controlplane import grammar, structured
from twinplane.controlplane.errors import InvalidRequest
from twinplane.controlplane.grammar import Grammar, TokenVocab
from twinplane.controlplane.structured import (TokenMatcher, Vocabulary, after_reasoning, avoiding, compiled,
                                               json_schema_regex)
from twinplane.controlplane.tokenizer import Tokenizer

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0},
    "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
}, "required": ["name", "age", "city"]}
ASK = [{"role": "user", "content": "Describe a person who lives in Paris as JSON with a name, an age and a city."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone",
                                         "parameters": {"type": "object", "properties": {
                                             "zone": {"type": "string", "maxLength": 30}}, "required": ["zone"]}}}


@pytest.fixture(scope="module")
def planes(smollm2_dir, tmp_path_factory):
    planes = Planes(tmp_path_factory.mktemp("structured"), smollm2_dir,
                    ("--block-size", "16", "--max-model-len", "1024"), http_listen="127.0.0.1:0",
                    tool_call_parser="hermes").start()
    yield planes
    planes.stop()


@pytest.fixture(scope="module")
def client(planes) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{planes.plane.http_port}/v1", api_key="-", max_retries=0,
                         timeout=120)


class Output(NamedTuple):
    text: str
    finish_reason: str


def generate(planes: Planes, **kwargs) -> Output:
    """One greedy request's whole text and finish reason, over gRPC."""
    with planes.client() as c:
        chunks = list(c.generate(timeout=120, temperature=0.0, max_tokens=kwargs.pop("max_tokens", 80), **kwargs))
    return Output("".join(ch.text for ch in chunks), chunks[-1].finish_reason)


def test_a_json_schema_gives_an_object_valid_under_it_that_ends_the_request(planes) -> None:
    out = generate(planes, messages=ASK, json_schema=PERSON)
    person = json.loads(out.text)
    assert list(person) == ["name", "age", "city"], out.text  # every required property, in the schema's order
    assert isinstance(person["name"], str) and len(person["name"]) <= 20
    assert isinstance(person["age"], int) and person["age"] >= 0 and person["city"] in ("Paris", "London", "Tokyo")
    assert out.finish_reason == "stop_token"  # end-of-sequence came once the object closed


def test_regex_choice_and_json_object(planes) -> None:
    phone = generate(planes, prompt="My phone number is", regex=r"\(\d{3}\) \d{3}-\d{4}")
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", phone.text), phone.text
    answer = generate(planes, messages=[{"role": "user", "content": "Is Paris in France? Answer yes or no."}],
                      choice=["yes", "no", "maybe not"])
    assert answer.text in ("yes", "no", "maybe not") and answer.finish_reason == "stop_token"
    anything = generate(planes, messages=ASK, json_object=True, max_tokens=120)
    assert anything.finish_reason == "stop_token", anything.text
    assert isinstance(json.loads(anything.text), dict)


def test_ignore_eos_ends_once_the_text_can_go_no_further(planes) -> None:
    """With ignore_eos a request runs past end-of-sequence tokens, but a structured one whose text is whole
    and can take no more bytes may sample nothing else: it ends there, not at max_tokens."""
    ask = [{"role": "user", "content": "Is Paris in France? Answer yes or no."}]
    answer = generate(planes, messages=ask, choice=["yes", "no"], ignore_eos=True, max_tokens=30)
    assert answer.text in ("yes", "no") and answer.finish_reason == "stop_token", answer
    with planes.client() as c:
        chunks = list(c.generate(messages=ask, regex="(yes|no)!*", ignore_eos=True, max_tokens=12, temperature=0.0,
                                 timeout=120))
    assert chunks[-1].finish_reason == "length"  # "!" may always come: the text never ends on its own
    assert sum(len(ch.token_ids) for ch in chunks) == 12


def test_constrained_and_free_requests_side_by_side(planes) -> None:
    """Masks apply to their own rows only: a free request batched with constrained ones gives the text it
    gives alone, and each constrained one still matches."""
    free = dict(messages=[{"role": "user", "content": "Name three colours."}], max_tokens=40)
    alone = generate(planes, **free).text
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        constrained = [pool.submit(generate, planes, messages=ASK, json_schema=PERSON) for _ in range(3)]
        constrained += [pool.submit(generate, planes, prompt="Call me at", regex=r"\d{3}-\d{4}") for _ in range(2)]
        together = pool.submit(generate, planes, **free)
        outputs = [f.result().text for f in constrained]
    assert together.result().text == alone
    assert all(list(json.loads(text)) == ["name", "age", "city"] for text in outputs[:3]), outputs
    assert all(re.fullmatch(r"\d{3}-\d{4}", text) for text in outputs[3:]), outputs


def test_openai_response_format_and_structured_outputs(client, planes) -> None:
    model = planes.engine.model_names[0]
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    chat = client.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=80,
                                          response_format=schema_format)
    assert list(json.loads(chat.choices[0].message.content)) == ["name", "age", "city"]
    assert chat.choices[0].finish_reason == "stop"
    grpc_text = generate(planes, messages=ASK, json_schema=PERSON).text
    assert chat.choices[0].message.content == grpc_text  # the same constraint over both APIs
    stream = client.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=80, stream=True,
                                            response_format=schema_format)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == grpc_text
    obj = client.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=120,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    done = client.completions.create(model=model, prompt="The answer is", temperature=0, max_tokens=10,
                                     extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert done.choices[0].text in ("yes", "no")
    older = client.completions.create(model=model, prompt="The answer is", temperature=0, max_tokens=10,
                                      extra_body={"guided_choice": ["yes", "no"]})  # vLLM's older spelling
    assert older.choices[0].text == done.choices[0].text
    person = client.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=80,
                                            extra_body={"guided_json": PERSON})
    assert person.choices[0].message.content == grpc_text
    response = client.responses.create(model=model, input=ASK[0]["content"], temperature=0, max_output_tokens=80,
                                       text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}})
    assert response.output_text == grpc_text


def test_forced_tool_calls(client, planes) -> None:
    """tool_choice "required" or a named function: the reply is nothing but calls in the parser's format,
    with arguments valid under the function's parameters, returned as tool calls."""
    model = planes.engine.model_names[0]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = client.chat.completions.create(model=model, messages=ask, temperature=0, max_tokens=80,
                                           tools=[TIME, WEATHER],
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.content  # a named function's call: "stop"
    [call] = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and list(arguments) == ["city", "unit"]
    assert arguments["unit"] in ("celsius", "fahrenheit")
    required = client.chat.completions.create(model=model, messages=ask, temperature=0, max_tokens=120,
                                              tools=[TIME, WEATHER], tool_choice="required", parallel_tool_calls=False)
    [call] = required.choices[0].message.tool_calls
    assert required.choices[0].finish_reason == "tool_calls" and call.function.name in ("get_time", "get_weather")
    response = client.responses.create(model=model, input=ask[0]["content"], temperature=0, max_output_tokens=80,
                                       tools=[{"type": "function", **WEATHER["function"]}],
                                       tool_choice={"type": "function", "name": "get_weather"})
    [item] = [i for i in response.output if i.type == "function_call"]
    assert item.name == "get_weather" and list(json.loads(item.arguments)) == ["city", "unit"]


def test_a_forced_tool_call_cut_short_leaves_no_markup_in_the_content(client, planes) -> None:
    """A reply forced to be tool calls and cut by max_tokens before a call's arguments open: finish_reason
    "length" and no call, and the call's markup is in no content (chat, its stream, Responses, gRPC)."""
    model = planes.engine.model_names[0]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    cut = dict(model=model, messages=ask, temperature=0, max_tokens=3, tools=[TIME, WEATHER], tool_choice="required")
    text = generate(planes, messages=ask, tools=[TIME, WEATHER], tool_choice="required", max_tokens=3).text
    assert text and "<tool_call>".startswith(text)  # the text as written: the start of a call's markup
    reply = client.chat.completions.create(**cut).choices[0]
    assert reply.finish_reason == "length" and not reply.message.content and not reply.message.tool_calls
    chunks = list(client.chat.completions.create(**cut, stream=True))
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    response = client.responses.create(model=model, input=ask[0]["content"], temperature=0, max_output_tokens=3,
                                       tools=[{"type": "function", **WEATHER["function"]}], tool_choice="required")
    assert response.status == "incomplete" and not response.output_text
    with planes.client() as c:
        parts = list(c.generate(messages=ask, tools=[TIME, WEATHER], tool_choice="required", max_tokens=3,
                                temperature=0.0, parse_output=True, timeout=120))
    assert not "".join(part.text for part in parts) and not [call for part in parts for call in part.tool_calls]


@pytest.mark.parametrize("kwargs, message", [
    (dict(regex="(?=a)b"), "lookahead"),
    (dict(regex="a{5,2}"), "structured_output.regex"),
    (dict(json_schema="{not json"), "JSON text of a JSON Schema"),
    (dict(json_schema={"type": "string", "format": "idn-email"}), "format"),
    (dict(choice=[]), "non-empty list"),
    (dict(choice=["yes", ""]), "non-empty"),
    (dict(regex="[^\\s\\S]"), "no text matches it"),
    (dict(regex="a+", min_tokens=2), "min_tokens (2) cannot go with structured output"),
    (dict(regex="a" * 16_385), "structured_output.regex is 16385 characters long; at most 16384"),
    (dict(choice=["x" * 9000, "y" * 9000]), "its strings hold 18000 characters; at most 16384"),
])
def test_bad_structured_output_over_grpc_is_refused_with_a_message(planes, kwargs, message) -> None:
    with planes.client() as c, pytest.raises(grpc.RpcError) as error:
        c.generate_text("Hello", timeout=30, max_tokens=4, **kwargs)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.value.details(), error.value.details()
    assert generate(planes, prompt="Hello", max_tokens=4).text  # the server serves on


@pytest.mark.parametrize("body, param, message", [
    (dict(response_format={"type": "xml"}), "response_format", "response_format must be"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
     "response_format", "type"),
    (dict(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}), "response_format",
     "send one of them"),
    (dict(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs", "one of"),
    (dict(guided_regex="a+", structured_outputs={"regex": "b"}), "structured_outputs",
     "structured_outputs and guided_regex each constrain"),
    (dict(guided_grammar="root ::= x"), "guided_grammar", "not supported"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice",
     "get_weather"),
])
def test_bad_structured_output_over_http_is_a_400_naming_the_field(client, planes, body, param, message) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=planes.engine.model_names[0], messages=ASK, max_tokens=4,
                                       extra_body=body)
    assert error.value.body["param"] == param and message in error.value.body["message"], error.value.body


def test_several_constraints_are_refused_by_the_client() -> None:
    with pytest.raises(ValueError, match="regex and choice"):
        build_request("x", regex="a", choice=["a"])


def test_a_large_schema_compiles_off_the_event_loop(planes, client, monkeypatch) -> None:
    """A schema whose grammar takes most of a second to compile (an enum of 1,000 long strings; ~0.6 s on the
    2-core CI machine, during which an event loop that compiled it answered nothing) is checked on a tokenizer
    thread of the frontend, not on its event loop; the answer is one of the strings. (The engine core's side:
    test_engine_core.py's test_a_grammar_compiles_off_the_step_loop.)"""
    words = [f"{'x' * 80}{i}" for i in range(1000)]
    schema = {"type": "json_schema", "json_schema": {"name": "w", "schema": {"enum": words}}}
    check, where = structured._regex_problem, []

    def recording(regex: str):
        try:
            asyncio.get_running_loop()
            where.append(threading.current_thread().name)
        except RuntimeError:  # no event loop runs in this thread
            where.append(None)
        return check(regex)

    monkeypatch.setattr(structured, "_regex_problem", recording)
    reply = client.chat.completions.create(model=planes.engine.model_names[0], messages=ASK, max_tokens=120,
                                           temperature=0, response_format=schema)
    assert json.loads(reply.choices[0].message.content) in words
    assert where and set(where) == {None}, where


def test_a_grammar_that_outgrows_its_bound_fails_its_request_not_the_core(monkeypatch) -> None:
    """An automaton that grows past grammar.MAX_DFA_STATES while a sequence uses it: the matcher records
    why and allows only the stop tokens, which the engine core turns into that request's error."""
    monkeypatch.setattr(grammar, "MAX_DFA_STATES", 12)
    vocabulary = SimpleNamespace(token_bytes=[b"a", b"b", None], vocab=TokenVocab([b"a", b"b", None], [2], 3))
    matcher = TokenMatcher(Grammar.from_regex("(a|b)*a(a|b){6}"), vocabulary)
    masks = []
    for token in [0, 1] * 8:
        masks.append(matcher.mask())
        if matcher.failure:
            break
        matcher.accept(token)
    assert masks[0] == bytes([0b011]) and masks[-1] == bytes([0b100])  # a or b; then the stop token only
    assert "automaton states" in matcher.failure


def test_constraints_together_allow_what_all_of_them_allow() -> None:
    """AllOf: allowed_token_ids, bad_words and a grammar together allow the tokens every one of them does. Where
    they leave none, a grammar whose text is a match may still end it; else the request fails, naming them."""
    from twinplane.controlplane.structured import AllOf, BannedWords, FixedTokens, token_bits

    token_bytes = [b"a", b"b", b"c", b"ab", None]  # token 4 is the end of the sequence
    vocabulary = SimpleNamespace(token_bytes=token_bytes, vocab=TokenVocab(token_bytes, [4], 5))
    stop = token_bits([4], 5)

    def allowed(matcher) -> set[int]:
        bits = np.unpackbits(np.frombuffer(matcher.mask(), np.uint8), bitorder="little")
        return set(np.flatnonzero(bits[:5]).tolist())

    def grammar(regex: str) -> TokenMatcher:
        return TokenMatcher(Grammar.from_regex(regex), vocabulary)

    both = AllOf([FixedTokens([0, 2, 4], 5), grammar("(a|b)+")], stop)
    assert not both.fixed and allowed(both) == {0}  # "a": not "b" (not listed), "c" (no match), "ab" (not listed)
    both.accept(0)
    assert allowed(both) == {0, 4} and not both.whole and both.failure is None
    ending = AllOf([FixedTokens([0], 5), grammar("a")], stop)  # the end of the sequence is not listed
    ending.accept(0)
    assert ending.whole and allowed(ending) == {4} and ending.failure is None  # a whole match ends anyway
    stuck = AllOf([FixedTokens([0], 5), grammar("b")], stop)
    assert allowed(stuck) == {4}
    assert stuck.failure == "allowed_token_ids and structured output leave no token to write next"

    fixed = AllOf([FixedTokens([0, 1, 2], 5), BannedWords(((1,),), 5)], stop)
    assert fixed.fixed and allowed(fixed) == {0, 2}
    words = AllOf([FixedTokens([0, 1, 2], 5), BannedWords(((1,), (0, 2)), 5)], stop)
    assert not words.fixed and allowed(words) == {0, 2}
    words.accept(0)
    assert allowed(words) == {0}  # "c" right after "a" would finish a banned word
    banned = AllOf([FixedTokens([1], 5), BannedWords(((1,),), 5)], stop)
    assert allowed(banned) == {4} and banned.failure == "allowed_token_ids and bad_words leave no token to write next"
    grammar_failure = AllOf([FixedTokens([0, 1], 5), grammar("a")], stop)
    grammar_failure.parts[1].failure = "structured output: too many states"
    assert grammar_failure.failure == "structured output: too many states"


NODE_SCRIPT = """
const { Client } = require(process.argv[1]);
(async () => {
  const client = new Client(process.argv[2]);
  let text = '';
  for await (const chunk of client.generate(JSON.parse(process.argv[3]))) text += chunk.text;
  client.close();
  console.log(JSON.stringify(text));
})();
"""


def test_the_node_client_sends_a_json_schema(node, planes) -> None:
    options = {"messages": ASK, "maxTokens": 80, "temperature": 0,
               "structuredOutput": {"jsonSchema": json.dumps(PERSON)}}
    result = subprocess.run([node, "-e", NODE_SCRIPT, str(NODE_CLIENT / "twinplane.js"), planes.address,
                             json.dumps(options)], capture_output=True, text=True, timeout=120,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == generate(planes, messages=ASK, json_schema=PERSON).text


def test_the_mask_benchmark_walks_each_form_to_a_match(smollm2_dir) -> None:
    result = subprocess.run([sys.executable, "-m", "twinplane.controlplane.bench_grammar", "--tokenizer",
                             str(smollm2_dir)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()[2:]]
    assert [row[0] for row in rows] == ["json_object", "json_schema", "regex", "choice"]


def test_grpc_tool_choice_forces_calls(planes, client, node) -> None:
    """chat.tool_choice over gRPC forces the calls the HTTP API forces: the same text, split by parse_output
    into the same call; the Python and Node.js clients send it."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = dict(messages=ask, tools=[TIME, WEATHER], tool_choice="get_weather")
    text = generate(planes, **forced).text
    call_text = r'<tool_call>\n\{"name": ?"get_weather", ?"arguments": ?\{"city".*\}\}\n</tool_call>'
    assert re.fullmatch(call_text, text), text
    with planes.client() as c:
        chunks = list(c.generate(timeout=120, temperature=0.0, max_tokens=80, parse_output=True, **forced))
    [call] = [call for chunk in chunks for call in chunk.tool_calls]
    assert not "".join(chunk.text for chunk in chunks)
    http = client.chat.completions.create(model=planes.engine.model_names[0], messages=ask, temperature=0,
                                          max_tokens=80, tools=[TIME, WEATHER],
                                          tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [http_call] = http.choices[0].message.tool_calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", json.loads(http_call.function.arguments))
    options = {"messages": ask, "tools": [TIME, WEATHER], "toolChoice": "get_weather", "maxTokens": 80,
               "temperature": 0}
    result = subprocess.run([node, "-e", NODE_SCRIPT, str(NODE_CLIENT / "twinplane.js"), planes.address,
                             json.dumps(options)], capture_output=True, text=True, timeout=120,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == text


@pytest.mark.parametrize("kwargs, message", [
    (dict(tools=[WEATHER], tool_choice="get_time"), 'the name of one of chat.tools \\(get_weather\\)'),
    (dict(tool_choice="required"), "needs chat.tools"),
    (dict(tools=[WEATHER], tool_choice="required", regex="a+"), "send one of them"),
])
def test_bad_grpc_tool_choice_is_refused(planes, kwargs, message) -> None:
    with planes.client() as c, pytest.raises(grpc.RpcError) as error:
        c.generate_text(messages=ASK, timeout=30, max_tokens=4, **kwargs)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(message, error.value.details()), error.value.details()


def test_grpc_tool_choice_needs_a_tool_call_parser(loopback_planes) -> None:
    with loopback_planes.client() as c, pytest.raises(grpc.RpcError) as error:
        c.generate_text(messages=ASK, tools=[WEATHER], tool_choice="required", timeout=30, max_tokens=4)
    assert "needs a server started with --tool-call-parser" in error.value.details()


@pytest.mark.parametrize("tag", ["</think>", "</tool_call>", "ab", "abc"])
def test_avoiding_matches_exactly_the_texts_without_the_tag(tag) -> None:
    pattern, rng = avoiding(tag), random.Random(0)
    letters = sorted(set(tag + "x"))
    for _ in range(20_000):
        text = "".join(rng.choice(letters) for _ in range(rng.randint(0, 16)))
        if rng.random() < 0.3:  # pieces of the tag, whole or cut, anywhere
            at = rng.randint(0, len(text))
            text = text[:at] + tag[:rng.randint(0, len(tag))] + text[at:]
        assert (re.fullmatch(pattern, text) is not None) == (tag not in text), text


@pytest.mark.parametrize("parser, texts, refused", [
    ("qwen3", ['{"n": 1}', '<think>\nIs it </thin k> or 1?</think>\n\n{"n": 1}', '\n<think></think>{"n":2}'],
     ['<think>x</think>\n\nhello', '<think>x</think>{"n": 1}</think>', 'hmm<think></think>{"n": 1}']),
    ("deepseek_r1", ['Think first.</think>\n\n{"n": 1}', '<think>Think.</think>{"n": 3}'],
     ['{"n": 1}', 'Think.</think>x']),
])
def test_the_constraint_applies_to_the_answer_after_the_reasoning(smollm2_dir, parser, texts, refused) -> None:
    """With a reasoning parser the thinking is free and the answer after it must match, token by token as
    SmolLM2's tokenizer writes the texts."""
    tokenizer = Tokenizer(smollm2_dir)
    vocabulary = Vocabulary(tokenizer, tokenizer.vocab_size, [tokenizer.token_id(tokenizer.eos_token)])
    grammar = compiled(after_reasoning(json_schema_regex({"type": "object", "properties": {
        "n": {"type": "integer"}}, "required": ["n"]}, "schema"), parser))
    for text, ok in [(t, True) for t in texts] + [(t, False) for t in refused]:
        matcher = TokenMatcher(grammar, vocabulary, tokenizer.encode(text, add_special_tokens=False))
        assert grammar.is_accepting(matcher.state) == ok, text


def test_a_reasoning_server_constrains_the_answer(planes_factory, smollm2_dir) -> None:
    """--reasoning-parser qwen3: SmolLM2 writes no <think>, so its whole answer is the JSON, over HTTP and
    over gRPC with parse_output (no reasoning text)."""
    planes = planes_factory(smollm2_dir, "--block-size", "16", "--max-model-len", "1024",
                            http_listen="127.0.0.1:0", reasoning_parser="qwen3")
    http = openai.OpenAI(base_url=f"http://127.0.0.1:{planes.plane.http_port}/v1", api_key="-", max_retries=0,
                         timeout=120)
    chat = http.chat.completions.create(model=planes.engine.model_names[0], messages=ASK, temperature=0,
                                        max_tokens=80, response_format={"type": "json_schema", "json_schema": {
                                            "name": "person", "schema": PERSON}})
    message = chat.choices[0].message
    assert list(json.loads(message.content)) == ["name", "age", "city"]
    assert not getattr(message, "reasoning_content", None)
    with planes.client() as c:
        chunks = list(c.generate(messages=ASK, json_schema=PERSON, parse_output=True, temperature=0.0,
                                 max_tokens=80, timeout=120))
    assert "".join(ch.text for ch in chunks) == message.content and not "".join(ch.reasoning_text for ch in chunks)


def test_a_server_without_a_tokenizer_refuses_structured_output(planes_factory) -> None:
    planes = planes_factory("dummy:tiny-qwen3", "--block-size", "16")
    with planes.client() as c, pytest.raises(grpc.RpcError) as error:
        c.generate_text(token_ids=[1, 2, 3], regex="[a-z]+", max_tokens=4, timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "needs the model's tokenizer" in error.value.details()
    with planes.client() as c:
        assert c.generate(token_ids=[1, 2, 3], max_tokens=4, timeout=30).text() is not None  # serving on


def _random_schema(rng: random.Random) -> dict:
    """A small object schema: 1-3 properties of the kinds tool parameters use, some of them required."""
    kinds = [lambda: {"type": "string", "maxLength": rng.randint(1, 12)},
             lambda: {"type": "integer", "minimum": rng.randint(-5, 5), "maximum": rng.randint(6, 500)},
             lambda: {"type": "number", "minimum": 0, "maximum": rng.randint(1, 10)},
             lambda: {"type": "boolean"},
             lambda: {"enum": rng.sample(["red", "green", "blue", 1, None, True], rng.randint(1, 3))},
             lambda: {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 3},
             lambda: {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "null"}]}]
    names = rng.sample(["name", "age", "score", "ok", "tags", "color", "note"], rng.randint(1, 3))
    return {"type": "object", "properties": {name: rng.choice(kinds)() for name in names},
            "required": [name for name in names if rng.random() < 0.6], "additionalProperties": False}


@pytest.mark.parametrize("seed", range(12))
def test_random_schemas_give_valid_json_greedy_or_drawn(planes, seed) -> None:
    """Random object schemas, greedy and at temperature 1: whatever the model writes, a text that ended with
    end-of-sequence is a JSON value valid under the schema (checked with the jsonschema package)."""
    rng = random.Random(seed)
    schema = _random_schema(rng)
    sampling = dict(temperature=0.0) if seed % 2 == 0 else dict(temperature=1.0, seed=seed)
    with planes.client() as c:
        chunks = list(c.generate(messages=ASK, json_schema=schema, max_tokens=120, timeout=120, **sampling))
    text, reason = "".join(ch.text for ch in chunks), chunks[-1].finish_reason
    assert reason in ("stop_token", "length"), reason
    if reason == "stop_token":
        jsonschema.validate(json.loads(text), schema)


def test_forced_tool_calls_with_the_mistral_parser(smollm2_dir, planes_factory) -> None:
    """--tool-call-parser mistral: a forced call is written after [TOOL_CALLS] in one of Mistral's forms and
    comes back as a call with arguments valid under its parameters and an id of nine letters and digits."""
    planes = planes_factory(smollm2_dir, "--block-size", "16", "--max-model-len", "1024", http_listen="127.0.0.1:0",
                            tool_call_parser="mistral")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{planes.plane.http_port}/v1", api_key="-", max_retries=0,
                           timeout=120)
    model = planes.engine.model_names[0]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        reply = client.chat.completions.create(model=model, messages=ask, temperature=0, max_tokens=120,
                                               tools=[TIME, WEATHER], tool_choice=choice, parallel_tool_calls=False)
        [call] = reply.choices[0].message.tool_calls
        want = "tool_calls" if choice == "required" else "stop"  # as OpenAI's: a named function's call ends "stop"
        assert reply.choices[0].finish_reason == want and not reply.choices[0].message.content
        assert re.fullmatch("[A-Za-z0-9]{9}", call.id)
        arguments = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            assert list(arguments) == ["city", "unit"] and arguments["unit"] in ("celsius", "fahrenheit")
        else:
            assert call.function.name == "get_time" and choice == "required" and list(arguments) == ["zone"]


def test_banned_words_masks_follow_the_output() -> None:
    """BannedWords: a one-token word is out of every mask (a fixed mask when all words are so); a longer word's
    last token is out only right after the rest of it, the output replayed when a request is taken up again."""
    from twinplane.controlplane.structured import BannedWords

    def allowed(mask: bytes) -> set[int]:
        return set(np.flatnonzero(np.unpackbits(np.frombuffer(mask, np.uint8), bitorder="little")[:20]).tolist())

    everything = set(range(20))
    singles = BannedWords(((3,), (7,)), 20)
    assert singles.fixed and allowed(singles.mask()) == everything - {3, 7}
    words = BannedWords(((3,), (5, 6, 9), (6, 2)), 20)
    assert not words.fixed and allowed(words.mask()) == everything - {3}
    for token, out in ((5, set()), (6, {9, 2}), (1, set()), (6, {2})):
        words.accept(token)
        assert allowed(words.mask()) == everything - {3} - out, token
    assert allowed(BannedWords(((5, 6, 9),), 20, [1, 5, 6]).mask()) == everything - {9}  # the output replayed
    assert allowed(BannedWords(((25,), (4, 30)), 20, [4]).mask()) == everything  # ids past the model's vocabulary
    assert len(words.mask()) == 3 and words.mask()[2] >> 4 == 0  # the bits past the vocabulary are clear


def test_the_frontend_keeps_a_regex_s_verdict_not_its_grammar() -> None:
    """The frontend checks a regex and keeps only whether it compiles (the engine core compiles the grammar
    it runs): no automaton, which can take MiBs, stays alive in the frontend."""
    import gc
    import weakref

    made = []
    original = Grammar.from_regex.__func__

    def tracked(cls, regex):
        grammar = original(cls, regex)
        made.append(weakref.ref(grammar))
        return grammar

    regex = "kept-verdict-[a-z]{1,4}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Grammar, "from_regex", classmethod(tracked))
        assert structured.checked_regex(regex, "regex") == regex
    gc.collect()
    assert made and all(ref() is None for ref in made)
    with pytest.raises(InvalidRequest, match="where: no text matches it"):
        structured.checked_regex("[^\\s\\S]", "where")
    # a refused pattern's verdict is kept too, by its digest: no pattern (a large one's MBs) stays behind
    for _ in range(2):
        with pytest.raises(InvalidRequest, match="too large"):
            structured.checked_regex("(?:a)" * 400_000, "where")
    assert all(isinstance(key, bytes) and len(key) == 16 for key in structured._verdicts)
