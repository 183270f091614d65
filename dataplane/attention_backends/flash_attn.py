"""FlashAttention over the paged KV cache (CUDA), with the Triton KV writer.

- ``flash_attn_4``: FlashAttention-4 (``flash_attn.cute``, Hopper and Blackwell). One
  ``flash_attn_varlen_func`` call with ``page_table`` and ``seqused_k`` handles every
  row kind of a step with prefill in it: prefill, prefix-cached prefill, chunked prefill
  and decode. On Hopper, steps of decodes only go to our Triton split-KV decode kernel
  (``kernels/decode_attention.py``): FlashAttention-4 computes a 128-row query tile for
  the one or few query rows of a decode and has no split-KV on Hopper, and the Triton
  kernel reads the cache 1.4x faster on an H200 (batch 256 x 1,024 tokens: 260 vs 361 us
  per layer; BENCHMARKS.md). For those steps ``decode_from_qkv`` runs q/k norm, RoPE and
  the K/V store inside that kernel too.
- ``flash_attn_2``: the flash-attn 2 package. ``flash_attn_with_kvcache`` for pure
  decode steps, ``flash_attn_varlen_func(block_table=...)`` otherwise (its paged path
  needs a block size that is a multiple of 256).

FlashAttention reads whole pages, so rows past a sequence's length in its last page
must hold finite values: the model runner allocates the cache zeroed.
"""

from __future__ import annotations

import torch

from twinplane.dataplane.attention_backends.base import AttentionBackend, AttentionMetadata
from twinplane.dataplane.attention_backends.triton_backend import TritonDecode, TritonKVWriter


class FlashAttention4Backend(TritonDecode, TritonKVWriter, AttentionBackend):
    name = "flash_attn_4"
    graphs_mixed_steps = True  # its varlen grid follows the token and sequence counts only

    def __init__(self, num_splits: int = 1) -> None:
        from flash_attn.cute import flash_attn_varlen_func  # ImportError when not installed

        from twinplane.kernels import decode_attention

        self._varlen = flash_attn_varlen_func
        # Measured only on Hopper (SM 9.0), where FlashAttention-4 lacks split-KV; elsewhere
        # (Blackwell) FlashAttention-4 keeps decode steps too.
        hopper = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
        self._decode = decode_attention if hopper else None
        self.num_splits = num_splits  # split-KV is not supported on SM 9.0 (Hopper)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        out = self.decode(q, k_cache, v_cache, metadata, scale)
        if out is not None:
            return out
        out = self._varlen(q, k_cache, v_cache, cu_seqlens_q=metadata.cu_seqlens_q,
                           seqused_k=metadata.context_lens, max_seqlen_q=metadata.max_seqlen_q,
                           max_seqlen_k=metadata.max_seqlen_k, page_table=metadata.block_tables,
                           softmax_scale=scale, causal=True, num_splits=self.num_splits)
        return out[0] if isinstance(out, tuple) else out


class FlashAttention2Backend(TritonKVWriter, AttentionBackend):
    name = "flash_attn_2"

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self._varlen, self._with_kvcache = flash_attn_varlen_func, flash_attn_with_kvcache

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        if metadata.max_seqlen_q == 1:  # decode only: one query per sequence
            out = self._with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=metadata.context_lens,
                                     block_table=metadata.block_tables, softmax_scale=scale, causal=True)
            return out.squeeze(1)
        return self._varlen(q, k_cache, v_cache, cu_seqlens_q=metadata.cu_seqlens_q,
                            cu_seqlens_k=metadata.cu_seqlens_k, max_seqlen_q=metadata.max_seqlen_q,
                            max_seqlen_k=metadata.max_seqlen_k, softmax_scale=scale, causal=True,
                            block_table=metadata.block_tables)
