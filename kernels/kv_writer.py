"""Triton kernel that stores this step's K and V into the paged KV cache.

One program per token: it reads the token's slot (block_id * block_size + offset)
and copies its K and V rows (kv_heads * head_dim values each) into the cache,
skipping slot -1 (tokens whose K/V must not be stored). The cache of one layer
is [num_blocks, block_size, kv_heads, head_dim], contiguous, so a slot is a row
of kv_heads * head_dim values.

A cache in float8 (e4m3, ``--kv-cache-dtype fp8``) holds each value as it is, without a
scale, clamped to the format's finite range (``cache_value``, shared by every kernel that
stores K/V); readers convert back to the compute dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


FP8_MAX = tl.constexpr(448.0)  # the largest finite float8 e4m3 value (torch.finfo(torch.float8_e4m3fn).max)


@triton.jit
def cache_value(x, dtype: tl.constexpr):
    """x converted for a KV cache of ``dtype``: clamped to float8's finite range first, where the
    cache is float8 (a value past it would not round to the largest finite one everywhere)."""
    if dtype.is_fp8():
        return tl.clamp(x.to(tl.float32), -FP8_MAX, FP8_MAX).to(dtype)
    else:
        return x.to(dtype)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_stride, v_stride, k_cache_ptr, v_cache_ptr, slot_ptr,
                     ROW: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    cols = tl.arange(0, BLOCK)
    mask = cols < ROW
    k = tl.load(k_ptr + token * k_stride + cols, mask=mask)
    v = tl.load(v_ptr + token * v_stride + cols, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + cols, cache_value(k, k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * ROW + cols, cache_value(v, v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v [T, kv_heads, head_dim] (rows may be strided) -> caches at slot_mapping [T] (int32/64)."""
    num_tokens = k.shape[0]
    row = k.shape[1] * k.shape[2]
    assert k.shape == v.shape and slot_mapping.shape[0] == num_tokens, "k, v and slot_mapping disagree"
    assert k.stride(-1) == 1 and k.stride(-2) == k.shape[2] and v.stride(-1) == 1 and v.stride(-2) == v.shape[2], \
        "each token's K/V must be one contiguous row"
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "the KV cache must be contiguous"
    assert k_cache.shape[2] * k_cache.shape[3] == row, "cache does not fit k"
    assert k_cache.dtype in (k.dtype, torch.float8_e4m3fn) and v_cache.dtype == k_cache.dtype, "cache dtype"
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](k, v, k.stride(0), v.stride(0), k_cache, v_cache, slot_mapping,
                                    ROW=row, BLOCK=triton.next_power_of_2(row))
