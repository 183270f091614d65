"""Per-request output handling in the frontend: detokenization, stop strings, and output deltas."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from twinplane.controlplane.api import RequestOutput, TokenLogprobs
from twinplane.controlplane.detokenizer import IncrementalDetokenizer
from twinplane.controlplane.errors import ServiceError
from twinplane.controlplane.finish import stop_strings_apply
from twinplane.controlplane.metrics import EngineMetrics
from twinplane.controlplane.sequence import FinishReason, RequestParams
from twinplane.controlplane.tokenizer import Tokenizer


class Unsent:
    """Tokens queued for streams and not sent yet, over every stream, and the streams still being read."""

    def __init__(self) -> None:
        self.total = 0
        self.streams: set[RequestState] = set()

    def furthest_behind(self) -> RequestState:
        return max(self.streams, key=lambda state: state.unsent)


class RequestState:
    """A request as the frontend sees it (the engine core holds its Sequence), and its stream."""

    def __init__(self, seq_id: int, request_id: str, prompt: list[int], params: RequestParams,
                 tokenizer: Tokenizer | None, stream_interval: int, metrics: EngineMetrics, arrival_time: float,
                 unsent: Unsent):
        self.seq_id = seq_id  # the engine core's name for it
        self.request_id = request_id  # as logs name it: with its choice after a dash when it has several
        self.prompt = prompt
        self.params = params
        self.num_prompt_tokens = len(prompt)
        self.output_ids: list[int] = []  # every token recorded so far
        self.num_cores = 0  # engine cores it was sent to (a new one gets it after a core dies)
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache (the core says)
        self.metrics = metrics
        self.arrival_time = arrival_time  # time.monotonic() when the request arrived
        self.first_token_time: float | None = None  # when the first token was streamed
        self.scheduled_time: float | None = None  # when the engine core first scheduled it (time.monotonic())
        self.last_token_time = 0.0  # when the latest message with tokens was streamed
        self.stream_interval = stream_interval  # tokens per message (the first and the last may hold fewer)
        self.detokenizer = None
        if tokenizer is not None:
            self.detokenizer = IncrementalDetokenizer(tokenizer, prompt, params.skip_special_tokens, params.stop,
                                                      params.include_stop_str_in_output)
        self.outputs: deque[RequestOutput | ServiceError] = deque()  # queued for the stream, not sent yet
        self._queued = asyncio.Event()  # set while outputs is not empty
        self.unsent = 0  # tokens in outputs
        self.all_unsent = unsent
        unsent.streams.add(self)
        self.end_call: Callable[[ServiceError], None] | None = None  # ends the call at once (set by the server)
        self.pending = self._new_output()
        # where the prompt leaves a reasoning model's text (reasoning.py); structured output's grammar reads the
        # text as the parser does by default (structured.after_reasoning), so its split does too
        self.pending.prompt_ids = prompt if params.regex is None else None
        self.num_outputs = 0  # output tokens recorded so far
        self.finished = False

    def _new_output(self) -> RequestOutput:
        return RequestOutput(self.request_id)

    def record_token(self, token_id: int, position: int, logprobs: TokenLogprobs | None, num_cached: int) -> None:
        """Records a token the core sampled at position."""
        out = self.pending
        out.token_ids.append(token_id)
        self.output_ids.append(token_id)
        if logprobs is not None and self.params.logprobs is not None:
            out.logprobs.append(logprobs)
        self.num_outputs = position + 1 - self.num_prompt_tokens
        self.num_cached_tokens = num_cached

    def add_text(self, token_id: int, reason: FinishReason | None) -> FinishReason | None:
        """Detokenizes a recorded token and applies the stop-string rule (``finish.py``); returns the
        final reason. At the last token (reason set), the text that waited for a later token (half a
        character) is added too, and looked at for stop strings even when a stop token ends the request.

        Runs while the data plane computes the next step, which may then hold one token of
        a request that a stop string ended: that token is discarded.
        """
        if self.detokenizer is None:
            return reason
        if reason is not FinishReason.STOP_TOKEN or self.params.include_stop_str_in_output:
            self.detokenizer.add_token(token_id)  # a stop token's text only when the client keeps stops
        if reason is not None:  # the last token: no later one completes a character
            self.detokenizer.flush()
        if stop_strings_apply(self.num_outputs, self.params):
            matched = self.detokenizer.find_stop()
            if matched is not None:
                self.pending.matched_stop = matched
                return FinishReason.STOP_STRING
        return reason

    def emit(self, finish_reason: FinishReason | None = None) -> None:
        """Pushes what is pending to the stream; each output carries the token counts so far (the OpenAI API's
        continuous_usage_stats), the last one the usage."""
        out = self.pending
        if self.detokenizer is not None:
            out.text += self.detokenizer.take_text(final=finish_reason is not None)
        if finish_reason is None and len(out.token_ids) < self.stream_interval and self.first_token_time is not None:
            return  # fewer new tokens than one message carries (the first token never waits)
        out.prompt_tokens, out.completion_tokens = self.num_prompt_tokens, self.num_outputs
        if finish_reason is not None:
            out.finish_reason = finish_reason
            out.cached_prompt_tokens = self.num_cached_tokens
            self.finished = True
        if out.token_ids:
            self._count_streamed(len(out.token_ids))
        self.push(out, len(out.token_ids))
        self.pending = self._new_output()

    def push(self, item: RequestOutput | ServiceError, num_tokens: int = 0) -> None:
        self.outputs.append(item)
        self._queued.set()
        self.unsent += num_tokens
        self.all_unsent.total += num_tokens

    async def next_output(self) -> RequestOutput:
        """The next output, with the outputs queued behind it merged in (a stream that fell behind
        catches up with fewer, larger messages); raises the request's error once it comes next."""
        while not self.outputs:
            self._queued.clear()
            await self._queued.wait()
        item = self.outputs.popleft()
        if isinstance(item, Exception):
            raise item
        while self.outputs and item.finish_reason is None and not isinstance(self.outputs[0], Exception):
            item.absorb(self.outputs.popleft())
        self._sent(len(item.token_ids))
        return item

    def _sent(self, num_tokens: int) -> None:
        self.unsent -= num_tokens
        self.all_unsent.total -= num_tokens

    def stream_closed(self) -> None:
        """The call ended: nothing queued is sent any more."""
        self.outputs.clear()
        self._sent(self.unsent)
        self.all_unsent.streams.discard(self)

    def _count_streamed(self, num_tokens: int) -> None:
        """Times a message of num_tokens tokens: the first one gives the time to first token, each
        later one num_tokens inter-token latencies of (time since the previous message) / num_tokens."""
        metrics, now = self.metrics, time.monotonic()
        if self.first_token_time is None:
            self.first_token_time = now
            metrics.prompt_tokens += self.num_prompt_tokens
            metrics.time_to_first_token.observe(now - self.arrival_time)
        else:
            metrics.inter_token_latency.observe((now - self.last_token_time) / num_tokens, num_tokens)
        self.last_token_time = now
        metrics.generation_tokens += num_tokens

    def summary(self, outcome: str) -> str:
        """The request's one log line, written when it ends."""
        now = time.monotonic()
        ttft = "-" if self.first_token_time is None else f"{self.first_token_time - self.arrival_time:.4f}s"
        return (f"request finished: id={self.request_id!r} reason={outcome} prompt_tokens={self.num_prompt_tokens} "
                f"output_tokens={self.num_outputs} cached_tokens={self.num_cached_tokens} "
                f"ttft={ttft} total={now - self.arrival_time:.4f}s")

    def fail(self, error: ServiceError) -> None:
        self.finished = True
        self.push(error)

    def end_unread(self, error: ServiceError) -> None:
        """Drops what the client left unread and ends its call with error."""
        self.stream_closed()
        self.fail(error)
        if self.end_call is not None:
            self.end_call(error)
