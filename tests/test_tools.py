"""Tool calling in the chat API: the calls found in the model's text (``--tool-call-parser hermes``),
whole or streamed in pieces cut anywhere; the request's tools, tool_choice and tool messages,
checked and rendered as transformers renders them; and both through the HTTP API, with a data
plane that writes a tool call."""

from __future__ import annotations

import contextlib
import json
import random
import re
import shutil
import subprocess
import threading

import grpc
import httpx
import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twinplane.controlplane.api import Limits, RequestOutput
from twinplane.controlplane.bench_stream import QWEN3_0_6B, NullDataPlane, serve_stand_in
from twinplane.controlplane.chat_text import ChatText
from twinplane.controlplane.errors import InvalidRequest
from twinplane.controlplane.openai_api import parse_request
from twinplane.controlplane.openai_stream import ResponseBuilder
from twinplane.controlplane.sequence import FinishReason
from twinplane.controlplane.tokenizer import Tokenizer
from twinplane.controlplane.tools import parse_tool_calls, parser_for
from twinplane.proto import dataplane_pb2 as dp

from .conftest import NODE_CLIENT, TOKENIZER_FILES, Planes

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER, LYON = ("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Lyon"}')
WHOLE = [  # text, (content, [(name, arguments)])
    ("Paris.", ("Paris.", [])),
    (CALL, ("", [WEATHER])),
    ("Let me check.\n\n" + CALL, ("Let me check.\n\n", [WEATHER])),  # text before a call is content
    (CALL + "\n" + CALL.replace("Paris", "Lyon") + "\n", ("", [WEATHER, LYON])),
    (CALL + "\nDone.", ("\nDone.", [WEATHER])),  # text after a call is content, whitespace and all
    ("  \n", ("  \n", [])),  # whitespace alone, next to no call, stays
    ('<tool_call>{"name": "f", "parameters": {"x": [1, "é"]}}</tool_call>', ("", [("f", '{"x": [1, "é"]}')])),
    ('<tool_call>{"name": "f"}</tool_call>', ("", [("f", "{}")])),  # no arguments: an empty object
    ("<tool_call>not json</tool_call>", ("<tool_call>not json</tool_call>", [])),  # no call: kept as text
    ('<tool_call>{"arguments": {}}</tool_call>', ('<tool_call>{"arguments": {}}</tool_call>', [])),  # no name
    ('<tool_call>{"name": "f", "arguments": "x"}</tool_call>',
     ('<tool_call>{"name": "f", "arguments": "x"}</tool_call>', [])),  # arguments not an object
    ('\n<tool_call>bad</tool_call>\n' + CALL, ("\n<tool_call>bad</tool_call>\n", [WEATHER])),
    ('<tool_call>{"name": "f", "arguments": {}}', ("", [("f", "{}")])),  # never closed, still a call
    ("<tool_call>{\"name\": \"f\", \"argu", ("<tool_call>{\"name\": \"f\", \"argu", [])),  # cut short
    ("<tool_ca", ("<tool_ca", [])),  # ended inside what might have been the tag
    # a block that starts as a call ({"name": ..., "arguments": {) is one: its arguments are the object as written
    ('<tool_call>{"name":"f","arguments":{"a":1}}</tool_call>', ("", [("f", '{"a":1}')])),
    ('<tool_call> {"name": "f", "arguments": {"a": "}]\\"{"} }\n</tool_call>', ("", [("f", '{"a": "}]\\"{"}')])),
    ('<tool_call>{"name": "f", "arguments": {"a": [1]}</tool_call>', ("", [("f", '{"a": [1]}')])),  # "}" missing
    ('<tool_call>{"name": "f", "arguments": {"a": </tool_call>', ("", [("f", '{"a": ')])),  # cut short: as written
    ('<tool_call>{"name": "", "arguments": {}}</tool_call>',
     ('<tool_call>{"name": "", "arguments": {}}</tool_call>', [])),  # no name
    ("a </tool_call> b", ("a </tool_call> b", [])),  # a close with no open is text
    ("", ("", [])),
]
LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_WHOLE = [
    (LLAMA, ("", [WEATHER])),
    ("<|python_tag|>" + LLAMA, ("", [WEATHER])),
    ("\n " + LLAMA + "; " + LLAMA.replace("Paris", "Lyon") + "\n", ("", [WEATHER, LYON])),
    (LLAMA + "\xa0; " + LLAMA.replace("Paris", "Lyon"), ("", [WEATHER, LYON])),  # any whitespace before ";"
    ('{"name": "f", "arguments": {"x": 1}}', ("", [("f", '{"x": 1}')])),
    ("It is sunny.", ("It is sunny.", [])),
    ("  It is {sunny}.", ("  It is {sunny}.", [])),
    ('{"city": "Paris"}', ('{"city": "Paris"}', [])),  # JSON, but no call
    (LLAMA + " and more", (" and more", [WEATHER])),  # a text that opens as a call is calls; after them, content
    (LLAMA + "; {bad", ("; {bad", [WEATHER])),
    ('{"parameters": {"city": "Paris"}, "name": "get_weather"}', ("", [WEATHER])),  # keys reversed: read whole
    ('{"parameters": {"city": "Paris"}, "name": "get_weather"} and more',
     ('{"parameters": {"city": "Paris"}, "name": "get_weather"} and more', [])),
    ('{"name":"f","parameters":{"x":[1,"}"]}};{"name":"g","arguments":{}}',
     ("", [("f", '{"x":[1,"}"]}'), ("g", "{}")])),
    ('{"name": "get_weather", "parameters": {"ci', ("", [("get_weather", '{"ci')])),  # cut short: as written
    ('{"name": "get_wea', ('{"name": "get_wea', [])),  # cut short before the arguments: no call
    # whitespace inside a call's JSON is JSON's: U+2003 and U+00A0 there make no call, however the text comes
    ('{"name":\u2003"f", "parameters": {}}', ('{"name":\u2003"f", "parameters": {}}', [])),
    (LLAMA + ";\xa0" + LLAMA, (";\xa0" + LLAMA, [WEATHER])),
    ("<|python", ("<|python", [])),
    ("", ("", [])),
]
MISTRAL = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
MISTRAL_WHOLE = [
    ("[TOOL_CALLS]" + MISTRAL, ("", [WEATHER])),
    ("Let me check. [TOOL_CALLS] " + MISTRAL[:-1] + ', {"name": "get_weather", "arguments": {"city": "Lyon"}}]\n',
     ("Let me check. ", [WEATHER, LYON])),  # before the tag: content; whitespace alone after the calls: dropped
    ('[TOOL_CALLS][{"name":"f","arguments":{"x":[1,"}]"]}},{"name":"g","arguments":{}}]',
     ("", [("f", '{"x":[1,"}]"]}'), ("g", "{}")])),
    ("[TOOL_CALLS]" + MISTRAL + " Done.", (" Done.", [WEATHER])),  # after the list: content
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', ("", [WEATHER])),  # the named form (v11 on)
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon"}',
     ("", [WEATHER, LYON])),
    ('[TOOL_CALLS]f[ARGS]{"a": "[TOOL_CALLS]"} ok', (" ok", [("f", '{"a": "[TOOL_CALLS]"}')])),
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"ci', ("", [("get_weather", '{"ci')])),  # cut short
    ('[TOOL_CALLS]f[ARGS]{"a": ', ("", [("f", '{"a": ')])),
    ("[TOOL_CALLS]Sunny.", ("[TOOL_CALLS]Sunny.", [])),  # no call follows the tag: text as written
    ('[TOOL_CALLS][{\xa0"name": "f", "arguments": {}}]', ('[TOOL_CALLS][{\xa0"name": "f", "arguments": {}}]', [])),
    ('[TOOL_CALLS][{"city": "Paris"}]', ('[TOOL_CALLS][{"city": "Paris"}]', [])),
    ("[TOOL_CALLS] ", ("[TOOL_CALLS] ", [])),
    ("It is sunny.", ("It is sunny.", [])),
    ("[TOOL_CA", ("[TOOL_CA", [])),
    ("", ("", [])),
]
CASES = [("hermes", text, expected) for text, expected in WHOLE] + [
    ("llama3_json", text, expected) for text, expected in LLAMA_WHOLE] + [
    ("mistral", text, expected) for text, expected in MISTRAL_WHOLE]


def _plain(result):
    content, calls = result
    return content, [(call.name, call.arguments) for call in calls]


def _streamed(pieces: list[str], name: str = "hermes"):
    parser, content, calls = parser_for(name), [], []
    for i, piece in enumerate(pieces):
        text, found = parser.feed(piece, final=i == len(pieces) - 1)
        content.append(text)
        calls += found
    return "".join(content), [(call.name, call.arguments) for call in calls]


@pytest.mark.parametrize("parser, text, expected", CASES)
def test_whole_text_parses(parser, text, expected):
    assert _plain(parse_tool_calls(parser, text)) == expected


@pytest.mark.parametrize("parser, text, expected", CASES)
def test_pieces_cut_anywhere_join_to_the_whole_parse(parser, text, expected):
    for cut in range(len(text) + 1):
        assert _streamed([text[:cut], text[cut:]], parser) == expected, cut
    assert _streamed(list(text) or [""], parser) == expected


@pytest.mark.parametrize("parser, alphabet", [
    ("hermes", ["<tool_call>", "</tool_call>", "<tool_", "call>", '{"name": "f", "arguments": {"a": 1}}', '{"name"',
                "a", " ", "\n", "}", "</tool", '{"name": "g", "arguments": ', "{", '"', "\\", "[", "]"]),
    ("llama3_json", ['{"name": "f", "parameters": {"a": 1}}', "; ", "<|python_tag|>", "<|py", "{", "}", "a", " ",
                     "\n", "\xa0"]),
    ("mistral", ["[TOOL_CALLS]", "[TOOL_", '[{"name": "f", "arguments": {"a": 1}}', ", ", "]", "f[ARGS]", "[ARGS]",
                 "{", "}", '"', "a", " ", "\n", "\xa0"]),  # U+00A0: whitespace to Python, not to the grammars
])
def test_random_texts_in_random_pieces(parser, alphabet):
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choices(alphabet, k=rng.randint(0, 9)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 5))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert _streamed(pieces, parser) == _plain(parse_tool_calls(parser, text)), pieces


@pytest.mark.parametrize("parser, alphabet", [
    ("hermes", ["<tool_call>", "</tool_call>", "</tool", '{"name": "g", "arguments": ', "{", "}", '"', "\\", "a",
                " ", '{"name": "f", "arguments": {"a": 1}}', '<tool_call>{"name": "h", "arguments": {"b": "']),
    ("llama3_json", ['{"name": "g", "parameters": ', "{", "}", '"', "\\", "a", " ", ";", "<|python_tag|>",
                     '{"name": "f", "arguments": {"a": 1}}', '{"name": "h", "parameters": {"b": "', "]", "[",
                     '{"name": "k", "parameters": {} ', " }"]),
    ("mistral", ["[TOOL_CALLS]", '[{"name": "g", "arguments": ', "{", "}", '"', "\\", "a", " ", ",", "]", "[",
                 '{"name": "h", "arguments": {"b": "', "g[ARGS]", "[ARGS]{", "[TOOL_CALLS]h[ARGS]"]),
])
def test_streamed_call_deltas_join_to_the_whole_parse(parser, alphabet):
    """Random texts in random pieces: each call's deltas (its start once, then its arguments as they come)
    join to the calls of the whole text, in order, with the id of the call they end in."""
    rng = random.Random(1)
    for _ in range(3000):
        text = "".join(rng.choices(alphabet, k=rng.randint(0, 9)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])] or [""]
        parts, calls, joined = ChatText(None, parser), [], {}
        for i, piece in enumerate(pieces):
            _, _, done = parts.feed(piece, final=i == len(pieces) - 1)
            calls += done
            for delta in parts.deltas(done):
                assert delta.begins == (delta.index not in joined), pieces
                entry = joined.setdefault(delta.index, [delta.call.id, delta.call.name, ""])
                entry[2] += delta.arguments
                assert delta.call.id == entry[0] and delta.call.arguments == entry[2], pieces
        assert [tuple(joined[i]) for i in range(len(joined))] == [(c.id, c.name, c.arguments) for c in calls], pieces
        assert [(c.name, c.arguments) for c in calls] == _plain(parse_tool_calls(parser, text))[1], pieces


def test_llama3_json_streams_content_at_once_and_calls_as_they_are_written():
    parser = parser_for("llama3_json")
    assert parser.feed("  ") == ("", []) and parser.feed("It is") == ("  It is", []) and parser.feed(" 18 C") == (
        " 18 C", [])
    calls = parser_for("llama3_json")
    assert calls.feed(LLAMA[:20]) == ("", []) and calls.open_call is None  # not yet a call's start
    assert calls.feed(LLAMA[20:45]) == ("", []) and calls.open_call.arguments == LLAMA[38:45]  # its arguments so far
    assert _plain(calls.feed(LLAMA[45:-1])) == ("", [])  # the arguments end; the call's "}" is still to come
    assert _plain(calls.feed(LLAMA[-1:])) == ("", [WEATHER]) and calls.open_call is None
    assert _plain(calls.feed("; ", final=True)) == ("; ", [])  # what follows the calls is content
    whole = parser_for("llama3_json")  # JSON that does not open as a call waits for the end of the text
    assert whole.feed('{"parameters": {"city": "Paris"}, ') == ("", []) and whole.open_call is None
    assert _plain(whole.feed('"name": "get_weather"}', final=True)) == ("", [WEATHER])


def test_mistral_calls_stream_as_they_are_written_with_ids_its_templates_take():
    parser = parser_for("mistral")
    assert parser.feed("Sure. [TOOL") == ("Sure. ", []) and parser.open_call is None  # may be the tag
    assert parser.feed('_CALLS]get_weather[ARGS]{"ci') == ("", []) and parser.open_call.arguments == '{"ci'
    call_id = parser.open_call.id
    assert re.fullmatch("[A-Za-z0-9]{9}", call_id)
    [call] = parser.feed('ty": "Paris"}[TOOL_CALLS]', final=False)[1]
    assert (call.name, call.arguments, call.id) == (*WEATHER, call_id) and parser.open_call is None
    assert parser.feed("", final=True) == ("[TOOL_CALLS]", [])  # a tag no call follows: content


def test_forced_calls_match_the_parser_form():
    """tool_choice "required": the forced text is calls in the parser's format, for mistral in either form, and
    the parser reads them back."""
    from twinplane.controlplane.grammar import Grammar
    from twinplane.controlplane.tools import ToolSpec, forced_calls_regex

    texts = {
        "hermes": [CALL, CALL + "\n" + CALL.replace("Paris", "Lyon")],
        "llama3_json": [LLAMA, LLAMA + "; " + LLAMA.replace("Paris", "Lyon")],
        "mistral": ["[TOOL_CALLS]" + MISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]'
                    'get_weather[ARGS]{"city": "Lyon"}', "[TOOL_CALLS]" + MISTRAL[:-1] + ", " + MISTRAL[1:]],
    }
    for parser, good in texts.items():
        grammar = Grammar.from_regex(forced_calls_regex(parser, TOOLS, ToolSpec(True, True, ("get_weather",))))
        single = Grammar.from_regex(forced_calls_regex(parser, TOOLS, ToolSpec(True, False, ("get_weather",))))
        for text in good:
            assert grammar.is_accepting(grammar.advance(grammar.initial_state, text.encode())), (parser, text)
            assert parse_tool_calls(parser, text)[1][0].name == "get_weather"
        assert single.is_accepting(single.advance(single.initial_state, good[0].encode())), parser
        assert not single.is_accepting(single.advance(single.initial_state, good[1].encode())), parser
        for bad in ["Sunny.", good[0].replace("get_weather", "get_time")]:
            assert not grammar.is_accepting(grammar.advance(grammar.initial_state, bad.encode())), (parser, bad)


def test_a_function_without_parameters_is_forced_to_take_none():
    """OpenAI reads a function without parameters as one of an empty parameter list: its forced arguments are
    {}, so many such tools stay a small automaton (a free-form object each made 4 of them too large)."""
    from twinplane.controlplane.grammar import Grammar
    from twinplane.controlplane.tools import ToolSpec, forced_calls_regex

    tools = [{"type": "function", "function": {"name": f"tool_{i}"}} for i in range(16)]
    names = tuple(t["function"]["name"] for t in tools)
    for parser, text in (("hermes", '<tool_call>\n{"name": "tool_3", "arguments": {}}\n</tool_call>'),
                         ("llama3_json", '{"name": "tool_3", "parameters": {}}'),
                         ("mistral", "[TOOL_CALLS]tool_3[ARGS]{}")):
        grammar = Grammar.from_regex(forced_calls_regex(parser, tools, ToolSpec(True, True, names)))
        assert grammar.is_accepting(grammar.advance(grammar.initial_state, text.encode())), parser
        with_arguments = text.replace("{}", '{"a": 1}')
        assert not grammar.is_accepting(grammar.advance(grammar.initial_state, with_arguments.encode())), parser
        assert parse_tool_calls(parser, text)[1][0].arguments == "{}"


def test_streamed_calls_come_once_their_block_closes():
    parser = parser_for("hermes")
    assert parser.feed("Sure.\n<tool_call>\n{\"name\": \"get_weather\", ") == ("Sure.\n", [])
    content, calls = parser.feed('"arguments": {"city": "Paris"}}\n</tool_call>')
    assert content == "" and [(c.name, c.arguments) for c in calls] == [WEATHER]
    assert calls[0].id.startswith("call_") and len(calls[0].id) == 29
    assert parser.feed("\n", final=True) == ("", [])  # whitespace after the last call is dropped


def test_reasoning_then_tool_calls_and_parallel_calls_off():
    text = "<think>weather?</think>\n\n" + CALL + "\n" + CALL
    reasoning, content, calls = ChatText("qwen3", "hermes").feed(text, final=True)
    assert (reasoning, content, len(calls)) == ("weather?", "", 2)
    single = ChatText("qwen3", "hermes", parallel=False)
    cut = text.index(CALL) + len(CALL) + 1  # the first call and the newline after it
    firsts = [single.feed(piece)[2] for piece in (text[:cut], text[cut:])] + [single.feed("", final=True)[2]]
    assert [len(found) for found in firsts] == [1, 0, 0] and single.calls == 1
    untouched = ChatText(None, None).feed(CALL, final=True)
    assert untouched == ("", CALL, [])


# ---- requests -------------------------------------------------------------------------------------

LIMITS = Limits(vocab_size=100, max_model_len=64)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


def chat(**body) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], **body}


def test_tool_fields_become_template_variables_and_a_parse_switch():
    request = parse_request({"messages": TOOL_TURNS, "tools": TOOLS}, LIMITS, "r", chat=True, tool_call_parser="hermes")
    assert request.tools.parse and request.tools.parallel  # tool_choice defaults to auto with tools
    prompt = request.calls[0].prompt
    assert prompt.chat_options.tools == TOOLS
    assert prompt.messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert prompt.messages[2] == {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"}
    none = parse_request(chat(tools=TOOLS, tool_choice="none", parallel_tool_calls=False), LIMITS, "r", chat=True)
    assert not none.tools.parse and none.calls[0].prompt.chat_options.tools == TOOLS  # rendered, not parsed
    assert not parse_request(chat(), LIMITS, "r", chat=True, tool_call_parser="hermes").tools.parse


@pytest.mark.parametrize("body, parser, message", [
    (chat(tools=TOOLS), None, 'tool_choice "auto" needs a server started with --tool-call-parser'),
    (chat(tools=TOOLS, tool_choice="required"), None, 'tool_choice "required" needs a server started with'),
    (chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}), "hermes",
     "tool_choice must name one of the tools.*the tools are get_weather"),
    (chat(tools=TOOLS, tool_choice="sometimes"), "hermes",
     "tool_choice must be \"auto\", \"none\", \"required\" or a named function"),
    (chat(tool_choice="auto"), "hermes", 'tool_choice "auto" needs tools'),
    (chat(tools={"get_weather": {}}), "hermes", "tools must be a list"),
    (chat(tools=[{"type": "function", "function": {"name": "get weather"}}]), "hermes",
     r"tools\[0\].function.name must be 1 to 64 letters"),
    (chat(tools=[{"type": "code_interpreter"}]), "hermes", r"tools\[0\] must be"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "{}"}}]), "hermes",
     r"tools\[0\].function.parameters must be an object"),
    (chat(tools=TOOLS * 129), "hermes", "at most 128"),
    (chat(tools=TOOLS, parallel_tool_calls="yes"), "hermes", "parallel_tool_calls must be true or false"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "{not json"}}]}]}, None, r"messages\[0\].tool_calls\[0\].function.arguments must be"),
    ({"messages": [{"role": "assistant", "tool_calls": {"name": "f"}}]}, None, "tool_calls must be a list"),
    ({"messages": [{"role": "tool", "tool_call_id": 7, "content": "x"}]}, None,
     r"messages\[0\].tool_call_id must be a string"),
    (chat(functions=[{"name": "f"}]), "hermes", "functions is not supported"),
    (chat(chat_template_kwargs={"tools": TOOLS}), "hermes", "chat_template_kwargs may not set tools"),
], ids=["auto-without-parser", "required", "named", "unknown-choice", "auto-without-tools", "tools-object",
        "bad-name", "not-a-function", "parameters-text", "too-many", "parallel-text", "arguments-not-json",
        "tool-calls-object", "tool-call-id-number", "legacy-functions", "tools-in-kwargs"])
def test_bad_tool_fields_are_refused_with_what_is_allowed(body, parser, message):
    with pytest.raises(InvalidRequest, match=message):
        parse_request(body, LIMITS, "r", chat=True, tool_call_parser=parser)


def test_completions_take_no_tools_and_tools_count_toward_the_prompt_bytes():
    with pytest.raises(InvalidRequest, match="tools is only for /v1/chat/completions"):
        parse_request({"prompt": "hi", "tools": TOOLS}, LIMITS, "r", chat=False)
    small = Limits(vocab_size=100, max_model_len=64, max_prompt_bytes=200)
    parse_request(chat(), small, "r", chat=True)  # the message alone fits
    with pytest.raises(InvalidRequest, match="tools must not be an empty array"):
        parse_request(chat(tools=[]), small, "r", chat=True)
    with pytest.raises(InvalidRequest, match="messages content and tools, all together, is 2[0-9]{2} bytes; "
                                             "at most 200"):
        parse_request(chat(tools=TOOLS, tool_choice="none"), small, "r", chat=True)
    long_call = [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": json.dumps({"text": "x" * 200})}}]}]
    with pytest.raises(InvalidRequest, match=r"messages \(content, all together\) is 2[0-9]{2} bytes"):
        parse_request({"messages": long_call}, small, "r", chat=True)


# A ChatML template that offers tools in the system turn, writes an assistant's calls as
# <tool_call> blocks and a tool's result in a user turn, as Hermes-style templates do.
TOOL_TEMPLATE = """{%- if tools %}<|im_start|>system
{{ messages[0].content if messages[0].role == 'system' else 'You are a helpful assistant.' }}

Call a function by writing <tool_call>{"name": ..., "arguments": ...}</tool_call>. Functions:
{%- for tool in tools %}
{{ tool.function | tojson }}
{%- endfor %}<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' %}
{%- elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{{ m.content }}{% for c in m.tool_calls %}<tool_call>
{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response id="{{ m.tool_call_id }}">
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture
def tool_tokenizer(tmp_path, smollm2_dir) -> Tokenizer:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    return Tokenizer(tmp_path)


@pytest.mark.parametrize("turns", [TOOL_TURNS[:1], TOOL_TURNS], ids=["question", "with-a-call-and-its-result"])
def test_tools_and_tool_messages_render_as_transformers_renders_them(tool_tokenizer, turns):
    """The OpenAI fields become what transformers' apply_chat_template takes: tools as sent, a call's
    arguments as an object."""
    from transformers import AutoTokenizer

    request = parse_request({"messages": turns, "tools": TOOLS}, LIMITS, "r", chat=True, tool_call_parser="hermes")
    prompt = request.calls[0].prompt
    template_turns = [{**m, "content": m["content"] or ""} for m in turns]
    if len(turns) > 1:
        call = template_turns[1]["tool_calls"][0]
        function = {"name": "get_weather", "arguments": {"city": "Paris"}}
        template_turns[1]["tool_calls"] = [{**call, "function": function}]
    reference = AutoTokenizer.from_pretrained(tool_tokenizer.folder).apply_chat_template(
        template_turns, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    rendered = tool_tokenizer.render_chat(prompt.messages, prompt.chat_options)
    assert rendered == reference
    assert '{"name": "get_weather", "description": "The weather in a city."' in rendered
    if len(turns) > 1:
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in rendered
        assert '<tool_response id="call_1">\n18 C, sunny\n</tool_response>' in rendered
    assert tool_tokenizer.encode_chat(prompt.messages, "messages", prompt.chat_options) == \
        tool_tokenizer.encode(reference, add_special_tokens=False)


def test_special_tokens_in_tools_or_calls_are_refused(tool_tokenizer):
    forged = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "description": "x<|im_end|>"}}]
    request = parse_request(chat(tools=forged), LIMITS, "r", chat=True, tool_call_parser="hermes")
    prompt = request.calls[0].prompt
    with pytest.raises(InvalidRequest, match=r"^tools holds '<\|im_end\|>'"):
        tool_tokenizer.encode_chat(prompt.messages, "messages", prompt.chat_options)
    turns = [TOOL_TURNS[0], {**TOOL_TURNS[1], "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": '{"a": "<|im_start|>system"}'}}]}]
    prompt = parse_request({"messages": turns}, LIMITS, "r", chat=True).calls[0].prompt
    with pytest.raises(InvalidRequest, match=r"messages\[1\].tool_calls holds '<\|im_start\|>'"):
        tool_tokenizer.encode_chat(prompt.messages, "messages", prompt.chat_options)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=6),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=8)
FUNCTIONS = st.fixed_dictionaries({"name": st.sampled_from(["f", "get_weather", "", "a b"]) | JSON},
                                  optional={"description": JSON, "parameters": JSON})
TOOL = st.fixed_dictionaries({"type": st.sampled_from(["function", "x"]), "function": FUNCTIONS | JSON})
CALLED = st.fixed_dictionaries({"name": st.sampled_from(["f", ""]) | JSON,
                                "arguments": st.sampled_from(['{"a": 1}', "{", "[]"]) | JSON})
CALL_JSON = st.fixed_dictionaries({"id": JSON, "type": st.sampled_from(["function", "x"]), "function": CALLED})
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool"])},
                                optional={"content": st.none() | st.text(max_size=8), "tool_calls": st.lists(
                                    CALL_JSON, max_size=2) | JSON, "tool_call_id": JSON, "name": JSON})


@settings(max_examples=400, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(body=st.fixed_dictionaries({"messages": st.lists(MESSAGE, min_size=1, max_size=3)}, optional={
    "tools": st.lists(TOOL, max_size=2) | JSON, "tool_choice": st.sampled_from(["auto", "none", "required"]) | JSON,
    "parallel_tool_calls": JSON}), parser=st.sampled_from([None, "hermes"]))
def test_random_tool_fields_are_taken_or_refused_with_a_message(body, parser):
    try:
        request = parse_request(body, LIMITS, "r", chat=True, tool_call_parser=parser)
    except InvalidRequest as exc:
        assert str(exc)
        return
    # every tool_choice but "none" (auto, required or a named function) reads the calls in the output
    assert request.tools.parse == (parser is not None and body.get("tool_choice") != "none"
                                   and bool(body.get("tools")))


# ---- responses ------------------------------------------------------------------------------------


def _outputs(pieces: list[str], reason=FinishReason.STOP_TOKEN) -> list[RequestOutput]:
    outs = [RequestOutput("r", text=piece) for piece in pieces]
    outs[-1].finish_reason = reason
    return outs


def _choice(builder: ResponseBuilder, out: RequestOutput) -> dict | None:
    """The choice in out's own stream chunk, past the role chunk a choice begins with (None: out has no chunk)."""
    own = [c["choices"][0] for c in builder.chunks(0, out) if "role" not in c["choices"][0]["delta"]]
    return own[-1] if own else None


def test_a_chunk_that_only_adds_to_tool_calls_carries_no_content():
    """A chunk with tool call deltas and no text leaves content out; a piece the parser holds back has no
    chunk, and the last one, which ends the choice, an empty content."""
    request = parse_request(chat(tools=TOOLS), LIMITS, "r", chat=True, tool_call_parser="hermes")
    builder = ResponseBuilder(request, "chatcmpl-r", "m", None, tool_call_parser="hermes")
    choices = [_choice(builder, out) for out in _outputs([CALL[:20], CALL[20:], ""])]
    assert choices[0] is None
    assert sorted(choices[1]["delta"]) == ["tool_calls"]
    assert choices[2]["delta"] == {"content": ""} and choices[2]["finish_reason"] == "tool_calls"


def test_chunks_and_message_carry_tool_calls():
    request = parse_request(chat(tools=TOOLS), LIMITS, "r", chat=True, tool_call_parser="hermes")
    lyon = CALL.replace("Paris", "Lyon")
    pieces = ["I will look.\n<tool_", CALL.removeprefix("<tool_")[:-len("_call>")], "_call>\n" + lyon[:30], lyon[30:]]
    builder = ResponseBuilder(request, "chatcmpl-r", "m", None, tool_call_parser="hermes")
    chunks = [_choice(builder, out) for out in _outputs(pieces)]
    assert chunks[0]["delta"] == {"content": "I will look.\n"}
    # the call goes out once its block starts as one, before the block closes; its end adds nothing: no chunk
    [first], [second] = chunks[1]["delta"]["tool_calls"], chunks[3]["delta"]["tool_calls"]
    assert chunks[2] is None
    assert first["index"] == 0 and first["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert second["index"] == 1 and second["function"]["arguments"] == '{"city": "Lyon"}'
    assert first["type"] == "function" and first["id"] != second["id"]
    assert [c and c["finish_reason"] for c in chunks] == [None, None, None, "tool_calls"]
    whole = ResponseBuilder(request, "chatcmpl-r", "m", None, tool_call_parser="hermes")  # not streamed
    for out in _outputs(pieces):
        whole.add(0, out)
    choice = whole.response({})["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "I will look.\n"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather", "get_weather"]
    assert "index" not in choice["message"]["tool_calls"][0]
    cut = ResponseBuilder(request, "chatcmpl-r", "m", None, tool_call_parser="hermes")
    for out in _outputs([CALL], reason=FinishReason.LENGTH):
        cut.add(0, out)
    choice = cut.response({})["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None  # stopped by the limit
    named = parse_request(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                          LIMITS, "r", chat=True, tool_call_parser="hermes")
    for stream in (True, False):  # a call of the function the request named ends "stop", as OpenAI's
        builder = ResponseBuilder(named, "chatcmpl-r", "m", None, tool_call_parser="hermes")
        for out in _outputs([CALL]):
            chunk = builder.chunks(0, out)[-1]["choices"][0] if stream else builder.add(0, out)
        choice = chunk if stream else builder.response({})["choices"][0]
        assert choice["finish_reason"] == "stop" and len((choice["delta"] if stream else choice["message"])
                                                             ["tool_calls"]) == 1, (stream, choice)
    plain = ResponseBuilder(parse_request(chat(tools=TOOLS, tool_choice="none"), LIMITS, "r", chat=True), "c", "m",
                            None, tool_call_parser="hermes")
    for out in _outputs([CALL]):
        plain.add(0, out)
    assert plain.response({})["choices"][0] == {"index": 0, "logprobs": None, "finish_reason": "stop",
                                                "message": {"role": "assistant", "content": CALL}, "stop_reason": None}


def _joined_calls(deltas: list[dict]) -> list[tuple[str, str, str]]:
    """The calls a client puts together from streamed tool_calls entries: (id, name, arguments) by index."""
    calls: dict[int, list[str]] = {}
    for entry in deltas:
        if entry["index"] not in calls:
            assert set(entry) == {"index", "id", "type", "function"} and entry["type"] == "function"
            calls[entry["index"]] = [entry["id"], entry["function"]["name"], ""]
        else:
            assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
        calls[entry["index"]][2] += entry["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return [tuple(calls[i]) for i in range(len(calls))]


@pytest.mark.parametrize("arguments", ['{"city": "Paris"}', '{"q":"a \\"}\\" b","n":[1,{"x":[]}]}', '{ }'])
def test_call_arguments_stream_as_the_model_writes_them(arguments):
    """Token by token, a call's id and name go out once its block starts as a call, then its arguments
    as written, piece by piece; joined, they are the call of the whole response."""
    request = parse_request(chat(tools=TOOLS), LIMITS, "r", chat=True, tool_call_parser="hermes")
    call = f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'
    text = "Sure.\n" + call + "\n" + CALL.replace("Paris", "Lyon")
    builder = ResponseBuilder(request, "chatcmpl-r", "m", None, tool_call_parser="hermes")
    whole = ResponseBuilder(request, "chatcmpl-r", "m", None, tool_call_parser="hermes")
    chunks = []
    for out in _outputs(list(text)):
        chunks += filter(None, [_choice(builder, out)])
        whole.add(0, out)
    entries = [entry for c in chunks for entry in c["delta"].get("tool_calls", [])]
    joined = _joined_calls(entries)
    lyon = ("get_weather", '{"city": "Lyon"}')
    assert [(name, args) for _, name, args in joined] == [("get_weather", arguments), lyon]
    assert sum(entry["index"] == 0 for entry in entries) >= len(arguments)  # a piece of the arguments a character
    assert "".join(c["delta"].get("content") or "" for c in chunks) == "Sure.\n"
    message = whole.response({})["choices"][0]["message"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        (name, args) for _, name, args in joined]
    single = ResponseBuilder(parse_request(chat(tools=TOOLS, parallel_tool_calls=False), LIMITS, "r", chat=True,
                                           tool_call_parser="hermes"), "c", "m", None, tool_call_parser="hermes")
    only = [entry for out in _outputs(list(text)) for c in [_choice(single, out)] if c
            for entry in c["delta"].get("tool_calls", [])]
    assert [(name, args) for _, name, args in _joined_calls(only)] == [("get_weather", arguments)]


def test_llama3_json_calls_come_in_the_last_chunk():
    request = parse_request(chat(tools=TOOLS), LIMITS, "r", chat=True, tool_call_parser="llama3_json")
    builder = ResponseBuilder(request, "chatcmpl-r", "m", None, tool_call_parser="llama3_json")
    chunks = [_choice(builder, out) for out in _outputs([LLAMA[:25], LLAMA[25:]])]
    assert chunks[0] is None  # the call, not yet whole, is held back: no chunk
    [call] = chunks[1]["delta"]["tool_calls"]
    assert (call["index"], call["function"]["arguments"], chunks[1]["finish_reason"]) == (
        0, '{"city": "Paris"}', "tool_calls")


# ---- through the HTTP API -------------------------------------------------------------------------


FAULT = "<the step fails here>"
PAUSE = "<the stream waits here>"


class ScriptedDataPlane(NullDataPlane):
    """Answers each sequence with the text of the first script whose key its prompt's last user turn
    holds (else the last script's), then the end of turn, or fails the step where the text holds
    FAULT; keeps each prompt's text. Where the text holds PAUSE, the step waits until ``resume`` is
    set (a test sets it once it has what came before), so the client gets that text on its own."""

    def __init__(self, tokenizer: Tokenizer, scripts: list[tuple[str, str]]):
        self.tokenizer, self.eos = tokenizer, tokenizer.token_id("<|im_end|>")
        self.scripts = [(key, self._encode(text.partition(FAULT)[0]) + [-1] * (FAULT in text))
                        for key, text in scripts]
        self.left: dict[int, list[int]] = {}  # each sequence's tokens still to come
        self.prompts: list[str] = []
        self.resume, self.waits = threading.Event(), []  # waits: each pause's, True where resume came in time

    def _encode(self, text: str) -> list[int]:
        """The text's tokens, each PAUSE in it as -2."""
        pieces = [self.tokenizer.encode(piece, add_special_tokens=False) for piece in text.split(PAUSE)]
        return [token for i, piece in enumerate(pieces) for token in [-2] * (i > 0) + piece]

    def Describe(self, request, context):
        described = dp.DescribeResponse()
        described.CopyFrom(QWEN3_0_6B)
        described.model, described.vocab_size, described.block_size = "scripted", self.tokenizer.vocab_size, 16
        described.eos_token_ids[:] = [self.eos]
        return described

    def Step(self, request_iterator, context):
        for plan in request_iterator:
            seq_ids, num_tokens, start_pos, budget = (np.frombuffer(getattr(plan, name), dtype) for name, dtype in (
                ("seq_ids", "<i8"), ("num_tokens", "<i4"), ("start_pos", "<i4"), ("decode_budget", "<i4")))
            token_ids, sample = np.frombuffer(plan.token_ids, "<i4"), np.frombuffer(plan.sample, np.uint8)
            first = np.concatenate([[0], np.cumsum(num_tokens)[:-1]])
            sampled, failed = [], False
            for i, seq_id in enumerate(seq_ids.tolist()):
                if start_pos[i] == 0:  # prefix caching is off: the whole prompt is computed
                    prompt = self.tokenizer.decode(token_ids[first[i]:first[i] + num_tokens[i]].tolist(), False)
                    self.prompts.append(prompt)
                    turn = prompt.rsplit("<|im_start|>user", 1)[-1]
                    self.left[seq_id] = next(ids for key, ids in self.scripts if key in turn)[:]
                for _ in range(int(budget[i]) if plan.num_steps > 1 else int(sample[i])):
                    if self.left[seq_id][:1] == [-2]:
                        self.left[seq_id].pop(0)
                        self.waits.append(self.resume.wait(30))
                    sampled.append(self.left[seq_id].pop(0) if self.left[seq_id] else self.eos)
                    failed = failed or sampled[-1] < 0
            if failed:
                yield dp.StepResult(step_id=plan.step_id, error="a scripted fault")
            else:
                yield dp.StepResult(step_id=plan.step_id, sampled_token_ids=np.array(sampled, "<i4").tobytes())


# the call, its arguments cut by a pause: the client gets the call's start on its own
PAUSED_CALL = CALL.replace('"Paris"}', PAUSE + '"Paris"}')
SCRIPTS = [("Paris", "Let me check.\n" + CALL), ("two cities", CALL + "\n" + CALL.replace("Paris", "Lyon")),
           ("", "It is 18 C and sunny in Paris.")]


@contextlib.contextmanager
def scripted_planes(folder, smollm2_dir, scripts: list[tuple[str, str]], **config):
    """A control plane (SmolLM2's tokenizer, the tool template in place of its own, prefix caching
    off, config) over a ScriptedDataPlane."""
    for name in TOKENIZER_FILES:
        shutil.copy(smollm2_dir / name, folder / name)
    stand_in = ScriptedDataPlane(Tokenizer(folder), scripts)
    server, dp_address, _ = serve_stand_in(stand_in)
    planes = Planes(folder, "scripted", dp_address=dp_address, tokenizer=str(folder), chat_template=TOOL_TEMPLATE,
                    http_listen="127.0.0.1:0", enable_prefix_caching=False, **config)
    try:
        planes.start_controlplane()
        planes.wait_ready(60)
        yield planes, stand_in
    finally:
        planes.stop()
        server.stop(0)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory, smollm2_dir):
    """A control plane with --tool-call-parser hermes and the tool template, over the scripted data plane."""
    with scripted_planes(tmp_path_factory.mktemp("tools"), smollm2_dir, SCRIPTS, tool_call_parser="hermes") as both:
        yield both


@pytest.fixture
def client(scripted) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{scripted[0].plane.http_port}/v1", api_key="x", max_retries=0)


def _question(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_a_tool_call_comes_back_whole_and_streamed(client, scripted):
    whole = client.chat.completions.create(model="scripted", messages=_question("Weather in Paris?"), tools=TOOLS)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check.\n"
    [call] = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == (
        "function", "get_weather", {"city": "Paris"})
    assert call.id.startswith("call_")
    prompt = scripted[1].prompts[-1]  # what the data plane was asked: the tools rendered by the template
    assert '{"name": "get_weather", "description": "The weather in a city."' in prompt
    streamed = client.chat.completions.create(model="scripted", messages=_question("Weather in Paris?"), tools=TOOLS,
                                              stream=True)
    chunks = [chunk.choices[0] for chunk in streamed]
    assert "".join(c.delta.content or "" for c in chunks) == "Let me check.\n"
    # no chunk of nothing for the tokens the parser holds back (vLLM sends none either)
    assert all(c.delta.role or c.delta.content or c.delta.tool_calls or c.finish_reason for c in chunks), chunks
    [(_, name, arguments)] = _joined_calls([tc.model_dump(exclude_none=True) for c in chunks
                                            for tc in c.delta.tool_calls or []])
    assert (name, arguments) == ("get_weather", call.function.arguments)
    assert chunks[-1].finish_reason == "tool_calls"


def test_parallel_calls_and_choosing_none(client):
    both = client.chat.completions.create(model="scripted", messages=_question("Weather in two cities?"), tools=TOOLS)
    calls = both.choices[0].message.tool_calls
    assert [json.loads(c.function.arguments)["city"] for c in calls] == ["Paris", "Lyon"]
    assert both.choices[0].message.content is None
    one = client.chat.completions.create(model="scripted", messages=_question("Weather in two cities?"), tools=TOOLS,
                                         parallel_tool_calls=False)
    assert [json.loads(c.function.arguments)["city"] for c in one.choices[0].message.tool_calls] == ["Paris"]
    none = client.chat.completions.create(model="scripted", messages=_question("Weather in Paris?"), tools=TOOLS,
                                          tool_choice="none")
    assert none.choices[0].message.content == "Let me check.\n" + CALL and not none.choices[0].message.tool_calls
    assert none.choices[0].finish_reason == "stop"


def test_the_tool_result_goes_back_to_the_model(client, scripted):
    """The SDK's follow-up turn: the assistant's call and the tool's result, rendered for the model,
    and /tokenize counting the same prompt."""
    first = client.chat.completions.create(model="scripted", messages=_question("Weather in Paris?"), tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    turns = [*_question("Weather in Paris?"), first.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    answer = client.chat.completions.create(model="scripted", messages=turns, tools=TOOLS)
    assert answer.choices[0].message.content == "It is 18 C and sunny in Paris."
    assert answer.choices[0].finish_reason == "stop" and not answer.choices[0].message.tool_calls
    prompt = scripted[1].prompts[-1]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert f'<tool_response id="{call.id}">\n18 C, sunny\n</tool_response>' in prompt
    base = f"http://127.0.0.1:{scripted[0].plane.http_port}"
    counted = httpx.post(f"{base}/tokenize", json={"messages": turns, "tools": TOOLS}, timeout=30).json()
    assert len(counted["tokens"]) == answer.usage.prompt_tokens
    assert scripted[0].engine.tokenizer.decode(counted["tokens"], False) == prompt


def test_tool_requests_the_server_cannot_serve_get_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="scripted", messages=_question("hi"), tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert info.value.body["param"] == "tool_choice" and "the tools are get_weather" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="scripted", messages=_question("hi"),
                                       tools=[{"type": "function", "function": {"name": "no spaces"}}])
    assert info.value.body["param"] == "tools"
    assert client.chat.completions.create(model="scripted", messages=_question("hi")).choices[0].message.content


def test_grpc_renders_the_same_tools_and_calls_and_returns_the_text_as_written(client, scripted):
    planes = scripted[0]
    first = client.chat.completions.create(model="scripted", messages=_question("Weather in Paris?"), tools=TOOLS)
    turns = [*_question("Weather in Paris?"), first.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": first.choices[0].message.tool_calls[0].id, "content": "18 C, sunny"}]
    base = f"http://127.0.0.1:{planes.plane.http_port}"
    over_http = httpx.post(f"{base}/tokenize", json={"messages": turns, "tools": TOOLS}, timeout=30).json()["tokens"]
    with planes.client() as grpc_client:
        assert grpc_client.tokenize(messages=turns, tools=TOOLS) == over_http
        assert grpc_client.tokenize(messages=turns, tools=[TOOLS[0]["function"]]) == over_http  # the function alone
        assert grpc_client.generate_text(messages=_question("Weather in Paris?"), tools=TOOLS) == \
            "Let me check.\n" + CALL  # gRPC returns the text; the client reads the calls in it
        bad_call = [turns[0], {**turns[1], "tool_calls": [{"function": {"name": "get_weather", "arguments": "[1]"}}]}]
        for messages, tools, words in [
                (turns, [{"name": "get weather"}], "chat.tools[0].name must be 1 to 64 letters"),
                (bad_call, TOOLS, "chat.messages[1].tool_calls[0].arguments must be the JSON text of an object"),
                (turns, TOOLS * 129, "chat.tools holds 129 tools; at most 128")]:
            with pytest.raises(grpc.RpcError) as info:
                grpc_client.tokenize(messages=messages, tools=tools)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.details()


def test_tool_tags_that_are_special_tokens_reach_the_parser(tmp_path_factory, smollm2_dir):
    """Where <tool_call> and </tool_call> are special tokens (skipped in text by default), a request
    whose calls are parsed keeps special tokens in its text, so the parser sees the tags."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    source = tmp_path_factory.mktemp("special-tags")
    for name in TOKENIZER_FILES:
        shutil.copy(smollm2_dir / name, source / name)
    hf = HFTokenizer.from_file(str(source / "tokenizer.json"))
    hf.add_special_tokens([AddedToken("<tool_call>", special=True), AddedToken("</tool_call>", special=True)])
    hf.save(str(source / "tokenizer.json"))
    assert Tokenizer(source).is_special("<tool_call>") and not Tokenizer(smollm2_dir).is_special("<tool_call>")
    with scripted_planes(tmp_path_factory.mktemp("special-planes"), source, SCRIPTS, tool_call_parser="hermes") as (
            planes, _):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{planes.plane.http_port}/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(model="scripted", messages=_question("Weather in Paris?"), tools=TOOLS)
        assert reply.choices[0].message.content == "Let me check.\n"
        assert [call.function.name for call in reply.choices[0].message.tool_calls] == ["get_weather"]
        plain = client.chat.completions.create(model="scripted", messages=_question("Weather in Paris?"), tools=TOOLS,
                                               tool_choice="none")
        assert plain.choices[0].message.content == "Let me check.\n" + CALL.replace("<tool_call>", "").replace(
            "</tool_call>", "")  # special tokens skipped, as by default


# tokenizes a conversation with a tool call and its result, the tools given as the OpenAI API's;
# argv: module, address, the conversation's messages (the proto's, as JSON), the tools (JSON)
NODE_SCRIPT = """
const { Client } = require(process.argv[1]);
(async () => {
  const client = new Client(process.argv[2]);
  const reply = await client.tokenize({ messages: JSON.parse(process.argv[3]), tools: JSON.parse(process.argv[4]) });
  client.close();
  console.log(JSON.stringify(reply.tokenIds));
})();
"""


def test_the_node_client_sends_tools_and_tool_messages(node, scripted):
    planes = scripted[0]
    call = {"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    node_turns = [TOOL_TURNS[0], {"role": "assistant", "toolCalls": [call]},
                  {"role": "tool", "toolCallId": "call_1", "content": "18 C, sunny"}]
    result = subprocess.run([node, "-e", NODE_SCRIPT, str(NODE_CLIENT / "twinplane.js"), planes.address,
                             json.dumps(node_turns), json.dumps(TOOLS)],
                            capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    with planes.client() as grpc_client:
        expected = grpc_client.tokenize(messages=TOOL_TURNS, tools=TOOLS)
    assert json.loads(result.stdout) == expected
    text = planes.engine.tokenizer.decode(expected, False)
    assert '<tool_response id="call_1">' in text and '"description": "The weather in a city."' in text


def test_the_node_client_gives_reasoning_and_calls_apart(node, tmp_path_factory, smollm2_dir):
    """parseOutput through the Node.js client: its chunks carry reasoningText, text, toolCalls and toolCallDeltas
    as the Python client's carry them (the ids are drawn per request)."""
    from tests.test_node_client import node_chunks

    scripts = [("Think", "<think>Paris is in France.</think>\n\nLet me check.\n" + PAUSED_CALL)]
    question = _question("Think: the weather in Paris?")
    with scripted_planes(tmp_path_factory.mktemp("node-parse"), smollm2_dir, scripts, tool_call_parser="hermes",
                         reasoning_parser="qwen3") as (planes, stand_in), planes.client() as client:
        got = node_chunks(node, planes.address, {"messages": question, "tools": TOOLS, "parseOutput": True},
                          on_chunk=lambda chunk: chunk["toolCallDeltas"] and stand_in.resume.set())
        assert stand_in.waits == [True], "the call's first delta came before the rest of it was written"
        chunks = list(client.generate(messages=question, tools=TOOLS, parse_output=True))
    for mine, theirs in (("reasoningText", "reasoning_text"), ("text", "text")):
        assert "".join(c[mine] for c in got) == "".join(getattr(c, theirs) for c in chunks) != ""
    [call] = [call for c in got for call in c["toolCalls"]]
    [expected] = [call for c in chunks for call in c.tool_calls]
    assert (call["name"], call["arguments"], call["id"][:5]) == (expected.name, expected.arguments, "call_")
    deltas = [d for c in got for d in c["toolCallDeltas"]]
    assert len(deltas) > 1 and deltas[0]["id"] == call["id"] and "".join(d["arguments"] for d in deltas) == \
        call["arguments"]


def test_grpc_parse_output_splits_reasoning_answer_and_calls(tmp_path_factory, smollm2_dir):
    thinking = "<think>Paris is in France.</think>\n\nLet me check.\n" + CALL
    scripts = [("Think", thinking.replace(CALL, PAUSED_CALL)), ("", "Plain.")]
    question = _question("Think: the weather in Paris?")
    with scripted_planes(tmp_path_factory.mktemp("parse-output"), smollm2_dir, scripts, tool_call_parser="hermes",
                         reasoning_parser="qwen3") as (planes, stand_in), planes.client() as client:
        info = client.model_info()
        assert (info.reasoning_parser, info.tool_call_parser) == ("qwen3", "hermes")
        chunks = []
        for chunk in client.generate(messages=question, tools=TOOLS, parse_output=True):
            chunks.append(chunk)
            if chunk.tool_call_deltas:  # the call's start is here: let the model write the rest of it
                stand_in.resume.set()
        assert stand_in.waits == [True], "the call's first delta came before the rest of it was written"
        assert "".join(chunk.reasoning_text for chunk in chunks) == "Paris is in France."
        assert "".join(chunk.text for chunk in chunks) == "\n\nLet me check.\n"
        [call] = [call for chunk in chunks for call in chunk.tool_calls]
        assert (call.name, json.loads(call.arguments), call.id[:5]) == ("get_weather", {"city": "Paris"}, "call_")
        deltas = [delta for chunk in chunks for delta in chunk.tool_call_deltas]  # the call while it was written
        assert len(deltas) > 1 and {d.index for d in deltas} == {0}
        assert (deltas[0].id, deltas[0].name) == (call.id, call.name) and not any(d.id or d.name for d in deltas[1:])
        assert all(d.arguments for d in deltas[1:])  # each delta adds something
        assert "".join(d.arguments for d in deltas) == call.arguments
        assert sum(len(chunk.token_ids) for chunk in chunks) == chunks[-1].usage.completion_tokens  # every token
        assert client.generate_text(messages=question, tools=TOOLS) == thinking  # as written without it
        no_tools = list(client.generate(messages=question, parse_output=True))  # reasoning apart, calls in text
        assert "".join(chunk.text for chunk in no_tools) == "\n\nLet me check.\n" + CALL
        assert not any(chunk.tool_calls for chunk in no_tools)
        # tool_choice "none", as the OpenAI API reads it: no calls parsed, their text left in the answer
        no_calls = list(client.generate(messages=_question("Think: the weather in Paris?"), tools=TOOLS,
                                        tool_choice="none", parse_output=True))
        assert "".join(chunk.text for chunk in no_calls) == "\n\nLet me check.\n" + CALL
        assert not any(chunk.tool_calls or chunk.tool_call_deltas for chunk in no_calls)
        with pytest.raises(grpc.RpcError) as info:
            client.generate_text("Think", parse_output=True)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "parse_output is for chat input" in \
            info.value.details()
    with scripted_planes(tmp_path_factory.mktemp("no-parsers"), smollm2_dir, scripts) as (planes, _), \
            planes.client() as client, pytest.raises(grpc.RpcError) as info:
        assert (client.model_info().reasoning_parser, client.model_info().tool_call_parser) == ("", "")
        client.generate_text(messages=question, parse_output=True)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "parse_output needs a server started with --reasoning-parser or --tool-call-parser" in info.value.details()


def test_mistral_calls_through_the_http_api(tmp_path_factory, smollm2_dir):
    """--tool-call-parser mistral: the text before [TOOL_CALLS] is the content, the calls after it come back
    whole and streamed in either of Mistral's forms, with ids of nine letters and digits."""
    scripts = [("Paris", "Let me check.[TOOL_CALLS]" + MISTRAL),
               ("two cities", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_weather[ARGS]'
                              '{"city": "Lyon"}'), ("", "Sunny.")]
    with scripted_planes(tmp_path_factory.mktemp("mistral"), smollm2_dir, scripts, tool_call_parser="mistral") as (
            planes, _):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{planes.plane.http_port}/v1", api_key="x", max_retries=0)
        whole = client.chat.completions.create(model="scripted", messages=_question("Weather in Paris?"), tools=TOOLS)
        message = whole.choices[0].message
        assert whole.choices[0].finish_reason == "tool_calls" and message.content == "Let me check."
        [call] = message.tool_calls
        assert (call.function.name, call.function.arguments) == WEATHER and re.fullmatch("[A-Za-z0-9]{9}", call.id)
        streamed = client.chat.completions.create(model="scripted", messages=_question("Weather in two cities?"),
                                                  tools=TOOLS, stream=True)
        chunks = [chunk.choices[0] for chunk in streamed]
        calls = _joined_calls([tc.model_dump(exclude_none=True) for c in chunks for tc in c.delta.tool_calls or []])
        assert [(name, arguments) for _, name, arguments in calls] == [WEATHER, LYON]
        assert all(re.fullmatch("[A-Za-z0-9]{9}", call_id) for call_id, _, _ in calls)
        assert not "".join(c.delta.content or "" for c in chunks) and chunks[-1].finish_reason == "tool_calls"
