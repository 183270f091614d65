"""Triton sampling for rows that use only temperature: one pass over the logits.

A temperature-only draw is the Gumbel-max trick: argmax over the vocabulary of
``logit / T + g`` with ``g = -log(-log(u))`` and ``u`` uniform, which picks token i with
probability softmax(logit / T)_i (the same distribution as the exponential race of the
general sampler). Greedy rows (T = 0) take the plain argmax, the first one on ties, as
``torch.argmax`` does. Done with torch ops, that is about ten passes over a float32 copy
of the [rows, vocab] logits (0.8 ms per step at 256 rows of Qwen's 151,936 tokens on an
H200); here it is one read of the bf16 logits.

- ``_partial_kernel``: one program per (row, vocabulary split); it keeps the best score
  and its index over its range and writes them out. Splits keep the GPU busy when there
  are few rows. Sizes are runtime arguments, so one compiled kernel serves every batch.
- ``_pick_kernel``: one program per row takes the index of its best split (the first on ties,
  as ``argmax``) and stores it in the caller's output, in its dtype (a CUDA graph of decode
  steps stores int32 tokens where the next step reads them).
- On sm_90 and newer both are launched with programmatic dependent launch: each launches while
  the kernel ahead of it runs and waits for it before reading anything.

Random numbers are Philox (``tl.rand4x``, four per call) keyed by a per-row seed and
counted by vocabulary position, so a row's draw depends on its seed alone: not on its
place in the batch, on the other rows or on the number of splits.

A row's seed is either given (``seeds``, one per row) or the draw's key plus the row's index:
``draw_key`` is an int64 tensor of one element on the device, which the pick kernel advances
by ``KEY_STRIDE`` once every row has read it. The key never visits the host, so a CUDA graph
that samples draws a new key at every replay, and the host neither computes nor copies one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from twinplane.kernels.device import launch_pdl, sm_count

BLOCK = 1024
KEY_STRIDE = 1 << 16  # a draw with draw_key: at most this many rows, keys draw_key + row


@triton.jit
def _keep_best(x, cols, best_score, best_index):
    """Each lane's running (best score, its index), updated with its score x at cols. A lane sees
    its columns in increasing order, so keeping the old best on ties keeps the first index."""
    better = x > best_score
    return tl.where(better, x, best_score), tl.where(better, cols, best_index)


@triton.jit
def _first_best(best_score, best_index):
    """(the best of the lanes' scores, the smallest index that has it): argmax's first on ties."""
    top = tl.max(best_score, axis=0)
    return top, tl.min(tl.where(best_score == top, best_index, 2**31 - 1), axis=0)


@triton.jit
def _score(logits_row, cols, end, temperature, u):
    """Gumbel-max score of the logits at cols (-inf past end); plain logits when temperature is 0."""
    x = tl.load(logits_row + cols, mask=cols < end, other=-float("inf")).to(tl.float32)
    if temperature > 0:
        # rand4x can round to 1.0 in float32, whose Gumbel noise is +inf: cap it just below.
        x = x / temperature - tl.log(-tl.log(tl.minimum(u, 0.99999994)))
    return tl.where(cols < end, x, -float("inf"))


@triton.jit(do_not_specialize=["stride_row", "vocab", "per_split", "num_splits"])
def _partial_kernel(logits_ptr, stride_row, temperature_ptr, greedy_ptr, seeds_ptr, best_score_ptr,
                    best_index_ptr, vocab, per_split, num_splits, ROW_SEEDS: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0)
    split = tl.program_id(1)
    temperature = tl.where(tl.load(greedy_ptr + row), 0.0, tl.load(temperature_ptr + row))
    if ROW_SEEDS:
        seed = tl.load(seeds_ptr + row)
    else:  # the draw's key (advanced by the pick kernel, which runs once this one is done)
        seed = tl.load(seeds_ptr) + row
    logits_row = logits_ptr + row.to(tl.int64) * stride_row
    start = split * per_split
    end = tl.minimum(start + per_split, vocab)
    QUARTER: tl.constexpr = BLOCK // 4
    lane = tl.arange(0, QUARTER)
    best_score = tl.full([QUARTER], -float("inf"), tl.float32)
    best_index = tl.full([QUARTER], 2**31 - 1, tl.int32)
    for tile in range(start, end, BLOCK):  # tiles start at multiples of BLOCK (per_split is one)
        # One Philox call gives four numbers: quarter i of the tile takes the i-th, and
        # column tile + i * QUARTER + lane always gets the same one.
        u0, u1, u2, u3 = tl.rand4x(seed, tile // 4 + lane)
        for_cols = tile + lane
        best_score, best_index = _keep_best(_score(logits_row, for_cols, end, temperature, u0), for_cols,
                                            best_score, best_index)
        for_cols += QUARTER
        best_score, best_index = _keep_best(_score(logits_row, for_cols, end, temperature, u1), for_cols,
                                            best_score, best_index)
        for_cols += QUARTER
        best_score, best_index = _keep_best(_score(logits_row, for_cols, end, temperature, u2), for_cols,
                                            best_score, best_index)
        for_cols += QUARTER
        best_score, best_index = _keep_best(_score(logits_row, for_cols, end, temperature, u3), for_cols,
                                            best_score, best_index)
    # One reduction at the end: the best score, and the first column that has it (a split
    # whose scores are all -inf reports its first column, as a lone argmax would).
    top, first = _first_best(best_score, best_index)
    tl.store(best_score_ptr + row * num_splits + split, top)
    tl.store(best_index_ptr + row * num_splits + split, tl.where(first == 2**31 - 1, start, first))


@triton.jit(do_not_specialize=["num_splits"])
def _pick_kernel(best_score_ptr, best_index_ptr, out_ptr, num_splits, key_ptr, ADVANCE: tl.constexpr,
                 STRIDE: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
    row = tl.program_id(0)
    if ADVANCE:
        if row == 0:
            tl.store(key_ptr, tl.load(key_ptr) + STRIDE)
    lane = tl.arange(0, BLOCK_S)
    best_score = tl.full([BLOCK_S], -float("inf"), tl.float32)
    best_index = tl.full([BLOCK_S], 2**31 - 1, tl.int32)
    for start in range(0, num_splits, BLOCK_S):  # a lane sees its splits, so their first columns, in order
        splits = start + lane
        score = tl.load(best_score_ptr + row * num_splits + splits, mask=splits < num_splits, other=-float("inf"))
        index = tl.load(best_index_ptr + row * num_splits + splits, mask=splits < num_splits, other=2**31 - 1)
        best_score, best_index = _keep_best(score, index, best_score, best_index)
    tl.store(out_ptr + row, _first_best(best_score, best_index)[1])


def vocab_splits(num_rows: int, vocab: int, device: torch.device) -> int:
    """Splits per row so that there are about four programs per SM (at least one tile each)."""
    sms = sm_count(device)
    return max(1, min(-(-4 * sms // max(num_rows, 1)), -(-vocab // (4 * BLOCK))))


def sample_temperature(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor,
                       seeds: torch.Tensor | None = None, num_splits: int | None = None,
                       out: torch.Tensor | None = None, draw_key: torch.Tensor | None = None) -> torch.Tensor:
    """logits [n, vocab] (any float dtype, unit stride on vocab), temperature float32 [n],
    greedy bool [n] (argmax rows), and either seeds int64 [n] (one Philox key per row) or
    draw_key int64 [1] (row i's key is draw_key + i; advanced by KEY_STRIDE) -> token ids [n]:
    ``out`` (int32 or int64, contiguous) if given, else a new int64 tensor."""
    num_rows, vocab = logits.shape
    assert (seeds is None) != (draw_key is None), "give either seeds or draw_key"
    keys = seeds if draw_key is None else draw_key
    assert logits.stride(-1) == 1 and greedy.shape == temperature.shape == (num_rows,)
    assert keys.dtype == torch.int64 and keys.shape == ((num_rows,) if draw_key is None else (1,))
    assert vocab < 2**31, "Philox offsets are 32-bit vocabulary indices"
    assert num_rows <= KEY_STRIDE, f"at most {KEY_STRIDE} rows a draw"
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    assert out.shape == (num_rows,) and out.stride(0) == 1 and out.dtype in (torch.int32, torch.int64)
    if num_rows == 0:
        return out
    splits = num_splits or vocab_splits(num_rows, vocab, logits.device)
    per_split = -(-vocab // (splits * BLOCK)) * BLOCK  # whole tiles: the noise of a column never moves
    best_score = torch.empty(num_rows, splits, dtype=torch.float32, device=logits.device)
    best_index = torch.empty(num_rows, splits, dtype=torch.int32, device=logits.device)
    pdl = launch_pdl(logits.device)
    _partial_kernel[(num_rows, splits)](logits, logits.stride(0), temperature, greedy, keys, best_score,
                                        best_index, vocab, per_split, splits, ROW_SEEDS=draw_key is None, BLOCK=BLOCK,
                                        PDL=pdl, num_warps=4, launch_pdl=pdl)
    _pick_kernel[(num_rows,)](best_score, best_index, out, splits, keys, ADVANCE=draw_key is not None,
                              STRIDE=KEY_STRIDE, BLOCK_S=64, PDL=pdl, num_warps=2, launch_pdl=pdl)
    return out
