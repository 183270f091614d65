"""The choices of one OpenAI request as engine requests, and their outputs as OpenAI JSON objects.

Each choice is an engine request of its own with its prompt (a completion may send a batch of
prompts, n choices each). The first choice of each prompt goes at once; the others are added once
its first token is out, when its prompt's full blocks are in the prefix cache, so they share those
blocks instead of computing the prompt again. With echo, a choice's first output starts with its
prompt, and with logprobs too its log-probabilities start with the prompt's; with max_tokens 0, that
is all it shows. With prompt_logprobs, every choice's first output carries the prompt's. The first
choice of each prompt computes them for all of them.

The choices' outputs pass through a queue of one slot per choice: what a slow client has not read
stays with the engine, which merges it and ends the streams that fall too far behind
(``max_unsent_tokens_per_stream``, ``max_unsent_tokens``), as for gRPC streams.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from twinplane.controlplane.api import GenerateCall, RequestOutput, TokenLogprobs
from twinplane.controlplane.chat_text import CallDelta, ChatText
from twinplane.controlplane.engine import Engine
from twinplane.controlplane.errors import InvalidRequest
from twinplane.controlplane.openai_api import (OpenAIRequest, TextOffsets, finish_reason, logprobs_json,
                                               prompt_logprobs_json, usage_json)
from twinplane.controlplane.request_state import RequestState
from twinplane.controlplane.sequence import FinishReason
from twinplane.controlplane.tools import ToolCall


class Choices:
    """The engine requests of one OpenAI request, read as one stream of (choice index, output).

    The first choice of each prompt starts at once; its n - 1 siblings once it has output, when
    the prompt's blocks are in the prefix cache for them to share."""

    def __init__(self, engine: Engine, request: OpenAIRequest):
        self.engine = engine
        self.calls, self.n, self.prompt_only = request.calls, request.n, request.prompt_only
        self.prompt_top = request.prompt_logprobs
        self.echo_top = self.calls[0].params.logprobs if request.echo and request.logprobs else None
        self.states: list[RequestState] = []
        self.tasks: list[asyncio.Task] = []
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=len(self.calls))
        self.finals: list[RequestOutput | None] = [None] * len(self.calls)
        self.started = [False] * len(self.calls)
        # with echo: each choice's prompt as its first output shows it (None before it starts and after that output)
        self.echo: list[str | None] | None = [None] * len(self.calls) if request.echo else None
        self.fresh = [True] * len(self.calls)  # no output yet
        # per prompt: its first token and the log-probabilities of the others, once its first choice brings them
        self.first_tokens = [0] * (len(self.calls) // self.n)
        self.arrival_times = [0.0] * (len(self.calls) // self.n)  # per prompt: when its first choice arrived
        self.scored: list[list[TokenLogprobs]] = [[] for _ in range(0, len(self.calls), self.n)]

    async def open(self) -> None:
        """Adds the first choice of every prompt, all or none (raises the engine's ServiceError for a request
        it refuses). The room for every choice is checked here: the others, added once the first has cached
        the prompt, are not refused part way."""
        self.engine.check_room(len(self.calls))
        if self.echo is not None and self.engine.tokenizer is None and any(map(_echoes_tokens, self.calls)):
            raise InvalidRequest("echo needs the model's tokenizer to show a prompt of token ids; this server has none")
        firsts = range(0, len(self.calls), self.n)
        states = await self.engine.add_all([self.calls[index] for index in firsts], room_checked=True)
        self.states.extend(states)
        try:
            for index, state in zip(firsts, states):
                await self._start(index, state)
        except BaseException:
            self.close()
            raise

    async def _start(self, index: int, state: RequestState) -> None:
        """A choice whose request is added (and in self.states): pumps its outputs."""
        self.started[index] = True
        if index % self.n == 0:
            self.arrival_times[index // self.n] = state.arrival_time
        self.first_tokens[index // self.n] = state.prompt[0]
        if self.echo is not None:
            self.echo[index] = await self._prompt_text(self.calls[index], state.prompt)
        self.tasks.append(asyncio.create_task(self._pump(index, state)))

    async def _add_sibling(self, index: int) -> None:
        # a prompt's later choices arrived with the first: their times to the first token and to the end count
        # from then, as the client sees them (and as vLLM times a request's choices)
        state = await self.engine.add(self.calls[index], room_checked=True,
                                      arrival_time=self.arrival_times[index // self.n])
        self.states.append(state)
        await self._start(index, state)

    async def _prompt_text(self, call: GenerateCall, token_ids: list[int]) -> str:
        """The prompt as echoed: a text prompt as sent, else (token ids, or a truncated text) the
        text of the tokens the model was given (``open`` has checked there is a tokenizer for it)."""
        if not _echoes_tokens(call):
            return call.prompt.text
        return await self.engine.in_tokenizer_pool(self.engine.tokenizer.decode, token_ids, False)

    async def _pump(self, index: int, state: RequestState) -> None:
        try:
            async for out in self.engine.outputs(state):
                await self.queue.put((index, out))
        except Exception as exc:  # noqa: BLE001 -- handed to the reader, which raises it
            await self.queue.put((index, exc))

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        remaining = len(self.calls)
        try:
            while remaining:
                index, out = await self.queue.get()
                if isinstance(out, Exception):
                    raise out
                if index % self.n == 0 and not self.started[index + self.n - 1]:  # the prompt's blocks are cached now
                    for sibling in range(index + 1, index + self.n):
                        await self._add_sibling(sibling)
                if out.prompt_logprobs is not None:  # the first output of a prompt's first choice
                    self.scored[index // self.n] = out.prompt_logprobs[1:]
                if self.fresh[index]:
                    self.fresh[index] = False
                    self._first(index, out)
                if out.finish_reason is not None:
                    self.finals[index] = out
                    remaining -= 1
                yield index, out
        finally:
            self.close()

    def _first(self, index: int, out: RequestOutput) -> None:
        """A choice's first output: with prompt_logprobs, the prompt's; with echo, its prompt first, and the
        prompt's log-probabilities first with logprobs (its first token's null); with max_tokens 0, the
        prompt alone."""
        scored = self.scored[index // self.n]
        out.prompt_logprobs = None if self.prompt_top is None else [None, *_top(scored, self.prompt_top)]
        if self.echo is None:
            return
        if self.prompt_only:  # its one output: the token drawn after the prompt is not shown
            out.text, out.token_ids, out.logprobs, out.matched_stop = "", [], [], ""
            out.finish_reason, out.completion_tokens = FinishReason.LENGTH, 0
        out.text, self.echo[index] = self.echo[index] + out.text, None
        if self.echo_top is not None:
            first = TokenLogprobs(self.first_tokens[index // self.n], None)
            out.logprobs = [first, *_top(scored, self.echo_top), *out.logprobs]

    def close(self) -> None:
        """Aborts what still runs (a client that went away, an error): frees the blocks now."""
        for task in self.tasks:
            task.cancel()
        for state in self.states:
            self.engine.abort(state)

    async def aclose(self) -> None:
        """``close`` as a response's background task, which runs a plain function on a worker thread."""
        self.close()

    def usage(self) -> dict:
        """Once every choice has finished."""
        return usage_json(self.finals, self.n)


def _echoes_tokens(call: GenerateCall) -> bool:
    """Whether echo shows the call's prompt as the text of its tokens (token ids, or a truncated text), which
    needs the tokenizer, rather than as the text sent."""
    return call.prompt.text is None or bool(call.truncate_prompt_tokens)


def _top(entries: list[TokenLogprobs], k: int) -> list[TokenLogprobs]:
    """entries with their k most likely tokens (the prompt's are computed for the most any view asks)."""
    return [replace(e, top=e.top[:k]) if len(e.top) > k else e for e in entries]


def tool_finish_reason(out: RequestOutput, text: ChatText, named: bool) -> str | None:
    """"tool_calls" once the model stopped after calling tools, unless the request named the function to call
    ("stop" then, as OpenAI's and vLLM's)."""
    reason = finish_reason(out)
    return "tool_calls" if reason == "stop" and text.calls and not named else reason


def stop_reason(out: RequestOutput, stop_token_ids: tuple[int, ...]) -> str | int | None:
    """vLLM's stop_reason of a choice's last output: the stop string that ended it, or the token of
    stop_token_ids that did; None for the model's end of sequence, the length, or a choice not ended."""
    if out.finish_reason is FinishReason.STOP_STRING:
        return out.matched_stop
    if out.finish_reason is FinishReason.STOP_TOKEN and out.token_ids and out.token_ids[-1] in stop_token_ids:
        return out.token_ids[-1]
    return None


def _call_delta(delta: CallDelta) -> dict:
    """A stream chunk's entry for what a piece adds to a tool call: the call's id and name with its first."""
    if delta.begins:
        return {"index": delta.index, "id": delta.call.id, "type": "function",
                "function": {"name": delta.call.name, "arguments": delta.arguments}}
    return {"index": delta.index, "function": {"arguments": delta.arguments}}


class ResponseBuilder:
    """OpenAI JSON for one request: stream chunks as outputs come, or the whole response at the end."""

    def __init__(self, request: OpenAIRequest, response_id: str, model: str, tokenizer,
                 reasoning_parser: str | None = None, tool_call_parser: str | None = None):
        """reasoning_parser: split chat text into reasoning (and reasoning_content) and content (``reasoning.py``);
        tool_call_parser: find the tool calls in it when the request lets the model call tools (``tools.py``)."""
        self.request = request
        self.id, self.model, self.tokenizer = response_id, model, tokenizer
        # what names the tokens in logprobs: their text, or "token_id:<id>" without a tokenizer
        self.token_names = None if request.tokens_as_ids else tokenizer
        self.created = int(time.time())
        n = len(request.calls)
        self.reasoning_parser = reasoning_parser if request.chat else None
        self.tool_call_parser = tool_call_parser if request.tools.parse else None
        self.parts = [ChatText(self.reasoning_parser, self.tool_call_parser, request.tools.parallel,
                               bool(request.tools.forced), tokenizer) for _ in range(n)] if request.chat else None
        self.texts = [""] * n  # the whole response's text (chat: its content)
        self.reasonings = [""] * n  # chat: the whole response's reasoning
        self.calls: list[list[ToolCall]] = [[] for _ in range(n)]  # chat: the whole response's tool calls
        self.logprobs: list[list] = [[] for _ in range(n)]
        self.prompt_logprobs: list[list | None] = [None] * n  # with prompt_logprobs: each choice's prompt's
        self.finals: list[RequestOutput | None] = [None] * n  # each choice's last output
        self.started = [False] * n
        self.offsets = [TextOffsets() for _ in range(n)]  # streamed completions' text_offset, choice by choice

    def _object(self, chunk: bool) -> dict:
        kind = ("chat.completion" if self.request.chat else "text_completion") + (".chunk" if chunk and
                                                                                  self.request.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _logprobs(self, index: int, out: RequestOutput) -> dict | None:
        if not self.request.logprobs:
            return None
        # offsets as in the whole response, not from the text sent (which may wait)
        return logprobs_json(self.request.chat, out.logprobs, self.token_names, self.offsets[index])

    def chunks(self, index: int, out: RequestOutput) -> list[dict]:
        """The stream chunks of one output of choice index: in chat, a choice's first output comes after a
        chunk of its role alone (as OpenAI's and vLLM's streams begin each choice). A chat output with nothing
        to show (text a reasoning or tool-call parser holds back, reasoning with include_reasoning false) has
        no chunk unless it ends the choice or carries logprobs, as in vLLM's streams; with echo, the role's chunk
        is followed by one of the echoed content."""
        first = []
        if self.request.chat and not self.started[index]:  # with echo, a chunk of the echoed content next
            deltas = [{"role": self.request.role, "content": ""}]
            if self.request.echoed:
                deltas.append({"content": self.request.echoed})
            first = [self._chunk({"index": index, "delta": delta, "logprobs": None, "finish_reason": None},
                                 out.prompt_tokens, 0) for delta in deltas]
        choice = self._choice(index, out)
        return first + ([] if choice is None else [self._chunk(choice, out.prompt_tokens, out.completion_tokens)])

    def _chunk(self, choice: dict, prompt_tokens: int, completion_tokens: int) -> dict:
        """A stream chunk of choice; with continuous_usage_stats, the counts of that choice so far (vLLM's)."""
        chunk = {**self._object(True), "choices": [choice]}
        if self.request.continuous_usage:
            chunk["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                              "total_tokens": prompt_tokens + completion_tokens}
        elif self.request.include_usage:
            chunk["usage"] = None
        return chunk

    def _choice(self, index: int, out: RequestOutput) -> dict | None:
        """The choice of one output of choice index, in a stream chunk (None: no chunk)."""
        self.started[index] = True
        choice = {"index": index, "logprobs": self._logprobs(index, out)}
        if self.request.chat:
            reasoning, content, calls = self.parts[index].take(out)
            deltas = [d for d in self.parts[index].deltas(calls) if d.adds]
            reason = tool_finish_reason(out, self.parts[index], self.request.tools.named)
            if not self.request.include_reasoning:
                reasoning = ""
            if not (reasoning or content or deltas or reason or (self.request.logprobs and out.logprobs)):
                return None  # nothing to show yet: text a parser holds back, or reasoning not shown
            delta = {}
            if reasoning:  # under vLLM's name and under the one DeepSeek's clients read
                delta["reasoning"] = delta["reasoning_content"] = reasoning
            if content or not (reasoning or deltas):
                delta["content"] = content
            if deltas:
                delta["tool_calls"] = [_call_delta(d) for d in deltas]
            choice["delta"], choice["finish_reason"] = delta, reason
        else:
            choice["text"], choice["finish_reason"] = out.text, finish_reason(out)
        if choice["finish_reason"] is not None:  # the choice's last chunk (vLLM's leave it out before)
            choice["stop_reason"] = stop_reason(out, self.request.calls[index].params.stop_token_ids)
        return choice

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._object(True), "choices": [], "usage": self._usage(usage)}

    def _usage(self, usage: dict) -> dict:
        """With a reasoning parser: the completion tokens that were reasoning, all choices together."""
        if not self.reasoning_parser:
            return usage
        return {**usage, "completion_tokens_details": {
            "reasoning_tokens": sum(part.reasoning_tokens for part in self.parts)}}

    def add(self, index: int, out: RequestOutput) -> None:
        """Collects an output of choice index for the whole response (chat: split as a chunk's is)."""
        self.logprobs[index] += out.logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[index] = out.prompt_logprobs
        text = out.text
        if self.request.chat:
            reasoning, text, calls = self.parts[index].take(out)
            self.reasonings[index] += reasoning
            self.calls[index] += calls
        self.texts[index] += text
        if out.finish_reason is not None:
            self.finals[index] = out

    def response(self, usage: dict) -> dict:
        choices = []
        for i, text in enumerate(self.texts):
            logprobs = None
            if self.request.logprobs:
                logprobs = logprobs_json(self.request.chat, self.logprobs[i], self.token_names)
            choice = {"index": i, "logprobs": logprobs}
            if self.request.chat:
                calls = self.calls[i]
                text = self.request.echoed + text
                message = {"role": self.request.role, "content": text if text or not calls else None}
                if self.reasoning_parser and self.request.include_reasoning:
                    message["reasoning"] = message["reasoning_content"] = self.reasonings[i] or None
                if calls:
                    message["tool_calls"] = [call.json() for call in calls]
                choice["message"] = message
                choice["finish_reason"] = tool_finish_reason(self.finals[i], self.parts[i], self.request.tools.named)
            else:
                choice["text"], choice["finish_reason"] = text, finish_reason(self.finals[i])
                if self.request.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(self.prompt_logprobs[i], self.tokenizer)
            choice["stop_reason"] = stop_reason(self.finals[i], self.request.calls[i].params.stop_token_ids)
            choices.append(choice)
        response = {**self._object(False), "choices": choices, "usage": self._usage(usage)}
        if self.request.chat and self.request.prompt_logprobs is not None:  # one prompt: beside the choices
            response["prompt_logprobs"] = prompt_logprobs_json(self.prompt_logprobs[0], self.tokenizer)
        return response
