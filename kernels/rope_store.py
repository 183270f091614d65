"""Triton kernel from the fused q/k/v projection to attention's inputs, in one pass per token.

Between the q/k/v projection and attention a decoder layer does: per-head RMSNorm of q and
of k (Qwen3), rotary embedding of q and k, and the store of k and v into the paged cache.
As separate kernels that is five launches per layer (four reads and writes of q and k);
at decode batch sizes each is a few microseconds of mostly launch latency, 28 layers deep.
Here one program per token reads its q, k and v rows from the projection output once,
writes the rotated q for attention and stores the rotated k and the v at the token's
cache slot (nothing for slot -1). Attention reads k and v from the cache only, so k is
never written anywhere else.

Decode steps on Hopper do the same inside the decode attention kernel instead
(``decode_q_store_kv`` below, called from ``kernels/decode_attention.py``).

Rounding follows the unfused layers: the norm's result is rounded to the model dtype and
then scaled by the weight (rounded again), RoPE is computed in float32 and rounded once.
RoPE is the rotate-half layout with cos and sin read from the cached table
[max_position, head_dim] (cos in the first half, sin in the second).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from twinplane.kernels.kv_writer import cache_value


class QKVRope(NamedTuple):
    """What turns a row of the fused q/k/v projection into attention's q and the cached K/V."""

    num_heads: int
    num_kv_heads: int
    positions: torch.Tensor  # [T], each token's position
    cos_sin_cache: torch.Tensor  # [max_position, head_dim]: cos in the first half, sin in the second
    q_norm: torch.Tensor | None  # [head_dim] RMSNorm weights (Qwen3), or None for no q/k norm
    k_norm: torch.Tensor | None
    eps: float


@triton.jit
def _norm_rope(x1, x2, weight_ptr, d, cos, sin, eps, HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    """Halves x1, x2 [heads, HALF] (float32) -> normed (if HAS_NORM) and rotated halves (float32)."""
    if HAS_NORM:
        dtype = weight_ptr.dtype.element_ty
        w1 = tl.load(weight_ptr + d).to(tl.float32)[None, :]
        w2 = tl.load(weight_ptr + HALF + d).to(tl.float32)[None, :]
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
        x1 = ((x1 * inv).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * inv).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _store_kv(k_row, at, v_offset, cos, sin, k_norm_ptr, d, eps, k_cache_ptr, v_cache_ptr, cache_at, mask,
              HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    """Normalises (if HAS_NORM) and rotates the keys at ``k_row + at`` (first halves [rows, HALF])
    and stores them, and the values ``v_offset`` further along the row, at ``cache_at`` where ``mask``."""
    k1, k2 = _norm_rope(tl.load(k_row + at, mask=mask).to(tl.float32),
                        tl.load(k_row + at + HALF, mask=mask).to(tl.float32),
                        k_norm_ptr, d, cos, sin, eps, HALF, HAS_NORM)
    dtype = k_cache_ptr.dtype.element_ty
    k_row_dtype = k_row.dtype.element_ty  # rounded to the model dtype first, as the unfused layers do
    tl.store(k_cache_ptr + cache_at, cache_value(k1.to(k_row_dtype), dtype), mask=mask)
    tl.store(k_cache_ptr + cache_at + HALF, cache_value(k2.to(k_row_dtype), dtype), mask=mask)
    v_row = k_row + v_offset
    tl.store(v_cache_ptr + cache_at, cache_value(tl.load(v_row + at, mask=mask), dtype), mask=mask)
    tl.store(v_cache_ptr + cache_at + HALF, cache_value(tl.load(v_row + at + HALF, mask=mask), dtype), mask=mask)


@triton.jit
def decode_q_store_kv(row, heads, row_ok, kv_head, position_ptr, cos_sin_ptr, q_norm_ptr, k_norm_ptr, eps,
                      slot_ptr, k_cache_ptr, v_cache_ptr, slot_stride, head_stride, store,
                      HEADS: tl.constexpr, KV_HEADS: tl.constexpr, ROWS: tl.constexpr, HALF: tl.constexpr,
                      HAS_NORM: tl.constexpr):
    """For decode attention straight from one token's q/k/v projection row ``row``: returns the
    normed, rotated queries of ``heads`` [ROWS] as [ROWS, 2 * HALF] (zeros where not ``row_ok``)
    and, if ``store`` (and the token's slot is not -1), stores KV head ``kv_head``'s normed,
    rotated key and its value at the token's cache slot. Ends with a barrier, so the calling
    program's later loads of that slot see what it stored."""
    head_dim: tl.constexpr = 2 * HALF
    pos = tl.load(position_ptr).to(tl.int64)
    slot = tl.load(slot_ptr).to(tl.int64)
    d = tl.arange(0, HALF)
    cos = tl.load(cos_sin_ptr + pos * head_dim + d)[None, :]
    sin = tl.load(cos_sin_ptr + pos * head_dim + HALF + d)[None, :]
    at = heads[:, None] * head_dim + d[None, :]
    q1, q2 = _norm_rope(tl.load(row + at, mask=row_ok[:, None], other=0.0).to(tl.float32),
                        tl.load(row + at + HALF, mask=row_ok[:, None], other=0.0).to(tl.float32),
                        q_norm_ptr, d, cos, sin, eps, HALF, HAS_NORM)
    dtype = row.dtype.element_ty
    q = tl.reshape(tl.permute(tl.join(q1.to(dtype), q2.to(dtype)), (0, 2, 1)), (ROWS, head_dim))

    cache_at = slot * slot_stride + kv_head * head_stride + d[None, :]
    store = d[None, :] < tl.where(store & (slot >= 0), HALF, 0)  # the whole row or none of it
    _store_kv(row + (HEADS + kv_head) * head_dim, d[None, :], KV_HEADS * head_dim, cos, sin, k_norm_ptr, d, eps,
              k_cache_ptr, v_cache_ptr, cache_at, store, HALF, HAS_NORM)
    tl.debug_barrier()
    return q


@triton.jit
def _rope_store_kernel(qkv_ptr, stride_t, positions_ptr, cos_sin_ptr, q_norm_ptr, k_norm_ptr, eps,
                       q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                       HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
                       KV_HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    token = tl.program_id(0)
    head_dim: tl.constexpr = 2 * HALF
    row = qkv_ptr + token.to(tl.int64) * stride_t
    pos = tl.load(positions_ptr + token).to(tl.int64)
    d = tl.arange(0, HALF)
    cos = tl.load(cos_sin_ptr + pos * head_dim + d)[None, :]
    sin = tl.load(cos_sin_ptr + pos * head_dim + HALF + d)[None, :]

    h = tl.arange(0, HEADS_PAD)[:, None]
    at = h * head_dim + d[None, :]
    mask = h < HEADS
    q1, q2 = _norm_rope(tl.load(row + at, mask=mask).to(tl.float32), tl.load(row + at + HALF, mask=mask).to(tl.float32),
                        q_norm_ptr, d, cos, sin, eps, HALF, HAS_NORM)
    out = q_out_ptr + token.to(tl.int64) * (HEADS * head_dim)
    tl.store(out + at, q1.to(q_out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + at + HALF, q2.to(q_out_ptr.dtype.element_ty), mask=mask)

    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        kh = tl.arange(0, KV_HEADS_PAD)[:, None]
        k_at = kh * head_dim + d[None, :]
        _store_kv(row + HEADS * head_dim, k_at, KV_HEADS * head_dim, cos, sin, k_norm_ptr, d, eps, k_cache_ptr,
                  v_cache_ptr, slot * (KV_HEADS * head_dim) + k_at, kh < KV_HEADS, HALF, HAS_NORM)


def check_qkv(qkv: torch.Tensor, rope: QKVRope, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """Asserts the shapes both kernels from the q/k/v projection rely on; returns head_dim."""
    head_dim = rope.cos_sin_cache.shape[-1]
    assert qkv.shape[1] == (rope.num_heads + 2 * rope.num_kv_heads) * head_dim and qkv.stride(1) == 1
    assert head_dim % 2 == 0 and (head_dim // 2) & (head_dim // 2 - 1) == 0, f"head_dim {head_dim}: half must be 2^k"
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "K/V are stored by flat slot index"
    assert k_cache.shape[2:] == (rope.num_kv_heads, head_dim) and (rope.q_norm is None) == (rope.k_norm is None)
    return head_dim


def norm_rope_store(qkv: torch.Tensor, rope: QKVRope, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> torch.Tensor:
    """qkv [T, (heads + 2 kv_heads) * d] -> q [T, heads, d] normed and rotated; k (normed,
    rotated) and v stored in the caches [num_blocks, block_size, kv_heads, d] at slot_mapping [T]."""
    num_tokens = qkv.shape[0]
    head_dim = check_qkv(qkv, rope, k_cache, v_cache)
    assert slot_mapping.shape[0] == num_tokens
    q = torch.empty(num_tokens, rope.num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    has_norm = rope.q_norm is not None
    _rope_store_kernel[(num_tokens,)](
        qkv, qkv.stride(0), rope.positions, rope.cos_sin_cache, rope.q_norm if has_norm else qkv,
        rope.k_norm if has_norm else qkv, rope.eps, q, k_cache, v_cache, slot_mapping, HEADS=rope.num_heads,
        KV_HEADS=rope.num_kv_heads, HEADS_PAD=triton.next_power_of_2(rope.num_heads),
        KV_HEADS_PAD=triton.next_power_of_2(rope.num_kv_heads), HALF=head_dim // 2, HAS_NORM=has_norm, num_warps=4)
    return q
