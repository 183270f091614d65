"""Our Triton kernels through Triton's CPU interpreter (TRITON_INTERPRET=1), so they are checked
without a GPU: the split-KV decode attention against the torch backend (float32; 1, 2 and 4
splits; grouped and plain heads; rows of context 0), and the KV writer against index_copy.

The interpreter is chosen when a kernel is decorated, so the checks run in a child process.
The GPU tests (test_gpu.py) check the same kernels compiled, in bf16.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

CHECKS = r'''
import torch
from twinplane.dataplane.attention_backends.base import AttentionMetadata
from twinplane.dataplane.attention_backends.torch_backend import TorchAttentionBackend, write_kv_by_slot
from twinplane.kernels.decode_attention import paged_decode_attention
from twinplane.kernels.kv_writer import store_kv

torch.manual_seed(0)
for heads, kv_heads, head_dim, block_size, num_seqs in [(4, 2, 16, 16, 3), (6, 2, 32, 32, 4), (3, 3, 16, 16, 2)]:
    max_blocks = 3
    k_cache = torch.randn(num_seqs * max_blocks, block_size, kv_heads, head_dim)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_seqs * max_blocks).view(num_seqs, max_blocks).to(torch.int32)
    lens = torch.randint(2, max_blocks * block_size + 1, (num_seqs,), dtype=torch.int32)
    lens[0] = 1
    q = torch.randn(num_seqs, heads, head_dim)
    scale = head_dim ** -0.5
    metadata = AttentionMetadata(
        cu_seqlens_q=torch.arange(num_seqs + 1, dtype=torch.int32), cu_seqlens_k=None, context_lens=lens,
        max_seqlen_q=1, max_seqlen_k=max_blocks * block_size, slot_mapping=None, block_tables=tables,
        query_lens_host=[1] * num_seqs, context_lens_host=lens.tolist())
    expected = TorchAttentionBackend().forward(q, k_cache, v_cache, metadata, scale)
    for splits in (1, 2, 4):
        out = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, num_splits=splits)
        error = (out - expected).abs().max().item()
        assert error < 1e-4, f"heads {heads}/{kv_heads}, {splits} splits: max error {error}"
    padded = lens.clone()
    padded[1:] = 0
    out = paged_decode_attention(q, k_cache, v_cache, tables, padded, scale, num_splits=2)
    assert out[1:].abs().max().item() == 0, "rows of context 0 must be zeros"
    assert (out[0] - expected[0]).abs().max().item() < 1e-4

tokens, kv_heads, head_dim, block_size = 40, 2, 16, 16
qkv = torch.randn(tokens, (2 + 2 * kv_heads) * head_dim)
k = qkv[:, 2 * head_dim:(2 + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)  # strided rows
v = torch.randn(tokens, kv_heads, head_dim)
slots = torch.randperm(8 * block_size)[:tokens].to(torch.int32)
slots[::5] = -1
caches = [torch.zeros(8, block_size, kv_heads, head_dim) for _ in range(4)]
store_kv(k, v, caches[0], caches[1], slots)
write_kv_by_slot(k, v, caches[2], caches[3], slots)
assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3]), "KV writer differs"
assert caches[0].abs().sum() > 0
print("kernels ok")
'''


def test_triton_kernels_match_torch_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", CHECKS], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "kernels ok" in result.stdout, result.stderr[-4000:]
