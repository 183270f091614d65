"""The attention backend interface and the per-step metadata every backend reads.

One call form covers every row kind in a batch: full prefill, prefix-cached prefill,
chunked prefill and decode. Sequence i contributes ``q_len_i = cu_seqlens_q[i+1] -
cu_seqlens_q[i]`` new query tokens and attends, causally, to the first ``context_lens[i]``
tokens stored in its blocks (the new tokens included, written just before). Query j of
sequence i sits at position ``context_lens[i] - q_len_i + j``.

The KV cache of one layer is a pair k_cache, v_cache, each
[num_blocks, block_size, num_kv_heads, head_dim] (FlashAttention's paged layout).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from twinplane.kernels.rope_store import QKVRope


@dataclass
class AttentionMetadata:
    """Per-step description of the batch, built by the model runner, read by attention."""

    cu_seqlens_q: torch.Tensor  # int32 [n + 1]: query token offsets of each sequence
    cu_seqlens_k: torch.Tensor  # int32 [n + 1]: cumulative context_lens (flash-attn 2 varlen)
    context_lens: torch.Tensor  # int32 [n]: tokens in the cache after this step (seqused_k)
    max_seqlen_q: int
    max_seqlen_k: int
    slot_mapping: torch.Tensor  # int32 [T]: cache slot of each new token; -1 = do not store
    block_tables: torch.Tensor  # int32 [n, max_blocks]: block ids, padded with 0 (page_table)
    # Host copies for backends that loop in Python (the torch backend); no device sync needed.
    query_lens_host: list[int]
    context_lens_host: list[int]
    # Decode steps: int32 [n], the sequences by context, longest first (the order in which the
    # decode kernel starts them); None for other steps.
    decode_order: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_host)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_host)


class AttentionBackend(ABC):
    """Stores new K/V into the paged cache and attends over it."""

    name: str = "base"
    # Whether one CUDA graph can serve every step with the same number of query tokens and
    # sequences: the launch must not depend on host-side lengths (max_seqlen_q aside).
    graphs_mixed_steps: bool = False

    @abstractmethod
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store k, v [T, kv_heads, head_dim] at ``slot_mapping`` [T]; slots of -1 are skipped."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T, heads, head_dim] -> attention output [T, heads, head_dim]."""

    def decode_from_qkv(self, qkv: torch.Tensor, rope: QKVRope, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        metadata: AttentionMetadata, scale: float) -> torch.Tensor | None:
        """Attention output [T, heads, head_dim] straight from the fused q/k/v projection (q/k
        norm, RoPE and the K/V store done inside), where the backend has a kernel for this step;
        None: the caller runs those steps itself and calls ``forward``."""
        return None
