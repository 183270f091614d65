"""A request's tokens and state: the only copy of them in the whole system."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass

# Stands in the token list for a token a step in flight is sampling; the data plane feeds
# that step's sampled token back as the next input, and the result replaces it here.
PENDING = -1
GREEDY_BELOW = 1e-5  # a lower temperature samples greedily (as vLLM): dividing the logits by it could overflow
_ARRIVALS = itertools.count()  # the order sequences are created in: first come, first served


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds KV blocks and is scheduled every step
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP_TOKEN = "stop_token"
    STOP_STRING = "stop_string"
    LENGTH = "length"
    ABORTED = "aborted"


@dataclass(frozen=True)
class SamplingOptions:
    """How to draw tokens; defaults turn every option off except temperature 1."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True)
class RequestParams:
    """Everything about a request except its prompt, already validated."""

    max_tokens: int
    sampling: SamplingOptions = SamplingOptions()
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None = none; n = the sampled token's plus the top n
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), ascending ids
    include_stop_str_in_output: bool = False  # the stop string that ends the text stays in it
    priority: int = 0  # with scheduling by priority: lower runs first
    regex: str | None = None  # structured output: the text must match it (structured.py)
    prompt_logprobs: int | None = None  # None = none; n = each prompt token's (after the first) plus the top n
    allowed_token_ids: tuple[int, ...] = ()  # the only tokens it may sample; () = any
    bad_words: tuple[str, ...] = ()  # words it may not write (their tokens: bad_words_ids, found by the frontend)
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    max_tokens_unset: bool = False  # the client sent none: max_tokens is what fitted (lowered if that shrinks)

    @property
    def plain_sampling(self) -> bool:
        """Temperature, top-k, top-p and min-p only (no penalties, seed, logprobs, min_tokens, logit
        bias or structured output): what a plan of several decode steps allows."""
        return (not self.sampling.has_penalties and self.sampling.seed is None and self.logprobs is None
                and self.min_tokens == 0 and not self.logit_bias and not self.constrained)

    @property
    def constrained(self) -> bool:
        """Something beyond sampling decides which tokens it may sample: structured output,
        allowed_token_ids or bad_words (the engine core gives it a matcher)."""
        return self.regex is not None or bool(self.allowed_token_ids) or bool(self.bad_words)


class Sequence:
    """Prompt plus generated tokens, and how far the KV cache has caught up.

    One rule drives prefill, chunked prefill, prefix caching and decode alike:
    the tokens in ``token_ids[num_computed_tokens:]`` still need a forward pass;
    when a step computes up to ``num_tokens``, the model samples the next token.
    Scheduling a step advances ``num_computed_tokens`` at once and, if the step samples,
    appends PENDING, so the next step can be planned before this one's result is back.
    """

    def __init__(self, seq_id: int, request_id: str, prompt_token_ids: list[int], params: RequestParams):
        assert prompt_token_ids, "a sequence needs at least one prompt token"
        self.seq_id = seq_id
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache, or being computed
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first admission
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hash of each full, computed block
        self.num_blocks_mirrored = 0  # block-table entries the data plane already has
        self.mirrored = False  # whether the data plane holds a mirror of this sequence
        self.num_preemptions = 0
        self.scheduled_time: float | None = None  # time.monotonic() when it was first scheduled (it queued till then)
        self.stop_ids: frozenset[int] = frozenset()  # the tokens that end it (finish.stop_token_ids)
        self.matcher = None  # what constrains its tokens: structured.TokenMatcher, FixedTokens, BannedWords or AllOf
        # the prompt's log-probabilities as steps compute them, entry i prompt token i's (entry 0 stays None);
        # None once they went out with the first output token, or when the request wants none
        self.prompt_logprobs: list | None = None if params.prompt_logprobs is None else [None] * len(prompt_token_ids)
        self.arrival = next(_ARRIVALS)

    @property
    def priority_key(self) -> tuple[int, int]:
        """Scheduling by priority: the lower, the sooner (priority, then arrival)."""
        return self.params.priority, self.arrival

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={self.block_table}, status={self.status.value})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def has_pending(self) -> bool:
        """Whether a step in flight is sampling this sequence's last token."""
        return self.token_ids[-1] == PENDING

    def drop_pending(self) -> None:
        """Forgets tokens whose steps will never report back (data plane lost, sequence ended);
        several steps may be in flight, each with one or more."""
        while self.token_ids[-1] == PENDING:
            self.token_ids.pop()

    def forget_kv(self) -> None:
        """Drops every trace of KV state (after preemption or a data-plane reset)."""
        self.num_computed_tokens = 0
        self.block_table = []
        self.block_hashes = []
        self.num_blocks_mirrored = 0
        self.mirrored = False
