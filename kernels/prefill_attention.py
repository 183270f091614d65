"""Triton paged attention for steps with prompt tokens: any number of query tokens per sequence.

Sequence i has ``cu_seqlens_q[i + 1] - cu_seqlens_q[i]`` new query tokens, the last of its
``context_lens[i]`` tokens in its pages (stored just before), and query j attends causally to
the keys at positions up to ``context_lens[i] - q_len + j``. That covers prompts, prompt
chunks after a cached prefix, and decode rows beside them in one launch.

- One program per (tile of ``BLOCK_Q`` query tokens of one sequence, KV head). The tile's
  rows are its tokens times the query heads that share the KV head (grouped-query attention),
  so each K/V tile is read once for all of them.
- The grid depends only on the number of query tokens and of sequences: sequence i's tiles
  are numbered from ``cu_seqlens_q[i] // BLOCK_Q + i`` on (at least as many as it needs), and
  a program finds its sequence by binary search over those starts. A CUDA graph captured for
  a (sequences, tokens) shape therefore serves every step of that shape, whatever the lengths;
  the programs past a sequence's tiles, and those of padding sequences (no query tokens), end
  at once.
- The cache of one layer is [num_blocks, block_size, kv_heads, head_dim], in the model dtype or
  in float8 (read and converted tile by tile, to float16 for bfloat16 queries: ``dot_queries``),
  the pages of a sequence in ``block_tables``; ``BLOCK_N`` divides ``block_size``, so a tile of
  keys lies in one page.

A step's attention is a small part of a prompt step's time (its projections are the rest), so
the kernel is plain: a causal mask on every tile, no split of the keys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from twinplane.kernels.decode_attention import LOG2E, _attend_tile, dot_queries, supports


@triton.jit(do_not_specialize=["num_seqs"])
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, cu_q_ptr, context_lens_ptr, block_table_ptr, num_seqs, scale_log2,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh, stride_bt,
                    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    lo = num_seqs * 0  # the last sequence whose first tile is at or before this one
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(cu_q_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid
        else:
            hi = mid - 1
    seq = lo
    q_begin = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_begin
    first = (tile - (q_begin // BLOCK_Q + seq)) * BLOCK_Q  # the tile's first query, within the sequence
    if first < q_len:
        context = tl.load(context_lens_ptr + seq)
        rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
        token = first + rows // GROUP_PAD
        group = rows % GROUP_PAD
        row_ok = (group < GROUP) & (token < q_len)
        dims = tl.arange(0, HEAD_DIM)
        heads = kv_head * GROUP + group
        q = tl.load(q_ptr + (q_begin + token).to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh
                    + dims[None, :], mask=row_ok[:, None], other=0.0)
        q = dot_queries(q, k_ptr)
        position = context - q_len + token  # of each row's query; it sees the keys at or before it
        keys_end = tl.minimum(context, context - q_len + first + BLOCK_Q)

        cols = tl.arange(0, BLOCK_N)
        table = block_table_ptr + seq.to(tl.int64) * stride_bt
        m = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM], tl.float32)
        for n in range(0, keys_end, BLOCK_N):  # every row sees key 0, so no row's max stays -inf
            page = tl.load(table + n // PAGE).to(tl.int64)
            key_ok = n + cols < keys_end
            offsets = page * stride_kb + (n % PAGE + cols)[:, None] * stride_kt + kv_head * stride_kh + dims[None, :]
            k = tl.load(k_ptr + offsets, mask=key_ok[:, None], other=0.0)
            v = tl.load(v_ptr + offsets, mask=key_ok[:, None], other=0.0)
            m, l, acc = _attend_tile(q, k, v, (n + cols)[None, :] <= position[:, None], m, l, acc, scale_log2)
        out = acc / l[:, None]
        tl.store(out_ptr + (q_begin + token).to(tl.int64)[:, None] * stride_ot + heads[:, None] * stride_oh
                 + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def query_tile(group: int) -> int:
    """Query tokens per program: 64 rows of query heads (tl.dot's tiles are at least 16 rows)."""
    return max(1, 64 // triton.next_power_of_2(group))


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                            block_n: int = 64, num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """q [T, heads, d] -> [T, heads, d]: each sequence's queries over the first ``context_lens[i]``
    tokens of its pages ``block_tables[i]``, causally (see the module docstring). Query rows
    past ``cu_seqlens_q[-1]`` (padding) are left as they are."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = context_lens.shape[0]
    _, page, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    assert num_heads == group * num_kv_heads, f"{num_heads} heads not a multiple of {num_kv_heads} kv heads"
    assert q.stride(-1) == 1 and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert supports(head_dim, page), f"head_dim {head_dim} / block size {page} not supported"
    assert cu_seqlens_q.shape[0] == num_seqs + 1 == block_tables.shape[0] + 1
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_q = query_tile(group)
    _prefill_kernel[(num_tokens // block_q + num_seqs, num_kv_heads)](
        q, k_cache, v_cache, out, cu_seqlens_q, context_lens, block_tables, num_seqs, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), block_tables.stride(0), GROUP=group, GROUP_PAD=triton.next_power_of_2(group),
        BLOCK_Q=block_q, HEAD_DIM=head_dim, BLOCK_N=min(block_n, page & -page), PAGE=page, num_warps=num_warps,
        num_stages=num_stages)
    return out
