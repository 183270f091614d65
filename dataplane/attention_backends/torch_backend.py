"""Plain torch attention over the paged KV cache (CPU, tests, and a GPU fallback).

Each sequence gathers its context K/V through its block table and runs one
``scaled_dot_product_attention`` call with a causal mask shifted by
``context_len - q_len``, so prefill, prefix-cached prefill, chunked prefill and decode
rows mix freely in one batch. Grouped-query attention is handled by SDPA's ``enable_gqa``.
An fp8 cache stores K/V clamped to the format's finite range and is read back in q's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from twinplane.dataplane.attention_backends.base import AttentionBackend, AttentionMetadata


def _store(flat_cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """flat_cache[slots] = values, in the cache's dtype. Into a float8 cache, values are clamped to its
    finite range first (a cast past it gives NaN in some torch versions, and in kernels: e4m3fn has no
    infinity) and copied through uint8 views (index_copy_ has no float8 kernel on CPU)."""
    if flat_cache.dtype.is_floating_point and flat_cache.dtype.itemsize == 1:
        limit = torch.finfo(flat_cache.dtype).max
        stored = values.clamp(-limit, limit).to(flat_cache.dtype)
        flat_cache.view(torch.uint8).index_copy_(0, slots, stored.view(torch.uint8))
    else:
        flat_cache.index_copy_(0, slots, values.to(flat_cache.dtype))


def write_kv_by_slot(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k_cache.flat[slot] = k for every token whose slot is not -1 (likewise v)."""
    assert k.shape == v.shape and k.shape[0] == slot_mapping.shape[0], (
        f"k {tuple(k.shape)}, v {tuple(v.shape)} and slot_mapping {tuple(slot_mapping.shape)} disagree")
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    _store(flat_k, slots, k[keep])
    _store(flat_v, slots, v[keep])


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """cache [blocks, block_size, kv_heads, d] -> the sequence's first context_len tokens [ctx, kv_heads, d]."""
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)
    blocks = cache.index_select(0, block_table[:num_blocks].long())
    return blocks.flatten(0, 1)[:context_len]


def _causal_mask(q_len: int, context_len: int, device: torch.device) -> torch.Tensor:
    """bool [q_len, context_len]: query j sees keys at positions <= context_len - q_len + j."""
    query_pos = torch.arange(q_len, device=device) + (context_len - q_len)
    key_pos = torch.arange(context_len, device=device)
    return key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)


class TorchAttentionBackend(AttentionBackend):
    """Loops over sequences in Python; exact and simple rather than fast."""

    name = "torch"

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        write_kv_by_slot(k, v, k_cache, v_cache, slot_mapping)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        start = 0
        for i, (q_len, context_len) in enumerate(zip(metadata.query_lens_host, metadata.context_lens_host)):
            assert 0 < q_len <= context_len, f"sequence {i}: q_len {q_len} must be in (0, context_len {context_len}]"
            block_table = metadata.block_tables[i]
            keys = _gather_context(k_cache, block_table, context_len).transpose(0, 1)
            values = _gather_context(v_cache, block_table, context_len).transpose(0, 1)
            queries = q[start:start + q_len].transpose(0, 1)  # [heads, q_len, d]
            mask = None if q_len == 1 else _causal_mask(q_len, context_len, q.device)
            # K/V in q's dtype: an fp8 cache is read back as the compute dtype (SDPA takes no float8)
            attended = F.scaled_dot_product_attention(
                queries, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=True)
            out[start:start + q_len] = attended.transpose(0, 1)
            start += q_len
        return out
