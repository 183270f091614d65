"""Attention over the paged KV cache: stores this step's K/V, then attends via a backend.

The module projects nothing: it takes q [T, heads * d], k and v [T, kv_heads * d] and
returns [T, heads * d]; ``attend`` takes q alone, when the caller stored K/V itself. The
model runner binds ``k_cache`` / ``v_cache`` (views into one preallocated tensor) after the
model is built; the backend is fixed at construction.
"""

from __future__ import annotations

import torch
from torch import nn

from twinplane.dataplane.attention_backends.base import AttentionBackend, AttentionMetadata


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

    def attend(self, q: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Attention of q [T, heads, head_dim] over the cache, this step's K/V already stored -> [T, heads * d]."""
        out = self.backend.forward(q, self.k_cache, self.v_cache, metadata, self.scale)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
