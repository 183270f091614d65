"""The data plane's persistent batch: per-sequence state in preallocated arrays.

The control plane owns every request; the data plane keeps, per seq_id, only what a
step needs, in one row of preallocated numpy arrays (as vLLM V1's persistent batch):
the block table (grown by each step's new block ids), the token history (for
penalties; -1 where never seen), and the sampling parameters from SequenceInit. A
StepPlan arrives as columns, so checking it and building the forward pass's tensors
are whole-array operations, not a Python loop per sequence: the hot path of a large
decode step. A plan that fails a check raises ValueError and leaves every row as it
was, apart from its drops.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from twinplane.dataplane.attention_backends.base import AttentionMetadata
from twinplane.dataplane.plan import PlanColumns, SamplingParams, SequenceInit, StepPlan
from twinplane.dataplane.sampling_batch import SamplingBatch, SamplingRow, build_sampling_batch


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
class StepInputs:
    input_ids: torch.Tensor  # int32 [T]
    positions: torch.Tensor  # int32 [T]
    metadata: AttentionMetadata
    sample_indices: torch.Tensor  # int32 [num_sampled]: rows of the hidden states to sample from
    sampling: SamplingBatch | None  # None when no sequence samples


def _fail(message: str) -> None:
    raise ValueError(message)


def check_sampling(seq_id: int, init: SequenceInit, limits: PlanLimits) -> None:
    """Rejects sampling parameters the sampler cannot honour."""
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
            _fail(f"seq {seq_id}: {message}")


def _is_plain(p: SamplingParams) -> bool:
    """Temperature, top-k, top-p and min-p only: the vectorized sampling path."""
    return not p.has_penalties and p.seed is None and p.num_logprobs < 0 and p.min_tokens == 0


class InputBatch:
    """seq_id -> row of per-sequence arrays; turns checked plans into device tensors."""

    def __init__(self, limits: PlanLimits, device: torch.device) -> None:
        self.limits = limits
        self.device = device
        self.max_blocks = -(-limits.max_model_len // limits.block_size)
        self.row_of: dict[int, int] = {}
        self._allocate(max(limits.max_num_seqs, 8))
        staging = 3 * limits.max_num_batched_tokens + (self.max_blocks + 4) * limits.max_num_seqs + 8
        self._staging = torch.empty(staging, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._staging_np = self._staging.numpy()

    def _allocate(self, rows: int) -> None:
        self.free_rows = list(range(rows - 1, -1, -1))
        self.block_table = np.zeros((rows, self.max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(rows, dtype=np.int32)
        self.num_prompt = np.zeros(rows, dtype=np.int32)
        self.tokens = np.full((rows, self.limits.max_model_len), -1, dtype=np.int32)
        self.params: list[SamplingParams | None] = [None] * rows
        self.plain = np.zeros(rows, dtype=bool)
        self.sampling_values = np.zeros((rows, 4), dtype=np.float32)  # temperature, top_p, top_k, min_p

    def _grow(self) -> None:
        old = len(self.params)
        saved = (self.block_table, self.num_blocks, self.num_prompt, self.tokens, self.params, self.plain,
                 self.sampling_values)
        self._allocate(2 * old)
        self.free_rows = list(range(2 * old - 1, old - 1, -1))
        for new, kept in zip((self.block_table, self.num_blocks, self.num_prompt, self.tokens), saved):
            new[:old] = kept
        self.params[:old], self.plain[:old], self.sampling_values[:old] = saved[4], saved[5], saved[6]

    # ---- mirrors ------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.row_of)

    @property
    def mirrors(self) -> dict[int, int]:
        """seq_id -> row of every sequence the data plane holds."""
        return self.row_of

    def reset(self) -> None:
        self.drop(list(self.row_of))

    def drop(self, seq_ids) -> None:
        for seq_id in seq_ids:
            row = self.row_of.pop(int(seq_id), None)
            if row is not None:
                self.params[row] = None
                self.free_rows.append(row)

    def _add(self, seq_id: int, init: SequenceInit, start_pos: int) -> int:
        if not self.free_rows:
            self._grow()
        row = self.free_rows.pop()
        self.row_of[seq_id] = row
        p = init.sampling
        self.params[row] = p
        self.plain[row] = _is_plain(p)
        self.sampling_values[row] = (p.temperature, p.top_p, p.top_k, p.min_p)
        self.num_blocks[row] = 0
        self.num_prompt[row] = init.num_prompt_tokens
        self.tokens[row].fill(-1)
        if init.prior_token_ids is not None:
            prior = init.prior_token_ids[:start_pos]
            self.tokens[row, :len(prior)] = prior
        return row

    # ---- a step ---------------------------------------------------------------------------

    def prepare(self, plan: StepPlan) -> StepInputs | None:
        """Checks the plan, updates the rows, and builds the step's tensors (None for an empty plan)."""
        cols = plan.cols()
        self.drop(plan.dropped_seq_ids)
        self._check_shapes(cols)
        if len(cols.seq_ids) == 0:
            return None
        rows, undo = self._rows(cols)
        try:
            positions = self._apply_blocks_and_check(cols, rows)
        except ValueError:
            self._undo(undo)
            raise
        for old_row in undo[1].values():  # rows of sequences that were sent again from scratch
            self.params[old_row] = None
            self.free_rows.append(old_row)
        context = cols.start_pos + cols.num_tokens
        self.tokens[np.repeat(rows, cols.num_tokens), positions] = cols.token_ids
        return self._build(cols, rows, positions, context)

    def _check_shapes(self, cols: PlanColumns) -> None:
        lim = self.limits
        n, num_tokens = len(cols.seq_ids), int(cols.num_tokens.sum())
        if n > lim.max_num_seqs:
            _fail(f"plan has {n} sequences, max_num_seqs is {lim.max_num_seqs}")
        if num_tokens > lim.max_num_batched_tokens:
            _fail(f"plan has {num_tokens} tokens, max_num_batched_tokens is {lim.max_num_batched_tokens}")
        if n == 0:
            return
        if len(np.unique(cols.seq_ids)) != n:
            _fail("plan schedules a seq_id more than once")
        if cols.num_tokens.min() < 1 or cols.start_pos.min() < 0:
            _fail("every scheduled sequence needs at least one token and a start position >= 0")
        if (cols.start_pos + cols.num_tokens).max() > lim.max_model_len:
            _fail(f"positions exceed max_model_len {lim.max_model_len}")
        if cols.token_ids.min() < 0 or cols.token_ids.max() >= lim.vocab_size:
            _fail(f"token ids must be in [0, {lim.vocab_size})")
        blocks = cols.new_block_ids
        if blocks.size and (blocks.min() < 0 or blocks.max() >= lim.num_kv_blocks):
            _fail(f"new_block_ids must be in [0, {lim.num_kv_blocks})")
        if cols.slot_mapping.size and cols.slot_mapping.max() >= lim.num_kv_blocks * lim.block_size:
            _fail("slot_mapping points past the KV cache")
        for seq_id, init in cols.inits.items():
            check_sampling(seq_id, init, lim)

    def _rows(self, cols: PlanColumns) -> tuple[np.ndarray, tuple[list[int], dict[int, int]]]:
        """The row of each scheduled sequence; new rows for inits. Also what undoing takes."""
        rows = np.empty(len(cols.seq_ids), dtype=np.int64)
        added: list[int] = []
        replaced: dict[int, int] = {}
        for i, seq_id in enumerate(cols.seq_ids.tolist()):
            init = cols.inits.get(seq_id)
            if init is not None:
                if seq_id in self.row_of:  # sent again (e.g. after a preemption): start over
                    replaced[seq_id] = self.row_of.pop(seq_id)
                rows[i] = self._add(seq_id, init, int(cols.start_pos[i]))
                added.append(seq_id)
            else:
                row = self.row_of.get(seq_id)
                if row is None:
                    self._undo((added, replaced))
                    _fail(f"seq {seq_id}: unknown to the data plane and sent without SequenceInit "
                          "(send the init again, e.g. after a data-plane restart)")
                rows[i] = row
        return rows, (added, replaced)

    def _undo(self, undo: tuple[list[int], dict[int, int]]) -> None:
        added, replaced = undo
        self.drop(added)
        self.row_of.update(replaced)

    def _apply_blocks_and_check(self, cols: PlanColumns, rows: np.ndarray) -> np.ndarray:
        """Appends new blocks, checks slots and prompts; returns each token's position."""
        bs = self.limits.block_size
        saved = self.num_blocks[rows].copy()
        try:
            offsets = np.concatenate([[0], np.cumsum(cols.num_new_blocks)])
            for i in np.flatnonzero(cols.num_new_blocks).tolist():
                row, have, k = rows[i], int(self.num_blocks[rows[i]]), int(cols.num_new_blocks[i])
                if have + k > self.max_blocks:
                    _fail(f"seq {int(cols.seq_ids[i])}: block table longer than max_model_len allows")
                self.block_table[row, have:have + k] = cols.new_block_ids[offsets[i]:offsets[i] + k]
                self.num_blocks[row] = have + k
            context = cols.start_pos + cols.num_tokens
            if np.any(-(-context // bs) > self.num_blocks[rows]):
                _fail("a sequence's block table does not cover its tokens")
            starts = np.concatenate([[0], np.cumsum(cols.num_tokens)[:-1]])
            positions = np.arange(len(cols.token_ids)) + np.repeat(cols.start_pos - starts, cols.num_tokens)
            token_rows = np.repeat(rows, cols.num_tokens)
            expected = self.block_table[token_rows, positions // bs] * bs + positions % bs
            slots = cols.slot_mapping
            if not np.all((slots == -1) | (slots == expected)):
                _fail("slot_mapping disagrees with the block table (slot = block_id * block_size + offset)")
            if np.any(cols.sample & (context < self.num_prompt[rows])):
                _fail("sample=True before the prompt is complete")
            return positions
        except ValueError:
            self.num_blocks[rows] = saved
            raise

    def _build(self, cols: PlanColumns, rows: np.ndarray, positions: np.ndarray, context: np.ndarray) -> StepInputs:
        n, t = len(rows), len(cols.token_ids)
        width = max(int((-(-context // self.limits.block_size)).max()), 1)
        cu_q = np.concatenate([[0], np.cumsum(cols.num_tokens)])
        sample_idx = cu_q[1:][cols.sample] - 1
        parts = [cols.token_ids, positions, cols.slot_mapping, cu_q, np.concatenate([[0], np.cumsum(context)]),
                 context, self.block_table[rows, :width].ravel(), sample_idx]
        views = self._to_device(parts)
        metadata = AttentionMetadata(
            cu_seqlens_q=views[3], cu_seqlens_k=views[4], context_lens=views[5],
            max_seqlen_q=int(cols.num_tokens.max()), max_seqlen_k=int(context.max()), slot_mapping=views[2],
            block_tables=views[6].view(n, width), query_lens_host=cols.num_tokens.tolist(),
            context_lens_host=context.tolist())
        sampling = self._sampling(cols, rows[cols.sample], context[cols.sample]) if len(sample_idx) else None
        assert views[0].shape[0] == t
        return StepInputs(views[0], views[1], metadata, views[7], sampling)

    def _to_device(self, parts: list[np.ndarray]) -> list[torch.Tensor]:
        """One host-to-device copy for every int32 array of the step."""
        sizes = [len(p) for p in parts]
        total = sum(sizes)
        assert total <= len(self._staging_np), "step inputs exceed the staging buffer"
        ends = np.cumsum(sizes)
        for part, end, size in zip(parts, ends, sizes):
            self._staging_np[end - size:end] = part
        device = self._staging[:total].to(self.device, non_blocking=True)
        return [device[end - size:end] for end, size in zip(ends.tolist(), sizes)]

    def _sampling(self, cols: PlanColumns, rows: np.ndarray, context: np.ndarray) -> SamplingBatch:
        if not self.plain[rows].all():
            sampling_rows = []
            for row, ctx in zip(rows.tolist(), context.tolist()):
                prompt_end = min(int(self.num_prompt[row]), ctx)
                sampling_rows.append(SamplingRow(self.params[row], ctx - int(self.num_prompt[row]),
                                                 self.tokens[row, :prompt_end], self.tokens[row, prompt_end:ctx]))
            return build_sampling_batch(sampling_rows, self.limits.vocab_size, self.device)
        values = self.sampling_values[rows]
        return SamplingBatch.from_plain_values(values, self.limits.vocab_size, self.device)
