"""Triton sampling for rows that use only temperature (and token masks): one pass over the logits, then a pick.

A temperature draw is an inverse-CDF draw from softmax(logit / T): one uniform ``u`` per row,
and the token where the cumulative probability first passes ``u``. The vocabulary is cut into
tiles of ``BLOCK`` logits, and two kernels share the work:

- ``_partial_kernel``: one program per (row, vocabulary split). For a sampled row it writes
  each of its tiles' max ``m`` of logit / T and sum of exp(logit / T - m) (the split holding
  tile 0 also writes the row's ``u``); for a greedy row (T = 0) the best logit of its range
  and its index. That is one read of the bf16 logits and one exponential a logit, where a
  Gumbel-max draw took a Philox number and two logarithms a logit and was bound by them: on
  an H200 the sampler takes 24 us at 128 rows against 85 (BENCHMARKS.md), though still under
  half the GPU's read rate. Splits keep the GPU busy when there are few rows. Sizes are
  runtime arguments, so one compiled kernel serves every batch.
- ``_pick_kernel``: one program per row. A sampled row weighs its tiles by their sums
  (rescaled to the row's max), takes the tile where the cumulative weight passes ``u`` times
  the total, and then the token inside that tile the same way, reading only that tile's
  logits again. A greedy row takes the index of its best split (the first on ties, as
  ``torch.argmax``). Either stores into the caller's output in its dtype (a CUDA graph of
  decode steps stores int32 tokens where the next step reads them).
- On sm_90 and newer both are launched with programmatic dependent launch: each launches while
  the kernel ahead of it runs and waits for it before reading anything.

A row with a token mask (structured output) reads its packed mask beside its logits, a byte per eight
tokens: both kernels see a token outside it as -inf, so the row takes the best of its allowed tokens or
draws among them in the same one pass. Rows without a mask read none.

The tiles start at multiples of ``BLOCK`` whatever the split count, and the pick adds them up
in one fixed order, so a row's draw depends on its logits and its seed alone: not on its place
in the batch, on the other rows or on the number of splits. ``u`` is Philox keyed by the
row's seed.

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
TILES = 4  # tiles a sampled row's program reads at once
KEY_STRIDE = 1 << 16  # a draw with draw_key: at most this many rows, keys draw_key + row
LOG2E = tl.constexpr(1.4426950408889634)


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
def _mask_of(masks_ptr, mask_index_ptr, mask_width, row, MASKED: tl.constexpr):
    """(where the row's token mask starts, whether it has one): row i's mask is mask_index[i] of the
    masks (-1: none)."""
    if MASKED:
        which = tl.load(mask_index_ptr + row)
        return masks_ptr + tl.maximum(which, 0).to(tl.int64) * mask_width, which >= 0
    else:
        return masks_ptr, False


@triton.jit
def _logits(logits_row, cols, end, mask_row, has_mask, MASKED: tl.constexpr):
    """The logits at cols (float32): -inf from end on, and for a row with a token mask at the tokens it
    does not allow (bit t % 8 of byte t // 8 clear). A row without one reads no mask: its loads are off."""
    x = tl.load(logits_row + cols, mask=cols < end, other=-float("inf")).to(tl.float32)
    if MASKED:
        byte = tl.load(mask_row + (cols >> 3), mask=cols < tl.where(has_mask, end, 0), other=255).to(tl.int32)
        x = tl.where(((byte >> (cols & 7)) & 1) != 0, x, -float("inf"))
    return x


@triton.jit
def _scaled(logits_row, cols, vocab, temperature, mask_row, has_mask, MASKED: tl.constexpr):
    """logit / T at cols, -inf past the vocabulary and outside the row's mask (the partial and the pick
    kernel compute it alike)."""
    return _logits(logits_row, cols, vocab, mask_row, has_mask, MASKED) / temperature


@triton.jit
def _tile_weights(x, top):
    """exp(x - top) for each x; 0 where x is -inf (everywhere, in a tile that has no finite x)."""
    shift = tl.where(top > -float("inf"), top, 0.0)
    return tl.where(x > -float("inf"), tl.exp2((x - shift) * LOG2E), 0.0)


@triton.jit
def _first_past(cumulative, weights, target, index):
    """The first index whose cumulative weight passes target; where rounding leaves none, the last
    index of nonzero weight; 0 where no weight is above 0 (NaN logits, or a temperature so small
    that logit / T overflows: the padding rows of a graph hold whatever was left there)."""
    past = tl.min(tl.where(cumulative > target, index, 2**31 - 1), axis=0)
    return tl.maximum(tl.minimum(past, tl.max(tl.where(weights > 0, index, -1), axis=0)), 0)


@triton.jit
def _lane(values, chosen):
    """values at the one lane where chosen is true (a scalar)."""
    return tl.sum(tl.where(chosen, values, 0.0), axis=0)


@triton.jit(do_not_specialize=["stride_row", "vocab", "per_split", "num_splits", "num_tiles", "mask_width"])
def _partial_kernel(logits_ptr, stride_row, temperature_ptr, greedy_ptr, seeds_ptr, best_score_ptr,
                    best_index_ptr, tile_max_ptr, tile_sum_ptr, u_ptr, vocab, per_split, num_splits, num_tiles,
                    masks_ptr, mask_index_ptr, mask_width, ROW_SEEDS: tl.constexpr, MASKED: tl.constexpr,
                    BLOCK: tl.constexpr, TILES: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0)
    split = tl.program_id(1)
    temperature = tl.where(tl.load(greedy_ptr + row), 0.0, tl.load(temperature_ptr + row))
    logits_row = logits_ptr + row.to(tl.int64) * stride_row
    mask_row, has_mask = _mask_of(masks_ptr, mask_index_ptr, mask_width, row, MASKED)
    start = split * per_split
    end = tl.minimum(start + per_split, vocab)
    lane = tl.arange(0, BLOCK)
    if temperature > 0:
        if split == 0:
            if ROW_SEEDS:
                seed = tl.load(seeds_ptr + row)
            else:  # the draw's key (advanced by the pick kernel, which runs once this one is done)
                seed = tl.load(seeds_ptr) + row
            pair = tl.arange(0, 2)
            tl.store(u_ptr + row, tl.sum(tl.where(pair == 0, tl.rand(seed, pair), 0.0), axis=0))
        tiles = tl.arange(0, TILES)
        for tile in range(start // BLOCK, tl.cdiv(end, BLOCK), TILES):  # per_split is whole tiles
            cols = (tile + tiles)[:, None] * BLOCK + lane[None, :]
            x = _scaled(logits_row, cols, end, temperature, mask_row, has_mask, MASKED)
            top = tl.max(x, axis=1)
            total = tl.sum(_tile_weights(x, top[:, None]), axis=1)
            ours = (tile + tiles) * BLOCK < end
            tl.store(tile_max_ptr + row * num_tiles + tile + tiles, top, mask=ours)
            tl.store(tile_sum_ptr + row * num_tiles + tile + tiles, total, mask=ours)
    else:
        best_score = tl.full([BLOCK], -float("inf"), tl.float32)
        best_index = tl.full([BLOCK], 2**31 - 1, tl.int32)
        for tile in range(start, end, BLOCK):
            x = _logits(logits_row, tile + lane, end, mask_row, has_mask, MASKED)
            best_score, best_index = _keep_best(x, tile + lane, best_score, best_index)
        # The best score, and the first column that has it (a split whose logits are all -inf
        # reports its first column, as a lone argmax would).
        top, first = _first_best(best_score, best_index)
        tl.store(best_score_ptr + row * num_splits + split, top)
        tl.store(best_index_ptr + row * num_splits + split, tl.where(first == 2**31 - 1, start, first))


@triton.jit(do_not_specialize=["stride_row", "vocab", "num_splits", "num_tiles", "mask_width"])
def _pick_kernel(logits_ptr, stride_row, temperature_ptr, greedy_ptr, best_score_ptr, best_index_ptr, tile_max_ptr,
                 tile_sum_ptr, u_ptr, out_ptr, vocab, num_splits, num_tiles, key_ptr, masks_ptr, mask_index_ptr,
                 mask_width, ADVANCE: tl.constexpr, MASKED: tl.constexpr, STRIDE: tl.constexpr, BLOCK: tl.constexpr,
                 BLOCK_S: tl.constexpr, TILES_PAD: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
    row = tl.program_id(0)
    if ADVANCE:
        if row == 0:
            tl.store(key_ptr, tl.load(key_ptr) + STRIDE)
    temperature = tl.where(tl.load(greedy_ptr + row), 0.0, tl.load(temperature_ptr + row))
    if temperature > 0:
        tiles = tl.arange(0, TILES_PAD)
        stats = row * num_tiles + tiles
        top = tl.load(tile_max_ptr + stats, mask=tiles < num_tiles, other=-float("inf"))
        total = tl.load(tile_sum_ptr + stats, mask=tiles < num_tiles, other=0.0)
        row_top = tl.max(top, axis=0)
        scale = _tile_weights(top, row_top)  # each tile's sums in units of exp(row_top)
        weights = total * scale
        cumulative = tl.cumsum(weights, axis=0)
        target = tl.load(u_ptr + row) * tl.sum(weights, axis=0)
        tile = _first_past(cumulative, weights, target, tiles)
        chosen = tiles == tile
        # what is left of the target inside the chosen tile, in that tile's own units
        rest = (target - _lane(cumulative - weights, chosen)) / _lane(scale, chosen)
        cols = tl.arange(0, BLOCK)
        mask_row, has_mask = _mask_of(masks_ptr, mask_index_ptr, mask_width, row, MASKED)
        x = _scaled(logits_ptr + row.to(tl.int64) * stride_row, tile * BLOCK + cols, vocab, temperature, mask_row,
                    has_mask, MASKED)
        probs = _tile_weights(x, _lane(top, chosen))
        token = tile * BLOCK + _first_past(tl.cumsum(probs, axis=0), probs, rest, cols)
    else:
        lane = tl.arange(0, BLOCK_S)
        best_score = tl.full([BLOCK_S], -float("inf"), tl.float32)
        best_index = tl.full([BLOCK_S], 2**31 - 1, tl.int32)
        for start in range(0, num_splits, BLOCK_S):  # a lane sees its splits, so their first columns, in order
            splits = start + lane
            score = tl.load(best_score_ptr + row * num_splits + splits, mask=splits < num_splits,
                            other=-float("inf"))
            index = tl.load(best_index_ptr + row * num_splits + splits, mask=splits < num_splits, other=2**31 - 1)
            best_score, best_index = _keep_best(score, index, best_score, best_index)
        token = _first_best(best_score, best_index)[1]
        token = tl.where(token == 2**31 - 1, 0, token)  # no logit above -inf (or NaN only): 0, as argmax
    tl.store(out_ptr + row, token)


def vocab_splits(num_rows: int, vocab: int, device: torch.device) -> int:
    """Splits per row for about sixteen programs per SM (at least TILES tiles each): against four,
    greedy passes of 128-256 rows are 15-26% faster, sampled ones within 2 us (BENCHMARKS.md)."""
    sms = sm_count(device)
    return max(1, min(-(-16 * sms // max(num_rows, 1)), -(-vocab // (TILES * BLOCK))))


def sample_temperature(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor,
                       seeds: torch.Tensor | None = None, num_splits: int | None = None,
                       out: torch.Tensor | None = None, draw_key: torch.Tensor | None = None,
                       masks: torch.Tensor | None = None, mask_index: torch.Tensor | None = None) -> torch.Tensor:
    """logits [n, vocab] (any float dtype, unit stride on vocab), temperature float32 [n],
    greedy bool [n] (argmax rows), and either seeds int64 [n] (one Philox key per row) or
    draw_key int64 [1] (row i's key is draw_key + i; advanced by KEY_STRIDE) -> token ids [n]:
    ``out`` (int32 or int64, contiguous) if given, else a new int64 tensor.

    Token masks (structured output): ``masks`` uint8 [m, >= vocab / 8], each a packed set of tokens (bit
    t % 8 of byte t // 8), and ``mask_index`` int32 [n], the mask row i samples within (-1: none). A masked
    row takes the best of its allowed tokens or draws among them, as if the others' logits were -inf."""
    num_rows, vocab = logits.shape
    assert (seeds is None) != (draw_key is None), "give either seeds or draw_key"
    keys = seeds if draw_key is None else draw_key
    assert logits.stride(-1) == 1 and greedy.shape == temperature.shape == (num_rows,)
    assert keys.dtype == torch.int64 and keys.shape == ((num_rows,) if draw_key is None else (1,))
    assert vocab < 2**31, "vocabulary indices are 32-bit"
    assert num_rows <= KEY_STRIDE, f"at most {KEY_STRIDE} rows a draw"
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    assert out.shape == (num_rows,) and out.stride(0) == 1 and out.dtype in (torch.int32, torch.int64)
    assert (masks is None) == (mask_index is None), "give masks with their index"
    if masks is not None:
        assert masks.dtype == torch.uint8 and masks.stride(1) == 1 and masks.shape[1] * 8 >= vocab
        assert mask_index.dtype == torch.int32 and mask_index.shape == (num_rows,)
    if num_rows == 0:
        return out
    splits = num_splits or vocab_splits(num_rows, vocab, logits.device)
    num_tiles = -(-vocab // BLOCK)
    per_split = -(-num_tiles // splits) * BLOCK  # whole tiles, so a tile's sums never depend on the splits
    best_score = torch.empty(num_rows, splits, dtype=torch.float32, device=logits.device)
    best_index = torch.empty(num_rows, splits, dtype=torch.int32, device=logits.device)
    tile_max = torch.empty(num_rows, num_tiles, dtype=torch.float32, device=logits.device)
    tile_sum = torch.empty_like(tile_max)
    u = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    pdl, masked = launch_pdl(logits.device), masks is not None
    mask_args = (masks, mask_index, masks.stride(0)) if masked else (greedy, greedy, 0)  # unread when not masked
    _partial_kernel[(num_rows, splits)](logits, logits.stride(0), temperature, greedy, keys, best_score,
                                        best_index, tile_max, tile_sum, u, vocab, per_split, splits, num_tiles,
                                        *mask_args, ROW_SEEDS=draw_key is None, MASKED=masked, BLOCK=BLOCK,
                                        TILES=TILES, PDL=pdl, num_warps=4, launch_pdl=pdl)
    _pick_kernel[(num_rows,)](logits, logits.stride(0), temperature, greedy, best_score, best_index, tile_max,
                              tile_sum, u, out, vocab, splits, num_tiles, keys, *mask_args,
                              ADVANCE=draw_key is not None, MASKED=masked, STRIDE=KEY_STRIDE, BLOCK=BLOCK, BLOCK_S=64,
                              TILES_PAD=max(16, triton.next_power_of_2(num_tiles)), PDL=pdl, num_warps=4,
                              launch_pdl=pdl)
    return out
