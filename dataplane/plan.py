"""Plain data-plane view of one step: what to compute, and what came out.

``twinplane.dataplane.convert`` turns the protobuf StepPlan into these objects
(numpy arrays decoded with ``frombuffer``) and a StepOutput back into a
StepResult; nothing past that edge handles generated message classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


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

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def context_len(self) -> int:
        """Tokens in the KV cache once this step has run."""
        return self.start_pos + self.num_tokens


@dataclass
class StepPlan:
    step_id: int
    seqs: list[ScheduledSeq]
    dropped_seq_ids: list[int] = field(default_factory=list)


@dataclass
class StepOutput:
    """Sampled tokens of one step, one per sequence with sample=True, in plan order."""

    step_id: int
    sampled_token_ids: np.ndarray  # int32 [num_sampled]
    sampled_logprobs: np.ndarray | None = None  # float32 [num_sampled], when any asked
    # index among sampled seqs -> (token ids int32 [n], logprobs float32 [n]), most likely first
    top_logprobs: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    prepare_us: int = 0
    execute_us: int = 0
    idle_us: int = 0
