"""Our Triton kernels through Triton's CPU interpreter (TRITON_INTERPRET=1), so they are checked
without a GPU: the split-KV decode attention against the torch backend (float32; 1, 2, 4 and 16
splits, where 16 loads its first tile before the wait; grouped and plain heads; rows of context
0; a given start order), the KV writer against index_copy, the
fused q/k norm + RoPE + K/V store against the unfused layers (with and without the norm), and
the paged prefill attention against the torch backend (prompts, prefix chunks, decode rows,
padding sequences; float32 and float8 caches), decode attention and the KV writer over a float8
cache, the temperature sampler (greedy = torch.argmax with ties, draws follow softmax(logits / T),
a row's draw depends on its seed only; token masks: the best allowed token, draws among the allowed
ones) alone and inside the Sampler, the skinny projections
(plain, and with the norm, residual add and SiLU-and-mul they fold in), the gated MLP's
SiLU-and-mul, the RMSNorm with its residual add, and the streaming read that measures the
GPU's read bandwidth.

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
    shuffled = torch.randperm(num_seqs).to(torch.int32)  # the order programs start in changes nothing
    for splits, order in [(1, None), (2, None), (4, None), (16, None), (1, shuffled), (2, shuffled)]:
        out = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, order=order, num_splits=splits)
        error = (out - expected).abs().max().item()
        assert error < 1e-4, f"heads {heads}/{kv_heads}, {splits} splits, order {order}: max error {error}"
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
from twinplane.dataplane.layers.layernorm import rms_norm
from twinplane.dataplane.layers.rotary import RotaryEmbedding, apply_rotary
from twinplane.kernels.decode_attention import decode_attention_from_qkv
from twinplane.kernels.rope_store import QKVRope, norm_rope_store

tokens, heads, kv_heads, head_dim, block_size = 30, 6, 3, 32, 16
rope = RotaryEmbedding(head_dim, 4096, 1e6)
positions = torch.randint(0, 4000, (tokens,), dtype=torch.int32)
slots = torch.randperm(8 * block_size)[:tokens].to(torch.int32)
slots[::4] = -1
for with_norm in (True, False):
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    q_w, k_w = (torch.rand(head_dim) + 0.5, torch.rand(head_dim) + 0.5) if with_norm else (None, None)
    caches = [torch.zeros(8, block_size, kv_heads, head_dim) for _ in range(4)]
    q = norm_rope_store(qkv, QKVRope(heads, kv_heads, positions, rope.cos_sin_cache, q_w, k_w, 1e-6),
                        caches[0], caches[1], slots)
    q_ref, k_ref, v_ref = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q_ref, k_ref = q_ref.reshape(tokens, heads, head_dim), k_ref.reshape(tokens, kv_heads, head_dim)
    if with_norm:
        q_ref, k_ref = rms_norm(q_ref, q_w, 1e-6), rms_norm(k_ref, k_w, 1e-6)
    q_ref, k_ref = apply_rotary(q_ref, k_ref, rope.cos_sin_cache, positions.long())
    write_kv_by_slot(k_ref, v_ref.reshape(tokens, kv_heads, head_dim), caches[2], caches[3], slots)
    assert (q - q_ref).abs().max().item() < 1e-4, f"q differs (norm {with_norm})"
    assert (caches[0] - caches[2]).abs().max().item() < 1e-4 and torch.equal(caches[1], caches[3])
    assert caches[0].abs().sum() > 0
# The same kernel inside a decoder layer's attention: the fused path equals the unfused forward.
from transformers import Qwen3Config
from twinplane.dataplane.models.decoder import DecoderAttention, DecoderSpec

cfg = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  max_position_embeddings=512, rms_norm_eps=1e-6)
for qk_norm in (True, False):
    layer = DecoderAttention(cfg, DecoderSpec(False, False, False, qk_norm), TorchAttentionBackend())
    for p in layer.parameters():
        p.data = torch.randn_like(p) * 0.1 if p.dim() > 1 else torch.rand_like(p) + 0.5
    caches = [torch.zeros(4, 16, 2, 32) for _ in range(4)]
    tokens = 10
    metadata = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32), cu_seqlens_k=None,
        context_lens=torch.tensor([tokens], dtype=torch.int32), max_seqlen_q=tokens, max_seqlen_k=tokens,
        slot_mapping=torch.arange(tokens, dtype=torch.int32), block_tables=torch.tensor([[0]], dtype=torch.int32),
        query_lens_host=[tokens], context_lens_host=[tokens])
    hidden, positions = torch.randn(tokens, 64), torch.arange(3, 3 + tokens, dtype=torch.int32)
    layer.attn.bind_kv_cache(caches[0], caches[1])
    unfused = layer(positions, hidden, metadata)  # CPU tensors take the unfused path
    layer.attn.bind_kv_cache(caches[2], caches[3])
    fused = layer.o_proj(layer.attn.attend_qkv(layer.qkv_proj(hidden), layer.qkv_rope(positions), metadata))
    assert (fused - unfused).abs().max().item() < 1e-4, f"decoder attention differs (qk_norm {qk_norm})"
    assert (caches[0] - caches[2]).abs().max().item() < 1e-4 and torch.equal(caches[1], caches[3])

# Decode attention from the q/k/v rows (norm, RoPE and the K/V store inside) equals the store
# kernel followed by decode attention: outputs and both caches, for every split count.
heads, kv_heads, head_dim, block_size, num_seqs, max_blocks = 6, 2, 32, 16, 4, 3
tables = torch.randperm(num_seqs * max_blocks).view(num_seqs, max_blocks).to(torch.int32)
lens = torch.tensor([1, 17, 48, 30], dtype=torch.int32)
positions = lens - 1
slots = (tables.gather(1, (positions // block_size).long().unsqueeze(1)).squeeze(1) * block_size
         + positions % block_size).to(torch.int32)
order = torch.argsort(lens, descending=True).to(torch.int32)
for with_norm in (True, False):
    qkv = torch.randn(num_seqs, (heads + 2 * kv_heads) * head_dim)
    weights = (torch.rand(head_dim) + 0.5, torch.rand(head_dim) + 0.5) if with_norm else (None, None)
    qkv_rope = QKVRope(heads, kv_heads, positions, rope.cos_sin_cache, *weights, 1e-6)
    history = torch.randn(num_seqs * max_blocks, block_size, kv_heads, head_dim)
    for splits in (1, 2, 4, 16):
        caches = [history.clone() for _ in range(4)]
        q = norm_rope_store(qkv, qkv_rope, caches[0], caches[1], slots)
        expected = paged_decode_attention(q, caches[0], caches[1], tables, lens, head_dim ** -0.5, num_splits=splits)
        out = decode_attention_from_qkv(qkv, qkv_rope, caches[2], caches[3], slots, tables, lens, head_dim ** -0.5,
                                        order=order, num_splits=splits)
        error = (out - expected).abs().max().item()
        assert error < 1e-4, f"from q/k/v, {splits} splits, norm {with_norm}: max error {error}"
        assert (caches[0] - caches[2]).abs().max().item() < 1e-4 and torch.equal(caches[1], caches[3])
        assert not torch.equal(caches[3], history), "the new tokens' values are stored"
    padded = lens.clone()
    padded[1:] = 0
    caches = [history.clone() for _ in range(2)]
    out = decode_attention_from_qkv(qkv, qkv_rope, *caches, torch.where(padded > 0, slots, -1), tables, padded,
                                    head_dim ** -0.5, num_splits=2)
    assert out[1:].abs().max().item() == 0, "rows of context 0 must be zeros"
    assert torch.equal(caches[0].flatten(0, 1)[slots[1:].long()], history.flatten(0, 1)[slots[1:].long()])
print("kernels ok")
'''


PREFILL_CHECKS = r'''
import torch
from twinplane.dataplane.attention_backends.base import AttentionMetadata
from twinplane.dataplane.attention_backends.torch_backend import TorchAttentionBackend
from twinplane.kernels.decode_attention import paged_decode_attention
from twinplane.kernels.kv_writer import store_kv
from twinplane.kernels.prefill_attention import paged_prefill_attention

FP8 = torch.float8_e4m3fn
torch.manual_seed(0)
# Prompts, chunks after a cached prefix, decode rows beside them, over a float32 and a float8 cache;
# grouped and plain heads, a group of 16 (one query token a tile).
q_lens, lens = [1, 5, 40, 17, 1, 64, 3], [30, 5, 60, 50, 1, 64, 64]
n = len(q_lens)
for heads, kv_heads, head_dim, block_size in [(4, 2, 16, 16), (6, 2, 32, 32), (3, 3, 16, 16), (16, 1, 16, 16)]:
    max_blocks = -(-64 // block_size)
    k_cache = torch.randn(n * max_blocks, block_size, kv_heads, head_dim)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(n * max_blocks).view(n, max_blocks).to(torch.int32)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    tokens, context = int(cu[-1]), torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(tokens + 7, heads, head_dim)  # 7 padding rows
    metadata = AttentionMetadata(cu_seqlens_q=cu, cu_seqlens_k=None, context_lens=context, max_seqlen_q=64,
                                 max_seqlen_k=64, slot_mapping=None, block_tables=tables, query_lens_host=q_lens,
                                 context_lens_host=lens)
    for cache_dtype in (torch.float32, FP8):
        k, v = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
        expected = TorchAttentionBackend().forward(q[:tokens], k, v, metadata, head_dim ** -0.5)
        out = paged_prefill_attention(q, k, v, cu, context, tables, head_dim ** -0.5)
        error = (out[:tokens] - expected).abs().max().item()
        assert error < 1e-4, f"prefill, heads {heads}/{kv_heads}, {cache_dtype}: max error {error}"
        # padding sequences (no query tokens, context 0), as a CUDA graph pads a step
        padded = paged_prefill_attention(q, k, v, torch.cat([cu, torch.full((2,), tokens, dtype=torch.int32)]),
                                         torch.cat([context, torch.zeros(2, dtype=torch.int32)]),
                                         torch.cat([tables, torch.zeros(2, max_blocks, dtype=torch.int32)]),
                                         head_dim ** -0.5)
        assert torch.equal(padded[:tokens], out[:tokens])
    # decode rows alone, through the decode kernel over the float8 cache
    ones = torch.arange(n + 1, dtype=torch.int32)
    decode = AttentionMetadata(cu_seqlens_q=ones, cu_seqlens_k=None, context_lens=context, max_seqlen_q=1,
                               max_seqlen_k=64, slot_mapping=None, block_tables=tables, query_lens_host=[1] * n,
                               context_lens_host=lens)
    k, v = k_cache.to(FP8), v_cache.to(FP8)
    expected = TorchAttentionBackend().forward(q[:n], k, v, decode, head_dim ** -0.5)
    for splits in (1, 4):
        out = paged_decode_attention(q[:n], k, v, tables, context, head_dim ** -0.5, num_splits=splits)
        assert (out - expected).abs().max().item() < 1e-4, f"decode over float8, {splits} splits"
    far = (expected - TorchAttentionBackend().forward(q[:n], k_cache, v_cache, decode, head_dim ** -0.5)).abs()
    assert far.max().item() > 1e-3  # float8 really rounds: the check above is not the float32 cache's
    # bfloat16 queries over the float8 cache, whose tiles are multiplied in float16 (dot_queries)
    q16 = q.bfloat16()
    expected = TorchAttentionBackend().forward(q16[:tokens].float(), k, v, metadata, head_dim ** -0.5)
    out = paged_prefill_attention(q16, k, v, cu, context, tables, head_dim ** -0.5)
    assert out.dtype == torch.bfloat16 and (out[:tokens].float() - expected).abs().max().item() < 2e-2
    expected = TorchAttentionBackend().forward(q16[:n].float(), k, v, decode, head_dim ** -0.5)
    out = paged_decode_attention(q16[:n], k, v, tables, context, head_dim ** -0.5)
    assert out.dtype == torch.bfloat16 and (out.float() - expected).abs().max().item() < 2e-2
    q16[0, 0, 0] = 1e6  # past float16's range: clamped to it, not turned into inf (and NaN after)
    assert paged_decode_attention(q16[:n], k, v, tables, context, head_dim ** -0.5).isfinite().all()

# The KV writer into a float8 cache: float8 values stored as they are, those past its range clamped.
# (Values that round are checked on the GPU: the interpreter's float32 -> float8 rounding is wrong where
# it carries into the next power of two, 124.8 -> 64.)
k = (torch.randn(40, 2, 16) * 100).to(FP8).float()
v = (torch.randn(40, 2, 16) * 100).to(FP8).float()
k[::3, 0, :4] = torch.tensor([1000.0, -1000.0, 449.0, -3e38])
slots = torch.randperm(8 * 16)[:40].to(torch.int32)
slots[1::5] = -1
caches = [torch.zeros(8, 16, 2, 16, dtype=FP8) for _ in range(2)]
store_kv(k, v, caches[0], caches[1], slots)
kept = slots >= 0
for cache, x in zip(caches, (k, v)):
    stored = cache.view(-1, 2, 16)[slots[kept].long()].float()
    assert torch.equal(stored, x[kept].clamp(-448, 448)), "float8 store"
assert caches[0].float().abs().max().item() == 448 and not caches[0].float().isnan().any()
print("prefill ok")
'''


SAMPLING_CHECKS = r'''
import numpy as np
import torch
from twinplane.dataplane.plan import SamplingParams
from twinplane.dataplane.sampler import Sampler
from twinplane.dataplane.sampling_batch import SamplingRow, build_sampling_batch
from twinplane.kernels.sampling import KEY_STRIDE, sample_temperature

torch.manual_seed(0)
# Greedy: the first maximum, as torch.argmax, however the vocabulary is split (integer logits tie often).
logits = torch.randint(0, 40, (6, 3000)).float()
greedy = torch.ones(6, dtype=torch.bool)
for splits in (1, 3, 7, 100):  # past 64 splits the pick kernel takes them in two passes
    out = sample_temperature(logits, torch.ones(6), greedy, torch.arange(6), num_splits=splits)
    assert torch.equal(out, logits.argmax(-1)), f"greedy differs from argmax at {splits} splits"
into = torch.full((6,), -1, dtype=torch.int32)  # the caller's int32 tokens, as a graph of decode steps keeps them
assert sample_temperature(logits, torch.ones(6), greedy, torch.arange(6), num_splits=3, out=into) is into
assert torch.equal(into.long(), logits.argmax(-1))

# Draws depend only on the row's seed, not on the split count; they follow softmax(logits / T).
never = torch.zeros(40, dtype=torch.bool)
wide, seeds = torch.randn(40, 3000), torch.arange(40)
assert torch.equal(sample_temperature(wide, torch.ones(40), never, seeds, num_splits=1),
                   sample_temperature(wide, torch.ones(40), never, seeds, num_splits=4)), "splits changed draws"
# A draw key: row i draws as with seed key + i, and the key moves on by KEY_STRIDE once all rows read it.
key = torch.tensor([123_456_789])
by_key = sample_temperature(wide, torch.ones(40), never, num_splits=2, draw_key=key)
assert key.item() == 123_456_789 + KEY_STRIDE, key
assert torch.equal(by_key, sample_temperature(wide, torch.ones(40), never, 123_456_789 + seeds, num_splits=3))
assert not torch.equal(by_key, sample_temperature(wide, torch.ones(40), never, num_splits=2, draw_key=key))
n, temperature = 1500, 0.8
base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5, -3.0, 0.2])
drawn = sample_temperature(base.repeat(n, 1), torch.full((n,), temperature), torch.zeros(n, dtype=torch.bool),
                           torch.arange(1000, 1000 + n), num_splits=1)
frequencies = torch.bincount(drawn, minlength=len(base)).float() / n
expected = (base / temperature).softmax(-1)
gap = (frequencies - expected).abs().max().item()
assert gap < 0.04, f"sample frequencies {frequencies.tolist()} vs softmax {expected.tolist()}"  # 3 sigma
# Mass in four tiles of 1,024 logits, each with its own maximum: the draw picks a tile by its share,
# then a token inside it (two in a tile below the top one). Every other token has p < 1e-9.
n, spread = 1000, torch.full((5000,), -20.0)
hot = torch.tensor([3, 1500, 1501, 3100, 3101, 4999])
spread[hot] = torch.tensor([1.0, 0.0, 2.0, 1.5, 1.2, -0.5])
drawn = sample_temperature(spread.repeat(n, 1), torch.full((n,), temperature), torch.zeros(n, dtype=torch.bool),
                           torch.arange(5000, 5000 + n), num_splits=2)
counts = torch.bincount(drawn, minlength=len(spread)).float()
assert counts[hot].sum() == n, "a token of p < 1e-9 was drawn"
gap = (counts[hot] / n - (spread / temperature).softmax(-1)[hot]).abs().max().item()
assert gap < 0.05, f"sample frequencies {(counts[hot] / n).tolist()}"  # 3 sigma at n = 1,000

# Rows with no finite weight still get a token of the vocabulary (a graph's padding rows feed theirs to the
# next step's embedding): NaN logits, sampled and greedy, and a temperature under which logit / T overflows.
odd = torch.randn(3, 3000)
odd[:2] = float("nan")
drawn = sample_temperature(odd, torch.tensor([1.0, 1.0, 1e-45]), torch.tensor([False, True, False]),
                           torch.arange(3), num_splits=2)
assert ((drawn >= 0) & (drawn < 3000)).all(), drawn

# Inside the Sampler: a seeded row draws the same token wherever it sits in the batch;
# unseeded rows follow the sampler's seed and draw anew at every batch.
def sample(sampler, params, vocab=500):
    batch = build_sampling_batch([SamplingRow(p, 3, np.empty(0, np.int32), np.empty(0, np.int32)) for p in params],
                                 vocab, torch.device("cpu"))
    assert batch.kernel_samples
    return sampler(torch.zeros(len(params), vocab), batch).token_ids.tolist()

seeded, other = SamplingParams(seed=7), SamplingParams()
cpu = torch.device("cpu")
alone = sample(Sampler(0, cpu, fused=True), [seeded])
mixed = sample(Sampler(5, cpu, fused=True), [other, SamplingParams(temperature=0.0), other, seeded])
assert alone[0] == mixed[3], "a seeded row's draw moved with its place in the batch"
first = Sampler(1, cpu, fused=True)
a, b = sample(first, [other] * 8), sample(first, [other] * 8)
assert a == sample(Sampler(1, cpu, fused=True), [other] * 8) and a != b
first.reseed(1)  # starts its draws over
assert sample(first, [other] * 8) == a

# Token masks (structured output): a masked row takes the best of its allowed tokens, or draws among them with
# their softmax shares, however the vocabulary is split; rows without a mask draw as with no masks at all.
def packed(allowed, vocab):
    bits = np.zeros(-(-vocab // 8) * 8, dtype=bool)
    bits[sorted(allowed)] = True
    return torch.from_numpy(np.packbits(bits, bitorder="little"))

vocab = 4999  # the last byte of a mask partly padding
logits = torch.randn(6, vocab) * 3
logits[:, 2000] = 50.0  # far the best, and allowed by no mask
sets = [{0, 1500, 4998}, {7, 3100}]
masks = torch.stack([packed(s, vocab) for s in sets])
index = torch.tensor([0, -1, 1, 0, -1, 1], dtype=torch.int32)
greedy = torch.ones(6, dtype=torch.bool)
for splits in (1, 3):
    out = sample_temperature(logits, torch.ones(6), greedy, torch.arange(6), num_splits=splits, masks=masks,
                             mask_index=index)
    best = [max(sets[i], key=lambda t: logits[row, t].item()) if i >= 0 else 2000 for row, i in enumerate(index)]
    assert out.tolist() == best, (splits, out.tolist(), best)
    free = sample_temperature(logits, torch.ones(6), ~greedy, torch.arange(6), num_splits=splits, masks=masks,
                              mask_index=index)
    assert free[index < 0].tolist() == [2000, 2000] and all(free[r].item() in sets[i] for r, i in
                                                             enumerate(index.tolist()) if i >= 0), free
unmasked = sample_temperature(logits, torch.ones(6), ~greedy, torch.arange(6), num_splits=2)
assert torch.equal(free[index < 0], unmasked[index < 0])
n, allowed = 1000, [1, 1500, 3100, 4998]  # in three tiles; the rest, allowed or not, far likelier
row = torch.full((vocab,), 5.0)
row[allowed] = torch.tensor([0.5, 1.0, -0.5, 0.0])
drawn = sample_temperature(row.repeat(n, 1), torch.full((n,), 0.8), torch.zeros(n, dtype=torch.bool),
                           torch.arange(n), num_splits=2, masks=packed(allowed, vocab)[None],
                           mask_index=torch.zeros(n, dtype=torch.int32))
counts = torch.bincount(drawn, minlength=vocab).float()
assert counts[allowed].sum() == n, "drew a token outside the mask"
gap = (counts[allowed] / n - (row[allowed] / 0.8).softmax(-1)).abs().max().item()
assert gap < 0.05, f"masked draw frequencies {(counts[allowed] / n).tolist()}"  # 3 sigma at n = 1,000

# In the Sampler: temperature with masks takes the kernel, seeded or not, and its greedy rows give what the torch
# path gives (each sampler's own draws differ: another generator).
def rows_of(params, masks):
    return [SamplingRow(p, 3, np.empty(0, np.int32), np.empty(0, np.int32), m) for p, m in zip(params, masks)]

mask = packed({0, 1500, 4998}, vocab).numpy().tobytes()
params = [SamplingParams(temperature=0.0, masked=True), SamplingParams(temperature=0.0),
          SamplingParams(temperature=0.9, seed=3, masked=True), SamplingParams(temperature=0.9, masked=True)]
batch = build_sampling_batch(rows_of(params, [mask, None, mask, mask]), vocab, cpu)
assert batch.kernel_samples and batch.masks is not None
kernel = Sampler(0, cpu, fused=True)(logits[:4], batch).token_ids.tolist()
torch_path = Sampler(0, cpu, fused=False)(logits[:4], batch).token_ids.tolist()
assert kernel[:2] == torch_path[:2] and kernel[1] == 2000 and set(kernel[2:]) <= {0, 1500, 4998}, kernel
print("sampling ok")
'''


SKINNY_CHECKS = '''
import torch
import torch.nn.functional as F
from twinplane.kernels import skinny_gemm
torch.manual_seed(0)
skinny_gemm.WEIGHT_BYTES_PER_PROGRAM = 4096  # several programs even for these small weights
for m, n, k in ((1, 40, 96), (2, 33, 200), (3, 16, 64), (4, 9, 130)):
    x, res, w, b = torch.randn(m, k), torch.randn(m, k), torch.randn(2 * n, k), torch.randn(2 * n)
    norm = torch.rand(k) + 0.5
    assert torch.allclose(skinny_gemm.skinny_linear(x, w), x @ w.T, atol=1e-4, rtol=1e-4), (m, n, k)
    assert torch.allclose(skinny_gemm.skinny_linear(x, w, b), x @ w.T + b, atol=1e-4, rtol=1e-4), (m, n, k)
    for r in (None, res):
        summed = x if r is None else x + r
        normed = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6) * norm
        y, s = skinny_gemm.skinny_norm_linear(x, r, norm, 1e-6, w, b)
        assert torch.equal(s, summed) and torch.allclose(y, normed @ w.T + b, atol=1e-4, rtol=1e-4), (m, n, k)
        y, s = skinny_gemm.skinny_norm_linear(x, r, norm, 1e-6, w, glu=True)
        gate, up = (normed @ w.T).chunk(2, dim=-1)
        assert y.shape == (m, n) and torch.allclose(y, F.silu(gate) * up, atol=1e-4, rtol=1e-4), (m, n, k)
print("skinny ok")
'''


SILU_CHECKS = '''
import torch
import torch.nn.functional as F
from twinplane.kernels import silu_mul
torch.manual_seed(0)
silu_mul.BLOCK = 64  # so that features span several tiles and end in a partial one
for tokens, d in ((1, 64), (3, 100), (5, 300), (0, 40)):
    x = torch.randn(tokens, 2 * d) * 4
    gate, up = x.chunk(2, dim=-1)
    y = silu_mul.silu_mul(x)
    assert y.shape == (tokens, d) and torch.allclose(y, F.silu(gate) * up, atol=1e-5, rtol=1e-5), (tokens, d)
rows = torch.randn(4, 3 * 128)[:, :256]  # rows of a wider tensor: strided, each contiguous
assert torch.allclose(silu_mul.silu_mul(rows), F.silu(rows[:, :128]) * rows[:, 128:], atol=1e-5, rtol=1e-5)
print("silu ok")
'''


READ_CHECKS = '''
import torch
from twinplane.kernels.bench_attention import read_sums
torch.manual_seed(0)
for n, programs, block in ((1000, 3, 64), (64, 4, 64), (5, 2, 16)):
    x = torch.randn(n)
    tiles = torch.cat([x, x.new_zeros(-n % block)]).view(-1, block)
    expected = torch.stack([tiles[p::programs].sum() for p in range(programs)])  # program p: every programs-th tile
    assert torch.allclose(read_sums(x, programs, block), expected, atol=1e-4), (n, programs, block)
print("read ok")
'''


NORM_CHECKS = '''
import torch
from twinplane.dataplane.layers.layernorm import add_rms_norm, rms_norm
from twinplane.kernels.rms_norm import rms_norm as norm_kernel
torch.manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    for tokens, d in ((1, 64), (5, 100), (3, 1024), (0, 32)):
        wide = torch.randn(tokens, d + 7, dtype=dtype) * 3
        x = wide[:, :d]  # rows of a wider tensor: strided, each contiguous
        residual = torch.randn(tokens, d, dtype=dtype)
        weight = torch.rand(d, dtype=dtype) + 0.5
        y, summed = norm_kernel(x, weight, 1e-6)
        assert summed is x and torch.allclose(y.float(), rms_norm(x, weight, 1e-6).float(), atol=2e-2, rtol=1e-2)
        y, summed = norm_kernel(x, weight, 1e-6, residual)
        expected, expected_sum = add_rms_norm(x, residual, weight, 1e-6)
        # The interpreter's float32 -> bfloat16 casts need not round as the GPU's do: exact in float32 only.
        assert torch.allclose(summed.float(), expected_sum.float(), atol=2e-2, rtol=1e-2), (dtype, tokens, d)
        assert y.dtype == dtype
        assert torch.allclose(y.float(), expected.float(), atol=2e-2, rtol=1e-2), (dtype, tokens, d)
        if dtype == torch.float32:
            assert torch.equal(summed, expected_sum)
            torch.testing.assert_close(y, expected)
print("norm ok")
'''


def _run_interpreted(checks: str, marker: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", checks], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and marker in result.stdout, result.stderr[-4000:]


def test_triton_kernels_match_torch_in_the_interpreter():
    _run_interpreted(CHECKS, "kernels ok")


def test_prefill_attention_and_float8_cache_in_the_interpreter():
    _run_interpreted(PREFILL_CHECKS, "prefill ok")


def test_triton_sampler_in_the_interpreter():
    _run_interpreted(SAMPLING_CHECKS, "sampling ok")


def test_skinny_projections_in_the_interpreter():
    """Rows 1-4, sizes that are not multiples of the blocks; bias, the norm with and without the
    residual add, and SiLU-and-mul after gate/up, against torch."""
    _run_interpreted(SKINNY_CHECKS, "skinny ok")


def test_silu_mul_in_the_interpreter():
    """Token counts 0-5, feature counts that end in a partial tile, strided rows."""
    _run_interpreted(SILU_CHECKS, "silu ok")


def test_read_bandwidth_kernel_in_the_interpreter():
    """The streaming read of ``bench_attention --read-peak``: its partial sums add up to x's sum."""
    _run_interpreted(READ_CHECKS, "read ok")


def test_rms_norm_in_the_interpreter():
    """The norm kernel, with and without the residual add, against the layers' torch functions."""
    _run_interpreted(NORM_CHECKS, "norm ok")


def test_decode_splits_cover_the_sms_and_split_sparse_batches(monkeypatch):
    """Under three programs (sequences x KV heads) per SM a sequence is split at least in two,
    and the splits give every SM a program (up to 16 splits); from there on it is not split."""
    import torch

    from twinplane.kernels import decode_attention

    monkeypatch.setattr(decode_attention, "sm_count", lambda device: 132)
    device = torch.device("cuda", 0)
    for seqs in range(1, 300):
        splits = decode_attention.decode_splits(seqs, 8, device)
        assert splits & (splits - 1) == 0 and 1 <= splits <= 16
        if seqs * 8 >= 3 * 132:
            assert splits == 1, seqs
        else:
            assert splits >= 2 and (seqs * 8 * splits >= 132 or splits == 16), (seqs, splits)
            assert splits == 2 or seqs * 8 * splits // 2 < 132, (seqs, splits)  # no more than that
    counts = (1, 4, 8, 16, 32, 49, 50, 99)
    assert [decode_attention.decode_splits(n, 8, device) for n in counts] == [16, 8, 4, 2, 2, 2, 1, 1]


def test_wave_gemm_takes_outputs_of_one_wave_on_cuda_only():
    """On an H200's 132 SMs, Qwen3-0.6B's o and down projections (1,024 features) go to quack's
    GEMM up to 512 rows, q/k/v (4,096) up to 128, gate/up (6,144) up to 64; CPU tensors never."""
    import torch

    from twinplane.kernels.wave_gemm import in_use, one_wave, supports

    for features, most_rows in ((1024, 512), (4096, 128), (6144, 64)):
        assert one_wave(most_rows, features, 132) and not one_wave(most_rows + 1, features, 132)
    x, weight = torch.zeros(8, 1024, dtype=torch.bfloat16), torch.zeros(1024, 1024, dtype=torch.bfloat16)
    assert not supports(x, weight) and not in_use(x.device, x.dtype)
