"""Triton paged attention for decode steps (one query token per sequence), with split-KV.

A decode step reads every sequence's whole K/V context once and does little arithmetic
with it, so it is bound by memory bandwidth. The kernel is shaped for that:

- One program per (KV head, sequence, split). It loads the queries of all the heads that
  share the KV head (grouped-query attention) as one small matrix, so each K/V row is read
  from memory once per step, not once per query head.
- The KV head is the fastest grid axis, so the programs of one sequence run side by side and
  read its pages together. With ``order`` (the sequences by context, longest first, as the
  input batch sends it for decode steps), the longest sequences start first, and the short
  ones fill the end of the step instead of a lone long one. On an H200 both together read the
  cache 6-9% faster at 64-256 sequences of mixed length (BENCHMARKS.md).
- Split-KV: while batch x KV heads is under three programs per SM, each sequence's context is
  cut into ``num_splits`` ranges that run in parallel, and a second kernel merges their
  partial outputs by their log-sum-exp. (Measured on an H200: splitting a batch that
  already fills the GPU is slower.) The split count depends only on the batch size, so it
  is fixed inside a CUDA graph, and every sequence divides its own context at run time.
- From the q/k/v projection (``decode_attention_from_qkv``): the same kernel also does what
  ``kernels/rope_store.py`` does for these tokens. Each program normalises and rotates its
  group's queries itself; the program whose key range holds the new token stores its key and
  value first and then reads them from the cache like every other key. That is one kernel
  and one round trip of q through memory less per layer: 47-60 us less kernel time per decode
  step of Qwen3-0.6B on an H200 at batch 1-128 (BENCHMARKS.md), the same at 160-256.
- On sm_90 and newer both kernels are launched with programmatic dependent launch: each lets
  the next kernel start at once (the output projection loads its weights meanwhile) and waits
  for the kernel ahead (``kernels/skinny_gemm.py`` says why). Where ``tile_keys`` says so, a
  program loads its first tile of keys and values before it waits: those keys were stored
  by earlier steps (all but the new token's, which it reads after).

The cache of one layer is [num_blocks, block_size, kv_heads, head_dim], in the model dtype or in
float8 (e4m3, no scale: ``kernels/kv_writer.py``), which is half the bytes to read; over float8 the
tile products take bfloat16 queries in float16 (``dot_queries``: decode steps 3.4% shorter on an
H100, BENCHMARKS.md); with one split the float8 tiles convert through ``e4m3_to_f16``, which takes fewer
registers than Triton's own conversion (decode steps 6% shorter on an H100), and its tile loads run
two ahead (``load_page``, ``key_stages``). ``BLOCK_N`` divides ``block_size``, so each tile of keys lies in
one page.
Sequences with context 0 (the padding rows of a CUDA graph) produce zeros.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from twinplane.kernels.device import e4m3_in_ptx, launch_pdl, runs_ptx, sm_count
from twinplane.kernels.rope_store import QKVRope, check_qkv, decode_q_store_kv

LOG2E = 1.4426950408889634


@triton.jit
def dot_queries(q, cache_ptr):
    """The queries as ``_attend_tile`` multiplies them: bfloat16 queries over a float8 cache in
    float16 (clamped to its range), so each tile of keys and values converts from float8 to
    float16, which Hopper does more cheaply than to bfloat16; otherwise as they are. float16 has
    three more mantissa bits than bfloat16, so within its range the queries lose nothing and the
    softmax weights less."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv and q.dtype == tl.bfloat16:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return q


@triton.jit
def e4m3_to_f16(x):
    """float8 e4m3 to float16 with sm_89's conversion instruction, the four bytes of each 32-bit register
    at once. Triton's own conversion widens the bytes to 16 bits one by one first; over the decode
    kernel's tiles this one takes fewer registers (128 against 141 a thread on sm_90, so four
    programs an SM instead of three): on an H100 the kernel took 9% less time over the benchmark's
    decode steps, and the run's decode steps 6% less (BENCHMARKS.md)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def load_page(ptr, ok, PTX: tl.constexpr):
    """The int32 at ``ptr`` where ``ok`` (else 0): a page number from the block table. With ``PTX``, through
    one inline ``ld.global.nc`` instead of ``tl.load``: Triton's pipeliner does not multi-buffer loads whose
    addresses come from a ``tl.load`` in the same loop, so with it the K/V tiles get one shared-memory
    buffer at any ``num_stages`` (sm_90, Triton 3.6 and 3.9: ``async_wait`` of 0); through this load, three stages
    give two buffers, and a tile loads while the one before it is multiplied. The table is not
    written while the kernel runs, so the read-only path is safe; predicated on ``ok``, a tile the loop
    runs ahead to past the end reads nothing."""
    if PTX:
        return tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b32 $0, 0; @p ld.global.nc.b32 $0, [$1]; }",
            "=r,l,r", [ptr, ok.to(tl.int32)], dtype=tl.int32, is_pure=True, pack=1)
    return tl.load(ptr, mask=ok, other=0)


@triton.jit
def _attend_tile(q, k, v, seen, m, l, acc, scale_log2):
    """Online softmax over one tile of keys: the running max m, sum l and output acc of each query;
    ``seen`` (broadcast to [queries, keys]) says which keys each query attends to. Keys and values
    from a float8 cache are converted to the queries' dtype (``dot_queries``) here."""
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k)) * scale_log2
    s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l, acc


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, block_table_ptr, context_lens_ptr, order_ptr, out_ptr, lse_ptr,
                   positions_ptr, cos_sin_ptr, q_norm_ptr, k_norm_ptr, eps, slot_ptr,
                   scale_log2, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt,
                   stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_N: tl.constexpr, PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr, ORDERED: tl.constexpr,
                   FROM_QKV: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HAS_NORM: tl.constexpr,
                   PREFETCH: tl.constexpr, PDL: tl.constexpr, E4M3_PTX: tl.constexpr, PAGE_PTX: tl.constexpr,
                   STAGES: tl.constexpr):
    # Before the wait the kernel reads only what no kernel of this step writes: the step's inputs
    # (copied before its first kernel, which is not launched with PDL) and, with PREFETCH, keys
    # that earlier steps stored.
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    if ORDERED:
        seq = tl.load(order_ptr + seq)
    split = tl.program_id(2)
    context = tl.load(context_lens_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(context, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, context)

    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    table = block_table_ptr + seq.to(tl.int64) * stride_bt
    if PREFETCH:  # the split's first tile, all but the new token (at context - 1)
        first_ok = start + cols < end
        earlier = first_ok & (start + cols < context - 1)
        first_page = tl.load(table + start // PAGE, mask=start < end, other=0).to(tl.int64)
        first = (first_page * stride_kb + (start % PAGE + cols)[:, None] * stride_kt + kv_head * stride_kh
                 + dims[None, :])
        k_first = tl.load(k_ptr + first, mask=earlier[:, None], other=0.0)
        v_first = tl.load(v_ptr + first, mask=earlier[:, None], other=0.0)
    if PDL:  # let the next kernel start loading its weights; wait for the q/k/v projection
        gdc_launch_dependents()
        gdc_wait()

    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    if FROM_QKV:  # q_ptr is the q/k/v projection; the split holding the new token stores its K/V
        q = decode_q_store_kv(q_ptr + seq.to(tl.int64) * stride_qt, heads, row_ok, kv_head, positions_ptr + seq,
                              cos_sin_ptr, q_norm_ptr, k_norm_ptr, eps, slot_ptr + seq, k_ptr, v_ptr, stride_kt,
                              stride_kh, (start < context) & (context <= end), HEADS, KV_HEADS, GROUP_PAD,
                              HEAD_DIM // 2, HAS_NORM)
    else:
        q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=row_ok[:, None],
                    other=0.0)
    q = dot_queries(q, k_ptr)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    rest = start
    if PREFETCH:
        new = (first_ok & ~earlier)[:, None]  # the new token, if it is in the first tile: read now
        k_first = tl.where(new, tl.load(k_ptr + first, mask=new, other=0.0), k_first)
        v_first = tl.where(new, tl.load(v_ptr + first, mask=new, other=0.0), v_first)
        if start < end:  # an empty split keeps l = 0 (a tile of no keys would divide -inf by -inf)
            m, l, acc = _attend_tile(q, k_first, v_first, first_ok[None, :], m, l, acc, scale_log2)
        rest += BLOCK_N
    for n in tl.range(rest, end, BLOCK_N, num_stages=STAGES):
        page = load_page(table + n // PAGE, n < end, PAGE_PTX).to(tl.int64)
        token_ok = n + cols < end
        offsets = page * stride_kb + (n % PAGE + cols)[:, None] * stride_kt + kv_head * stride_kh + dims[None, :]
        k = tl.load(k_ptr + offsets, mask=token_ok[:, None], other=0.0)
        v = tl.load(v_ptr + offsets, mask=token_ok[:, None], other=0.0)
        if E4M3_PTX:
            k = e4m3_to_f16(k)
            v = e4m3_to_f16(v)
        m, l, acc = _attend_tile(q, k, v, token_ok[None, :], m, l, acc, scale_log2)

    has_keys = l > 0
    out = acc / tl.where(has_keys, l, 1.0)[:, None]
    out_offsets = split * stride_os + seq * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    if NUM_SPLITS > 1:
        lse = tl.where(has_keys, m + tl.log2(tl.where(has_keys, l, 1.0)), float("-inf"))
        tl.store(lse_ptr + split * stride_ls + seq * stride_lt + heads, lse, mask=row_ok)


@triton.jit
def _merge_kernel(part_ptr, lse_ptr, out_ptr, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
                  stride_ot, stride_oh, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    lse = tl.load(lse_ptr + splits * stride_ls + seq * stride_lt + head)
    top = tl.max(lse, 0)
    weights = tl.where(lse > float("-inf"), tl.exp2(lse - top), 0.0)
    total = tl.sum(weights, 0)
    parts = tl.load(part_ptr + splits[:, None] * stride_ps + seq * stride_pt + head * stride_ph + dims[None, :])
    out = tl.sum(parts * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


def programs_per_sm(num_seqs: int, num_kv_heads: int, device: torch.device) -> float:
    """Programs of one split per sequence (sequences x KV heads) for each SM of the device."""
    return max(1, num_seqs * num_kv_heads) / sm_count(device)


def decode_splits(num_seqs: int, num_kv_heads: int, device: torch.device, max_splits: int = 16) -> int:
    """Splits per sequence: one from three programs per SM on; under that at least two, and
    enough for a program per SM. With contexts of mixed length, one program per sequence
    leaves the longest ones running alone at the end of the step.

    Measured on an H200 (Qwen3-0.6B heads). The kernel alone, in CUDA graphs, on the decode
    steps of the default benchmark (batch b with contexts U[100, 1024] + t as it shrinks with
    step t; ``python -m twinplane.kernels.bench_attention --splits``): two splits took 62
    sequences (3.8 programs an SM) from 111.6 to 89.0 us and 76 from 118.0 to 100.6. In the
    benchmark itself, two splits up to six programs an SM (with 128-key tiles for one split
    under twelve) made its decode steps slower, not faster: 4.71 / 4.72 ms against 4.68 / 4.69
    (26,068 / 26,040 against 26,228 / 26,156 tok/s, runs interleaved); two splits alone, up
    to four or six programs an SM, changed nothing (decode steps 4.64-4.66 ms either way).
    Under one program per SM more splits than this were faster alone (7 sequences: 16.0 us
    with 8 splits, 19.9 with 4) but not in plans of decode steps (H100, plans of 8 steps at
    context 512: 4 sequences 1,413.5 us a token with 16 splits, 1,322.2 with 8)."""
    per_sm = programs_per_sm(num_seqs, num_kv_heads, device)
    if per_sm >= 3:
        return 1
    return min(max_splits, max(2, triton.next_power_of_2(math.ceil(1 / per_sm))))


def tile_keys(num_splits: int) -> tuple[int, bool]:
    """(keys per tile, whether a program loads its first tile before it waits) for this many
    splits, as measured fastest on an H200 (bf16, head dim 128, GQA group 2, Qwen3-0.6B shapes):

    - 16 splits (one or two sequences): 64 keys, loaded early. Decoding one sequence at context
      500 / 1,500 took 693 / 749 us a token instead of 760 / 877 (32-key tiles, not loaded
      early): the kernel starts while the q/k/v projection ahead of it still runs.
    - One split: 64 keys (64 x 512 context: 35 vs 40 us at 128). 128 keys made the kernel alone
      3% faster on the benchmark's decode steps (62 sequences: 89.6 vs 110.2 us), but the
      benchmark's own decode steps slower: 4.76 against 4.70 ms, runs interleaved, and 4.73
      with programmatic dependent launch off. Loaded early, the kernel alone was faster up to
      ~6 programs an SM and slower past it, but the benchmark's decode steps took the same
      time either way, so it does not.
    - 2-8 splits: 128 keys. 64 loaded early was slower at 4 sequences (1,472 vs 1,354 us a token).
    """
    if num_splits >= 16:
        return 64, True
    return (64 if num_splits == 1 else 128), False


def key_stages(num_splits: int, float8: bool) -> int:
    """Pipeline stages of the loop over tiles of keys (``num_stages``; 2 keeps one tile in flight, 3 two):
    3 for one split over a float8 cache, else 2. Measured on an H100 over the benchmark's decode steps
    (the kernel alone, in CUDA graphs, one split, 64-key tiles): over float8 three stages took 530 us
    against 547 (38,912 against 22,528 bytes of shared memory a program, 104 against 128 registers a
    thread), and the run's decode steps 3.86 against 3.92 ms (30,665 against 30,364 tok/s, one call); over
    bf16 912 us either way (71,680 against 38,912 bytes), so there it stays at 2. 32-key tiles at three or
    four stages were slower over both (bf16 917-922, float8 557-560 us)."""
    return 3 if float8 and num_splits == 1 else 2


def supports(head_dim: int, block_size: int) -> bool:
    """Whether the kernel takes this shape (tl.dot needs power-of-two tiles of at least 16)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and block_size % 16 == 0


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           order: torch.Tensor | None = None, num_splits: int | None = None, block_n: int | None = None,
                           num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """q [n, heads, d] (one query per sequence, at its last position) -> [n, heads, d].

    Sequence i attends to the first ``context_lens[i]`` tokens of its pages
    ``block_tables[i]`` in the caches [num_blocks, block_size, kv_heads, d]. ``order`` (int32 [n],
    optional): a permutation of the sequences, the order in which their programs start.
    """
    assert q.stride(-1) == 1
    return _launch(q, q.shape[1], q.stride(0), q.stride(1), None, None, k_cache, v_cache, block_tables, context_lens,
                   scale, order, num_splits, block_n, num_warps, num_stages)


def decode_attention_from_qkv(qkv: torch.Tensor, rope: QKVRope, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                              scale: float, order: torch.Tensor | None = None, num_splits: int | None = None,
                              tile: tuple[int, bool] | None = None) -> torch.Tensor:
    """``norm_rope_store`` and ``paged_decode_attention`` in one kernel, for decode steps.

    qkv [n, (heads + 2 kv_heads) * d] holds each sequence's new token (row i: sequence i, at
    position ``rope.positions[i]`` = context_lens[i] - 1). Every program normalises and rotates
    the queries of its KV head itself; the program whose split holds the new token stores its
    key and value at ``slot_mapping[i]`` (nothing for -1) and then reads them from the cache
    like the rest. Saves a kernel launch and a round trip of q through memory per layer.
    ``num_splits`` and ``tile`` (keys per tile, first tile loaded early) override the measured
    choices of ``decode_splits`` and ``tile_keys``. Returns the attention output [n, heads, d].
    """
    head_dim = check_qkv(qkv, rope, k_cache, v_cache)
    assert slot_mapping.shape[0] == qkv.shape[0] == context_lens.shape[0], "one new token per sequence"
    return _launch(qkv, rope.num_heads, qkv.stride(0), head_dim, rope, slot_mapping, k_cache, v_cache, block_tables,
                   context_lens, scale, order, num_splits, None, 4, 2, tile)


def _launch(q, num_heads, stride_qt, stride_qh, rope, slot_mapping, k_cache, v_cache, block_tables, context_lens,
            scale, order, num_splits, block_n, num_warps, num_stages, tile=None) -> torch.Tensor:
    """The decode (and merge) kernels; ``q`` is the queries [n, heads, d], or with ``rope`` the q/k/v rows."""
    num_seqs = q.shape[0]
    _, page, num_kv_heads, head_dim = k_cache.shape
    group = num_heads // num_kv_heads
    assert num_heads == group * num_kv_heads, f"{num_heads} heads not a multiple of {num_kv_heads} kv heads"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert supports(head_dim, page), f"head_dim {head_dim} / block size {page} not supported"
    if num_splits is None:
        num_splits = decode_splits(num_seqs, num_kv_heads, q.device)
    keys, prefetch = tile or tile_keys(num_splits)
    block_n = min(block_n or keys, page & -page)  # a power of two that divides the page
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_splits > 1:
        part = torch.empty((num_splits, num_seqs, num_heads, head_dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((num_splits, num_seqs, num_heads), dtype=torch.float32, device=q.device)
    else:
        part, lse = out.unsqueeze(0), out  # written straight to out; lse unused
    if num_seqs == 0:
        return out
    assert order is None or order.shape == (num_seqs,), "order must hold one entry per sequence"
    from_qkv = rope is not None
    has_norm = from_qkv and rope.q_norm is not None  # check_qkv made sure k_norm comes with q_norm
    unused = context_lens  # any tensor, for the pointers a variant does not read
    pdl = launch_pdl(q.device)
    # One split (a GPU full of programs): float8 tiles through e4m3_to_f16. With several (few sequences) it
    # made the kernel slower on an H100 (16 sequences: 34.6 against 31.0 us), so there Triton converts.
    float8 = k_cache.dtype == torch.float8_e4m3fn
    e4m3_ptx = float8 and num_splits == 1 and e4m3_in_ptx(q.device)
    _decode_kernel[(num_kv_heads, num_seqs, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, unused if order is None else order, part, lse,
        rope.positions if from_qkv else unused, rope.cos_sin_cache if from_qkv else unused,
        rope.q_norm if has_norm else unused, rope.k_norm if has_norm else unused, rope.eps if has_norm else 0.0,
        slot_mapping if from_qkv else unused, scale * LOG2E,
        stride_qt, stride_qh, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_N=block_n, PAGE=page, NUM_SPLITS=num_splits, ORDERED=order is not None, FROM_QKV=from_qkv,
        HEADS=num_heads, KV_HEADS=num_kv_heads, HAS_NORM=has_norm, PREFETCH=prefetch, PDL=pdl,
        E4M3_PTX=e4m3_ptx, PAGE_PTX=runs_ptx(q.device), STAGES=key_stages(num_splits, float8), num_warps=num_warps,
        num_stages=num_stages, launch_pdl=pdl)
    if num_splits > 1:
        _merge_kernel[(num_seqs, num_heads)](
            part, lse, out, part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1), HEAD_DIM=head_dim, NUM_SPLITS=num_splits, PDL=pdl, launch_pdl=pdl)
    return out
