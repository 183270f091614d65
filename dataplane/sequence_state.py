"""The data plane's per-sequence mirror and the checks a StepPlan must pass.

The control plane owns every request; the data plane keeps, per seq_id, only what a step
needs: the block table (grown by each step's ``new_block_ids``), the token history (filled
from each step's ``token_ids`` at their positions; -1 where never seen, e.g. prefix-cached
tokens), and the sampling parameters from ``SequenceInit``. ``check_plan`` validates a whole
plan before anything is mutated, so a bad plan fails its step with ValueError and leaves
the mirrors as they were.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from twinplane.dataplane.plan import SamplingParams, ScheduledSeq, SequenceInit, StepPlan


@dataclass(frozen=True)
class PlanLimits:
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_logprobs: int


@dataclass
class SequenceMirror:
    sampling: SamplingParams
    num_prompt_tokens: int
    block_table: list[int]
    tokens: np.ndarray  # int32 [max_model_len]; -1 = not seen by the data plane


def _fail(seq_id: int, message: str) -> None:
    raise ValueError(f"seq {seq_id}: {message}")


def check_sampling(seq_id: int, init: SequenceInit, limits: PlanLimits) -> None:
    """Reject sampling parameters the sampler cannot honour."""
    p = init.sampling
    problems = [
        (init.num_prompt_tokens >= 0, f"num_prompt_tokens {init.num_prompt_tokens} < 0"),
        (p.temperature >= 0.0, f"temperature {p.temperature} < 0"),
        (0.0 < p.top_p <= 1.0, f"top_p {p.top_p} not in (0, 1]"),
        (0.0 <= p.min_p <= 1.0, f"min_p {p.min_p} not in [0, 1]"),
        (p.repetition_penalty > 0.0, f"repetition_penalty {p.repetition_penalty} <= 0"),
        (p.num_logprobs <= limits.max_logprobs, f"num_logprobs {p.num_logprobs} > {limits.max_logprobs}"),
        (all(0 <= t < limits.vocab_size for t in p.stop_token_ids), "stop_token_ids outside the vocabulary"),
    ]
    for ok, message in problems:
        if not ok:
            _fail(seq_id, message)


def _check_arrays(seq: ScheduledSeq, limits: PlanLimits) -> None:
    n = seq.num_tokens
    if seq.token_ids.ndim != 1 or n == 0:
        _fail(seq.seq_id, "token_ids must be a non-empty 1-D array")
    if seq.slot_mapping.shape != (n,):
        _fail(seq.seq_id, f"slot_mapping has shape {seq.slot_mapping.shape}, expected ({n},)")
    if seq.token_ids.min() < 0 or seq.token_ids.max() >= limits.vocab_size:
        _fail(seq.seq_id, f"token ids must be in [0, {limits.vocab_size})")
    if seq.start_pos < 0 or seq.context_len > limits.max_model_len:
        _fail(seq.seq_id, f"positions [{seq.start_pos}, {seq.context_len}) exceed max_model_len {limits.max_model_len}")
    blocks = seq.new_block_ids
    if blocks.size and (blocks.min() < 0 or blocks.max() >= limits.num_kv_blocks):
        _fail(seq.seq_id, f"new_block_ids must be in [0, {limits.num_kv_blocks})")


def _check_slots(seq: ScheduledSeq, block_table: np.ndarray, block_size: int) -> None:
    """Each slot is -1 or the slot the block table gives its position."""
    needed = -(-seq.context_len // block_size)
    if block_table.shape[0] < needed:
        _fail(seq.seq_id, f"block table has {block_table.shape[0]} blocks, {seq.context_len} tokens need {needed}")
    positions = np.arange(seq.start_pos, seq.context_len)
    expected = block_table[positions // block_size].astype(np.int64) * block_size + positions % block_size
    slots = seq.slot_mapping.astype(np.int64)
    if not np.all((slots == -1) | (slots == expected)):
        _fail(seq.seq_id, "slot_mapping disagrees with the block table (slot = block_id * block_size + offset)")


class SequenceTable:
    """seq_id -> SequenceMirror."""

    def __init__(self, limits: PlanLimits) -> None:
        self.limits = limits
        self.mirrors: dict[int, SequenceMirror] = {}

    def __len__(self) -> int:
        return len(self.mirrors)

    def reset(self) -> None:
        self.mirrors.clear()

    def drop(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self.mirrors.pop(seq_id, None)

    def check_plan(self, plan: StepPlan) -> None:
        """Raise ValueError if ``plan`` (applied after its drops) is not executable."""
        limits = self.limits
        if len(plan.seqs) > limits.max_num_seqs:
            raise ValueError(f"plan has {len(plan.seqs)} sequences, max_num_seqs is {limits.max_num_seqs}")
        num_tokens = sum(s.num_tokens for s in plan.seqs)
        if num_tokens > limits.max_num_batched_tokens:
            raise ValueError(f"plan has {num_tokens} tokens, max_num_batched_tokens is {limits.max_num_batched_tokens}")
        seq_ids = [s.seq_id for s in plan.seqs]
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("plan schedules a seq_id more than once")
        dropped = set(plan.dropped_seq_ids)
        for seq in plan.seqs:
            self._check_seq(seq, None if seq.seq_id in dropped else self.mirrors.get(seq.seq_id))

    def _check_seq(self, seq: ScheduledSeq, mirror: SequenceMirror | None) -> None:
        if seq.init is None and mirror is None:
            _fail(seq.seq_id, "unknown to the data plane and sent without SequenceInit "
                              "(send the init again, e.g. after a data-plane restart)")
        _check_arrays(seq, self.limits)
        if seq.init is not None:
            check_sampling(seq.seq_id, seq.init, self.limits)
        known = [] if seq.init is not None or mirror is None else mirror.block_table
        block_table = np.concatenate([np.asarray(known, dtype=np.int64), seq.new_block_ids.astype(np.int64)])
        _check_slots(seq, block_table, self.limits.block_size)
        num_prompt = seq.init.num_prompt_tokens if seq.init is not None else mirror.num_prompt_tokens  # type: ignore[union-attr]
        if seq.sample and seq.context_len < num_prompt:
            _fail(seq.seq_id, f"sample=True before the prompt is complete ({seq.context_len} < {num_prompt} tokens)")

    def apply(self, seq: ScheduledSeq) -> SequenceMirror:
        """Create (on init) or update the mirror of a checked ScheduledSeq."""
        if seq.init is not None:
            tokens = np.full(self.limits.max_model_len, -1, dtype=np.int32)
            prior = seq.init.prior_token_ids
            if prior is not None:
                tokens[:min(len(prior), seq.start_pos)] = prior[:seq.start_pos]
            self.mirrors[seq.seq_id] = SequenceMirror(seq.init.sampling, seq.init.num_prompt_tokens, [], tokens)
        mirror = self.mirrors[seq.seq_id]
        mirror.block_table.extend(int(b) for b in seq.new_block_ids)
        mirror.tokens[seq.start_pos:seq.context_len] = seq.token_ids
        return mirror
