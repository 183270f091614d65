"""Plain data-plane view of one step: what to compute, and what came out.

``twinplane.dataplane.convert`` turns the protobuf StepPlan into these objects
(numpy arrays decoded with ``frombuffer``) and a StepOutput back into a
StepResult; nothing past that edge handles generated message classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

MAX_DECODE_STEPS = 64  # most decode steps one plan may ask for


@dataclass(frozen=True)
class SamplingParams:
    """How to draw the next token of one sequence (the data plane's copy)."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # <= 0 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # draw at output position i depends only on (seed, i)
    num_logprobs: int = -1  # -1 = none; n >= 0 = sampled token's + top n
    min_tokens: int = 0  # stop_token_ids are masked while fewer outputs exist
    stop_token_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit before penalties)
    masked: bool = False  # structured output: each plan that samples it brings a mask of allowed tokens

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True)
class SequenceInit:
    """Sent the first time the data plane sees a sequence."""

    sampling: SamplingParams
    num_prompt_tokens: int
    prior_token_ids: np.ndarray | None = None  # tokens before the first chunk, when penalties need them


@dataclass(frozen=True)
class PromptLogprobsAsk:
    """Log-probabilities wanted at the first positions of one sequence's chunk: after its j-th token,
    those of next_token_ids[j] (the prompt token that follows it) and of the num_top most likely."""

    next_token_ids: np.ndarray  # int32 [m], 1 <= m <= the chunk's tokens
    num_top: int = 0


@dataclass
class PromptLogprobs:
    """What one PromptLogprobsAsk gets back, under the model's own distribution."""

    logprobs: np.ndarray  # float32 [m]: of each of the ask's next_token_ids
    top_ids: np.ndarray  # int32 [m, num_top], most likely first
    top_logprobs: np.ndarray  # float32 [m, num_top]
    ranks: np.ndarray  # int32 [m]: 1 + the number of tokens more likely than each next token


@dataclass
class ScheduledSeq:
    """One sequence's share of a step."""

    seq_id: int
    token_ids: np.ndarray  # int32 [n]: prefill chunk, or the last token in decode
    start_pos: int  # position of token_ids[0] = tokens already in the KV cache
    slot_mapping: np.ndarray  # int32 [n]: KV slot of each token (block_id * block_size + offset)
    new_block_ids: np.ndarray  # int32: appended to the sequence's block table
    sample: bool  # sample a token after this chunk
    init: SequenceInit | None = None  # first time only
    decode_budget: int = 1  # tokens to sample in a plan of several decode steps (StepPlan.num_steps)
    prompt_logprobs: PromptLogprobsAsk | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def context_len(self) -> int:
        """Tokens in the KV cache once this step has run."""
        return self.start_pos + self.num_tokens


@dataclass
class PlanColumns:
    """A step as columns (the wire form): entry i of each per-sequence array is sequence i;
    per-token and per-block arrays are those of all sequences concatenated in order."""

    seq_ids: np.ndarray  # int64 [n]
    num_tokens: np.ndarray  # int32 [n]
    start_pos: np.ndarray  # int32 [n]
    token_ids: np.ndarray  # int32 [T]
    slot_mapping: np.ndarray  # int32 [T]
    num_new_blocks: np.ndarray  # int32 [n]
    new_block_ids: np.ndarray  # int32 [sum(num_new_blocks)]
    sample: np.ndarray  # bool [n]
    inits: dict[int, SequenceInit]  # seq_id -> init, for sequences seen for the first time
    decode_budget: np.ndarray | None = None  # int32 [n]: tokens to sample, with num_steps > 1
    # index in seq_ids -> packed bitmask of the tokens that sequence may sample (SamplingParams.masked)
    token_masks: dict[int, bytes] = field(default_factory=dict)
    # index in seq_ids -> the prompt log-probabilities that sequence wants from its chunk
    prompt_logprobs: dict[int, PromptLogprobsAsk] = field(default_factory=dict)

    @classmethod
    def from_seqs(cls, seqs: list[ScheduledSeq]) -> PlanColumns:
        def cat(arrays: list[np.ndarray]) -> np.ndarray:
            return np.concatenate(arrays).astype(np.int32) if arrays else np.empty(0, np.int32)

        return cls(
            seq_ids=np.array([s.seq_id for s in seqs], dtype=np.int64),
            num_tokens=np.array([s.num_tokens for s in seqs], dtype=np.int32),
            start_pos=np.array([s.start_pos for s in seqs], dtype=np.int32),
            token_ids=cat([s.token_ids for s in seqs]),
            slot_mapping=cat([s.slot_mapping for s in seqs]),
            num_new_blocks=np.array([len(s.new_block_ids) for s in seqs], dtype=np.int32),
            new_block_ids=cat([s.new_block_ids for s in seqs]),
            sample=np.array([s.sample for s in seqs], dtype=bool),
            inits={s.seq_id: s.init for s in seqs if s.init is not None},
            decode_budget=np.array([s.decode_budget for s in seqs], dtype=np.int32),
            prompt_logprobs={i: s.prompt_logprobs for i, s in enumerate(seqs) if s.prompt_logprobs is not None},
        )


@dataclass
class StepPlan:
    """One step: built from ScheduledSeq objects (tests, tools) or directly as columns (the server).

    With num_steps K > 1 it is K decode steps: every sequence decodes one token and samples,
    then each sampled token is fed back in, until sequence i has its decode_budget[i] tokens.
    """

    step_id: int
    seqs: list[ScheduledSeq] = field(default_factory=list)
    dropped_seq_ids: list[int] = field(default_factory=list)
    columns: PlanColumns | None = None
    num_steps: int = 1
    masks_follow: bool = False  # its token masks come in a later message (dataplane.proto's masks_follow)

    def cols(self) -> PlanColumns:
        if self.columns is None:
            self.columns = PlanColumns.from_seqs(self.seqs)
        return self.columns


class StepPath(IntEnum):
    """How a step's forward pass ran (the StepPath values of dataplane.proto)."""

    EAGER = 0
    DECODE_GRAPH = 1
    MIXED_GRAPH = 2
    MULTI_DECODE = 3


@dataclass
class StepOutput:
    """Sampled tokens of one step, one per sequence with sample=True, in plan order (with
    num_steps > 1: each sequence's decode_budget tokens, sequences in plan order)."""

    step_id: int
    sampled_token_ids: np.ndarray  # int32 [num_sampled]
    sampled_logprobs: np.ndarray | None = None  # float32 [num_sampled], when any asked
    # index among sampled seqs -> (token ids int32 [n], logprobs float32 [n]), most likely first
    top_logprobs: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)  # by the asks' plan indexes
    prepare_us: int = 0
    launch_us: int = 0  # host time of the whole launch (prepare_us is its first part)
    execute_us: int = 0
    idle_us: int = 0
    path: StepPath = StepPath.EAGER
