"""Tool calling in the OpenAI-compatible chat API: the request's tools and tool messages, checked
and shaped for the chat template, and the tool calls in the model's text (``--tool-call-parser``).

The tools reach the template as the ``tools`` variable, as sent (transformers' ``apply_chat_template``
passes them so). An assistant message's ``tool_calls`` reach it with each call's ``arguments``
decoded from its JSON text to an object, the form templates expect (Qwen3's writes either, Llama
3's needs the object).

Parsers (as vLLM's of the same names):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, as Qwen2.5,
  Qwen3 and the Hermes models write them. A block that starts as a call (``{"name": "f",
  "arguments": {``) is one from there on: its arguments are that object as the model wrote it
  (as far as it got, if the block ends first), and they stream while it is written
  (``open_call``). Another block that holds such an object (``parameters`` for ``arguments``, keys
  in another order) is a call once it closes; one that holds none (bad JSON, no name) stays in
  the content as written. Text outside the blocks is the content, but whitespace alone between
  blocks, or between a block and the start or end of the text, is dropped.
- ``llama3_json``: JSON objects ``{"name": ..., "parameters": {...}}`` (``arguments`` taken too),
  separated by ``;`` and optionally after ``<|python_tag|>``, as Llama 3.1 to 3.3 write calls. A
  text that opens as a call (``{"name": "f", "parameters": {``) is calls from there on, their
  arguments as written (streamed while written), and whatever follows the last one is content; a
  text that opens as other JSON is calls only if all of it is (read once it has ended); any other
  text is content, as written.
- ``mistral``: the calls after ``[TOOL_CALLS]``, as a JSON list ``[{"name": ..., "arguments": {...}}]``
  or as ``name[ARGS]{...}`` (``MistralParser``); the text before the tag is content, and call ids are
  nine letters and digits, as Mistral's chat templates want them.

Text arrives in pieces; a piece that may be the start of a tag, whitespace that may turn out to
sit next to a block, an open block, and with ``llama3_json`` JSON that does not open as a call
all wait for the text after them, so the content pieces joined and the calls in order equal the
parse of the whole text; so do the arguments of a call streamed while it is written, joined.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field

from twinplane.controlplane.errors import InvalidRequest, json_excerpt
from twinplane.controlplane.finish import partial_tag
from twinplane.controlplane.grammar import Grammar, regex_literal
from twinplane.controlplane.structured import json_schema_regex

TOOL_CHOICES = ("auto", "none", "required")
MAX_TOOLS = 128  # most tools one request may define
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a function name, as OpenAI allows them
OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


def _fail(message: str) -> None:
    raise InvalidRequest(message)


def _call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _mistral_call_id() -> str:
    """Nine letters and digits: Mistral's chat templates refuse any other tool-call id."""
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


_ALPHANUMERIC = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=_call_id)

    def json(self) -> dict:
        """The call as the OpenAI API gives it."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


# ---- requests -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolSpec:
    """Whether a chat request's output is parsed for tool calls, and how many it may keep."""

    parse: bool = False  # the output's tool calls are returned apart from its content (tool_choice not "none")
    parallel: bool = True  # parallel_tool_calls: false keeps the first call only
    # tool_choice "required" (every tool's name) or a named function: the output is nothing but calls of these
    forced: tuple[str, ...] = ()
    named: bool = False  # tool_choice names a function: its reply ends "stop", not "tool_calls", as OpenAI's


def function_name(value, where: str) -> str:
    """A tool's name, checked."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        _fail(f"{where} must be 1 to 64 letters, digits, underscores or dashes, got {str(value)[:80]!r}")
    return value


def _tool(tool, where: str) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        _fail(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., \"parameters\": ...}}}}")
    function = tool["function"]
    function_name(function.get("name"), f"{where}.function.name")
    if not isinstance(function.get("description", ""), str):
        _fail(f"{where}.function.description must be a string")
    if not isinstance(function.get("parameters", {}), dict):
        _fail(f"{where}.function.parameters must be an object (a JSON Schema)")
    return tool


def template_tools(body: dict) -> list[dict] | None:
    """The request's tools, checked, for the template (None when it defines none)."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        _fail("tools must be a list of {\"type\": \"function\", \"function\": {...}} objects")
    if not tools:  # refused as vLLM and OpenAI refuse it
        _fail("tools must not be an empty array; leave it out (or null) for no tools")
    check_tool_count(len(tools), "tools")
    return [_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]


def check_tool_count(count: int, where: str) -> None:
    if count > MAX_TOOLS:
        _fail(f"{where} holds {count} tools; at most {MAX_TOOLS} are allowed")


def tool_spec(body: dict, tools: list[dict] | None, parser: str | None) -> ToolSpec:
    """The request's tool_choice and parallel_tool_calls, checked; tools: its tools (``template_tools``);
    parser: the server's ``--tool-call-parser`` (None: output is never parsed for tool calls)."""
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    label = json_excerpt(choice, 200)  # as the messages below name it
    names = [t["function"]["name"] for t in tools or ()]
    forced: tuple[str, ...] = ()
    if isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict) or function.get("name") not in names:
            _fail(f"tool_choice must name one of the tools, as {{\"type\": \"function\", \"function\": {{\"name\": "
                  f"...}}}}; the tools are {', '.join(names) or 'none'}")
        forced, choice = (function["name"],), "named"
    elif choice == "required":
        forced = tuple(names)
    elif choice not in TOOL_CHOICES:
        _fail(f"tool_choice must be \"auto\", \"none\", \"required\" or a named function, got {str(choice)[:80]!r}")
    if choice != "none" and not tools:
        _fail(f"tool_choice {label} needs tools")
    if choice != "none" and parser is None:
        _fail(f"tool_choice {label} needs a server started with --tool-call-parser (one of "
              f"{', '.join(TOOL_CALL_PARSERS)}) to find the calls in the model's text; send tool_choice \"none\" "
              "to render the tools without parsing calls")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        _fail(f"parallel_tool_calls must be true or false, got {type(parallel).__name__}")
    return ToolSpec(choice != "none", parallel is not False and choice != "named", forced, choice == "named")


def forced_calls_regex(parser: str, tools: list[dict], spec: ToolSpec) -> str:
    """Structured output for a forced tool call: the text of one call of spec.forced's functions as the
    parser reads them (with parallel calls, one or more), arguments valid under each one's parameters;
    ``mistral`` in either of its forms."""
    objects, named = [], []
    for i, tool in enumerate(tools):
        function = tool["function"]
        if function["name"] not in spec.forced:
            continue
        # no parameters: an empty parameter list (OpenAI's reading), so the arguments are {}
        schema = function.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}
        arguments = json_schema_regex(schema, f"tools[{i}].function.parameters")
        name, key = regex_literal(function["name"]), "parameters" if parser == "llama3_json" else "arguments"
        objects.append(rf'\{{"name":[ ]?"{name}",[ ]?"{key}":[ ]?{arguments}\}}')
        named.append(rf"{name}{regex_literal(ARGS)}{arguments}")

    def calls(one: list[str], separator: str) -> str:
        one = "(?:" + "|".join(one) + ")"
        return one + (f"(?:{separator}{one})*" if spec.parallel else "")

    if parser == "hermes":
        return calls([regex_literal(OPEN + "\n") + o + regex_literal("\n" + CLOSE) for o in objects], "\\n")
    if parser == "llama3_json":
        return calls(objects, ";[ ]?")
    tag = regex_literal(TOOL_CALLS)
    return rf"{tag}(?:\[{calls(objects, ',[ ]?')}\]|{calls(named, tag)})"


def template_tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's tool_calls (OpenAI's JSON) as the template reads them."""
    if not isinstance(calls, list):
        _fail(f"{where} must be a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function" \
                or not isinstance(call.get("function"), dict):
            _fail(f"{at} must be {{\"id\": ..., \"type\": \"function\", \"function\": {{\"name\": ..., "
                  "\"arguments\": ...}}")
        if call.get("id") is not None and not isinstance(call["id"], str):
            _fail(f"{at}.id must be a string")
        function = call["function"]
        out.append(template_tool_call(call.get("id"), function.get("name"), function.get("arguments", "{}"),
                                      f"{at}.function."))
    return out


def template_tool_call(call_id: str | None, name, arguments, where: str) -> dict:
    """One call as the template reads it: arguments decoded from JSON text to an object. where:
    what the client's API calls the call's fields, up to their names."""
    function_name(name, f"{where}name")
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json_object(arguments, f"{where}arguments")}}


def json_object(text, where: str) -> dict:
    """The object that text holds as JSON."""
    try:
        decoded = json.loads(text) if isinstance(text, str) else None
    except (ValueError, RecursionError):
        decoded = None
    if not isinstance(decoded, dict):
        _fail(f"{where} must be the JSON text of an object, e.g. \"{{\\\"city\\\": \\\"Paris\\\"}}\"")
    return decoded


# ---- model output ---------------------------------------------------------------------------------


def _call(value) -> ToolCall | None:
    """The call a decoded JSON value stands for ({"name", "arguments" or "parameters"}), or None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False)) if isinstance(arguments, dict) else None


_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)')  # a call's start


class _ValueEnd:
    """Finds where a JSON object or array that starts at a given place in a growing text ends, reading
    each character once however many pieces the text comes in."""

    def __init__(self, start: int):
        self.start = start
        self.at, self.depth, self.in_string, self.escaped = start, 0, False, False
        self.end: int | None = None

    def scan(self, text: str) -> int | None:
        """The end of the value (just past its last character) in text, a longer version of the last text
        scanned; None while it has not ended."""
        while self.end is None and self.at < len(text):
            char = text[self.at]
            self.at += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if not self.depth:
                    self.end = self.at
        return self.end


class _WrittenCall:
    """A call whose start has been read (``{"name": "f", "arguments": {``): its id and name, and its
    arguments as they are written (``_ValueEnd`` finds where their JSON object ends)."""

    def __init__(self, name: str, start: int, call_id: str):
        self.id, self.name, self.value = call_id, name, _ValueEnd(start)

    @classmethod
    def starting(cls, start: re.Pattern, text: str, at: int = 0, new_id=_call_id) -> _WrittenCall | None:
        """The call whose start the pattern matches in text at at (its name a non-empty JSON string, or a
        bare name)."""
        found = start.match(text, at)
        if found:
            with contextlib.suppress(ValueError):
                name = json.loads(found[1]) if found[1].startswith('"') else found[1]
                if name:
                    return cls(name, found.end(), new_id())
        return None

    def call(self, text: str, limit: int | None = None) -> ToolCall:
        """The call as far as text goes: its arguments up to their object's end, or, while that has not
        come, up to limit (the end of text)."""
        end = self.value.scan(text)
        if end is None:
            end = len(text) if limit is None else limit
        return ToolCall(self.name, text[self.value.start:end], self.id)


def _hermes_call(body: str) -> ToolCall | None:
    """The call in a block's text, or None when it holds none."""
    try:
        return _call(json.loads(body))
    except (ValueError, RecursionError):
        return None


class HermesParser:
    """One choice's text, fed piece by piece, split into content pieces and the calls in its
    <tool_call> blocks."""

    def __init__(self):
        self.partial = ""  # outside a block: text that may be the start of OPEN
        self.block: str | None = None  # inside a block: its text so far
        self.gap = ""  # the current stretch outside blocks, while it is whitespace only
        self.has_text = False  # the current stretch holds more than whitespace: it is content
        self.after_call = False  # the stretch follows a tool call
        self.head: _WrittenCall | None = None  # the open block's call, once its text starts as one
        self.call_offsets: list[int] = []  # the last feed's calls: where each came in its content

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        """The content and the calls in text (with what was held before); final: the text ends here.
        ``call_offsets`` then says how much of the content came before each call."""
        text, self.partial = self.partial + text, ""
        content: list[str] = []
        calls: list[ToolCall] = []
        self.call_offsets = []
        while text:
            if self.block is not None:
                start = max(0, len(self.block) - len(CLOSE) + 1)  # CLOSE may have begun in the last piece
                self.block += text
                at = self.block.find(CLOSE, start)
                if at < 0:
                    self._read_head(self.block)
                    break
                body, text, self.block = self.block[:at], self.block[at + len(CLOSE):], None
                self._end_block(body, True, content, calls)
                continue
            at = text.find(OPEN)
            if at < 0:
                keep = 0 if final else partial_tag(text, OPEN)
                self._outside(text[:len(text) - keep], content)
                self.partial = text[len(text) - keep:]
                break
            self._outside(text[:at], content)
            self.block, text = "", text[at + len(OPEN):]
        if final:
            if self.block is not None:  # never closed: a call all the same when its text holds one
                self._end_block(self.block, False, content, calls)
                self.block = None
            if self.gap and not self.after_call:
                content.append(self.gap)
            self.gap = ""
        return "".join(content), calls

    def _outside(self, text: str, content: list[str]) -> None:
        if self.has_text:
            content.append(text)
            return
        self.gap += text
        if not self.gap.isspace() and self.gap:
            content.append(self.gap)
            self.gap, self.has_text = "", True

    @property
    def open_call(self) -> ToolCall | None:
        """The call the open block is writing, its arguments so far (the same id as the call it will be)."""
        if self.block is None or self.head is None:
            return None
        return self.head.call(self.block, len(self.block) - partial_tag(self.block, CLOSE))  # CLOSE may be coming

    def _read_head(self, block: str) -> None:
        """Marks the open block as a call once its text starts as one; its arguments may then stream."""
        if self.head is None:
            self.head = _WrittenCall.starting(_HEADER, block)

    def _end_block(self, body: str, closed: bool, content: list[str], calls: list[ToolCall]) -> None:
        self._read_head(body)
        if self.head is not None:  # a call from its start on, whatever follows
            call, self.head = self.head.call(body), None
        else:
            call = _hermes_call(body)
        if call is None:  # not a call: the block is text like any other
            self._outside(OPEN + body + (CLOSE if closed else ""), content)
            return
        calls.append(call)  # whitespace alone before it is dropped
        self.call_offsets.append(sum(map(len, content)))
        self.gap, self.has_text, self.after_call = "", False, True


def _llama3_calls(text: str) -> list[ToolCall] | None:
    """The calls in a text of JSON objects separated by ";", or None when it is anything else."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        try:
            value, at = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            return None
        calls.append(_call(value))
        rest = text[at:].lstrip()
        if not rest:
            return None if None in calls else calls
        if not rest.startswith(";"):
            return None
        at = len(text) - len(rest[1:].lstrip())


_JSON_STRING = r'"(?:[^"\\]|\\[\s\S])*"'  # a JSON string, in the syntax re and grammar.py share
# JSON's whitespace, spelled out: re's \s is Unicode's and grammar.py's ASCII's, so with it a start such as
# '{"name":\u3000"f"' would be one to re, read whole, and dead to the automaton, read in pieces
_WS = r"[ \t\n\r]*"


class _CallHeader:
    """Where a call starts, up to the "{" of its arguments, its name captured (group 1), written once
    for both readers: ``header`` (re) finds a whole start, ``prefix`` (grammar.py, through
    ``_CallStart``) tells whether a text may still become one."""

    def __init__(self, pattern: str):
        self.header, self.prefix = re.compile(pattern + r"(?=\{)"), pattern + r"\{"


@functools.lru_cache(maxsize=None)
def _prefixes(start: str) -> Grammar:
    """The automaton of a call's start (the regex start, then anything): whether a text may still
    become one (``grammar.Grammar`` tells a dead prefix)."""
    return Grammar.from_regex(start + r"[\s\S]*")


class _CallStart:
    """Whether the text from a given place may still open a call (a start that ``_prefixes`` reads),
    reading each character once however many pieces it comes in."""

    def __init__(self, start: int, pattern: str):
        self.start, self.at, self.pattern = start, start, pattern
        self.state = _prefixes(pattern).initial_state

    def possible(self, text: str) -> bool:
        if self.at < len(text):
            self.state = _prefixes(self.pattern).advance(self.state, text[self.at:].encode())
            self.at = len(text)
        return self.state != Grammar.DEAD


@dataclass(frozen=True)
class _CallForm:
    """How a parser's calls follow one another: the first one's start and a later one's, looked for past the
    whitespace after the last call, whether a "}" closes each call after its arguments, what closes the
    calls after the last one, and the calls' ids."""

    first: _CallHeader
    later: _CallHeader
    closed: bool = True
    end: str = ""  # "]" of a JSON list
    new_id: Callable[[], str] = _call_id


class _CallSequence:
    """Calls one after another in a growing text (``held``), from ``at`` on, in a ``_CallForm``: each call's
    arguments stream as written, and the text after the last call is content, whitespace alone dropped."""

    def __init__(self, form: _CallForm | None = None):
        self.held = ""
        self.form = form
        self.at = 0  # in held: where the first call may start, then where the text after the last whole call starts
        self.num_calls = 0
        self.head: _WrittenCall | None = None  # the call being written
        self.next: _CallStart | None = None  # where a call may open next, while it is not known yet
        self.done = False  # the calls have ended: the rest is content
        self.call_offsets: list[int] = []  # the last feed's calls: where each came in its content

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        """The content and the calls in text (with what was held before); final: the text ends here.
        ``call_offsets`` then says how much of the content came before each call."""
        before, calls, after = self._feed(text, final)
        self.call_offsets = [len(before)] * len(calls)
        return before + after, calls

    def _feed(self, text: str, final: bool) -> tuple[str, list[ToolCall], str]:
        """The content before the calls in text, the calls, and the content after them."""
        raise NotImplementedError

    @property
    def open_call(self) -> ToolCall | None:
        """The call being written, its arguments so far (the same id as the call it will be)."""
        return None if self.head is None else self.head.call(self.held)

    def _calls(self, final: bool) -> tuple[str, list[ToolCall]] | None:
        """The calls the held text completes, and the content after the last one once it shows; None when
        the text at ``at`` opens no call (the text ends, or can no longer become one)."""
        form, calls = self.form, []
        while True:
            if self.head is not None:  # a call being written
                end = self.head.value.scan(self.held)
                closing = "" if end is None or not form.closed else self.held[end:].lstrip()  # the call's "}"
                if (end is None or (form.closed and not closing)) and not final:
                    return "", calls
                calls.append(self.head.call(self.held))
                self.head, self.num_calls = None, self.num_calls + 1
                if end is None:
                    self.done = True
                    return "", calls
                self.at = len(self.held) - len(closing) + closing.startswith("}") if form.closed else end
                continue
            start = form.later if self.num_calls else form.first
            # past the whitespace in Python: the grammar that tells whether a start may still come knows ASCII
            # whitespace only, the re that reads it Unicode's
            at = len(self.held) - len(self.held[self.at:].lstrip())
            self.head = _WrittenCall.starting(start.header, self.held, at, form.new_id)
            if self.head is not None:
                continue
            if not final:
                if self.next is None or self.next.start != at:
                    self.next = _CallStart(at, start.prefix)
                if self.next.possible(self.held):
                    return "", calls
            if not self.num_calls:
                return None
            rest = self.held[self.at:]
            if form.end and rest.lstrip().startswith(form.end):
                rest = rest.lstrip()[len(form.end):]  # past the end of the calls
            if (not rest or rest.isspace()) and not final:
                return "", calls  # whitespace alone after the calls is dropped, unless text follows
            self.done = True
            return ("" if rest.isspace() else rest), calls


def _object_start(key: str) -> str:
    """A call object's start, up to the "{" of its arguments (key: their key, a regex), its name captured."""
    return rf'{_WS}\{{{_WS}"name"{_WS}:{_WS}({_JSON_STRING}){_WS},{_WS}"(?:{key})"{_WS}:{_WS}'


_LLAMA = _object_start("parameters|arguments")
_LLAMA_CALLS = _CallForm(_CallHeader(_LLAMA), _CallHeader(";" + _LLAMA))


class Llama3JsonParser(_CallSequence):
    """One choice's text, fed piece by piece: content as it comes, unless it opens as JSON. A text that
    opens as a call (``{"name": "f", "parameters": {``, ``arguments`` taken too) is calls from there on:
    each call's arguments stream as written, the calls separated by ``;``, and the text after the last
    one is content (whitespace alone dropped). Other JSON waits for the end of the text, to be read as
    calls (``_llama3_calls``) or, when it holds none, as content."""

    def __init__(self):
        super().__init__(_LLAMA_CALLS)
        self.state = "opening"  # until the first text past whitespace (and the python tag) shows which

    def _feed(self, text: str, final: bool) -> tuple[str, list[ToolCall], str]:
        if self.done:
            return text, [], ""
        self.held += text
        if self.state == "opening":
            start = self.held.lstrip()
            if start.startswith(PYTHON_TAG):
                start = start[len(PYTHON_TAG):].lstrip()
            if start.startswith("{"):
                self.state, self.at = "calls", len(self.held) - len(start)
            elif (not start or PYTHON_TAG.startswith(start)) and not final:
                return "", [], ""
            else:
                self.done, held, self.held = True, self.held, ""
                return held, [], ""
        found = self._calls(final) if self.state == "calls" else None
        if found is not None:
            return "", found[1], found[0]
        self.state = "whole"  # JSON that is no call as it starts: read whole at the end
        if not final:
            return "", [], ""
        body = self.held.lstrip().removeprefix(PYTHON_TAG)
        calls = _llama3_calls(body.strip())
        return ("", calls, "") if calls else (self.held, [], "")


TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_MISTRAL_FORMS = {
    "list": _CallForm(_CallHeader(rf"{_WS}\[" + _object_start("arguments")),
                      _CallHeader(f"{_WS}," + _object_start("arguments")),
                      end="]", new_id=_mistral_call_id),
    "named": _CallForm(_CallHeader(rf"{_WS}([A-Za-z0-9_\-]{{1,64}})\[ARGS\]"),
                       _CallHeader(rf"{_WS}\[TOOL_CALLS\]{_WS}([A-Za-z0-9_\-]{{1,64}})\[ARGS\]"),
                       closed=False, new_id=_mistral_call_id),
}


class MistralParser(_CallSequence):
    """One choice's text, fed piece by piece: content up to ``[TOOL_CALLS]``, calls after it, in either
    of Mistral's forms: a JSON list ``[{"name": "f", "arguments": {...}}, ...]`` (tokenizers up to v7),
    or ``f[ARGS]{...}``, each later call after a ``[TOOL_CALLS]`` of its own (v11 on). Each call's
    arguments stream as written; the text after the last call (past the list's "]") is content,
    whitespace alone dropped. A tag that no call follows is content, as written."""

    def __init__(self):
        super().__init__()  # the form, once the text after the tag shows which
        self.partial = ""  # before the tag: text that may be the start of TOOL_CALLS
        self.tagged = False  # the tag has come: held is the text after it

    def _feed(self, text: str, final: bool) -> tuple[str, list[ToolCall], str]:
        if self.done:
            return text, [], ""
        content = ""
        if not self.tagged:
            text, self.partial = self.partial + text, ""
            at = text.find(TOOL_CALLS)
            if at < 0:
                keep = 0 if final else partial_tag(text, TOOL_CALLS)
                self.partial = text[len(text) - keep:]
                return text[:len(text) - keep], [], ""
            content, text, self.tagged = text[:at], text[at + len(TOOL_CALLS):], True
        self.held += text
        if self.form is None:
            start = self.held.lstrip()
            if not start and not final:
                return content, [], ""
            self.form = _MISTRAL_FORMS["list" if start.startswith("[") else "named"]
        found = self._calls(final)
        if found is None:  # the tag led to no call: text as any other
            self.done = True
            return content + TOOL_CALLS + self.held, [], ""
        return content, found[1], found[0]


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}
TOOL_CALL_PARSERS = tuple(PARSERS)
# the text each parser needs to see (llama3_json: none)
TAGS = {"hermes": (OPEN, CLOSE), "llama3_json": (), "mistral": (TOOL_CALLS, ARGS)}


def tags_are_special(parser: str | None, tokenizer) -> bool:
    """Whether the tags the parser reads are special tokens of the tokenizer, which decoding with
    skip_special_tokens leaves out of the text: then a request whose calls are parsed keeps them."""
    return bool(parser and tokenizer and any(tokenizer.is_special(tag) for tag in TAGS[parser]))


def parser_for(name: str) -> HermesParser | Llama3JsonParser | MistralParser:
    """A parser for one choice's text."""
    if name not in PARSERS:
        raise ValueError(f"tool call parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {name!r}")
    return PARSERS[name]()


def parse_tool_calls(parser: str, text: str) -> tuple[str, list[ToolCall]]:
    """The content and the tool calls of a whole text."""
    return parser_for(parser).feed(text, final=True)
