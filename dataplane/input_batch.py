"""The data plane's persistent batch: per-sequence state in preallocated arrays.

The control plane owns every request; the data plane keeps, per seq_id, only what a
step needs, in one row of preallocated numpy arrays (as vLLM V1's persistent batch):
the block table (grown by each step's new block ids), the token history (kept only
for rows whose sampling reads it: penalties; -1 where never seen), and the sampling
parameters from SequenceInit. A
StepPlan arrives as columns, so checking it and building the forward pass's tensors
are whole-array operations, not a Python loop per sequence: the hot path of a large
decode step. A plan that fails a check raises ValueError and leaves every row as it
was, apart from its drops.

A plan may arrive before the previous step's tokens are on the host: a decode token of
-1 (PENDING) stands for the token that sequence sampled in the previous plan, which stays
on the device (``last_token``, one entry per row) and is gathered into the inputs there.

A plan of K decode steps (``StepPlan.num_steps``) gets, besides the first step's inputs, the
positions, slots and context lengths of all K steps, computed here from the block tables: a
sequence whose budget ends before K keeps its last position and stores nothing more, so
only the tokens fed back from one step to the next are left to the device.

A decode plan that the runner's graphs that sample can replay (``decode_graphs.py``: every
sequence samples with temperature only, few enough sequences and steps) is staged straight in
the layout of their input buffer instead, and copied there: ``GraphStep``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from twinplane.controlplane.sequence import GREEDY_BELOW
from twinplane.dataplane.attention_backends.base import AttentionMetadata
from twinplane.dataplane.plan import MAX_DECODE_STEPS, PlanColumns, SamplingParams, SequenceInit, StepPlan
from twinplane.dataplane.sampling_batch import (SamplingBatch, SamplingRow, build_sampling_batch, plain_columns,
                                                temperature_only, token_masks)

if TYPE_CHECKING:
    from twinplane.dataplane.decode_graphs import GraphInputs

PENDING = -1  # a decode token the data plane sampled in the previous plan
# the arrays of a plan of several decode steps, in the order _decode_steps returns them
DECODE_STEP_PARTS = ("step_positions", "step_slots", "step_context_lens", "step_cu_seqlens_k", "step_last")
# every array a step may stage for its one host-to-device copy (see _build)
STAGED_PARTS = ("token_ids", "positions", "slot_mapping", "cu_seqlens_q", "cu_seqlens_k", "context_lens",
                "block_tables", "sample_idx", "sample_rows", "pending_at", "pending_rows", "decode_order",
                *DECODE_STEP_PARTS, "sampling_columns", "greedy_flags")


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
    sample_rows: torch.Tensor  # int32 [num_sampled]: their batch rows (where last_token is kept)
    sampled: "SampledRows | None"  # the same on the host, to record tokens where a history is kept, else None
    decode_steps: DecodeSteps | None = None  # a plan of several decode steps
    # a plan whose token masks follow: its sampling, from the masks (sampling is None until then)
    with_masks: Callable[[dict[int, bytes]], SamplingBatch] | None = None


@dataclass
class DecodeSteps:
    """The inputs of steps 0 .. K-1 of a plan of K decode steps (step 0's also in StepInputs)."""

    positions: torch.Tensor  # int32 [K, n]
    slot_mapping: torch.Tensor  # int32 [K, n]: -1 once a sequence's budget is spent
    context_lens: torch.Tensor  # int32 [K, n]
    cu_seqlens_k: torch.Tensor  # int32 [K, n + 1]
    context_lens_host: list[list[int]]  # [K][n]
    budget: np.ndarray  # int32 [n]: tokens each sequence samples
    last: torch.Tensor  # int32 [n]: where each sequence's last token lands in the [K, n] tokens, flattened

    @property
    def num_steps(self) -> int:
        return len(self.context_lens_host)


@dataclass
class GraphStep:
    """A decode plan staged in the graphs' input buffer (``GraphInputs``): what replaying it needs."""

    num_seqs: int
    num_steps: int
    sample_rows: torch.Tensor  # int32 [n] on the device: each sequence's batch row
    budget: np.ndarray | None = None  # a plan of several steps: tokens each sequence samples
    last: torch.Tensor | None = None  # ... and where its last one lands in the [K, n] tokens, flattened


@dataclass
class SampledRows:
    """Host-side identity of a step's sampled sequences: row, seq_id and the new token's position."""

    rows: np.ndarray
    seq_ids: np.ndarray
    positions: np.ndarray


def _fail(message: str) -> None:
    raise ValueError(message)


def _cumsum0(values: np.ndarray) -> np.ndarray:
    """[0, v0, v0 + v1, ...]: the offsets of consecutive runs of the given lengths (int32)."""
    out = np.zeros(len(values) + 1, dtype=np.int32)
    np.cumsum(values, out=out[1:])
    return out


LOWEST_TEMPERATURE = float(np.float32(GREEDY_BELOW))  # the lowest the control plane sends, as a 32-bit float


def check_sampling(seq_id: int, init: SequenceInit, limits: PlanLimits) -> None:
    """Rejects sampling parameters the sampler cannot honour."""
    p = init.sampling
    problems = [
        (0 <= init.num_prompt_tokens <= limits.max_model_len,
         f"num_prompt_tokens {init.num_prompt_tokens} not in [0, {limits.max_model_len}] (max_model_len)"),
        (p.temperature == 0.0 or LOWEST_TEMPERATURE <= p.temperature < math.inf,
         f"temperature {p.temperature} is neither 0 (greedy) nor a finite number >= {GREEDY_BELOW}"),
        (all(map(math.isfinite, (p.repetition_penalty, p.presence_penalty, p.frequency_penalty))),
         "penalties not finite"),
        (0.0 < p.top_p <= 1.0, f"top_p {p.top_p} not in (0, 1]"),
        (0.0 <= p.min_p <= 1.0, f"min_p {p.min_p} not in [0, 1]"),
        (p.repetition_penalty > 0.0, f"repetition_penalty {p.repetition_penalty} <= 0"),
        (p.num_logprobs <= limits.max_logprobs, f"num_logprobs {p.num_logprobs} > {limits.max_logprobs}"),
        (all(0 <= t < limits.vocab_size for t in p.stop_token_ids), "stop_token_ids outside the vocabulary"),
        (all(0 <= t < limits.vocab_size for t, _ in p.logit_bias), "logit_bias token ids outside the vocabulary"),
        (all(math.isfinite(v) for _, v in p.logit_bias), "logit_bias values not finite"),
        (len({t for t, _ in p.logit_bias}) == len(p.logit_bias), "logit_bias names a token id twice"),
    ]
    for ok, message in problems:
        if not ok:
            _fail(f"seq {seq_id}: {message}")


def _is_plain(p: SamplingParams) -> bool:
    """Temperature, top-k, top-p and min-p only: the vectorized sampling path."""
    return (not p.has_penalties and p.seed is None and p.num_logprobs < 0 and p.min_tokens == 0 and not p.logit_bias
            and not p.masked)


class InputBatch:
    """seq_id -> row of per-sequence arrays; turns checked plans into device tensors."""

    def __init__(self, limits: PlanLimits, device: torch.device) -> None:
        self.limits = limits
        self.device = device
        self.max_blocks = -(-limits.max_model_len // limits.block_size)
        self.row_of: dict[int, int] = {}
        self.plan_index = 0  # plans prepared so far
        self.wait_for_tokens = lambda: None  # brings the previous plan's tokens to the host
        self._allocate(max(limits.max_num_seqs, 8))
        # how many entries of held rows' block tables name each KV block (see _check_writes_own_blocks)
        self.block_holders = np.zeros(limits.num_kv_blocks, dtype=np.int32)
        t, s, k = limits.max_num_batched_tokens, limits.max_num_seqs, MAX_DECODE_STEPS
        staging = (3 * t  # token_ids, positions, slot_mapping
                   + (8 + self.max_blocks) * s + 2  # the other per-sequence arrays of STAGED_PARTS, block_tables
                   + (4 * k + 1) * s + k  # several decode steps: four [K, n] arrays, cu_seqlens_k's K more, step_last
                   + 4 * s + s // 4 + 1  # plain sampling values and flags
                   + 3 * len(STAGED_PARTS))  # each staged array starts 16-byte aligned
        self._allocate_staging(staging)
        pinned = device.type == "cuda"
        self._staging_copied = [torch.cuda.Event() if pinned else None for _ in range(2)]
        # the stream steps run on, found once: looking it up costs more host time than recording an event
        self.stream = torch.cuda.current_stream(device) if pinned else None
        self.use_graph_inputs(None)

    def _allocate_staging(self, size: int) -> None:
        """Two staging buffers, alternating: one may still be copying while the next plan is prepared."""
        pinned = self.device.type == "cuda"
        try:
            self._staging = [torch.empty(size, dtype=torch.int32, pin_memory=pinned) for _ in range(2)]
        except RuntimeError:  # torch's host allocator says so in a RuntimeError: the data plane's limits are too large
            raise MemoryError(f"2 staging buffers of {size * 4 / 2**30:.1f} GiB each") from None
        self._staging_host = [buffer.numpy() for buffer in self._staging]

    def use_graph_inputs(self, graph_inputs: GraphInputs | None) -> None:
        """Stage the plans that ``graph_inputs`` takes in its layout (None: every plan as a StepInputs)."""
        if graph_inputs is not None and graph_inputs.size > len(self._staging_host[0]):
            for copied in self._staging_copied:
                if copied is not None:
                    copied.synchronize()
            self._allocate_staging(graph_inputs.size)
        self.graph_inputs = graph_inputs
        self._graph_host = [] if graph_inputs is None else [graph_inputs.views(h) for h in self._staging_host]

    def _allocate(self, rows: int) -> None:
        self.free_rows = list(range(rows - 1, -1, -1))
        self.block_table = np.zeros((rows, self.max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(rows, dtype=np.int32)
        self.num_prompt = np.zeros(rows, dtype=np.int32)
        self.num_sent = np.zeros(rows, dtype=np.int32)  # positions plans have stored (or had cached) so far
        self.tokens = np.full((rows, self.limits.max_model_len), -1, dtype=np.int32)
        self.params: list[SamplingParams | None] = [None] * rows
        self.plain = np.zeros(rows, dtype=bool)
        self.masked_plain = np.zeros(rows, dtype=bool)  # plain but for its token masks
        self.sampling_values = np.zeros((rows, 4), dtype=np.float32)  # temperature, top_p, top_k, min_p
        self.owner = np.full(rows, -1, dtype=np.int64)  # seq_id of each row, -1 = free
        self.sampled_at = np.full(rows, -1, dtype=np.int64)  # plan_index of the row's last sample
        self.last_token = torch.zeros(rows, dtype=torch.int32, device=self.device)  # that sample

    def _grow(self) -> None:
        old = len(self.params)
        arrays = ("block_table", "num_blocks", "num_prompt", "num_sent", "tokens", "plain", "masked_plain",
                  "sampling_values", "owner", "sampled_at", "last_token")
        saved = [getattr(self, name) for name in arrays]
        params = self.params
        self._allocate(2 * old)
        self.free_rows = list(range(2 * old - 1, old - 1, -1))
        for name, kept in zip(arrays, saved):
            getattr(self, name)[:old] = kept
        self.params[:old] = params

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
                self._free(row)

    def _hold(self, row: int, sign: int) -> None:
        """Counts (sign 1) or uncounts (-1) the blocks of the row's table in block_holders."""
        np.add.at(self.block_holders, self.block_table[row, :self.num_blocks[row]], sign)

    def _free(self, row: int, holds: bool = True) -> None:
        """Frees the row (holds: its blocks still count in block_holders)."""
        if holds:
            self._hold(row, -1)
        self.num_blocks[row] = 0
        self.params[row] = None
        self.owner[row] = self.sampled_at[row] = -1
        self.free_rows.append(row)

    def _add(self, seq_id: int, init: SequenceInit, start_pos: int) -> int:
        if not self.free_rows:
            self._grow()
        row = self.free_rows.pop()
        self.row_of[seq_id] = row
        self.owner[row] = seq_id
        p = init.sampling
        self.params[row] = p
        self.plain[row] = _is_plain(p)
        self.masked_plain[row] = p.masked and _is_plain(replace(p, masked=False))
        self.sampling_values[row] = (p.temperature, p.top_p, p.top_k, p.min_p)
        self.num_blocks[row] = 0
        self.num_prompt[row] = init.num_prompt_tokens
        self.num_sent[row] = start_pos  # a prefix-cache hit: its tokens are in blocks other sequences computed
        self.tokens[row].fill(-1)
        if init.prior_token_ids is not None:
            prior = init.prior_token_ids[:start_pos]
            self.tokens[row, :len(prior)] = prior
        return row

    # ---- a step ---------------------------------------------------------------------------

    def prepare(self, plan: StepPlan, graphs: bool = True) -> StepInputs | GraphStep | None:
        """Checks the plan, updates the rows, and builds the step's tensors (None for an empty plan); with
        ``graphs``, stages a plan that the graphs take in their buffer instead (GraphStep)."""
        cols = plan.cols()
        self.plan_index += 1
        self.drop(plan.dropped_seq_ids)
        budget = self._check_shapes(cols, plan.num_steps)
        if len(cols.seq_ids) == 0:
            return None
        rows, undo = self._rows(cols)
        unknown = cols.token_ids == PENDING
        decode = len(cols.token_ids) == len(rows)  # one token a sequence: its token i is sequence i's
        try:
            if plan.num_steps > 1 and not self.plain[rows].all():
                _fail("a plan of several decode steps takes only sequences sampled with temperature, top-k, "
                      "top-p and min-p (no penalties, seed, log-probabilities, min_tokens or logit bias)")
            self._check_no_gap(cols, rows)
            pending = self._check_pending(cols, rows, unknown, decode)
            if plan.masks_follow and (plan.num_steps > 1 or cols.token_masks):
                _fail("a plan whose token masks follow is one step and carries no masks itself")
            if not plan.masks_follow:
                self._check_masks(cols, rows)
            positions, token_rows = self._apply_blocks_and_check(cols, rows, budget, decode)
        except ValueError:
            self._undo(undo)
            raise
        for old_row in undo[1].values():  # rows of sequences that were sent again from scratch
            self._free(old_row, holds=False)
        context = cols.start_pos + cols.num_tokens
        self.num_sent[rows] = context + budget - 1
        if not unknown.all():  # the known tokens of rows that keep a history (none are plain)
            kept = ~(unknown | self.plain[token_rows])
            self.tokens[token_rows[kept], positions[kept]] = cols.token_ids[kept]
        waiting = rows[pending][~self.plain[rows[pending]]] if pending.any() else ()
        if any(self.params[row].has_penalties for row in waiting):
            self.wait_for_tokens()  # penalties read the history, PENDING tokens included
        self.sampled_at[rows[cols.sample]] = self.plan_index
        if (graphs and decode and not plan.masks_follow and not cols.prompt_logprobs
                and self._graphs_take(cols, rows, plan.num_steps)):
            return self._stage_for_graphs(cols, rows, context, pending, budget if plan.num_steps > 1 else None)
        inputs = self._build(cols, rows, positions, context, pending, budget if plan.num_steps > 1 else None,
                             plan.masks_follow)
        if plan.masks_follow:  # sampled once the masks come
            inputs.with_masks = functools.partial(self._sampling_with_masks, cols, rows, context)
        return inputs

    def _check_no_gap(self, cols: PlanColumns, rows: np.ndarray) -> None:
        """A sequence seen before goes on at most where its earlier plans ended (again from an earlier
        position is allowed: it stores those keys anew). Past it, attention would read positions no plan
        stored, keys and values another sequence may have left in the block."""
        gap = cols.start_pos > self.num_sent[rows]  # a sequence new in this plan starts where it says
        if gap.any():
            i = int(np.flatnonzero(gap)[0])
            _fail(f"seq {int(cols.seq_ids[i])}: plan starts at position {int(cols.start_pos[i])}, past the "
                  f"{int(self.num_sent[rows[i]])} positions its plans so far stored or found cached; each plan "
                  "goes on where the one before ended, or earlier")

    def _check_pending(self, cols: PlanColumns, rows: np.ndarray, unknown: np.ndarray, decode: bool) -> np.ndarray:
        """Which sequences decode a PENDING token (unknown: per token, whether it is PENDING);
        each must have sampled in the previous plan. decode: one token a sequence."""
        pending = unknown if decode else unknown[np.cumsum(cols.num_tokens) - 1]
        ok = decode or int(unknown.sum()) == int(pending.sum())  # none inside a chunk
        if pending.any():
            ok = ok and bool((self.sampled_at[rows[pending]] == self.plan_index - 1).all())
            if not decode:  # and it is the sequence's only token
                ok = ok and bool((cols.num_tokens[pending] == 1).all())
        if not ok:
            _fail(f"token id {PENDING} (pending) is allowed only as the one token of a sequence that sampled "
                  "in the previous plan")
        return pending

    def sampling_refused(self) -> None:
        """The last plan samples nothing after all (its token masks were refused): no PENDING token may
        stand for what its rows would have sampled."""
        self.sampled_at[self.sampled_at == self.plan_index] = -1

    def record_sampled(self, sampled: SampledRows, token_ids: np.ndarray) -> None:
        """Writes a step's sampled tokens into the history of rows still held by the same sequences
        (those that keep one)."""
        kept = (self.owner[sampled.rows] == sampled.seq_ids) & ~self.plain[sampled.rows]
        self.tokens[sampled.rows[kept], sampled.positions[kept]] = token_ids[kept]

    def _check_shapes(self, cols: PlanColumns, num_steps: int) -> np.ndarray:
        """Checks what needs no row; returns each sequence's decode budget (1 unless num_steps > 1)."""
        lim = self.limits
        n, num_tokens = len(cols.seq_ids), int(cols.num_tokens.sum())
        budget = np.ones(n, dtype=np.int32)
        if num_steps > 1:
            if num_steps > MAX_DECODE_STEPS:
                _fail(f"plan asks for {num_steps} decode steps, at most {MAX_DECODE_STEPS} are allowed")
            if cols.decode_budget is None or len(cols.decode_budget) != n:
                _fail("a plan of several decode steps needs one decode_budget per sequence")
            budget = cols.decode_budget
            if n and (budget.min() < 1 or budget.max() > num_steps):
                _fail(f"decode_budget must be in [1, {num_steps}] (num_steps)")
            if n and (cols.num_tokens.max() != 1 or not cols.sample.all() or cols.inits):
                _fail("in a plan of several decode steps every sequence computes one token, samples, "
                      "and was seen before (no SequenceInit)")
        if n > lim.max_num_seqs:
            _fail(f"plan has {n} sequences, max_num_seqs is {lim.max_num_seqs}")
        if num_tokens > lim.max_num_batched_tokens:
            _fail(f"plan has {num_tokens} tokens, max_num_batched_tokens is {lim.max_num_batched_tokens}")
        if n == 0:
            return budget
        if len(set(cols.seq_ids.tolist())) != n:
            _fail("plan schedules a seq_id more than once")
        if cols.num_tokens.min() < 1 or cols.start_pos.min() < 0 or cols.num_new_blocks.min() < 0:
            _fail("every scheduled sequence needs at least one token, a start position >= 0 and num_new_blocks >= 0")
        if cols.start_pos.max() > lim.max_model_len or (cols.start_pos + cols.num_tokens + budget - 1).max() > \
                lim.max_model_len:  # the first check keeps the sum from overflowing int32
            _fail(f"positions exceed max_model_len {lim.max_model_len}")
        if cols.token_ids.min() < PENDING or cols.token_ids.max() >= lim.vocab_size:
            _fail(f"token ids must be in [0, {lim.vocab_size}) or {PENDING} (pending)")
        blocks = cols.new_block_ids
        if blocks.size and (blocks.min() < 0 or blocks.max() >= lim.num_kv_blocks):
            _fail(f"new_block_ids must be in [0, {lim.num_kv_blocks})")
        if cols.slot_mapping.size and cols.slot_mapping.max() >= lim.num_kv_blocks * lim.block_size:
            _fail("slot_mapping points past the KV cache")
        for seq_id, init in cols.inits.items():
            check_sampling(seq_id, init, lim)
        self._check_prompt_logprobs(cols, num_steps)
        return budget

    def _check_prompt_logprobs(self, cols: PlanColumns, num_steps: int) -> None:
        lim, n = self.limits, len(cols.seq_ids)
        if cols.prompt_logprobs and num_steps > 1:
            _fail("a plan of several decode steps asks for no prompt log-probabilities")
        for index, ask in cols.prompt_logprobs.items():
            if not 0 <= index < n:
                _fail(f"prompt_logprobs: index {index} is not a sequence of the plan, [0, {n})")
            m, chunk = len(ask.next_token_ids), int(cols.num_tokens[index])
            if not 1 <= m <= chunk:
                _fail(f"prompt_logprobs: index {index} asks at {m} positions of a chunk of {chunk} tokens; "
                      "1 to the chunk's tokens are allowed")
            if ask.next_token_ids.min() < 0 or ask.next_token_ids.max() >= lim.vocab_size:
                _fail(f"prompt_logprobs: index {index} has next token ids outside [0, {lim.vocab_size})")
            if ask.num_top > lim.max_logprobs:
                _fail(f"prompt_logprobs: index {index} asks for the top {ask.num_top} tokens, "
                      f"max_logprobs is {lim.max_logprobs}")

    def _rows(self, cols: PlanColumns) -> tuple[np.ndarray, tuple[list[int], dict[int, int]]]:
        """The row of each scheduled sequence; new rows for inits. Also what undoing takes."""
        if not cols.inits:  # every sequence known (the loop below names one that is not)
            try:
                return np.array([self.row_of[s] for s in cols.seq_ids.tolist()], dtype=np.int64), ([], {})
            except KeyError:
                pass
        rows = np.empty(len(cols.seq_ids), dtype=np.int64)
        added: list[int] = []
        replaced: dict[int, int] = {}
        for i, seq_id in enumerate(cols.seq_ids.tolist()):
            init = cols.inits.get(seq_id)
            if init is not None:
                if seq_id in self.row_of:  # sent again (e.g. after a preemption): start over
                    replaced[seq_id] = self.row_of.pop(seq_id)
                    self._hold(replaced[seq_id], -1)  # its old table may hand its blocks to the new one
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
        for row in replaced.values():
            self._hold(row, 1)

    def _apply_blocks_and_check(self, cols: PlanColumns, rows: np.ndarray, budget: np.ndarray,
                                decode: bool) -> tuple[np.ndarray, np.ndarray]:
        """Appends new blocks, checks slots and prompts; returns each token's position and row.
        budget: each sequence's decode steps in the plan; decode: one token a sequence."""
        bs, final = self.limits.block_size, cols.start_pos + cols.num_tokens + budget - 1
        growing = np.flatnonzero(cols.num_new_blocks)
        saved = self.num_blocks[rows].copy()
        try:
            offsets = _cumsum0(cols.num_new_blocks) if len(growing) else None
            for i in growing.tolist():
                row, have, k = rows[i], int(self.num_blocks[rows[i]]), int(cols.num_new_blocks[i])
                if have + k > self.max_blocks:
                    _fail(f"seq {int(cols.seq_ids[i])}: block table longer than max_model_len allows")
                self.block_table[row, have:have + k] = cols.new_block_ids[offsets[i]:offsets[i] + k]
                self.num_blocks[row] = have + k
            if np.any(-(-final // bs) > self.num_blocks[rows]):
                _fail("a sequence's block table does not cover its tokens")
            if decode:
                positions, token_rows = cols.start_pos, rows
            else:
                starts = _cumsum0(cols.num_tokens)[:-1]
                positions = np.arange(len(cols.token_ids)) + np.repeat(cols.start_pos - starts, cols.num_tokens)
                token_rows = np.repeat(rows, cols.num_tokens)
            expected = self.block_table[token_rows, positions // bs] * bs + positions % bs
            slots = cols.slot_mapping
            if not np.array_equal(slots, expected):  # -1 too: attention would read a position never stored
                _fail("slot_mapping disagrees with the block table (slot = block_id * block_size + offset)")
            if budget.max() == 1:  # each stored token's slot, position, row and its row's blocks before the plan
                written, written_positions, writers = slots, positions, token_rows
                held_before = saved if decode else np.repeat(saved, cols.num_tokens)
            else:  # every step's tokens; a sequence whose budget is spent stores none (slot -1)
                step_positions, step_slots = self._decode_steps(rows, cols.start_pos, budget)[:2]
                stored = step_slots >= 0
                written, written_positions = step_slots[stored], step_positions[stored]
                writers = np.broadcast_to(rows, step_slots.shape)[stored]
                held_before = np.broadcast_to(saved, step_slots.shape)[stored]
            if len(rows) > 1 or len(growing):  # one sequence stores a slot twice only by a block new twice
                self._check_slots_distinct(written)
            self._check_writes_own_blocks(written // bs, written_positions // bs, held_before, writers)
            if np.any(cols.sample & (cols.start_pos + cols.num_tokens < self.num_prompt[rows])):
                _fail("sample=True before the prompt is complete")
        except ValueError:
            self.num_blocks[rows] = saved
            raise
        np.add.at(self.block_holders, cols.new_block_ids, 1)
        return positions, token_rows

    def _check_writes_own_blocks(self, blocks: np.ndarray, columns: np.ndarray, held_before: np.ndarray,
                                 writers: np.ndarray) -> None:
        """No token of a plan is stored in a block that another sequence held before the plan, or that the
        writing sequence's own table names twice, or that another sequence of the plan writes too. The prefix
        cache shares only blocks whose tokens are all computed, which no sequence writes again: such a write
        would overwrite keys and values another sequence reads. blocks, columns, writers: the block of each
        token stored (over all the plan's steps), its column in the sequence's table and the sequence's row;
        held_before: how many blocks that table had before this plan (block_holders does not count this
        plan's new blocks yet, so a block held before counts its own)."""
        held = columns < held_before
        shared = self.block_holders[blocks] > held
        if shared.any():
            _fail(f"plan writes KV block {int(blocks[shared][0])}, which another held sequence's block table "
                  "names too (or this one's twice): only a sequence's own blocks may be written")
        if not held.all():  # blocks new in this plan: each written by one sequence
            order = np.argsort(blocks[~held], kind="stable")
            fresh, by = blocks[~held][order], writers[~held][order]
            both = (fresh[1:] == fresh[:-1]) & (by[1:] != by[:-1])
            if both.any():
                _fail(f"plan writes KV block {int(fresh[1:][both][0])} from two sequences: only a sequence's own "
                      "blocks may be written")

    @staticmethod
    def _check_slots_distinct(slots: np.ndarray) -> None:
        """No two tokens of a plan (over all its steps; -1: none) are stored in one KV slot, where one
        sequence's keys and values would overwrite another's."""
        ordered = np.sort(slots, axis=None)
        if np.any((ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)):
            _fail("plan stores two tokens in one KV slot: the sequences of a plan write blocks of their own")

    def _build(self, cols: PlanColumns, rows: np.ndarray, positions: np.ndarray, context: np.ndarray,
               pending: np.ndarray, budget: np.ndarray | None, masks_follow: bool = False) -> StepInputs:
        n, t = len(rows), len(cols.token_ids)
        width = self._table_width(context, budget)
        cu_q = _cumsum0(cols.num_tokens)
        sample_idx = cu_q[1:][cols.sample] - 1
        sample_rows = rows[cols.sample]
        parts = {"token_ids": cols.token_ids, "positions": positions, "slot_mapping": cols.slot_mapping,
                 "cu_seqlens_q": cu_q, "cu_seqlens_k": _cumsum0(context), "context_lens": context,
                 "block_tables": self.block_table[rows, :width].ravel(), "sample_idx": sample_idx,
                 "sample_rows": sample_rows, "pending_at": cu_q[1:][pending] - 1, "pending_rows": rows[pending]}
        decode = n == t
        if decode:  # longest context first: the decode kernel starts them in this order
            parts["decode_order"] = np.argsort(-context, kind="stable")
        if budget is not None:
            steps = self._decode_steps(rows, cols.start_pos, budget)
            parts.update(zip(DECODE_STEP_PARTS, (a.ravel() for a in steps)))
        plain = len(sample_idx) > 0 and bool(self.plain[sample_rows].all())
        if plain:  # the sampling values travel with the rest: no copy of their own
            values = self.sampling_values[sample_rows]
            parts["sampling_columns"], parts["greedy_flags"] = plain_columns(values, self.limits.vocab_size)
        v = self._to_device(parts)
        input_ids = self._input_ids(v["token_ids"], pending, v["pending_at"], v["pending_rows"])
        metadata = AttentionMetadata(
            cu_seqlens_q=v["cu_seqlens_q"], cu_seqlens_k=v["cu_seqlens_k"], context_lens=v["context_lens"],
            max_seqlen_q=int(cols.num_tokens.max()), max_seqlen_k=int(context.max()), slot_mapping=v["slot_mapping"],
            block_tables=v["block_tables"].view(n, width), query_lens_host=cols.num_tokens.tolist(),
            context_lens_host=context.tolist(), decode_order=v.get("decode_order"))
        if plain:
            sampling = SamplingBatch.from_plain_columns(values, v["sampling_columns"], v["greedy_flags"],
                                                        self.limits.vocab_size)
        else:
            sampling = self._sampling(cols, sample_rows, context[cols.sample]) if len(sample_idx) and not masks_follow \
                else None
        # rows sampled plainly keep no history: nothing to record
        sampled = None if plain else SampledRows(sample_rows, cols.seq_ids[cols.sample], context[cols.sample])
        assert input_ids.shape[0] == t
        inputs = StepInputs(input_ids, v["positions"], metadata, v["sample_idx"], sampling, v["sample_rows"], sampled)
        if budget is not None:
            k = len(steps[0])
            pos, slots, ctx, cu_k = (v[name].view(k, -1) for name in DECODE_STEP_PARTS[:4])
            inputs.decode_steps = DecodeSteps(pos, slots, ctx, cu_k, steps[2].tolist(), budget, v["step_last"])
        return inputs

    def _input_ids(self, token_ids: torch.Tensor, pending: np.ndarray, pending_at: torch.Tensor,
                   pending_rows: torch.Tensor) -> torch.Tensor:
        """The step's token ids, PENDING ones taken from the previous plan's samples (still on the device)."""
        if pending.all():
            return self.last_token.index_select(0, pending_rows)
        if pending.any():
            return token_ids.index_put((pending_at,), self.last_token.index_select(0, pending_rows))
        return token_ids

    def warm_up(self) -> None:
        """Launches once the device ops that only some plans reach. CUDA loads a kernel's module on
        its first launch; for index_put that took ~17 ms of host time on an H200, and it came in the
        middle of serving: the first plan with a prompt beside decodes of PENDING tokens stalled
        every stream."""
        ids = torch.zeros(2, dtype=torch.int32, device=self.device)
        self._input_ids(ids, np.array([True, False]), ids[:1], ids[:1])

    def _decode_steps(self, rows: np.ndarray, start: np.ndarray, budget: np.ndarray) -> list[np.ndarray]:
        """Positions, slots, context lengths and cumulative context lengths [K, ...] of each of
        K decode steps: sequence i advances for budget[i] steps, then stays and stores nothing."""
        bs, k = self.limits.block_size, int(budget.max())
        step = np.arange(k, dtype=np.int32)[:, None]
        positions = start[None, :] + np.minimum(step, budget[None, :] - 1)
        slots = self.block_table[rows[None, :], positions // bs] * bs + positions % bs
        slots = np.where(step < budget[None, :], slots, -1)
        context = positions + 1
        cu_k = np.concatenate([np.zeros((k, 1), np.int32), np.cumsum(context, axis=1)], axis=1)
        last = (budget - 1) * len(rows) + np.arange(len(rows))
        return [a.astype(np.int32) for a in (positions, slots, context, cu_k, last)]

    def _table_width(self, context: np.ndarray, budget: np.ndarray | None) -> int:
        """Block-table columns a step reads: enough for the longest context its sequences reach (after
        budget[i] decode steps each, in a plan of several)."""
        final = context if budget is None else context + budget - 1
        return max(int((-(-final // self.limits.block_size)).max()), 1)

    def set_last_tokens(self, sample_rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Keeps a step's sampled tokens on the device, as inputs for PENDING tokens of the next plan."""
        self.last_token.index_put_((sample_rows,), token_ids.to(torch.int32))

    def _host_staging(self) -> int:
        """Which staging buffer this plan fills, once the copy that last read it is done."""
        k = self.plan_index % 2
        if self._staging_copied[k] is not None:
            self._staging_copied[k].synchronize()  # the plan before last may still be reading this buffer
        return k

    def _send(self, k: int, end: int, into: torch.Tensor | None = None) -> torch.Tensor:
        """Queues the copy of staging buffer k's first ``end`` entries to the device (into ``into``,
        else a new tensor); returns the device copy."""
        staged = self._staging[k][:end]
        if into is None:
            device = staged.to(self.device, non_blocking=True)
        else:
            device = into[:end].copy_(staged, non_blocking=True)
        if self._staging_copied[k] is not None:
            self._staging_copied[k].record(self.stream)
        return device

    def _to_device(self, parts: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """One host-to-device copy for every int32 array of the step; returns a view of each by name.

        Each array starts on a 16-byte boundary: Triton specializes kernels on pointer
        alignment, so an odd token count must not shift the next array off it (that would
        compile new kernel variants in the middle of serving).
        """
        k = self._host_staging()
        host, spans, end = self._staging_host[k], {}, 0
        assert len(parts) <= len(STAGED_PARTS), "more staged arrays than the staging buffer allows for"
        for name, part in parts.items():
            size = len(part)
            host[end:end + size] = part
            spans[name] = (end, size)
            end += -(-size // 4) * 4
        assert end <= len(host), "step inputs exceed the staging buffer"
        device = self._send(k, end)
        return {name: device[start:start + size] for name, (start, size) in spans.items()}

    def _graphs_take(self, cols: PlanColumns, rows: np.ndarray, num_steps: int) -> bool:
        """Whether the graphs that sample replay this decode plan: they are held for its size, and
        every sequence samples with temperature only (no seed, log-probabilities or penalties)."""
        g = self.graph_inputs
        return (g is not None and g.takes(len(rows), num_steps) and bool(cols.sample.all())
                and bool(self.plain[rows].all())
                and temperature_only(self.sampling_values[rows], self.limits.vocab_size))

    def _stage_for_graphs(self, cols: PlanColumns, rows: np.ndarray, context: np.ndarray, pending: np.ndarray,
                          budget: np.ndarray | None) -> GraphStep:
        """Writes a decode plan in the graphs' layout, padding rows up to the batch size included (token
        0, slot -1, context 0: they store and read nothing), copies it into their buffer, and puts the
        PENDING tokens in place on the device."""
        g, n, num_steps = self.graph_inputs, len(rows), 1 if budget is None else int(budget.max())
        padded = next(size for size in g.batch_sizes if size >= n)
        k = self._host_staging()
        h = self._graph_host[k]
        h.first_ids[:n], h.first_ids[n:padded] = cols.token_ids, 0
        h.rows[:n] = rows
        h.order[:n] = np.argsort(-context, kind="stable")
        h.order[n:padded] = np.arange(n, padded)
        h.temperature[:n] = self.sampling_values[rows, 0]  # 0: greedy, as the flag says
        h.greedy[:n] = h.temperature[:n] == 0.0
        if budget is None:
            steps = [[cols.start_pos], [cols.slot_mapping], [context]]
        else:
            *steps, _, last = self._decode_steps(rows, cols.start_pos, budget)  # positions, slots, contexts
            h.last[:n] = last
        for step in range(num_steps):
            h.positions[step][:n], h.slots[step][:n], h.context_lens[step][:n] = (a[step] for a in steps)
            h.positions[step][n:padded], h.slots[step][n:padded], h.context_lens[step][n:padded] = 0, -1, 0
        width = self._table_width(context, budget)
        h.block_tables[:n, :width] = self.block_table[rows, :width]
        self._send(k, g.end(n), into=g.buffer)
        d = g.parts
        if pending.all():
            torch.index_select(self.last_token, 0, d.rows[:n], out=d.first_ids[:n])
        elif pending.any():
            ids = d.first_ids[:n]
            torch.where(ids == PENDING, self.last_token.index_select(0, d.rows[:n]), ids, out=ids)
        return GraphStep(n, num_steps, d.rows[:n], budget, None if budget is None else d.last[:n])

    def _check_masks(self, cols: PlanColumns, rows: np.ndarray) -> None:
        """A token mask comes with each sampled sequence that samples by one, and with no other."""
        if not cols.token_masks and self.plain[rows].all():
            return  # the hot path: a masked sequence is never plain
        needed = [i for i in np.flatnonzero(cols.sample).tolist() if self.params[rows[i]].masked]
        if sorted(cols.token_masks) != needed:
            _fail(f"token masks for sequences {sorted(cols.token_masks)[:8]} of the plan; wanted one for each "
                  f"sampled sequence with a masked sampler, {needed[:8]}")
        width, checked = -(-self.limits.vocab_size // 8), set()
        for i, allowed in cols.token_masks.items():
            if id(allowed) in checked:  # a mask several rows share (TokenMask.same_as)
                continue
            checked.add(id(allowed))
            empty = allowed.count(0) == len(allowed)  # in C: a mask of 151,936 tokens is 19 KB
            if len(allowed) != width or empty:
                _fail(f"seq {cols.seq_ids[i]}: a token mask must be {width} bytes (one bit per token) with a bit "
                      f"set; got {len(allowed)} bytes{', none set' if empty else ''}")

    def _sampling_with_masks(self, cols: PlanColumns, rows: np.ndarray, context: np.ndarray,
                             token_masks: dict[int, bytes]) -> SamplingBatch:
        """The sampling of a plan whose token masks came after it (StepPlan.masks_follow), checked as a
        plan's own are."""
        cols.token_masks = token_masks
        self._check_masks(cols, rows)
        return self._sampling(cols, rows[cols.sample], context[cols.sample])

    def _sampling(self, cols: PlanColumns, rows: np.ndarray, context: np.ndarray) -> SamplingBatch:
        """Rows with penalties, seeds, log-probabilities, min_tokens or token masks: one row at a time, but for
        rows that are plain apart from their masks (structured output's usual rows), which are built at once."""
        masks = [cols.token_masks.get(i) for i in np.flatnonzero(cols.sample).tolist()]
        if (self.plain[rows] | self.masked_plain[rows]).all():
            batch = SamplingBatch.from_plain_values(self.sampling_values[rows], self.limits.vocab_size, self.device)
            batch.masks = token_masks(masks, self.device)
            return batch
        sampling_rows = []
        for row, ctx, allowed in zip(rows.tolist(), context.tolist(), masks):
            prompt_end = min(int(self.num_prompt[row]), ctx)
            sampling_rows.append(SamplingRow(self.params[row], ctx - int(self.num_prompt[row]),
                                             self.tokens[row, :prompt_end], self.tokens[row, prompt_end:ctx], allowed))
        return build_sampling_batch(sampling_rows, self.limits.vocab_size, self.device)
