"""Shared helpers for the data-plane tests: a minimal block allocator that builds StepPlans.

No tests live here; it plays the control plane's part (blocks, slots, start positions)
just far enough to drive ModelRunner.step by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from twinplane.dataplane.plan import SamplingParams, ScheduledSeq, SequenceInit

GREEDY = SamplingParams(temperature=0.0)


@dataclass
class DrivenSeq:
    seq_id: int
    tokens: list[int]  # prompt, then generated tokens as they come
    num_prompt_tokens: int
    sampling: SamplingParams = GREEDY
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    sent_blocks: int = 0
    initialised: bool = False


class PlanBuilder:
    """Hands out KV blocks in order and turns "compute n more tokens" into ScheduledSeqs."""

    def __init__(self, block_size: int, first_block: int = 0) -> None:
        self.block_size = block_size
        self.next_block = first_block

    def new_seq(self, seq_id: int, prompt: list[int], sampling: SamplingParams = GREEDY,
                shared_blocks: list[int] | None = None) -> DrivenSeq:
        """A sequence; ``shared_blocks`` are full prefix blocks already in the cache."""
        seq = DrivenSeq(seq_id, list(prompt), len(prompt), sampling)
        if shared_blocks:
            seq.blocks = list(shared_blocks)
            seq.num_computed = len(shared_blocks) * self.block_size
        return seq

    def schedule(self, seq: DrivenSeq, num_tokens: int | None = None, sample: bool = True,
                 decode_budget: int = 1) -> ScheduledSeq:
        """The next ``num_tokens`` uncomputed tokens (all by default) of ``seq``; with a decode
        budget b > 1, its last token and the b - 1 tokens a plan of several decode steps feeds back."""
        start = seq.num_computed
        end = len(seq.tokens) if num_tokens is None else start + num_tokens
        assert start < end <= len(seq.tokens), "nothing to compute"
        while len(seq.blocks) * self.block_size < end + decode_budget - 1:
            seq.blocks.append(self.next_block)
            self.next_block += 1
        positions = np.arange(start, end)
        slots = np.array(seq.blocks, dtype=np.int64)[positions // self.block_size] * self.block_size
        slots += positions % self.block_size
        init = None if seq.initialised else SequenceInit(seq.sampling, seq.num_prompt_tokens)
        new_blocks = np.array(seq.blocks[seq.sent_blocks:], dtype=np.int32)
        seq.sent_blocks, seq.num_computed, seq.initialised = len(seq.blocks), end + decode_budget - 1, True
        return ScheduledSeq(seq_id=seq.seq_id, token_ids=np.array(seq.tokens[start:end], dtype=np.int32),
                            start_pos=start, slot_mapping=slots.astype(np.int32), new_block_ids=new_blocks,
                            sample=sample, init=init, decode_budget=decode_budget)

    def generate(self, runner, seqs: list[DrivenSeq], plans: list[tuple[int, ...]]) -> list[list[int]]:
        """Prefills ``seqs`` in one plan, then runs plans of several decode steps (each sequence's
        budget per plan); returns each sequence's generated tokens."""
        from twinplane.dataplane.plan import StepPath, StepPlan

        out = runner.step(StepPlan(0, [self.schedule(s) for s in seqs]))
        for s, token in zip(seqs, out.sampled_token_ids.tolist()):
            s.tokens.append(token)
        for step, budgets in enumerate(plans, start=1):
            out = runner.step(StepPlan(step, [self.schedule(s, decode_budget=b) for s, b in zip(seqs, budgets)],
                                       num_steps=max(budgets)))
            assert out.path is StepPath.MULTI_DECODE
            for s, part in zip(seqs, np.split(out.sampled_token_ids, np.cumsum(budgets)[:-1])):
                s.tokens += part.tolist()
        return [s.tokens[s.num_prompt_tokens:] for s in seqs]
