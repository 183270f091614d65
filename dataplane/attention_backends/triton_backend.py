"""Our Triton kernels for every step, over a cache in the model dtype or in float8.

- Steps of decodes only: the split-KV decode kernel (``kernels/decode_attention.py``), from
  the fused q/k/v projection (``decode_from_qkv``: q/k norm, RoPE and the K/V store inside).
- Steps with prompt tokens: ``kernels/rope_store.py`` stores the step's K/V and then the
  paged prefill kernel (``kernels/prefill_attention.py``) attends, decode rows beside the
  prompts included. Its launch depends only on the number of query tokens and of sequences,
  so mixed steps are graphed too.

Needs no FlashAttention, and is the backend that reads a float8 cache (``--kv-cache-dtype
fp8``); FlashAttention-4 on Hopper also uses the decode kernel (``TritonDecode``), and
``TritonKVWriter`` stores K/V for the FlashAttention backends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from twinplane.dataplane.attention_backends.base import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from twinplane.kernels.rope_store import QKVRope


class TritonKVWriter:
    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        from twinplane.kernels.kv_writer import store_kv

        store_kv(k, v, k_cache, v_cache, slot_mapping)


class TritonDecode:
    """Decode-only steps through the Triton decode kernel, where ``self._decode`` holds its module."""

    _decode = None

    def _decode_kernels(self, metadata: AttentionMetadata, k_cache: torch.Tensor):
        """The Triton decode module if this step is decode-only and its shape is supported, else None."""
        decode = self._decode
        if decode is not None and metadata.max_seqlen_q == 1 and decode.supports(k_cache.shape[-1], k_cache.shape[1]):
            return decode
        return None

    def decode_from_qkv(self, qkv: torch.Tensor, rope: QKVRope, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        metadata: AttentionMetadata, scale: float) -> torch.Tensor | None:
        decode = self._decode_kernels(metadata, k_cache)
        if decode is None:
            return None
        return decode.decode_attention_from_qkv(qkv, rope, k_cache, v_cache, metadata.slot_mapping,
                                                metadata.block_tables, metadata.context_lens, scale,
                                                order=metadata.decode_order)

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
               scale: float) -> torch.Tensor | None:
        """Attention of a decode-only step from its queries, or None where the decode kernel does not take it."""
        decode = self._decode_kernels(metadata, k_cache)
        if decode is None:
            return None
        return decode.paged_decode_attention(q, k_cache, v_cache, metadata.block_tables, metadata.context_lens,
                                             scale, order=metadata.decode_order)


class TritonAttentionBackend(TritonDecode, TritonKVWriter, AttentionBackend):
    name = "triton"
    graphs_mixed_steps = True  # the prefill kernel's grid follows the token and sequence counts only

    def __init__(self) -> None:
        from twinplane.kernels import decode_attention, prefill_attention  # ImportError without triton

        if not torch.cuda.is_available():
            raise ImportError("the triton attention backend runs on CUDA")
        self._decode, self._prefill = decode_attention, prefill_attention

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        out = self.decode(q, k_cache, v_cache, metadata, scale)
        if out is not None:
            return out
        return self._prefill.paged_prefill_attention(q, k_cache, v_cache, metadata.cu_seqlens_q, metadata.context_lens,
                                                     metadata.block_tables, scale)
