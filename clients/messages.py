"""Plain types of the twinplane Generation API and their protobuf edge.

``build_request`` turns keyword arguments into a GenerateRequest (None leaves a
proto3 optional field unset, so the server's documented default applies);
``chunk_from_pb``, ``model_info_from_pb`` and ``stats_from_pb`` turn responses into
the plain dataclasses below. No generated message class leaves this module and
``client.py``. ``build_request`` raises ValueError for unusable arguments.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Union

from twinplane.proto import generation_pb2 as pb
from twinplane.proto import set_fields


Message = Union[Mapping[str, Any], tuple[str, str]]  # {"role", "content", ...} or (role, content)
ChannelOptions = Sequence[tuple[str, Any]]

FINISH_REASONS: dict[int, str | None] = {
    pb.FINISH_REASON_UNSPECIFIED: None,
    pb.FINISH_REASON_STOP_TOKEN: "stop_token",
    pb.FINISH_REASON_STOP_STRING: "stop_string",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORTED: "aborted",
}


@dataclass(frozen=True)
class PositionLogprobs:
    """Log-probabilities at one generated (or prompt) position."""

    token_id: int  # the sampled token (the prompt's, in prompt_logprobs)
    logprob: float  # its natural-log probability
    top: list[tuple[int, float]]  # (token_id, logprob) of the most likely tokens, best first
    rank: int | None = None  # in prompt_logprobs: 1 + the number of tokens more likely than the prompt's


@dataclass(frozen=True)
class Usage:
    """Token counts of a finished request."""

    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int  # prompt tokens whose KV cache was reused


@dataclass(frozen=True)
class ToolCall:
    """A call of a tool the model made (parse_output): its id, the function, the arguments' JSON text."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a tool call while the model writes it (parse_output): the call's index among the
    reply's calls, its id and name on its first piece ("" after), and the text it adds to the arguments."""

    index: int
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class GenerateChunk:
    """One message of a generation stream: what was generated since the previous one."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[PositionLogprobs]  # one per token id, when requested
    finish_reason: str | None  # a FINISH_REASONS value: None while running ("unknown" if newer than us)
    usage: Usage | None  # on the last chunk only
    matched_stop: str  # the stop string that ended the request, else ""
    reasoning_text: str = ""  # with parse_output: the reasoning since the previous chunk
    tool_calls: list[ToolCall] = field(default_factory=list)  # with parse_output: the calls completed since then
    tool_call_deltas: list[ToolCallDelta] = field(default_factory=list)  # with parse_output: the calls as written
    # with prompt_logprobs, on the first chunk: prompt token i + 1's at entry i (given tokens 0 to i)
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)


@dataclass(frozen=True)
class ModelInfo:
    """The served model and the limits that requests must respect."""

    model: str
    architecture: str
    vocab_size: int
    max_model_len: int
    dtype: str
    block_size: int
    num_kv_blocks: int
    tensor_parallel_size: int
    attention_backend: str
    eos_token_ids: list[int]
    max_logprobs: int
    has_chat_template: bool
    weight_bytes: int = 0
    kv_bytes_per_token: int = 0
    device: str = ""
    data_parallel_size: int = 1
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    hidden_size: int = 0
    num_hidden_layers: int = 0
    num_attention_heads: int = 0
    head_dim: int = 0
    layer_params: int = 0  # decoder-layer matrix weights, all ranks together (0: not reported)
    reasoning_parser: str = ""  # the server's --reasoning-parser ("" when off)
    tool_call_parser: str = ""  # the server's --tool-call-parser ("" when off)
    kv_cache_dtype: str = ""  # the data plane's KV cache: dtype, or "float8_e4m3fn" ("" from an older server)
    # what a request's unset sampling fields and max_tokens get, by field name, where the model's generation
    # config sets it (empty: the built-in defaults)
    generation_defaults: dict = field(default_factory=dict)


# ---- protobuf edge: requests --------------------------------------------------------------


def structured_output(json_schema: dict | str | None = None, json_object: bool = False, regex: str | None = None,
                      choice: Iterable[str] | None = None) -> pb.StructuredOutput | None:
    """What the output must match (None: free text), from at most one of the four forms."""
    given = {name: value for name, value in (("json_schema", json_schema), ("json_object", json_object or None),
                                              ("regex", regex), ("choice", choice)) if value is not None}
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)}: give at most one constraint of the output")
    if not given:
        return None
    if json_schema is not None:
        text = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
        return pb.StructuredOutput(json_schema=text)
    if choice is not None:
        return pb.StructuredOutput(choice=pb.Choices(choices=list(choice)))
    return pb.StructuredOutput(json_object=True) if json_object else pb.StructuredOutput(regex=regex)


def build_request(
    prompt: str | None = None,
    *,
    token_ids: Iterable[int] | None = None,
    messages: Iterable[Message] | None = None,
    request_id: str = "",
    max_tokens: int | None = None,
    min_tokens: int = 0,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    seed: int | None = None,
    stop: str | Iterable[str] = (),
    stop_token_ids: Iterable[int] = (),
    ignore_eos: bool = False,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    truncate_prompt_tokens: int = 0,
    skip_special_tokens: bool | None = None,
    logit_bias: dict[int, float] | None = None,
    include_stop_str_in_output: bool = False,
    priority: int = 0,
    allowed_token_ids: Iterable[int] = (),
    bad_words: Iterable[str] = (),
    parse_output: bool = False,
    json_schema: dict | str | None = None,
    json_object: bool = False,
    regex: str | None = None,
    choice: Iterable[str] | None = None,
    **chat: Any,
) -> pb.GenerateRequest:
    """A GenerateRequest from exactly one of prompt, token_ids and messages.

    None leaves an optional field unset (the server's default applies); chat: chat_input's
    options for messages. At most one of json_schema (a JSON Schema, as a dict or JSON text),
    json_object, regex and choice constrains the output (structured output). Raises ValueError
    unless exactly one input is given, when messages are malformed or when several constraints are.
    """
    _check_one_input(prompt=prompt, token_ids=token_ids, messages=messages)
    if unknown := sorted(set(chat) - CHAT_OPTIONS):
        raise TypeError(f"unknown argument {', '.join(unknown)}")
    if chat and messages is None:
        raise TypeError(f"{', '.join(sorted(chat))}: options of chat messages, given without messages")
    sampling = _message(
        pb.SamplingParams, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, seed=seed,
    )
    request = _message(
        pb.GenerateRequest, request_id=request_id, max_tokens=max_tokens, min_tokens=min_tokens,
        stop=[stop] if isinstance(stop, str) else list(stop), stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        truncate_prompt_tokens=truncate_prompt_tokens,
        skip_special_tokens=skip_special_tokens, logit_bias=logit_bias or {},
        include_stop_str_in_output=include_stop_str_in_output, priority=priority, parse_output=parse_output,
        allowed_token_ids=list(allowed_token_ids), bad_words=list(bad_words),
    )
    if sampling.ListFields():
        request.sampling.CopyFrom(sampling)
    structured = structured_output(json_schema=json_schema, json_object=json_object, regex=regex, choice=choice)
    if structured is not None:
        request.structured_output.CopyFrom(structured)
    if prompt is not None:
        request.text = prompt
    elif token_ids is not None:
        request.token_ids.ids.extend(_token_ids(token_ids))
    else:
        request.chat.CopyFrom(chat_input(messages or (), **chat))
    return request


def build_tokenize_request(
    text: str | None = None, messages: Iterable[Message] | None = None, **chat: Any
) -> pb.TokenizeRequest:
    """A TokenizeRequest from exactly one of text and messages (else ValueError); chat: chat_input's options."""
    _check_one_input(text=text, messages=messages)
    if text is not None:
        return pb.TokenizeRequest(text=text)
    return pb.TokenizeRequest(chat=chat_input(messages or (), **chat))


def chat_input(messages: Iterable[Message], *, add_generation_prompt: bool | None = None,
               continue_final_message: bool = False, chat_template_kwargs: dict[str, Any] | None = None,
               tools: Iterable[Mapping[str, Any]] = (), tool_choice: str = "") -> pb.ChatInput:
    """Chat messages, each {"role", "content"} or (role, content), as a ChatInput; the options as
    the proto documents them (None: the server's default). A message dict may also hold the
    OpenAI API's tool_calls ([{"id", "function": {"name", "arguments"}}]), tool_call_id, name and
    reasoning_content; tools are OpenAI's ({"type": "function", "function": {...}}) or the
    functions alone ({"name", "description", "parameters"}); tool_choice "required" or a tool's
    name forces calls."""
    chat = pb.ChatInput(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                        tool_choice=tool_choice)
    for message in messages:
        chat.messages.append(_chat_message(message))
    for tool in tools:
        function = tool.get("function", tool)
        added = chat.tools.add(name=function["name"], description=function.get("description") or "")
        if function.get("parameters") is not None:
            parameters = function["parameters"]
            added.parameters = parameters if isinstance(parameters, str) else json.dumps(parameters)
    if chat_template_kwargs:
        chat.chat_template_kwargs.update(chat_template_kwargs)
    return chat


CHAT_OPTIONS = frozenset(name for name, p in inspect.signature(chat_input).parameters.items()
                         if p.kind is p.KEYWORD_ONLY)


def _message(cls: type, **fields: Any) -> Any:
    """cls(**fields); a value the field cannot hold (out of its range, of another type) raises
    ValueError naming the field."""
    try:
        return cls(**fields)
    except (TypeError, ValueError) as error:
        for name, value in fields.items():
            try:
                cls(**{name: value})
            except (TypeError, ValueError) as culprit:
                raise ValueError(f"{name}={value!r}: {culprit}") from None
        raise ValueError(str(error)) from None


def _check_one_input(**inputs: object) -> None:
    given = [name for name, value in inputs.items() if value is not None]
    if len(given) != 1:
        names = ", ".join(inputs)
        raise ValueError(f"give exactly one of {names}; got {', '.join(given) or 'none'}")


def _chat_message(message: Message) -> pb.ChatMessage:
    extra: dict[str, Any] = {}
    if isinstance(message, Mapping):
        calls = message.get("tool_calls") or ()
        if "role" not in message or ("content" not in message and not calls):
            raise ValueError(f"a chat message needs 'role' and 'content', got keys {sorted(message)}")
        role, content = message["role"], message.get("content")
        content = "" if content is None and calls else content
        extra = {name: message[name] for name in ("tool_call_id", "name", "reasoning_content") if message.get(name)}
        extra["tool_calls"] = [_tool_call(call) for call in calls]
    elif isinstance(message, tuple) and len(message) == 2:
        role, content = message
    else:
        raise ValueError(f"a chat message is a dict or a (role, content) tuple, got {message!r}")
    if not isinstance(role, str) or not isinstance(content, str):
        raise ValueError(f"chat role and content must be strings, got {message!r}")
    return pb.ChatMessage(role=role, content=content, **extra)


def _tool_call(call: Any) -> pb.ToolCall:
    """An assistant's tool call as the OpenAI API gives it: {"id", "function": {"name", "arguments"}}."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or "name" not in function:
        raise ValueError(f"a tool call is {{'id': ..., 'function': {{'name': ..., 'arguments': ...}}}}, got {call!r}")
    return pb.ToolCall(id=call.get("id") or "", name=function["name"], arguments=function.get("arguments", "{}"))


def _token_ids(ids: Iterable[int]) -> list[int]:
    result = [int(i) for i in ids]
    if any(i < 0 for i in result):
        raise ValueError("token ids must be >= 0")
    return result


# ---- protobuf edge: responses -------------------------------------------------------------


def chunk_from_pb(response: pb.GenerateResponse) -> GenerateChunk:
    """A GenerateResponse as a GenerateChunk."""
    usage = None
    if response.HasField("usage"):
        u = response.usage
        usage = Usage(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens)
    return GenerateChunk(
        request_id=response.request_id,
        token_ids=list(response.token_ids),
        text=response.text,
        logprobs=[_position_logprobs(p) for p in response.logprobs],
        finish_reason=FINISH_REASONS.get(response.finish_reason, "unknown"),
        usage=usage,
        matched_stop=response.matched_stop,
        reasoning_text=response.reasoning_text,
        tool_calls=[ToolCall(c.id, c.name, c.arguments) for c in response.tool_calls],
        tool_call_deltas=[ToolCallDelta(d.index, d.id, d.name, d.arguments) for d in response.tool_call_deltas],
        prompt_logprobs=[_position_logprobs(p) for p in response.prompt_logprobs],
    )


def _position_logprobs(position: pb.PositionLogprobs) -> PositionLogprobs:
    return PositionLogprobs(
        token_id=position.sampled.token_id,
        logprob=position.sampled.logprob,
        top=[(t.token_id, t.logprob) for t in position.top],
        rank=position.sampled.rank if position.sampled.HasField("rank") else None,
    )


def model_info_from_pb(info: pb.ModelInfo) -> ModelInfo:
    """A ModelInfo message as a ModelInfo dataclass (fields of the same names)."""
    values = {f.name: getattr(info, f.name) for f in fields(ModelInfo)}
    return ModelInfo(**{**values, "eos_token_ids": list(info.eos_token_ids),
                        "generation_defaults": set_fields(info.generation_defaults)})


def stats_from_pb(stats: pb.ServerStats) -> dict:
    """ServerStats as a dict of its counters; "dataplanes" holds one such dict per data plane."""
    out = {f.name: getattr(stats, f.name) for f in stats.DESCRIPTOR.fields if f.name != "dataplanes"}
    out["dataplanes"] = [{f.name: getattr(d, f.name) for f in d.DESCRIPTOR.fields} for d in stats.dataplanes]
    return out
