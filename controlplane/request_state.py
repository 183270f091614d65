"""Per-request output handling: stop rules, detokenization, and output deltas."""

from __future__ import annotations

import asyncio
import time

from twinplane.controlplane.api import RequestOutput, TokenLogprobs
from twinplane.controlplane.detokenizer import IncrementalDetokenizer
from twinplane.controlplane.errors import ServiceError
from twinplane.controlplane.metrics import EngineMetrics
from twinplane.controlplane.sequence import FinishReason, Sequence
from twinplane.controlplane.tokenizer import Tokenizer


class RequestState:
    """A sequence plus everything needed to turn its tokens into a stream."""

    def __init__(self, seq: Sequence, tokenizer: Tokenizer | None, eos_token_ids: frozenset[int],
                 max_model_len: int, stream_interval: int, metrics: EngineMetrics, arrival_time: float):
        self.seq = seq
        self.metrics = metrics
        self.arrival_time = arrival_time  # time.monotonic() when the request arrived
        self.first_token_time: float | None = None  # when the first token was streamed
        self.last_token_time = 0.0  # when the latest message with tokens was streamed
        self.stream_interval = stream_interval  # tokens per message (the first and the last may hold fewer)
        params = seq.params
        self.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)
        self.max_model_len = max_model_len
        self.detokenizer = None
        if tokenizer is not None:
            self.detokenizer = IncrementalDetokenizer(
                tokenizer, seq.token_ids, params.skip_special_tokens, params.stop)
        self.outputs: asyncio.Queue[RequestOutput | ServiceError] = asyncio.Queue()
        self.pending = self._new_output()
        self.num_outputs = 0  # output tokens recorded so far
        self.finished = False

    def _new_output(self) -> RequestOutput:
        return RequestOutput(self.seq.request_id)

    def record_token(self, token_id: int, position: int, logprobs: TokenLogprobs | None) -> FinishReason | None:
        """Records a sampled token (already in the sequence, at position).

        Returns why the request ends if a token rule says so (a stop token, or the
        length); cheap, so it runs before the next step is scheduled.
        """
        params, out = self.seq.params, self.pending
        out.token_ids.append(token_id)
        if logprobs is not None and params.logprobs is not None:
            out.logprobs.append(logprobs)
        self.num_outputs = num_outputs = position + 1 - self.seq.num_prompt_tokens
        if token_id in self.stop_ids and num_outputs > params.min_tokens:
            return FinishReason.STOP_TOKEN
        if num_outputs >= params.max_tokens or position + 1 >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def add_text(self, token_id: int, reason: FinishReason | None) -> FinishReason | None:
        """Detokenizes a recorded token and applies stop strings; returns the final reason.

        Runs while the data plane computes the next step, which may then hold one token of
        a request that a stop string ended: that token is discarded.
        """
        if reason is FinishReason.STOP_TOKEN or self.detokenizer is None:
            return reason  # a stop token's text is never part of the output
        self.detokenizer.add_token(token_id)
        params = self.seq.params
        if params.stop and self.num_outputs > params.min_tokens:
            matched = self.detokenizer.find_stop()
            if matched is not None:
                self.pending.matched_stop = matched
                return FinishReason.STOP_STRING
        return reason

    def emit(self, finish_reason: FinishReason | None = None) -> None:
        """Pushes what is pending to the stream; the last output carries the usage."""
        out = self.pending
        if self.detokenizer is not None:
            out.text += self.detokenizer.take_text(final=finish_reason is not None)
        if finish_reason is None and len(out.token_ids) < self.stream_interval and self.first_token_time is not None:
            return  # fewer new tokens than one message carries (the first token never waits)
        if finish_reason is not None:
            seq = self.seq
            out.finish_reason = finish_reason
            out.prompt_tokens = seq.num_prompt_tokens
            out.completion_tokens = seq.num_output_tokens
            out.cached_prompt_tokens = seq.num_cached_tokens
            self.finished = True
        if out.token_ids:
            self._count_streamed(len(out.token_ids))
        self.outputs.put_nowait(out)
        self.pending = self._new_output()

    def _count_streamed(self, num_tokens: int) -> None:
        """Times a message of num_tokens tokens: the first one gives the time to first token, each
        later one num_tokens inter-token latencies of (time since the previous message) / num_tokens."""
        metrics, now = self.metrics, time.monotonic()
        if self.first_token_time is None:
            self.first_token_time = now
            metrics.prompt_tokens += self.seq.num_prompt_tokens
            metrics.time_to_first_token.observe(now - self.arrival_time)
        else:
            metrics.inter_token_latency.observe((now - self.last_token_time) / num_tokens, num_tokens)
        self.last_token_time = now
        metrics.generation_tokens += num_tokens

    def summary(self, outcome: str) -> str:
        """The request's one log line, written when it ends."""
        seq, now = self.seq, time.monotonic()
        ttft = "-" if self.first_token_time is None else f"{self.first_token_time - self.arrival_time:.4f}s"
        return (f"request finished: id={seq.request_id!r} reason={outcome} prompt_tokens={seq.num_prompt_tokens} "
                f"output_tokens={seq.num_output_tokens} cached_tokens={seq.num_cached_tokens} "
                f"ttft={ttft} total={now - self.arrival_time:.4f}s")

    def fail(self, error: ServiceError) -> None:
        self.finished = True
        self.outputs.put_nowait(error)
