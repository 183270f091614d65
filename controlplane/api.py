"""The public API's edge: GenerateRequest -> validated plain objects -> GenerateResponse.

Every check of client input lives here, and each failure names the field and
what is allowed. Nothing past this module handles generated protobuf classes.
"""

from __future__ import annotations

import math
import string
import struct
import urllib.parse
import uuid
from dataclasses import dataclass, field

from google.protobuf import json_format

from twinplane.controlplane.errors import InvalidRequest
from twinplane.controlplane.sequence import GREEDY_BELOW, FinishReason, RequestParams, SamplingOptions
from twinplane.controlplane.structured import after_reasoning, checked_regex, structured_regex_from_pb
from twinplane.controlplane.tokenizer import CHAT_ROLES, MESSAGE_FIELDS, SERVER_TEMPLATE_NAMES, ChatOptions, chat_texts
from twinplane.controlplane.tools import (ToolSpec, check_tool_count, forced_calls_regex, function_name, json_object,
                                         template_tool_call)
from twinplane.proto import generation_pb2 as pb

MAX_REQUEST_ID_LEN = 256
MAX_TEMPLATE_NESTING = 16  # levels of objects and lists in chat_template_kwargs (the top object included)
REQUEST_ID_HEADER = "x-request-id"  # metadata a client may send its request id in; echoed back
MAX_BAD_WORDS = 64  # words one request may ban
MAX_STOP_TOKEN_IDS = 64  # stop_token_ids of one request
_PERCENT_ENCODE_SAFE = "".join(c for c in string.printable if c not in string.whitespace and c != "%")


@dataclass(frozen=True)
class Limits:
    """What requests must respect, from the config and the data plane."""

    vocab_size: int
    max_model_len: int
    max_logprobs: int = 20
    max_stop_strings: int = 16
    max_stop_string_len: int = 256
    max_prompt_bytes: int = 1 << 20  # UTF-8 bytes of text, or of every chat message's role and content
    max_chat_messages: int = 1024
    max_logit_bias: int = 1024  # entries of logit_bias
    by_priority: bool = False  # requests may set a priority (--scheduling-policy priority)
    # what a request that leaves a sampling field or max_tokens unset gets, by field name, where the model's
    # generation config sets it (generation_config.py); a field left out: the built-in default
    defaults: dict[str, float | int] = field(default_factory=dict)


@dataclass(frozen=True)
class Prompt:
    """Exactly one of the three is set."""

    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None
    messages_name: str = "chat.messages"  # what the client's API calls the messages, for error messages
    chat_options: ChatOptions = ChatOptions()  # how the messages are rendered
    # the tokenizer's special tokens (a BOS) added to a text or to the rendered messages: None for the kind's
    # default, as vLLM's add_special_tokens (text: added; chat: not, its template places them)
    add_special_tokens: bool | None = None


@dataclass(frozen=True)
class GenerateCall:
    """A validated GenerateRequest; max_tokens is resolved once the prompt length is known."""

    request_id: str
    prompt: Prompt
    params: RequestParams  # params.max_tokens is 0 when the client left it unset
    truncate_prompt_tokens: int = 0
    # what the client's API calls the input and max_tokens, for the messages of checks made after tokenizing
    input_name: str = "input"
    max_tokens_name: str = "max_tokens"
    choice: int | None = None  # its place among the request's choices (n, several prompts); None: the only one

    @property
    def name(self) -> str:
        """The request id, with the choice after a dash when the request has several (for logs)."""
        return self.request_id if self.choice is None else f"{self.request_id}-{self.choice}"


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float | None  # None only for an echoed prompt's first token, which nothing scores
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None  # 1 + the number of tokens more likely; known for the prompt's tokens


@dataclass
class RequestOutput:
    """What one request produced since its previous output."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # first output only: entry i prompt token i's (0: None)
    finish_reason: FinishReason | None = None
    matched_stop: str = ""
    prompt_tokens: int = 0  # the counts so far (the last output's: the usage)
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0  # the last output's
    # first output only, within the process: the prompt's token ids (whether the chat template opened the
    # model's thinking, for the OpenAI API's reasoning parser)
    prompt_ids: list[int] | None = None

    def absorb(self, later: RequestOutput) -> None:
        """Appends the output that followed this one, so both go out as one message."""
        self.token_ids += later.token_ids
        self.text += later.text
        self.logprobs += later.logprobs
        self.prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs
        self.prompt_ids = self.prompt_ids or later.prompt_ids
        self.finish_reason, self.matched_stop = later.finish_reason, later.matched_stop
        self.prompt_tokens, self.completion_tokens = later.prompt_tokens, later.completion_tokens
        self.cached_prompt_tokens = later.cached_prompt_tokens


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequest(message)


def _float32(value: float) -> float:
    """value as the 32-bit float the data plane receives (a tiny value becomes 0, a huge one inf)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except (OverflowError, struct.error):  # past the float32 range, or an integer past any float
        return math.inf if value > 0 else -math.inf


def _range(name: str, value: float, low: float, high: float, *, low_open: bool = False) -> None:
    single = _float32(value)
    _check(math.isfinite(single), f"{name} must be a finite number (as a 32-bit float), got {value}")
    interval = f"{'(' if low_open else '['}{low}, {high}]"
    ok = (single > low if low_open else single >= low) and single <= high
    as_sent = "" if single == value or not low <= value <= high else f", which is {single:g} as the 32-bit float sent"
    _check(ok, f"{name} must be in {interval}, got {value:g}{as_sent}")


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "seed")
MAX_TOP_K = (1 << 31) - 1  # top_k travels to the data plane as an int32


def sampling_options(values: dict, prefix: str = "sampling.", defaults: dict | None = None) -> SamplingOptions:
    """Validated sampling options from plain values (SAMPLING_FIELDS; a missing one takes defaults' value, else
    the built-in default): the one place both APIs apply the server's defaults (Limits.defaults). prefix goes
    before each field name in error messages."""
    values = {**{name: value for name, value in (defaults or {}).items() if name in SAMPLING_FIELDS}, **values}
    options = SamplingOptions()
    temperature = values.get("temperature", options.temperature)
    _check(math.isfinite(_float32(temperature)) and temperature >= 0,
           f"{prefix}temperature must be a finite number >= 0 (as a 32-bit float; 0 = greedy), got {temperature}")
    if temperature < GREEDY_BELOW:
        temperature = 0.0
    top_p = values.get("top_p", 1.0)
    _range(f"{prefix}top_p", top_p, 0.0, 1.0, low_open=True)
    top_k = values.get("top_k", 0)
    _check(-1 <= top_k <= MAX_TOP_K, f"{prefix}top_k must be in [-1, {MAX_TOP_K}] (0 or -1 for no limit), got {top_k}")
    min_p = values.get("min_p", 0.0)
    _range(f"{prefix}min_p", min_p, 0.0, 1.0)
    repetition = values.get("repetition_penalty", 1.0)  # any positive value, as vLLM and TGI take
    sent = _float32(repetition)
    _check(math.isfinite(sent) and sent > 0,
           f"{prefix}repetition_penalty must be a finite number > 0 (as a 32-bit float; 1 = off), got {repetition:g}")
    presence = values.get("presence_penalty", 0.0)
    _range(f"{prefix}presence_penalty", presence, -2.0, 2.0)
    frequency = values.get("frequency_penalty", 0.0)
    _range(f"{prefix}frequency_penalty", frequency, -2.0, 2.0)
    return SamplingOptions(
        temperature=float(temperature), top_p=float(top_p), top_k=max(top_k, 0), min_p=float(min_p),
        repetition_penalty=float(repetition), presence_penalty=float(presence),
        frequency_penalty=float(frequency), seed=values.get("seed"),
    )


def sampling_from_pb(s: pb.SamplingParams, defaults: dict | None = None) -> SamplingOptions:
    return sampling_options({name: getattr(s, name) for name in SAMPLING_FIELDS if s.HasField(name)},
                            defaults=defaults)


def text_prompt(text: str, limits: Limits, name: str = "text") -> Prompt:
    _check(text != "", f"{name} must not be empty")
    _check_bytes(name, _utf8_size(name, text), limits)
    return Prompt(text=text)


def token_prompt(ids: list[int], limits: Limits, name: str = "token_ids.ids") -> Prompt:
    _check(bool(ids), f"{name} must not be empty")
    _check_token_ids(name, ids, limits)
    return Prompt(token_ids=ids)


def _check_token_ids(name: str, ids, limits: Limits) -> None:
    bad = [i for i in ids if not 0 <= i < limits.vocab_size]
    _check(not bad, f"{name} must be in [0, {limits.vocab_size}); got {bad[:5]}")


def chat_prompt(messages: list[dict], limits: Limits, name: str = "chat.messages",
                options: ChatOptions = ChatOptions()) -> Prompt:
    check_chat_count(len(messages), limits, name)
    for i, m in enumerate(messages):
        _check(m["role"] in CHAT_ROLES, f"{name}[{i}].role must be one of {', '.join(CHAT_ROLES)}, "
                                        f"got {m['role']!r}")
    variables = {"chat_template_kwargs": options.template_kwargs, "tools": options.tools}
    size = sum(_utf8_size(where, text) for where, text in chat_texts(messages, name, variables))
    given = [key for key, value in variables.items() if value]
    what = f"{name} content and {' and '.join(given)}, all together," if given else f"{name} (content, all together)"
    _check_bytes(what, size, limits)
    return Prompt(messages=messages, messages_name=name, chat_options=options)


def chat_options(add_generation_prompt: bool, continue_final_message: bool, template_kwargs: dict,
                 prefix: str = "chat.", tools: list[dict] | None = None) -> ChatOptions:
    """Checked options of a chat prompt; prefix goes before each field name in error messages."""
    _check(not (add_generation_prompt and continue_final_message),
           f"{prefix}continue_final_message needs {prefix}add_generation_prompt false: the last message is "
           "either continued or answered")
    taken = [name for name in SERVER_TEMPLATE_NAMES if name in template_kwargs]
    _check(not taken, f"{prefix}chat_template_kwargs may not set {', '.join(taken)}: the server sets these "
                      f"itself (the generation prompt: {prefix}add_generation_prompt)")
    _check(_nesting(template_kwargs) <= MAX_TEMPLATE_NESTING,
           f"{prefix}chat_template_kwargs nests objects and lists more than {MAX_TEMPLATE_NESTING} levels deep")
    return ChatOptions(add_generation_prompt, continue_final_message, template_kwargs, tools)


def check_chat_count(count: int, limits: Limits, name: str = "chat.messages") -> None:
    _check(count > 0, f"{name} must not be empty")
    _check(count <= limits.max_chat_messages,
           f"{name} holds {count} messages; at most {limits.max_chat_messages} are allowed (max_chat_messages)")


def prompt_from_pb(req: pb.GenerateRequest | pb.TokenizeRequest, limits: Limits) -> Prompt:
    """The request's input, refused before any tokenizing when it is empty or over the size limits."""
    kind = req.WhichOneof("input")
    if kind == "text":
        return text_prompt(req.text, limits)
    if kind == "token_ids":
        return token_prompt(list(req.token_ids.ids), limits)
    if kind == "chat":
        chat = req.chat
        generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
        check_chat_count(len(chat.messages), limits)  # before any work per message
        check_tool_count(len(chat.tools), "chat.tools")
        tools = [_tool_from_pb(tool, f"chat.tools[{i}]") for i, tool in enumerate(chat.tools)]
        options = chat_options(generation_prompt, chat.continue_final_message,
                               _template_kwargs(chat.chat_template_kwargs), tools=tools or None)
        messages = [_message_from_pb(m, f"chat.messages[{i}]") for i, m in enumerate(chat.messages)]
        return chat_prompt(messages, limits, options=options)
    raise InvalidRequest("input is required: set one of text, token_ids or chat")


def _template_kwargs(kwargs) -> dict:
    """chat.chat_template_kwargs as plain values; a NaN or an infinity (no JSON value) is refused."""
    try:
        return _plain(json_format.MessageToDict(kwargs))
    except ValueError as exc:
        raise InvalidRequest(f"chat.chat_template_kwargs must hold JSON values: {exc}") from None


def _message_from_pb(m: pb.ChatMessage, where: str) -> dict:
    """A message as the template reads it (as the OpenAI API's: fields left empty are left out)."""
    message = {"role": m.role, "content": m.content}
    for name in MESSAGE_FIELDS:
        if getattr(m, name):
            message[name] = getattr(m, name)
    if m.reasoning_content:  # under vLLM's name too, as the OpenAI API passes it
        message["reasoning"] = m.reasoning_content
    if m.tool_calls:
        message["tool_calls"] = [template_tool_call(call.id or None, call.name, call.arguments or "{}",
                                                    f"{where}.tool_calls[{j}].") for j, call in enumerate(m.tool_calls)]
    return message


def _tool_from_pb(tool: pb.Tool, where: str) -> dict:
    """A tool as the template reads it: the OpenAI API's {"type": "function", "function": {...}}."""
    function = {"name": function_name(tool.name, f"{where}.name")}
    if tool.description:
        function["description"] = tool.description
    if tool.parameters:
        function["parameters"] = json_object(tool.parameters, f"{where}.parameters")
    return {"type": "function", "function": function}


def _nesting(value) -> int:
    """How many objects and lists deep a JSON value goes (found without recursion)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth + 1)
            if depth + 1 <= MAX_TEMPLATE_NESTING:  # deeper than that is refused: no need to look further
                stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _plain(value):
    """A protobuf Struct's values as JSON would give them: whole numbers as ints (Struct holds doubles)."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
        return int(value)
    return value


def _utf8_size(name: str, text: str) -> int:
    """Bytes of text in UTF-8. JSON may escape a lone surrogate ("\\ud800"), which is no character."""
    try:
        return len(text.encode())
    except UnicodeEncodeError as exc:
        raise InvalidRequest(f"{name} is not valid Unicode: a lone surrogate (U+{ord(text[exc.start]):04X}) at "
                             f"character {exc.start}") from None


def _check_bytes(name: str, size: int, limits: Limits) -> None:
    _check(size <= limits.max_prompt_bytes, f"{name} is {size} bytes; at most {limits.max_prompt_bytes} are "
                                            "allowed (max_prompt_bytes)")


def checked_request_id(request_id: str, header: str | None, header_first: bool = False) -> str:
    """request_id if given, else the x-request-id header (the header first with header_first: HTTP's, as
    vLLM's), else a new id; both at most MAX_REQUEST_ID_LEN long."""
    for name, value in (("request_id", request_id), (REQUEST_ID_HEADER, header or "")):
        _check(len(value) <= MAX_REQUEST_ID_LEN,
               f"{name} must be at most {MAX_REQUEST_ID_LEN} characters, got {len(value)}")
    first, second = (header, request_id) if header_first else (request_id, header)
    return first or second or uuid.uuid4().hex


def request_id_header_value(request_id: str) -> str:
    """request_id as a metadata value: unchanged when it is printable ASCII (any id sent in the header
    is), else percent-encoded as UTF-8, since metadata values cannot hold other characters."""
    if request_id.isascii() and request_id.isprintable():
        return request_id
    return urllib.parse.quote(request_id, safe=_PERCENT_ENCODE_SAFE)


def request_params(limits: Limits, sampling: SamplingOptions, *, max_tokens: int | None = None, min_tokens: int = 0,
                   stop: tuple[str, ...] = (), stop_token_ids: tuple[int, ...] = (), ignore_eos: bool = False,
                   logprobs: int | None = None, skip_special_tokens: bool = True, logit_bias: dict | None = None,
                   include_stop_str_in_output: bool = False, priority: int = 0, logprobs_name: str = "logprobs",
                   max_tokens_name: str = "max_tokens", regex: str | None = None,
                   prompt_logprobs: int | None = None, allowed_token_ids: tuple[int, ...] = (),
                   bad_words: tuple[str, ...] = ()) -> RequestParams:
    """Validated RequestParams from plain values; max_tokens None means as many as fit. logit_bias maps
    token ids (ints) to biases; regex: structured output's, already checked (structured.py)."""
    if max_tokens is not None:
        _check(0 < max_tokens <= limits.max_model_len,
               f"{max_tokens_name} must be in [1, {limits.max_model_len}] (max_model_len), got {max_tokens}")
    _check(0 <= min_tokens <= limits.max_model_len,
           f"min_tokens must be in [0, {limits.max_model_len}] (max_model_len), got {min_tokens}")
    _check(max_tokens is None or min_tokens <= max_tokens,
           f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})")
    _check(len(stop) <= limits.max_stop_strings,
           f"stop may hold at most {limits.max_stop_strings} strings, got {len(stop)}")
    for i, s in enumerate(stop):
        _check(0 < len(s) <= limits.max_stop_string_len,
               f"stop[{i}] must be 1 to {limits.max_stop_string_len} characters long, got {len(s)}")
        _utf8_size(f"stop[{i}]", s)
    _check_token_ids("stop_token_ids", stop_token_ids, limits)
    _check(len(stop_token_ids) <= MAX_STOP_TOKEN_IDS,
           f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(stop_token_ids)}")
    _check(logprobs is None or 0 <= logprobs <= limits.max_logprobs,
           f"{logprobs_name} must be in [0, {limits.max_logprobs}], got {logprobs}")
    _check(prompt_logprobs is None or 0 <= prompt_logprobs <= limits.max_logprobs,
           f"prompt_logprobs must be in [0, {limits.max_logprobs}], got {prompt_logprobs}")
    _check_token_ids("allowed_token_ids", allowed_token_ids, limits)
    _check(len(bad_words) <= MAX_BAD_WORDS, f"bad_words may hold at most {MAX_BAD_WORDS} words, got {len(bad_words)}")
    for i, word in enumerate(bad_words):
        _check(0 < len(word.strip()) <= limits.max_stop_string_len,
               f"bad_words[{i}] must be 1 to {limits.max_stop_string_len} characters long (not blank), got {len(word)}")
        _utf8_size(f"bad_words[{i}]", word)
    _check(regex is None or min_tokens == 0,
           f"min_tokens ({min_tokens}) cannot go with structured output, whose text may be whole sooner; leave it 0")
    _check(priority == 0 or limits.by_priority,
           f"priority {priority} needs a server started with --scheduling-policy priority; leave it 0 here")
    _check(-2 ** 31 <= priority < 2 ** 31, f"priority must be in [-2147483648, 2147483647], got {priority}")
    return RequestParams(max_tokens=max_tokens or 0, sampling=sampling, min_tokens=min_tokens, stop=stop,
                         stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, logprobs=logprobs,
                         skip_special_tokens=skip_special_tokens,
                         logit_bias=checked_logit_bias(logit_bias or {}, limits),
                         include_stop_str_in_output=include_stop_str_in_output, priority=priority, regex=regex,
                         prompt_logprobs=prompt_logprobs, allowed_token_ids=tuple(sorted(set(allowed_token_ids))),
                         bad_words=tuple(bad_words))


def checked_logit_bias(bias: dict, limits: Limits) -> tuple[tuple[int, float], ...]:
    """(token id, bias) pairs in ascending id order, each id in the vocabulary and each bias in [-100, 100]."""
    _check(len(bias) <= limits.max_logit_bias,
           f"logit_bias may hold at most {limits.max_logit_bias} entries, got {len(bias)}")
    _check_token_ids("logit_bias token ids", bias, limits)
    pairs = sorted(bias.items())
    for token_id, value in pairs:
        _range(f"logit_bias[{token_id}]", value, -100.0, 100.0)
    return tuple((int(i), float(_float32(v))) for i, v in pairs)


def check_truncation(truncate_prompt_tokens: int, limits: Limits, longest: bool = False) -> None:
    """longest: the caller takes -1 as the most (the OpenAI API's), as the message says; the gRPC field is unsigned."""
    _check(0 <= truncate_prompt_tokens < limits.max_model_len,
           f"truncate_prompt_tokens must be {'-1 (the longest that fits) or ' if longest else ''}in [0, "
           f"{limits.max_model_len - 1}] (below max_model_len), 0 for no truncation; got {truncate_prompt_tokens}")


def generate_call_from_pb(req: pb.GenerateRequest, limits: Limits, header_request_id: str | None = None,
                          tool_call_parser: str | None = None, reasoning_parser: str | None = None) -> GenerateCall:
    """tool_call_parser: the server's, which chat.tool_choice "required" or a function's name needs;
    reasoning_parser: the server's, whose reasoning a chat's structured output leaves free."""
    request_id = checked_request_id(req.request_id, header_request_id)
    prompt = prompt_from_pb(req, limits)
    check_truncation(req.truncate_prompt_tokens, limits)
    params = request_params(
        limits, sampling_from_pb(req.sampling, limits.defaults),
        max_tokens=req.max_tokens if req.HasField("max_tokens") else None,
        min_tokens=req.min_tokens,
        stop=tuple(req.stop),
        stop_token_ids=tuple(req.stop_token_ids),
        ignore_eos=req.ignore_eos,
        logprobs=req.logprobs if req.HasField("logprobs") else None,
        skip_special_tokens=req.skip_special_tokens if req.HasField("skip_special_tokens") else True,
        logit_bias=dict(req.logit_bias),
        include_stop_str_in_output=req.include_stop_str_in_output,
        priority=req.priority,
        regex=_output_regex_from_pb(req, prompt, tool_call_parser, reasoning_parser),
        prompt_logprobs=req.prompt_logprobs if req.HasField("prompt_logprobs") else None,
        allowed_token_ids=tuple(req.allowed_token_ids),
        bad_words=tuple(req.bad_words),
    )
    return GenerateCall(request_id, prompt, params, req.truncate_prompt_tokens)


def _output_regex_from_pb(req: pb.GenerateRequest, prompt: Prompt, parser: str | None,
                          reasoning_parser: str | None) -> str | None:
    """Structured output: structured_output's, or the calls that chat.tool_choice forces (after the reasoning,
    for chat on a server with a reasoning parser); None for free text."""
    regex = _forced_calls_from_pb(req, prompt, parser)
    if regex is None and req.HasField("structured_output"):
        regex = structured_regex_from_pb(req.structured_output)
    if regex is not None and prompt.messages is not None and reasoning_parser is not None:
        regex = after_reasoning(regex, reasoning_parser)
    return regex


def forces_calls(req: pb.GenerateRequest) -> bool:
    """chat.tool_choice forces tool calls: it is "required" or names a function."""
    return req.WhichOneof("input") == "chat" and req.chat.tool_choice not in ("", "auto", "none")


def _forced_calls_from_pb(req: pb.GenerateRequest, prompt: Prompt, parser: str | None) -> str | None:
    """The regex of the calls chat.tool_choice forces, if it forces any."""
    if not forces_calls(req):
        return None
    choice = req.chat.tool_choice
    tools = prompt.chat_options.tools or []
    names = [tool["function"]["name"] for tool in tools]
    _check(choice == "required" or choice in names, f"chat.tool_choice must be \"auto\", \"none\", \"required\" or "
           f"the name of one of chat.tools ({', '.join(names) or 'none given'}); got {choice[:80]!r}")
    _check(bool(tools), f"chat.tool_choice {choice!r} needs chat.tools")
    _check(parser is not None, f"chat.tool_choice {choice!r} needs a server started with --tool-call-parser, "
           "whose format the calls are written in")
    _check(not req.HasField("structured_output"),
           "chat.tool_choice and structured_output each constrain the output; send one of them")
    spec = ToolSpec(True, choice == "required", tuple(names) if choice == "required" else (choice,))
    return checked_regex(forced_calls_regex(parser, tools, spec), "chat.tool_choice")


def _add_logprobs(field, logprobs: list[TokenLogprobs]) -> None:
    """Appends a PositionLogprobs to the repeated ``field`` for each entry of ``logprobs``."""
    for lp in logprobs:
        entry = field.add()
        entry.sampled.token_id, entry.sampled.logprob = lp.token_id, lp.logprob
        if lp.rank is not None:
            entry.sampled.rank = lp.rank
        for token_id, logprob in lp.top:
            entry.top.add(token_id=token_id, logprob=logprob)


_FINISH_TO_PB = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP_TOKEN: pb.FINISH_REASON_STOP_TOKEN,
    FinishReason.STOP_STRING: pb.FINISH_REASON_STOP_STRING,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORTED: pb.FINISH_REASON_ABORTED,
}


def output_to_pb(out: RequestOutput) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(request_id=out.request_id, token_ids=out.token_ids, text=out.text,
                              finish_reason=_FINISH_TO_PB[out.finish_reason], matched_stop=out.matched_stop)
    _add_logprobs(msg.logprobs, out.logprobs)
    if out.prompt_logprobs is not None:
        _add_logprobs(msg.prompt_logprobs, out.prompt_logprobs[1:])
    if out.finish_reason is not None:
        msg.usage.prompt_tokens = out.prompt_tokens
        msg.usage.completion_tokens = out.completion_tokens
        msg.usage.cached_prompt_tokens = out.cached_prompt_tokens
    return msg
