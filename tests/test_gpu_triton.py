"""GPU (skipped without CUDA): the triton attention backend and the float8 KV cache.

- The paged prefill kernel against the torch backend (prompts, prompt chunks after a cached
  prefix, decode rows beside them, padding sequences as a CUDA graph pads them), over a bf16
  and a float8 cache.
- The decode kernel's float8 conversion against torch's, for every float8 value.
- The K/V stores into a float8 cache (the KV writer, the fused norm/RoPE/store and the decode
  kernel from the q/k/v projection) against torch's conversion of the same 16-bit values, values
  past float8's range clamped; decode attention over a float8 cache against the torch backend.
- The backend in a model: bf16 logits as close to transformers' float32 as test_gpu.py asks of
  FlashAttention; CUDA graphs (decode and mixed steps) give eager's tokens; with a float8 cache,
  the logits of the torch backend reading the same float8 values.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from tests import test_gpu
from tests.test_gpu import _drive, _drive_with_arrival, _prompts, _reference, _runner, assert_logits_match_transformers
from twinplane.dataplane.attention_backends.base import AttentionMetadata
from twinplane.dataplane.plan import StepPath
from twinplane.kernels.decode_attention import e4m3_to_f16

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FP8 = torch.float8_e4m3fn
qwen3_folder = test_gpu.qwen3_folder  # a random-weight Qwen3-0.6B folder (fixture)


def _torch_attention(q, k_cache, v_cache, cu, lens, tables, scale):
    from twinplane.dataplane.attention_backends.torch_backend import TorchAttentionBackend

    q_lens = (cu[1:] - cu[:-1]).tolist()
    metadata = AttentionMetadata(cu_seqlens_q=cu, cu_seqlens_k=None, context_lens=lens, max_seqlen_q=max(q_lens),
                                 max_seqlen_k=int(lens.max()), slot_mapping=None, block_tables=tables,
                                 query_lens_host=q_lens, context_lens_host=lens.tolist())
    return TorchAttentionBackend().forward(q.float(), k_cache, v_cache, metadata, scale)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(16, 8, 128, 256), (32, 8, 128, 16), (14, 2, 64, 32),
                                                                 (8, 1, 128, 16)])
def test_prefill_attention_matches_torch(heads, kv_heads, head_dim, block_size, cache_dtype):
    from twinplane.kernels.prefill_attention import paged_prefill_attention

    torch.manual_seed(0)
    # whole prompts, chunks after a prefix, decode rows, a prompt of one token, a long one
    q_lens = [300, 1, 17, 1, 64, 1, 1000, 5]
    lens = [300, 700, 17, 1, 1500, 2000, 1000, 37]
    max_blocks = -(-2048 // block_size)
    n = len(q_lens)
    with torch.device("cuda"):
        k_cache = torch.randn(n * max_blocks, block_size, kv_heads, head_dim).to(cache_dtype)
        v_cache = torch.randn_like(k_cache, dtype=torch.float32).to(cache_dtype)
        tables = torch.randperm(n * max_blocks).view(n, max_blocks).to(torch.int32)
        cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
        context = torch.tensor(lens, dtype=torch.int32)
        tokens = int(cu[-1])
        q = torch.randn(tokens + 24, heads, head_dim, dtype=torch.bfloat16)  # 24 padding rows
    scale = head_dim ** -0.5
    expected = _torch_attention(q[:tokens], k_cache, v_cache, cu, context, tables, scale)
    out = paged_prefill_attention(q, k_cache, v_cache, cu, context, tables, scale)
    largest = expected.abs().max().item()
    error = (out[:tokens].float() - expected).abs().max().item()
    assert error <= 2 ** -6 * largest, f"max error {error} (largest output {largest})"
    # Padding as a CUDA graph pads a step: sequences with no query tokens and context 0.
    padded_cu = torch.cat([cu, torch.full((3,), tokens, dtype=torch.int32, device="cuda")])
    padded_lens = torch.cat([context, torch.zeros(3, dtype=torch.int32, device="cuda")])
    padded_tables = torch.cat([tables, torch.zeros(3, max_blocks, dtype=torch.int32, device="cuda")])
    again = paged_prefill_attention(q, k_cache, v_cache, padded_cu, padded_lens, padded_tables, scale)
    assert torch.equal(again[:tokens], out[:tokens])


@pytest.mark.parametrize("kv_heads,head_dim", [(8, 128), (2, 64)])
def test_stores_into_a_float8_cache_convert_as_torch_does(kv_heads, head_dim):
    """The KV writer and the fused norm/RoPE/store write to a float8 cache what torch's conversion of
    the 16-bit cache's values gives, values past float8's finite range clamped to it, never NaN."""
    from twinplane.dataplane.layers.rotary import RotaryEmbedding
    from twinplane.kernels.kv_writer import store_kv
    from twinplane.kernels.rope_store import QKVRope, norm_rope_store

    torch.manual_seed(0)
    tokens, block_size, num_blocks, heads = 300, 16, 64, 2 * kv_heads
    with torch.device("cuda"):
        k = torch.randn(tokens, kv_heads, head_dim, dtype=torch.bfloat16) * 100
        v = torch.randn_like(k) * 100
        for x in (k, v):  # some past float8's 448
            x[::5, 0, :3] = torch.tensor([1000.0, -1000.0, 600.0])
        slots = torch.randperm(num_blocks * block_size)[:tokens].to(torch.int32)
        zeros = lambda dtype: torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype,  # noqa: E731
                                          device="cuda")
        caches16, caches8 = (zeros(torch.bfloat16), zeros(torch.bfloat16)), (zeros(FP8), zeros(FP8))
        rope = RotaryEmbedding(head_dim, 4096, 1e6)
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=torch.bfloat16) * 300
        positions = torch.randint(0, 4096, (tokens,), dtype=torch.int32)
    slots[::7] = -1
    assert (k.abs() > 448).any()

    def as_torch_converts(cache: torch.Tensor) -> torch.Tensor:
        return cache.float().clamp(-448, 448).to(FP8)

    store_kv(k, v, *caches16, slots)
    store_kv(k, v, *caches8, slots)
    for c16, c8 in zip(caches16, caches8):
        assert not c8.float().isnan().any() and c8.float().abs().max().item() == 448
        assert torch.equal(c8.view(torch.uint8), as_torch_converts(c16).view(torch.uint8))
    rope_args = QKVRope(heads, kv_heads, positions, rope.cos_sin_cache, None, None, 1e-6)
    caches16, caches8 = (zeros(torch.bfloat16), zeros(torch.bfloat16)), (zeros(FP8), zeros(FP8))
    q16 = norm_rope_store(qkv, rope_args, *caches16, slots)
    q8 = norm_rope_store(qkv, rope_args, *caches8, slots)
    assert torch.equal(q16, q8)
    for c16, c8 in zip(caches16, caches8):
        assert (c16.float().abs() > 448).any()
        assert torch.equal(c8.view(torch.uint8), as_torch_converts(c16).view(torch.uint8))


@triton.jit
def _to_f16(x_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, e4m3_to_f16(tl.load(x_ptr + i)))


def test_the_decode_kernels_float8_conversion_gives_torchs_for_every_value():
    """e4m3_to_f16 (PTX, four bytes a register) over all 256 bit patterns, four times, rolled by 0-3 places so
    each pattern sits at every byte of a register: torch's float16 of each, NaN where torch gives NaN."""
    x = torch.arange(256, dtype=torch.uint8, device="cuda")  # (torch has no cat or roll of float8 on CUDA)
    x = torch.cat([x, x.roll(1), x.roll(2), x.roll(3)]).view(FP8)
    out = torch.empty(x.shape, dtype=torch.float16, device="cuda")
    _to_f16[(1,)](x, out, N=x.numel())
    expected = x.to(torch.float16)
    assert torch.equal(out.isnan(), expected.isnan())
    assert torch.equal(out.nan_to_num(), expected.nan_to_num())


@pytest.mark.parametrize("num_seqs", [1, 12, 160])
def test_decode_attention_over_a_float8_cache(num_seqs):
    """From queries and from the q/k/v projection, at every split count the step would use: within a
    bf16 step or two of the torch backend reading the same float8 values; the new token stored as
    float8 too."""
    from twinplane.dataplane.layers.rotary import RotaryEmbedding
    from twinplane.kernels.decode_attention import decode_attention_from_qkv, decode_splits, paged_decode_attention
    from twinplane.kernels.rope_store import QKVRope, norm_rope_store

    torch.manual_seed(0)
    heads, kv_heads, head_dim, block_size = 16, 8, 128, 256
    max_blocks = -(-2048 // block_size)
    with torch.device("cuda"):
        rope = RotaryEmbedding(head_dim, 4096, 1e6)
        history = torch.randn(num_seqs * max_blocks, block_size, kv_heads, head_dim).to(FP8)
        tables = torch.randperm(num_seqs * max_blocks).view(num_seqs, max_blocks).to(torch.int32)
        lens = torch.randint(1, 2048, (num_seqs,), dtype=torch.int32)
        qkv = torch.randn(num_seqs, (heads + 2 * kv_heads) * head_dim, dtype=torch.bfloat16) * 2
        norms = (torch.rand(head_dim, dtype=torch.bfloat16) + 0.5, torch.rand(head_dim, dtype=torch.bfloat16) + 0.5)
    positions = lens - 1
    slots = (tables.gather(1, (positions // block_size).long().unsqueeze(1)).squeeze(1) * block_size
             + positions % block_size).to(torch.int32)
    qkv_rope = QKVRope(heads, kv_heads, positions, rope.cos_sin_cache, *norms, 1e-6)
    cu = torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda")
    scale = head_dim ** -0.5
    for splits in sorted({1, 4, 16, decode_splits(num_seqs, kv_heads, qkv.device)}):
        caches = [history.clone() for _ in range(4)]
        q = norm_rope_store(qkv, qkv_rope, caches[0], caches[1], slots)
        expected = _torch_attention(q, caches[0], caches[1], cu, lens, tables, scale)
        largest = expected.abs().max().item()
        out = paged_decode_attention(q, caches[0], caches[1], tables, lens, scale, num_splits=splits)
        fused = decode_attention_from_qkv(qkv, qkv_rope, caches[2], caches[3], slots, tables, lens, scale,
                                          num_splits=splits)
        assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))
        assert (caches[0].float() - caches[2].float()).abs().max().item() <= 2 ** -3 * caches[0].float().abs().max()
        for name, got in (("from q", out), ("from qkv", fused)):
            error = (got.float() - expected).abs().max().item()
            assert error <= 2 ** -5 * largest, f"{name}, {splits} splits: max error {error} (largest {largest})"


def test_triton_backend_logits_match_transformers(qwen3_folder):
    """As test_gpu.py asks of FlashAttention: no further from transformers' float32 than twice its own bf16."""
    assert assert_logits_match_transformers(qwen3_folder, attention_backend="triton") == "triton"


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_triton_backend_graphs_give_the_tokens_of_eager(qwen3_folder, kv_cache_dtype):
    graphed = _runner(qwen3_folder, attention_backend="triton", kv_cache_dtype=kv_cache_dtype)
    with_graphs, paths = _drive_with_arrival(graphed)
    graphed.close()
    eager = _runner(qwen3_folder, attention_backend="triton", kv_cache_dtype=kv_cache_dtype, enforce_eager=True)
    without, eager_paths = _drive_with_arrival(eager)
    eager.close()
    assert paths[:2] == [StepPath.MIXED_GRAPH] * 2 and paths[-1] == StepPath.DECODE_GRAPH, paths
    assert set(eager_paths) == {StepPath.EAGER}
    assert with_graphs == without and all(len(tokens) >= 5 for tokens in with_graphs)


def test_a_float8_cache_gives_the_logits_of_the_torch_backend_over_it(qwen3_folder):
    """The triton backend over a float8 cache, against the torch backend storing and reading the same
    float8 values: within twice bf16's own error of each other (prompts and decode steps). How far
    both are from the 16-bit cache is printed (the cost of float8, not a defect)."""
    prompts = _prompts(3, seed=6)
    runs = {}
    for backend, kv in (("triton", "fp8"), ("torch", "fp8"), ("triton", "auto")):
        runner = _runner(qwen3_folder, attention_backend=backend, kv_cache_dtype=kv)
        assert runner.kv_cache.dtype == (FP8 if kv == "fp8" else torch.bfloat16)
        runs[backend, kv] = _drive(runner, prompts, num_decode=4)
        runner.close()
    tokens, triton8 = runs["triton", "fp8"]
    torch_tokens, torch8 = runs["torch", "fp8"]
    logits16 = runs["triton", "auto"][1]
    ref32, ref16 = _reference(qwen3_folder, torch.float32), _reference(qwen3_folder, torch.bfloat16)
    compared = 0
    for i, prompt in enumerate(prompts):
        full = torch.tensor([prompt + tokens[i][:-1]], device="cuda")
        with torch.no_grad():
            err_hf = (ref16(full).logits[0, len(prompt) - 1:].float()
                      - ref32(full).logits[0, len(prompt) - 1:].float()).abs().max().item()
        for step in range(len(triton8)):
            if tokens[i][:step] != torch_tokens[i][:step]:
                break  # the runs parted at a near-tie: later steps see other inputs
            error = (triton8[step][i] - torch8[step][i]).abs().max().item()
            print(f"seq {i} step {step}: fp8 triton vs fp8 torch {error:.4f}, vs the bf16 cache "
                  f"{(triton8[step][i] - logits16[step][i]).abs().max().item():.4f}; hf bf16 vs fp32 {err_hf:.4f}")
            assert error <= 2 * err_hf + 0.02
            compared += 1
    assert compared >= len(prompts) + 2  # every prompt step and some decode steps
