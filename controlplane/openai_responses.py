"""The OpenAI Responses API (POST /v1/responses) on the chat completions' machinery.

A request becomes a chat completion request: ``instructions`` a system message first, ``input``
(a string, or items: messages, the function calls of earlier turns and their outputs) the
messages, function ``tools`` the chat API's, ``max_output_tokens`` the most tokens; sampling
fields and this server's extensions go as they are. So the same validation, chat template, tool
call parser and reasoning parser apply. The output is a list of items, in the order the model
wrote them: its reasoning (with ``--reasoning-parser``), its message, its function calls. Streamed,
every item is announced, filled and closed with the API's events, each numbered; the last event
carries the whole response, which is also what a request without ``stream`` gets. ``reasoning.effort``
reaches the chat template as chat's ``reasoning_effort``; ``truncation: "auto"`` leaves out the earliest
input messages that a prompt too long for the model has no room for.

Nothing is stored: ``previous_response_id`` is refused, and a conversation goes on by sending its
items again (the output items of a response are valid input items).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import replace

from twinplane.controlplane.api import SAMPLING_FIELDS, RequestOutput
from twinplane.controlplane.chat_text import CallDelta, ChatText
from twinplane.controlplane.errors import InvalidRequest, json_excerpt
from twinplane.controlplane.openai_api import REASONING_EFFORTS, OpenAIRequest
from twinplane.controlplane.sequence import FinishReason
from twinplane.controlplane.tools import ToolCall, template_tool_call

# fields that go to the chat completion request as they are
PASSED = (*SAMPLING_FIELDS, "stream", "parallel_tool_calls", "max_output_tokens", "min_tokens",
          "ignore_eos", "stop", "stop_token_ids", "skip_special_tokens", "logit_bias", "priority",
          "chat_template_kwargs", "truncate_prompt_tokens", "include_stop_str_in_output")
REFUSED = {"previous_response_id": "this server stores no responses; send the conversation's items again in input",
           "conversation": "this server stores no conversations; send the conversation's items in input",
           "background": "background responses are not supported; stream the response instead",
           "prompt": "stored prompt templates are not supported; send instructions and input"}
ROLES = ("user", "assistant", "system", "developer")
TRUNCATIONS = ("auto", "disabled")
MAX_TOP_LOGPROBS = 20  # the API's bound on top_logprobs
TEXT_PARTS = ("input_text", "output_text", "text")
SUMMARIES = ("auto", "concise", "detailed")  # reasoning.summary's values
# the API's bounds on metadata: its pairs, and the characters of a key and of a value
MAX_METADATA, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


def _fail(message: str) -> None:
    raise InvalidRequest(message)


def _text(content, where: str) -> str:
    """A message's content or a function's output (``where`` names which): a string, or text parts joined
    by newlines (as chat's)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        _fail(f"{where} must be a string or a list of input_text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            _fail(f"{where}[{j}] must be a text part ({{\"type\": \"input_text\", \"text\": ...}}); "
                  "only text input is supported")
        texts.append(part["text"])
    return "\n".join(texts)


def _call_id(item: dict, where: str) -> str:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        _fail(f"{where}.call_id is required: the id that ties a function call to its output")
    return call_id


def _reasoning(item: dict, where: str) -> str:
    """A reasoning item's text: its reasoning_text parts joined (its summary is not what the model wrote)."""
    content = item.get("content") or []
    if not isinstance(content, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                for p in content):
        _fail(f"{where}.content must be a list of reasoning_text parts ({{\"type\": \"reasoning_text\", "
              "\"text\": ...}})")
    return "".join(part["text"] for part in content)


def _messages(value) -> list[dict]:
    """The chat messages of input: items in order; a function call joins the assistant message before it, and
    a reasoning item becomes the reasoning_content of the assistant message after it (chat templates show
    the thinking of the turn under way, between tool calls)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        _fail("input is required: a string, or a list of items (messages, function calls and their outputs)")
    messages: list[dict] = []
    thinking = ""  # a reasoning item's text, for the assistant message that follows it
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            _fail(f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            if item.get("role") not in ROLES:
                _fail(f"{where}.role must be one of {', '.join(ROLES)}, got {str(item.get('role'))[:40]!r}")
            messages.append({"role": item["role"], "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":  # checked here, to be named as the client sent it
            template_tool_call(None, item.get("name"), item.get("arguments"), f"{where}.")
            call = {"id": _call_id(item, where), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if messages and messages[-1]["role"] == "assistant" and not thinking:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = _text(item.get("output"), f"{where}.output")  # the function's result
            messages.append({"role": "tool", "tool_call_id": _call_id(item, where), "content": output})
        elif kind == "reasoning":
            thinking += _reasoning(item, where)
            continue
        else:
            _fail(f"{where}.type must be message, function_call, function_call_output or reasoning, "
                  f"got {str(kind)[:40]!r}")
        if thinking and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = thinking
        thinking = ""
    return messages


def _tool(tool, where: str) -> dict:
    """A Responses function tool ({"type": "function", "name", ...}) as the chat API's."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        _fail(f"{where} must be a function tool ({{\"type\": \"function\", \"name\": ..., \"parameters\": ...}}); "
              "this server runs no built-in tools")
    return {"type": "function", "function": {key: tool[key] for key in ("name", "description", "parameters")
                                             if tool.get(key) is not None}}


def chat_body(body: dict) -> dict:
    """The chat completion request body that a Responses request body stands for."""
    for name, why in REFUSED.items():
        if body.get(name):
            _fail(f"{name}: {why}")
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(name, str) for name in include):
        _fail("include must be a list of strings")
    top = body.get("top_logprobs")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool)):
        _fail(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {type(top).__name__}")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        _fail(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
    if "message.output_text.logprobs" in include or top:
        _fail("include: message.output_text.logprobs (and top_logprobs) are not supported here; the chat "
              "completions API gives log-probabilities")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        _fail("instructions must be a string")
    if body.get("truncation") not in (None, *TRUNCATIONS):
        _fail(f"truncation must be auto or disabled, got {json_excerpt(body['truncation'], 40)}")
    _check_metadata(body.get("metadata"))
    limit = body.get("max_tool_calls")  # of built-in tools, which this server runs none of: nothing to limit
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
        _fail(f"max_tool_calls must be an integer >= 0, got {json_excerpt(limit, 40)}")
    chat = {name: body[name] for name in PASSED if name in body}
    effort = _reasoning_effort(body.get("reasoning"))
    if effort is not None:  # the chat template's reasoning_effort, as chat's
        chat["reasoning_effort"] = effort
    chat["messages"] = [{"role": "system", "content": instructions}] * (instructions is not None) + _messages(
        body.get("input"))
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            _fail("tools must be a list of function tools")
        if tools:  # [] (the API's default) defines none, where chat refuses an empty list
            chat["tools"] = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):  # a named function: {"type": "function", "name": ...} in this API
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            _fail('tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}, got '
                  f"{json_excerpt(choice, 80)}")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None and (choice != "auto" or tools):  # "auto" (the API's default) without tools: none
        chat["tool_choice"] = choice
    if body.get("text") is not None:
        chat["response_format"] = _response_format(_text_format(body))
    return chat


def _check_metadata(metadata) -> None:
    """metadata, which the response repeats as sent: string values under string keys, within the API's bounds
    (anything else would come back in a response that the API's own types refuse)."""
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA or not all(
            isinstance(v, str) and len(k) <= MAX_METADATA_KEY and len(v) <= MAX_METADATA_VALUE
            for k, v in metadata.items()):
        _fail(f"metadata must be an object of at most {MAX_METADATA} string values, each under a key of at most "
              f"{MAX_METADATA_KEY} characters and of at most {MAX_METADATA_VALUE} characters, got "
              f"{json_excerpt(metadata, 80)}")


def _reasoning_effort(reasoning) -> str | None:
    """reasoning.effort (its summary is checked, since the response repeats it, and unused: no model here writes
    a summary of its reasoning)."""
    if reasoning is None:
        return None
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
    if not isinstance(reasoning, dict) or effort not in (None, *REASONING_EFFORTS):
        _fail(f"reasoning must be an object whose effort is one of {', '.join(REASONING_EFFORTS)}, got "
              f"{json_excerpt(reasoning, 80)}")
    if reasoning.get("summary") not in (None, *SUMMARIES):
        _fail(f"reasoning.summary must be one of {', '.join(SUMMARIES)}, got {json_excerpt(reasoning['summary'], 80)}")
    return effort


async def fit_input(chat: dict, kept: int, fits) -> dict:
    """truncation "auto": the chat request less the fewest of its earliest messages that let it fit (``await
    fits(chat)``); its first kept messages (the instructions) and its last message stay. As it is when it fits,
    or when even its last message leaves too many: that prompt's length is refused then, as any other's."""
    messages = chat["messages"]

    def less(drop: int) -> dict:
        return {**chat, "messages": messages[:kept] + messages[kept + drop:]}

    most = len(messages) - kept - 1  # all but the last
    if most < 1 or await fits(chat) or not await fits(less(most)):
        return chat
    low, high = 1, most  # the fewest that fit lie in [low, high]: a halving search, as fewer leave more tokens
    while low < high:
        middle = (low + high) // 2
        if await fits(less(middle)):
            high = middle
        else:
            low = middle + 1
    return less(low)


def _text_format(body: dict):
    """The request's text.format ({"type": "text"} when it sets none)."""
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else text
    return {"type": "text"} if fmt is None else fmt


def _response_format(fmt) -> dict:
    """text.format as the chat API's response_format (its json_schema's fields sit one level up here)."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema" or "schema" not in fmt:
        _fail("text.format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": \"json_schema\", "
              "\"name\": ..., \"schema\": {...}}")
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class ResponsesBuilder:
    """One request's output as Responses events (``add``), and the response itself (``response``)."""

    def __init__(self, request: OpenAIRequest, response_id: str, model: str, body: dict,
                 reasoning_parser: str | None = None, tool_call_parser: str | None = None, tokenizer=None):
        """body: the Responses request, whose settings the response repeats; tokenizer: reads where the
        prompt leaves the reasoning."""
        self.id, self.model, self.created = response_id, model, int(time.time())
        self.text = ChatText(reasoning_parser, tool_call_parser if request.tools.parse else None,
                             request.tools.parallel, bool(request.tools.forced), tokenizer)
        self.items: list[dict] = []  # the output items so far, the open one last
        self.open: str | None = None  # "reasoning" or "message": the last item's kind while it takes text
        self.texts: list[str] = []  # the text of each item (function calls: "")
        self.calls: dict[str, int] = {}  # each function call's item, by call id
        self.sequence = 0
        tools = body.get("tools") or []
        self.settings = {"instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
                         "temperature": body.get("temperature"), "top_p": body.get("top_p"), "tools": tools,
                         "tool_choice": body.get("tool_choice") or ("auto" if tools else "none"),
                         "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
                         "metadata": body.get("metadata"), "text": {"format": _text_format(body)},
                         "truncation": body.get("truncation") or "disabled",
                         "max_tool_calls": body.get("max_tool_calls"), "reasoning": None,
                         "store": False}  # nothing is kept: a later request cannot name this one
        if body.get("reasoning") is not None:
            self.settings["reasoning"] = {key: body["reasoning"].get(key) for key in ("effort", "summary")}
        self.final: RequestOutput | None = None

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": f"response.{kind}", "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def start(self) -> list[dict]:
        """The events before any output."""
        return [self._event("created", response=self.response()), self._event("in_progress", response=self.response())]

    def add(self, index: int, out: RequestOutput) -> list[dict]:
        """The events of one output (of the one choice: index 0). The last one's text is read first as if
        more were to come, then its end: an item that ended before the text did is whole, and only those
        the end closes are cut short (incomplete), however many tokens that output carries."""
        if out.finish_reason is None:
            return self._events(*self.text.take(out))
        events = self._events(*self.text.take(replace(out, finish_reason=None)))
        self.final = out  # before the items the end closes: one cut by max_output_tokens is incomplete
        return events + self._events(*self.text.feed("", final=True)) + self._close()

    def _events(self, reasoning: str, content: str, calls: list[ToolCall]) -> list[dict]:
        """The events of what a piece of the text adds: reasoning, content and calls, as ``ChatText.feed``
        split them."""
        events: list[dict] = []
        deltas = self.text.deltas(calls)
        for delta in deltas:  # a call written in earlier pieces goes on first: text comes after its block
            if not delta.begins:
                events += self._call(delta)
        if reasoning:
            events += self._append("reasoning", reasoning)
        done = 0  # the content sent so far: each call that begins here goes where it came in the text
        cuts = dict(zip((call.id for call in calls), self.text.call_offsets))
        for delta in deltas:
            if delta.begins:
                cut = cuts.get(delta.call.id, len(content))  # one still being written comes after the text
                if cut > done:
                    events += self._append("message", content[done:cut])
                done = max(done, cut)
                events += self._call(delta)
        if len(content) > done:
            events += self._append("message", content[done:])
        return events

    def finish(self, usage: dict) -> list[dict]:
        """The last event: the whole response."""
        response = self.response(usage)
        return [self._event(response["status"], response=response)]  # completed, incomplete or failed

    def _append(self, kind: str, text: str) -> list[dict]:
        events = [] if self.open == kind else self._close() + self._begin(kind)
        at = len(self.items) - 1
        self.texts[at] += text
        delta = "reasoning_text.delta" if kind == "reasoning" else "output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return events + [self._event(delta, item_id=self.items[at]["id"], output_index=at, content_index=0,
                                     delta=text, **extra)]

    def _begin(self, kind: str) -> list[dict]:
        if kind == "reasoning":
            item = {"id": _id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
        else:
            item = {"id": _id("msg"), "type": "message", "role": "assistant", "content": [], "status": "in_progress"}
        self.items.append(item)
        self.texts.append("")
        self.open = kind
        at = len(self.items) - 1
        events = [self._event("output_item.added", output_index=at, item=dict(item))]
        if kind == "message":
            events.append(self._event("content_part.added", item_id=item["id"], output_index=at, content_index=0,
                                      part=_output_text("")))
        return events

    def _close(self) -> list[dict]:
        """Ends the open item, when there is one."""
        if self.open is None:
            return []
        at, kind, self.open = len(self.items) - 1, self.open, None
        item, text = self.items[at], self.texts[at]
        where = {"item_id": item["id"], "output_index": at, "content_index": 0}
        if kind == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            events = [self._event("reasoning_text.done", **where, text=text)]
        else:
            item["content"] = [_output_text(text)]
            events = [self._event("output_text.done", **where, text=text, logprobs=[]),
                      self._event("content_part.done", **where, part=_output_text(text))]
        item["status"] = self._item_status
        return events + [self._event("output_item.done", output_index=at, item=item)]

    def _call(self, delta: CallDelta) -> list[dict]:
        """The events of what a piece adds to a function call: its item first, its arguments as they come."""
        events, call = [], delta.call
        if delta.begins:
            events = self._close()
            self.items.append({"id": _id("fc"), "type": "function_call", "call_id": call.id, "name": call.name,
                               "arguments": "", "status": "in_progress"})
            self.texts.append("")
            self.calls[call.id] = len(self.items) - 1
            events.append(self._event("output_item.added", output_index=len(self.items) - 1,
                                      item=dict(self.items[-1])))
        at = self.calls[call.id]
        item = self.items[at]
        where = {"item_id": item["id"], "output_index": at}
        if delta.arguments:
            events.append(self._event("function_call_arguments.delta", **where, delta=delta.arguments))
        if delta.ends:
            item.update(arguments=call.arguments, status=self._item_status)
            events += [self._event("function_call_arguments.done", **where, name=call.name, arguments=call.arguments),
                       self._event("output_item.done", output_index=at, item=dict(item))]
        return events

    @property
    def _item_status(self) -> str:
        """An ended item's: incomplete when the output was cut (by max_output_tokens, or the server ended it)."""
        cut = self.final is not None and self.final.finish_reason in (FinishReason.LENGTH, FinishReason.ABORTED)
        return "incomplete" if cut else "completed"

    def response(self, usage: dict | None = None) -> dict:
        """The response as it stands: in progress until the output has ended and usage is given."""
        status, incomplete, error = "in_progress", None, None
        if self.final is not None and usage is not None:
            reason = self.final.finish_reason
            status = {FinishReason.LENGTH: "incomplete", FinishReason.ABORTED: "failed"}.get(reason, "completed")
            incomplete = {"reason": "max_output_tokens"} if reason == FinishReason.LENGTH else None
            if reason == FinishReason.ABORTED:  # the server ended it (shutting down): no client cancels here
                error = {"code": "server_error", "message": "the server ended the request before it finished"}
        done = [item for item in self.items if item["status"] != "in_progress"]
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
                "output": done, "incomplete_details": incomplete, "error": error, **self.settings,
                "usage": None if usage is None else _usage(usage, self.text.reasoning_tokens)}


def _output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(usage: dict, reasoning_tokens: int) -> dict:
    """The chat API's usage as the Responses API names it; the tokens written to the prefix cache
    are not counted apart (0)."""
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens}}
