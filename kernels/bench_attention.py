"""Decode attention alone: our Triton split-KV kernel against FlashAttention-4, same paged cache.

    python -m twinplane.kernels.bench_attention [--block-size 256]
    python -m twinplane.kernels.bench_attention --splits [--kv-cache-dtype fp8]
    python -m twinplane.kernels.bench_attention --read-peak

For each (batch, context, q heads, kv heads) case it prints the time per call
(``triton.testing.do_bench``: wall clock, so under ~50 us it is the launch cost) and the
bandwidth it implies (K and V bytes read / time), for FlashAttention-4's
``flash_attn_varlen_func`` and for ``paged_decode_attention`` with each of a few tile configs.
Needs a CUDA GPU and ``flash_attn.cute``.

``--splits``: the kernel as decode steps call it (``decode_attention_from_qkv``, Qwen3-0.6B
heads) in a CUDA graph (``do_bench_cudagraph``), at 1-16 splits per sequence and three tiles,
on the batches and contexts of the default benchmark's decode steps and a few small batches,
beside what ``decode_splits`` and ``tile_keys`` choose. Needs a CUDA GPU only. A config that is
faster here is not always faster in ``twinplane bench`` (``decode_splits`` has a case): judge
a new rule by the benchmark's decode steps, run interleaved with the old one.

``--read-peak``: the most bandwidth a plain streaming read of 2 GiB reaches on this GPU (a Triton
kernel that only loads and sums, over a few grid sizes and tiles), the ceiling for a kernel
bound by reading memory, as decode attention is; the two other modes print it first.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from twinplane.dataplane.config import KV_CACHE_DTYPES
from twinplane.dataplane.kv_cache import resolve_kv_dtype
from twinplane.kernels.decode_attention import (decode_attention_from_qkv, decode_splits, paged_decode_attention,
                                                tile_keys)
from twinplane.kernels.device import sm_count
from twinplane.kernels.rope_store import QKVRope

CASES = [(1, 1024, 16, 8), (8, 1024, 16, 8), (64, 1024, 16, 8), (256, 1024, 16, 8), (256, 0, 16, 8),
         (128, 0, 16, 8), (256, 1024, 16, 4), (64, 1024, 16, 4)]  # context 0: uniform in [100, 2048)
CONFIGS = [(64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 2), (32, 4, 4)]  # block_n, warps, stages


@triton.jit
def _read_sums(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Each program sums every num_programs-th tile of x into out[program]: nothing but loads."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


def read_sums(x: torch.Tensor, programs: int, block: int = 1024, num_warps: int = 4) -> torch.Tensor:
    """Partial sums of a contiguous x in float32 by ``programs`` programs (they add up to x's sum)."""
    out = torch.empty(programs, device=x.device, dtype=torch.float32)
    _read_sums[(programs,)](x, out, x.numel(), BLOCK=block, num_warps=num_warps)
    return out


def read_peak(gib: float = 2.0) -> float:
    """TB/s of the fastest streaming read of ``gib`` GiB of bf16, calls back to back in a CUDA graph
    (``triton.testing.do_bench``, which clears the L2 between calls, reads ~2% slower)."""
    x = torch.randn(int(gib * 2 ** 30) // 2, device="cuda", dtype=torch.bfloat16)
    sms = sm_count(x.device)
    best = min(triton.testing.do_bench_cudagraph(lambda: read_sums(x, sms * per_sm, block, warps), rep=50)
               for per_sm in (4, 8, 16) for block in (2048, 4096) for warps in (4, 8))
    return x.numel() * x.element_size() / (best * 1e-3) / 1e12


def make_case(batch: int, context: int, heads: int, kv_heads: int, page: int, head_dim: int = 128):
    device = torch.device("cuda")
    max_blocks = -(-4096 // page)
    k_cache = torch.randn(batch * max_blocks, page, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(batch * max_blocks, device=device).view(batch, max_blocks).to(torch.int32)
    lens = torch.randint(100, 2048, (batch,)) if context == 0 else torch.full((batch,), context)
    lens = lens.to(device, torch.int32)
    q = torch.randn(batch, heads, head_dim, device=device, dtype=torch.bfloat16)
    return q, k_cache, v_cache, tables, lens


def sweep_splits(page: int, heads: int = 16, kv_heads: int = 8, head_dim: int = 128,
                 cache_dtype: torch.dtype = torch.bfloat16) -> None:
    """Time per call of decode attention from the q/k/v projection, for each split count and
    tile, on the decode steps of the default benchmark: 256 prompts of U[100, 1024] tokens and
    outputs of U[100, 1024], so at step t the batch is the sequences whose output is longer
    than t, at contexts U[100, 1024] + t; then a few small batches at long contexts."""
    device = torch.device("cuda")
    max_blocks = -(-2304 // page)
    k_cache = torch.randn(256 * max_blocks, page, kv_heads, head_dim, device=device).to(cache_dtype)
    v_cache = torch.randn(k_cache.shape, device=device).to(cache_dtype)
    ones = torch.ones(head_dim, device=device, dtype=torch.bfloat16)
    cos_sin = torch.randn(4096, head_dim, device=device, dtype=torch.bfloat16)
    configs = [(n, tile) for n in (1, 2, 4, 8) for tile in ((64, False), (128, False))] + [(16, (64, True))]
    steps = [(max(1, round(256 * (1 - (t - 100) / 924))), 100 + t, 1024 + t) for t in range(100, 1030, 50)]
    steps += [(batch, 1500, 2000) for batch in (1, 2, 4, 8, 12, 16, 24)]
    chosen_total = fastest_total = 0.0
    print("sequences  contexts        chosen (splits, keys, early)       fastest three")
    for batch, low, high in steps:
        lens = torch.randint(low, high + 1, (batch,)).to(device, torch.int32)
        tables = torch.randperm(256 * max_blocks, device=device)[:batch * max_blocks].view(batch, max_blocks).int()
        order = torch.argsort(lens, descending=True).to(torch.int32)
        positions = lens - 1
        slots = (tables.gather(1, (positions // page)[:, None].long())[:, 0] * page + positions % page).int()
        rope = QKVRope(heads, kv_heads, positions, cos_sin, ones, ones, 1e-6)
        qkv = torch.randn(batch, (heads + 2 * kv_heads) * head_dim, device=device, dtype=torch.bfloat16)

        def call(splits=None, tile=None):
            return decode_attention_from_qkv(qkv, rope, k_cache, v_cache, slots, tables, lens, head_dim ** -0.5,
                                             order, num_splits=splits, tile=tile)

        times = {config: triton.testing.do_bench_cudagraph(lambda: call(*config), rep=30) * 1e3 for config in configs}
        chosen = triton.testing.do_bench_cudagraph(call, rep=30) * 1e3
        splits = decode_splits(batch, kv_heads, device)
        tile = tile_keys(splits)
        fastest = sorted(times, key=times.get)[:3]
        if high < 1500:  # a benchmark step: each stands for 50 of them
            chosen_total += 50 * chosen
            fastest_total += 50 * times[fastest[0]]
        print(f"{batch:>9}  U[{low}, {high}]  {str((splits,) + tile):>20} {chosen:6.1f} us  "
              + ", ".join(f"{(n,) + t} {times[(n, t)]:.1f}" for n, t in fastest), flush=True)
    print(f"benchmark decode steps, x28 layers: {chosen_total * 28 / 1e6:.3f} s as chosen, "
          f"{fastest_total * 28 / 1e6:.3f} s at the fastest of each step")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--splits", action="store_true", help="time each split count of the decode steps' kernel")
    p.add_argument("--read-peak", action="store_true", help="only the GPU's streaming read bandwidth")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="with --splits: the cache in bf16 (auto) or float8")
    args = p.parse_args()
    torch.manual_seed(0)
    print(f"streaming read peak: {read_peak():.2f} TB/s", flush=True)
    if args.read_peak:
        return
    if args.splits:
        sweep_splits(args.block_size, cache_dtype=resolve_kv_dtype(args.kv_cache_dtype, torch.bfloat16))
        return
    from flash_attn.cute import flash_attn_varlen_func

    print(f"{'case':>24} {'FA4 us':>8} {'TB/s':>5} | {'Triton us':>9} {'TB/s':>5} (block_n, warps, stages, splits)")
    for batch, context, heads, kv_heads in CASES:
        q, k_cache, v_cache, tables, lens = make_case(batch, context, heads, kv_heads, args.block_size)
        scale = q.shape[-1] ** -0.5
        nbytes = int(lens.sum()) * kv_heads * q.shape[-1] * 2 * k_cache.element_size()
        cu = torch.arange(batch + 1, device=q.device, dtype=torch.int32)

        def fa4():
            return flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=cu, seqused_k=lens, max_seqlen_q=1,
                                          max_seqlen_k=4096, page_table=tables, softmax_scale=scale, causal=True)

        t_fa4 = triton.testing.do_bench(fa4, warmup=20, rep=100) * 1e3
        best = None
        for block_n, warps, stages in CONFIGS:
            for splits in sorted({1, decode_splits(batch, kv_heads, q.device)}):
                t = triton.testing.do_bench(lambda: paged_decode_attention(
                    q, k_cache, v_cache, tables, lens, scale, num_splits=splits, block_n=block_n,
                    num_warps=warps, num_stages=stages), warmup=20, rep=100) * 1e3
                if best is None or t < best[0]:
                    best = (t, (block_n, warps, stages, splits))
        name = f"{batch}x{context or 'U[100,2048)'} {heads}/{kv_heads}"
        print(f"{name:>24} {t_fa4:>8.1f} {nbytes / t_fa4 / 1e6:>5.2f} | {best[0]:>9.1f} "
              f"{nbytes / best[0] / 1e6:>5.2f} {best[1]}")


if __name__ == "__main__":
    main()
