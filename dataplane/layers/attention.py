"""Attention over the paged KV cache: stores this step's K/V, then attends via a backend.

The module projects nothing: it takes q [T, heads * d], k and v [T, kv_heads * d] and
returns [T, heads * d]; ``attend`` takes q alone, when the caller stored K/V itself, and
``attend_qkv`` the fused q/k/v projection before q/k norm and RoPE (CUDA). The
model runner binds ``k_cache`` / ``v_cache`` (views into one preallocated tensor) after the
model is built; the backend is fixed at construction.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from twinplane.dataplane.attention_backends.base import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from twinplane.kernels.rope_store import QKVRope


class Attention(nn.Module):
    """Paged attention for one layer (this rank's heads)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 backend: AttentionBackend) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0, f"{num_heads} heads not a multiple of {num_kv_heads} kv heads"
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.backend = backend
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def bind_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Attach this layer's cache views, each [num_blocks, block_size, kv_heads, head_dim]."""
        expected = (self.num_kv_heads, self.head_dim)
        assert tuple(k_cache.shape[2:]) == expected and k_cache.shape == v_cache.shape, (
            f"cache shape {tuple(k_cache.shape)} does not fit kv_heads, head_dim = {expected}")
        self.k_cache, self.v_cache = k_cache, v_cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        assert self.k_cache.numel() > 0, "KV cache is not bound; the model runner allocates it before forward"
        num_tokens = q.shape[0]
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        self.backend.write_kv(k, v, self.k_cache, self.v_cache, metadata.slot_mapping)
        return self.attend(q, metadata)

    def attend_qkv(self, qkv: torch.Tensor, rope: QKVRope, metadata: AttentionMetadata) -> torch.Tensor:
        """Attention straight from the fused q/k/v projection [T, (heads + 2 kv_heads) * d] -> [T, heads * d]:
        one kernel where the backend has it for this step, else q/k norm, RoPE and the K/V store
        as one kernel (``kernels/rope_store.py``) and then the backend's attention. CUDA only."""
        from twinplane.kernels.rope_store import norm_rope_store

        out = self.backend.decode_from_qkv(qkv, rope, self.k_cache, self.v_cache, metadata, self.scale)
        if out is None:
            q = norm_rope_store(qkv, rope, self.k_cache, self.v_cache, metadata.slot_mapping)
            out = self.backend.forward(q, self.k_cache, self.v_cache, metadata, self.scale)
        return out.reshape(qkv.shape[0], self.num_heads * self.head_dim)

    def attend(self, q: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Attention of q [T, heads, head_dim] over the cache, this step's K/V already stored -> [T, heads * d]."""
        out = self.backend.forward(q, self.k_cache, self.v_cache, metadata, self.scale)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
