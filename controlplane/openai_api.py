"""OpenAI-compatible requests in, validated GenerateCalls out; outputs back as OpenAI JSON objects.

No HTTP here: ``openai_http.py`` is the edge. Field checks reuse ``api.py``'s validators, so limits
and messages are those of the gRPC API (fields named as OpenAI names them).
"""

from __future__ import annotations

import codecs
import math
import re
from dataclasses import dataclass, replace

import xxhash

from twinplane.controlplane.api import (SAMPLING_FIELDS, GenerateCall, Limits, Prompt, RequestOutput, TokenLogprobs,
                                        chat_options, chat_prompt, check_chat_count, check_truncation, request_params,
                                        sampling_options, text_prompt, token_prompt)
from twinplane.controlplane.errors import InvalidRequest, json_excerpt
from twinplane.controlplane.json_schema import any_json_regex
from twinplane.controlplane.sequence import FinishReason
from twinplane.controlplane.structured import (after_reasoning, checked_regex, choice_regex, client_regex,
                                               json_schema_regex, schema_text)
from twinplane.controlplane.tokenizer import CHAT_ROLES, MESSAGE_FIELDS, Tokenizer
from twinplane.controlplane.tools import ToolSpec, forced_calls_regex, template_tool_calls, template_tools, tool_spec

MAX_CHOICES = 16  # most sequences (n) one request may ask for
MAX_BATCH_PROMPTS = 32  # most prompts in one completion request (each gets n choices)
# refused unless null or empty
UNSUPPORTED = ("functions", "function_call", "suffix", "audio", "prediction", "guided_grammar",
               "guided_whitespace_pattern", "use_beam_search")
CHAT_OPTIONS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice"}  # vLLM's older fields
# vLLM's structured_outputs: one constraint (json, regex, choice or json_object here), with options beside it
OUTPUT_KINDS = ("json", "regex", "choice", "json_object", "grammar", "structural_tag")
OUTPUT_KINDS_TAKEN = "one of json (a JSON Schema), regex (a string) or choice (strings), or json_object: true"
# true asks for what this server's JSON always is: no fallback to another compiler (there is one, and a
# constraint it cannot compile is refused), no properties but those a schema lists (vLLM's flag sets
# additionalProperties false where properties are listed; these objects hold only those anyway)
OUTPUT_FLAGS_HONOURED = ("disable_fallback", "disable_additional_properties")
# the library vLLM compiles the constraint with (set by its clients, or copied from its own params): this
# server compiles every constraint alike
OUTPUT_BACKEND = ("backend", "_backend", "backend_was_auto", "_backend_was_auto")
OUTPUT_FIELDS = (*OUTPUT_KINDS, *OUTPUT_FLAGS_HONOURED, "disable_any_whitespace", "whitespace_pattern")
# reasoning_effort's values (vLLM's): a chat template variable of that name, for the templates that read one
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_TOKEN_ID = re.compile(r"-?[0-9]{1,20}")  # a logit_bias key
_INTS = ("top_k", "seed", "n", "max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens",
         "top_logprobs", "truncate_prompt_tokens", "priority", "prompt_logprobs")
# request fields an error message may start with: an error's "param"
PARAMS = frozenset((*SAMPLING_FIELDS, *_INTS, "model", "messages", "prompt", "stop", "stop_token_ids",
                    "allowed_token_ids", "bad_words", "logprobs", "logit_bias",
                    "skip_special_tokens", "stream_options", "response_format", "echo", "include_stop_str_in_output",
                    "return_tokens_as_token_ids", "ignore_eos", "stream", "best_of",
                    "tokens", "modalities", *CHAT_OPTIONS, *TOOL_FIELDS, *UNSUPPORTED,
                    "input", "instructions", "text", "previous_response_id", "conversation", "background", "include",
                    "structured_outputs", *GUIDED, "include_reasoning", "reasoning_effort", "add_special_tokens",
                    "spaces_between_special_tokens", "reasoning", "truncation", "max_tool_calls", "metadata",
                    "request_id"))
FINISH_REASONS = {FinishReason.STOP_TOKEN: "stop", FinishReason.STOP_STRING: "stop",
                  FinishReason.LENGTH: "length", FinishReason.ABORTED: "abort"}


@dataclass(frozen=True)
class OpenAIRequest:
    """A validated /v1/chat/completions or /v1/completions request (a /v1/responses request as the chat
    request it reads as): one GenerateCall per choice."""

    chat: bool  # chat completion, else text completion
    calls: list[GenerateCall]  # n per prompt, prompt after prompt (a completion may send a batch of prompts)
    n: int = 1  # choices per prompt
    echo: bool = False  # completions: each choice's text starts with its prompt
    # chat: the role of the response's message, the last message's without a generation prompt (vLLM's), and with
    # echo, the content that each choice's starts with: the last message's when its role is that one
    role: str = "assistant"
    echoed: str = ""
    prompt_only: bool = False  # completions, echo with max_tokens 0: the prompt alone (one token is drawn, unshown)
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: each chunk with its choice's counts
    logprobs: bool = False  # return log-probabilities (the top ones: calls[i].params.logprobs of them)
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's log-probability and rank, and the top n
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name each token "token_id:<id>"
    tools: ToolSpec = ToolSpec()  # chat: whether the output is parsed for tool calls
    include_reasoning: bool = True  # chat: the reasoning parser's reasoning goes out (reasoning_content)


def _fail(message: str) -> None:
    raise InvalidRequest(message)


def _typed(body: dict, name: str, kinds: tuple[type, ...], what: str):
    value = body.get(name)
    if value is not None and (not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds):
        _fail(f"{name} must be {what}, got {type(value).__name__}")
    return value


def _number(body: dict, name: str) -> float | None:
    value = _typed(body, name, (int, float), "a number")
    if value is None:
        return None
    try:
        return float(value)
    except OverflowError:  # an integer of hundreds of digits: past any float, as its range check then says
        return math.inf if value > 0 else -math.inf


def _int(body: dict, name: str) -> int | None:
    return _typed(body, name, (int,), "an integer")


def _bool(body: dict, name: str) -> bool:
    return bool(_typed(body, name, (bool,), "true or false"))


def _sampling(body: dict, defaults: dict):
    values = {}
    for name in SAMPLING_FIELDS:
        value = _int(body, name) if name in _INTS else _number(body, name)
        if value is not None:
            values[name] = value
    seed = values.get("seed")
    if seed is not None:  # OpenAI's is signed (int64), the gRPC API's unsigned: the same 64 bits either way
        if not -(1 << 63) <= seed < 1 << 64:
            _fail(f"seed must be a 64-bit integer, in [-2**63, 2**64), got {seed}")
        values["seed"] = seed % (1 << 64)
    return sampling_options(values, prefix="", defaults=defaults)


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        _fail("stop must be a string or a list of strings")
    return tuple(stop)


def _bad_words(body: dict) -> tuple[str, ...]:
    words = body.get("bad_words")
    words = [] if words is None else words
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        _fail("bad_words must be a list of strings")
    return tuple(words)


def _logit_bias(body: dict) -> dict[int, float]:
    """OpenAI's logit_bias: an object from token ids (as strings, as JSON keys are) to numbers."""
    bias = _typed(body, "logit_bias", (dict,), "an object from token ids to biases") or {}
    parsed, keys = {}, {}
    for key, value in bias.items():
        if not isinstance(key, str) or not _TOKEN_ID.fullmatch(key):  # ASCII digits: int() takes others too
            _fail(f"logit_bias keys must be token ids (integers), got {key[:40]!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(f"logit_bias[{key}] must be a number, got {json_excerpt(value, 40)}")
        token_id = int(key)
        if token_id in keys:  # "7" and "07": one token, two biases
            _fail(f"logit_bias names token id {token_id} twice, as {keys[token_id]!r} and {key!r}")
        keys[token_id], parsed[token_id] = key, value
    return parsed


def _int_list(body: dict, name: str) -> tuple[int, ...]:
    value = body.get(name)
    value = [] if value is None else value
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        _fail(f"{name} must be a list of integers")
    return tuple(value)


def _content(content, where: str) -> str:
    """A message's content: a string, or a list of text parts joined by newlines (as vLLM joins them)."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        _fail(f"{where}.content must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            _fail(f"{where}.content[{j}] must be a text part ({{\"type\": \"text\", \"text\": ...}}); "
                  "only text input is supported")
        texts.append(part["text"])
    return "\n".join(texts)


def _messages(body: dict, limits: Limits) -> Prompt:
    messages = body.get("messages")
    if not isinstance(messages, list):
        _fail("messages is required: a list of {role, content} objects")
    check_chat_count(len(messages), limits, "messages")  # before any work per message
    out = [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
    generation_prompt = _typed(body, "add_generation_prompt", (bool,), "true or false")
    kwargs = _typed(body, "chat_template_kwargs", (dict,), "an object of template variables") or {}
    effort = body.get("reasoning_effort")
    if effort is not None:  # a template variable, as vLLM passes it; "none" turns off a template's thinking
        if effort not in REASONING_EFFORTS:
            _fail(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {str(effort)[:40]!r}")
        kwargs = {"enable_thinking": effort != "none", **kwargs, "reasoning_effort": effort}
    options = chat_options(True if generation_prompt is None else generation_prompt,
                           bool(_typed(body, "continue_final_message", (bool,), "true or false")), kwargs,
                           prefix="", tools=template_tools(body))
    prompt = chat_prompt(out, limits, name="messages", options=options)
    return replace(prompt, add_special_tokens=_typed(body, "add_special_tokens", (bool,), "true or false"))


def _message(m, where: str) -> dict:
    """A chat message as the template reads it: role and content, and the fields of tool calling
    (an assistant's tool_calls, a tool result's tool_call_id) and of reasoning when sent."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        _fail(f"{where} must be an object with a string role")
    if m["role"] not in (*CHAT_ROLES, "developer"):
        _fail(f"{where}.role must be one of {', '.join(CHAT_ROLES)} or developer (as system), got {m['role'][:40]!r}")
    role = "system" if m["role"] == "developer" else m["role"]
    message = {"role": role, "content": _content(m.get("content"), where)}
    for name in MESSAGE_FIELDS:
        value = m.get(name)
        if value is not None and not isinstance(value, str):
            _fail(f"{where}.{name} must be a string, got {type(value).__name__}")
        if value is not None:
            message[name] = value
    reasoning = m.get("reasoning")  # vLLM's name for reasoning_content: the template gets both, whichever came
    if reasoning is not None and not isinstance(reasoning, str):
        _fail(f"{where}.reasoning must be a string, got {type(reasoning).__name__}")
    if reasoning is not None or "reasoning_content" in message:
        message.setdefault("reasoning_content", reasoning)
        message.setdefault("reasoning", message["reasoning_content"])
    if m.get("tool_calls"):
        message["tool_calls"] = template_tool_calls(m["tool_calls"], f"{where}.tool_calls")
    return message


def _prompts(body: dict, limits: Limits) -> list[Prompt]:
    """A completion's prompt: a string or a list of token ids, or a batch of them (a list of those)."""
    prompt = body.get("prompt")
    if prompt is None:
        _fail("prompt is required: a string or a list of token ids")
    special = _typed(body, "add_special_tokens", (bool,), "true or false")  # a text's (token ids are as sent)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_BATCH_PROMPTS:
            _fail(f"prompt: a batch holds at most {MAX_BATCH_PROMPTS} prompts, got {len(prompt)}")
        return [_one_prompt(p, limits, f"prompt[{i}]", special) for i, p in enumerate(prompt)]
    return [_one_prompt(prompt, limits, "prompt", special)]


def _one_prompt(value, limits: Limits, name: str, add_special_tokens: bool | None = None) -> Prompt:
    if isinstance(value, str):
        return replace(text_prompt(value, limits, name=name), add_special_tokens=add_special_tokens)
    if isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        return token_prompt(value, limits, name=name)
    _fail(f"{name} must be a string or a list of token ids (integers)")


def tokenize_prompt(body: dict, limits: Limits) -> Prompt:
    """/tokenize: chat messages (rendered with the chat template and the request's chat options) or a text prompt."""
    if "messages" in body:
        return _messages(body, limits)
    if not isinstance(body.get("prompt"), str):
        _fail("prompt is required: a string (or send messages: a list of {role, content} objects)")
    return _one_prompt(body["prompt"], limits, "prompt", _typed(body, "add_special_tokens", (bool,), "true or false"))


def detokenize_ids(body: dict, limits: Limits) -> list[int]:
    """/detokenize: the token ids to turn into text."""
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in tokens):
        _fail("tokens is required: a list of token ids (integers)")
    return token_prompt(tokens, limits, name="tokens").token_ids


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many top alternatives per token (0: the sampled token's only), or None for no logprobs."""
    if chat:
        top = _int(body, "top_logprobs")
        if not _bool(body, "logprobs"):
            if top:  # 0 asks for nothing without them (vLLM's default, which its clients send)
                _fail("top_logprobs needs logprobs: true")
            return None
        return top or 0
    return _int(body, "logprobs")


def _check_supported(body: dict) -> None:
    for name in UNSUPPORTED:
        if body.get(name):
            _fail(f"{name} is not supported by this server")
    modalities = body.get("modalities")
    if modalities is not None and (not isinstance(modalities, list) or set(modalities) - {"text"}):
        _fail(f'modalities must be ["text"] (this server writes text alone), got {json_excerpt(modalities, 80)}')
    best_of, n = _int(body, "best_of"), _int(body, "n")  # n's own checks come after
    if best_of is not None and best_of != (1 if n is None else n):
        _fail("best_of is not supported by this server (leave it unset or equal to n)")


def _output_regex(body: dict, tools: list[dict] | None, spec: ToolSpec, parser: str | None) -> str | None:
    """Structured output, as one regex: response_format (json_object or json_schema), vLLM's
    structured_outputs (json, regex, choice or json_object) or its older guided_json, guided_regex and guided_choice,
    or a forced tool call; None for free text."""
    fmt = body.get("response_format")
    asked = [name for name in ("response_format", "structured_outputs", *GUIDED) if body.get(name) is not None]
    if isinstance(fmt, dict) and fmt.get("type") == "text":
        asked.remove("response_format")
    asked += ["tool_choice"] * bool(spec.forced)
    if len(asked) > 1:
        _fail(f"{' and '.join(asked)} each constrain the output; send one of them")
    if not asked:
        return None
    if spec.forced:
        return checked_regex(forced_calls_regex(parser, tools, spec), "tool_choice")
    if asked[0] == "response_format":
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            return any_json_regex()
        schema = fmt.get("json_schema") if kind == "json_schema" else None
        if not isinstance(schema, dict) or "schema" not in schema:
            _fail("response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": "
                  "\"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}")
        return json_schema_regex(schema["schema"], "response_format.json_schema.schema")
    if asked[0] in GUIDED:
        kind, value, where = GUIDED[asked[0]], body[asked[0]], asked[0]
    else:
        kind, value = _structured_outputs(body["structured_outputs"])
        where = f"structured_outputs.{kind}"
    if kind == "json_object":
        return any_json_regex()
    if kind == "json":
        return json_schema_regex(schema_text(value, where) if isinstance(value, str) else value, where)
    if kind == "regex":
        return client_regex(value, where)
    return choice_regex(value, where)


def _structured_outputs(outputs) -> tuple[str, object]:
    """vLLM's structured_outputs: its one constraint, as (kind, value). A null field is unset, as vLLM reads
    it, and so is an option at its default (false or null), as a client that sends every field sends it."""
    if not isinstance(outputs, dict):
        _fail(f"structured_outputs must hold {OUTPUT_KINDS_TAKEN}")
    for name, value in outputs.items():
        if value is not None and name not in (*OUTPUT_FIELDS, *OUTPUT_BACKEND):
            _fail(f"structured_outputs has no field {name[:40]!r}; its fields are {', '.join(OUTPUT_FIELDS)}")
        if value is not None and name.startswith("disable_") and not isinstance(value, bool):
            _fail(f"structured_outputs.{name} must be true or false, got {type(value).__name__}")
    # json_object false asks for nothing, as null does
    given = [k for k in OUTPUT_KINDS if outputs.get(k) is not None and not (k == "json_object" and outputs[k] is False)]
    if len(given) == 1 and given[0] in ("grammar", "structural_tag"):
        _fail(f"structured_outputs must hold {OUTPUT_KINDS_TAKEN}; {given[0]} is not supported by this server")
    if len(given) != 1 or given[0] == "json_object" and outputs["json_object"] is not True:
        _fail(f"structured_outputs must hold {OUTPUT_KINDS_TAKEN}")
    if given[0] in ("json", "json_object"):  # the options of a JSON text's layout
        if outputs.get("disable_any_whitespace"):
            _fail("structured_outputs.disable_any_whitespace: true is not supported: this server's JSON may hold "
                  "a space after each : and , (leave it false)")
        if outputs.get("whitespace_pattern") is not None:
            _fail("structured_outputs.whitespace_pattern is not supported: this server's JSON may hold a space "
                  "after each : and , and no other whitespace (leave it null)")
    return given[0], outputs[given[0]]


def _max_tokens(body: dict) -> tuple[int | None, str]:
    """The most tokens to generate, and the field that gave it (the Responses API's: max_output_tokens)."""
    for name in ("max_completion_tokens", "max_output_tokens"):
        value = _int(body, name)
        if value is not None:
            return value, name
    return _int(body, "max_tokens"), "max_tokens"


def _chat_role(prompt: Prompt, echo: bool) -> tuple[str, str]:
    """(the role of a chat response's message, what its content starts with), as vLLM's: the assistant's
    after a generation prompt, else the last message's role, whose message goes on; with echo, the last
    message's content when its role is that one."""
    last = prompt.messages[-1]
    role = "assistant" if prompt.chat_options.add_generation_prompt else last["role"]
    return role, (last["content"] or "") if echo and last["role"] == role else ""


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice 0 keeps the request's seed (so n=1 matches the gRPC API); the others get distinct ones."""
    if seed is None or index == 0:
        return seed
    return xxhash.xxh64_intdigest(f"{seed}:{index}".encode())


def parse_request(body: dict, limits: Limits, request_id: str, chat: bool,
                  tool_call_parser: str | None = None, special_tool_tags: bool = False,
                  reasoning_parser: str | None = None, spaced_special_tokens: bool = False) -> OpenAIRequest:
    """Validates an OpenAI request body; each choice gets the request id with '-<index>' when there are several.
    tool_call_parser: the server's ``--tool-call-parser``, which tool_choice "auto" needs; special_tool_tags:
    the tags it reads are special tokens, so a request whose calls it reads keeps special tokens in its text;
    reasoning_parser: the server's ``--reasoning-parser``, whose reasoning a chat's structured output leaves free;
    spaced_special_tokens: the tokenizer decodes special tokens with a space between them
    (``Tokenizer.spaces_special_tokens``)."""
    _check_supported(body)
    for name in () if chat else (*TOOL_FIELDS, "reasoning_effort"):
        if body.get(name) is not None:
            _fail(f"{name} is only for /v1/chat/completions")
    include_reasoning = _typed(body, "include_reasoning", (bool,), "true or false") is not False
    if not chat and not include_reasoning:
        _fail("include_reasoning: false is only for /v1/chat/completions (a completion's text is not split into "
              "reasoning and answer)")
    n = _int(body, "n")
    n = 1 if n is None else n
    if not 1 <= n <= MAX_CHOICES:
        _fail(f"n must be in [1, {MAX_CHOICES}], got {n}")
    prompts = [_messages(body, limits)] if chat else _prompts(body, limits)
    tools = tool_spec(body, prompts[0].chat_options.tools, tool_call_parser) if chat else ToolSpec()
    regex = _output_regex(body, prompts[0].chat_options.tools, tools, tool_call_parser)
    if regex is not None and chat and reasoning_parser is not None:
        regex = after_reasoning(regex, reasoning_parser)
    top = _logprobs(body, chat)
    echo = _bool(body, "echo")
    role, echoed = _chat_role(prompts[0], echo) if chat else ("assistant", "")
    echo = echo and not chat  # from here: a completion's prompt echoed (a chat's message is in echoed)
    prompt_top = _int(body, "prompt_logprobs")
    allowed_token_ids = _int_list(body, "allowed_token_ids")
    if body.get("allowed_token_ids") == []:
        _fail("allowed_token_ids must not be empty (leave it out to allow every token)")
    max_tokens, max_tokens_name = _max_tokens(body)
    prompt_only = echo and max_tokens == 0  # scores a text: its prompt computed, the token drawn after it dropped
    min_tokens = _int(body, "min_tokens") or 0
    if prompt_only and min_tokens > 0:  # checked here: the params ask for the one token drawn, not for 0
        _fail(f"min_tokens ({min_tokens}) must not exceed {max_tokens_name} (0), which with echo gives the prompt "
              "alone")
    params = request_params(
        limits, _sampling(body, limits.defaults), max_tokens=1 if prompt_only else max_tokens, min_tokens=min_tokens,
        stop=_stop(body), stop_token_ids=_int_list(body, "stop_token_ids"), ignore_eos=_bool(body, "ignore_eos"),
        logprobs=top, skip_special_tokens=_typed(body, "skip_special_tokens", (bool,), "true or false") is not False
        and not (tools.parse and special_tool_tags),
        logit_bias=_logit_bias(body), include_stop_str_in_output=_bool(body, "include_stop_str_in_output"),
        priority=_int(body, "priority") or 0, logprobs_name="top_logprobs" if chat else "logprobs",
        max_tokens_name=max_tokens_name, regex=regex, prompt_logprobs=prompt_top, allowed_token_ids=allowed_token_ids,
        bad_words=_bad_words(body))
    spaces = _typed(body, "spaces_between_special_tokens", (bool,), "true or false")
    if spaces is False and spaced_special_tokens and not params.skip_special_tokens:
        _fail("spaces_between_special_tokens: false is not supported with this model's tokenizer, whose decoding "
              "puts a space between special tokens (leave it true, or leave the special tokens out with "
              "skip_special_tokens)")
    truncate = _int(body, "truncate_prompt_tokens") or 0
    if truncate == -1:  # vLLM's: the longest that fits, as if that were sent
        truncate = limits.max_model_len - 1
    check_truncation(truncate, limits, longest=True)
    options = _typed(body, "stream_options", (dict,), "an object")
    stream = _bool(body, "stream")
    if options and not stream:  # an empty one asks for nothing, as vLLM reads it
        _fail("stream_options is only allowed with stream: true")
    usage = {}  # include_usage: a last chunk with the usage; continuous_usage_stats: every chunk with the counts
    for name in ("include_usage", "continuous_usage_stats"):  # (apart from each other: each asks for its own)
        usage[name] = options.get(name) if options is not None else None
        if usage[name] is not None and not isinstance(usage[name], bool):
            _fail(f"stream_options.{name} must be true or false, got {type(usage[name]).__name__}")
    if prompt_top is not None and stream:
        _fail("prompt_logprobs is not available with stream: true")
    # the prompt's log-probabilities come from its first choice, the others share them (echo with logprobs
    # shows them too): as many top ones as either asks for
    scoring = [k for k in (top if echo else None, prompt_top) if k is not None]
    calls = []  # prompt after prompt, n choices each: choice index = prompt index * n + j
    for prompt in prompts:
        for j in range(n):  # a prompt's choices draw as they would with that prompt alone
            sampling = replace(params.sampling, seed=choice_seed(params.sampling.seed, j))
            choice = None if n * len(prompts) == 1 else len(calls)
            scored = max(scoring) if scoring and j == 0 else None
            calls.append(GenerateCall(request_id, prompt, replace(params, sampling=sampling, prompt_logprobs=scored),
                                      truncate, "messages" if chat else "prompt", max_tokens_name, choice))
    return OpenAIRequest(chat=chat, calls=calls, n=n, echo=echo, role=role, echoed=echoed, prompt_only=prompt_only,
                         stream=stream, include_usage=bool(usage["include_usage"]),
                         continuous_usage=bool(usage["continuous_usage_stats"]), logprobs=top is not None,
                         prompt_logprobs=prompt_top, tokens_as_ids=_bool(body, "return_tokens_as_token_ids"),
                         tools=tools, include_reasoning=include_reasoning)


# ---- responses ------------------------------------------------------------------------------------


def finish_reason(out: RequestOutput) -> str | None:
    return None if out.finish_reason is None else FINISH_REASONS[out.finish_reason]


def usage_json(finals: list[RequestOutput], n: int = 1) -> dict:
    """Usage of a request's choices (finals: in choice order, n per prompt): each prompt counted
    once, the completions added up."""
    firsts = finals[::n]
    prompt = sum(f.prompt_tokens for f in firsts)
    completion = sum(f.completion_tokens for f in finals)
    cached = sum(f.cached_prompt_tokens for f in firsts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _token_text(tokenizer: Tokenizer | None, token_id: int) -> str:
    return tokenizer.token_texts([token_id])[0] if tokenizer is not None else f"token_id:{token_id}"


def _safe(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else -9999.0  # JSON has no -inf


def prompt_logprobs_json(entries: list[TokenLogprobs | None], tokenizer: Tokenizer | None) -> list[dict | None]:
    """vLLM's prompt_logprobs: null for the first prompt token; for each other one, {token id: {logprob, rank,
    decoded_token}} of the prompt's token and of the top ones (a top one that is the prompt's listed once)."""
    ids = [t for e in entries if e is not None for t in (e.token_id, *(t for t, _ in e.top))]
    texts = dict(zip(ids, tokenizer.token_texts(ids))) if tokenizer is not None and ids else {}
    out: list[dict | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        position = {}
        for rank, (token_id, logprob) in [(e.rank, (e.token_id, e.logprob)), *enumerate(e.top, 1)]:
            entry = position.setdefault(str(token_id), {"logprob": _safe(logprob), "rank": rank,
                                                        "decoded_token": texts.get(token_id, f"token_id:{token_id}")})
            entry["rank"] = entry["rank"] or rank  # a data plane that gives no rank: the top's place, if there
        out.append(position)
    return out


def _token_name(tokenizer: Tokenizer | None, token_id: int) -> tuple[str, bytes]:
    """A token's name in log-probabilities, and its bytes: its text, or "token_id:<id>" without a tokenizer (and
    with return_tokens_as_token_ids); a token that holds part of a character is named by its bytes, as OpenAI's
    ("bytes:\\xe2\\x80"), so that such tokens do not all share the name of a replacement character."""
    text = _token_text(tokenizer, token_id)
    raw = tokenizer.logprob_bytes(token_id, text) if tokenizer is not None else text.encode()
    return (text if raw == text.encode() else "bytes:" + "".join(f"\\x{b:02x}" for b in raw)), raw


class TextOffsets:
    """Completions' text_offset of one choice's tokens, in order: where each begins in the text, in characters;
    a character whose bytes span several tokens counts once it is whole."""

    def __init__(self) -> None:
        self.chars = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def take(self, raw: bytes) -> int:
        """The offset of the next token, whose bytes are raw."""
        offset = self.chars
        self.chars += len(self._decoder.decode(raw))
        return offset


def logprobs_json(chat: bool, entries: list[TokenLogprobs], tokenizer: Tokenizer | None,
                  offsets: TextOffsets | None = None) -> dict:
    """Chat: {content: [...]}; completions: the legacy columns, text_offset from offsets (a stream's, which
    goes on from the tokens before these; else the text starts with them)."""
    if chat:
        def token(token_id: int, logprob: float) -> dict:
            name, raw = _token_name(tokenizer, token_id)
            return {"token": name, "logprob": _safe(logprob), "bytes": list(raw)}
        return {"content": [{**token(e.token_id, e.logprob), "top_logprobs": [token(t, lp) for t, lp in e.top]}
                            for e in entries]}
    offsets = offsets or TextOffsets()
    names = [_token_name(tokenizer, e.token_id) for e in entries]
    # an echoed prompt's first token has no log-probability (logprob None): null, as its top tokens. The token
    # itself comes first among its top ones, as OpenAI's (up to logprobs + 1 of them)
    top = []
    for e, (name, _) in zip(entries, names):
        position = None if e.logprob is None else {name: _safe(e.logprob)}
        for t, lp in e.top if position is not None else ():
            position.setdefault(_token_name(tokenizer, t)[0], _safe(lp))
        top.append(position)
    return {"tokens": [name for name, _ in names],
            "token_logprobs": [None if e.logprob is None else _safe(e.logprob) for e in entries],
            "top_logprobs": top, "text_offset": [offsets.take(raw) for _, raw in names]}
