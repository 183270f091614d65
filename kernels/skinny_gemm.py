"""Triton products of a few rows with a weight matrix: y = x @ W.T for 1 to 4 rows of x.

At batch 1-4 a decode step's linear layers read their weights and little else, so each
should run near the memory bandwidth. cuBLAS does for most of Qwen3-0.6B's shapes, but not
for some: its kernel for the attention output projection (1024 x 2048) took 12.8 us at one
row on an H200, 0.33 TB/s, against ~2 us for the bytes. Here each program owns BLOCK_N
output features, streams their [BLOCK_N, K] slice of W once in BLOCK_K tiles, and
multiplies every tile with each row of x (the rows are few, so all of them at once).
Products accumulate elementwise in float32 and are summed once at the end: a sum per tile
made the loop wait on a cross-warp reduction before its next loads (5.4 against 4.7 us a
call at one row in Qwen3-0.6B's decode step on an H200). The output has x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 4


@triton.jit(do_not_specialize=["M", "N", "K"])
def _skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_y,
                   ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rows = tl.arange(0, ROWS)
    cols_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + cols_n[:, None].to(tl.int64) * stride_w + ks[None, :],
                    mask=(cols_n[:, None] < N) & (ks[None, :] < K), other=0.0).to(tl.float32)
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :],
                    mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0).to(tl.float32)
        acc += x[:, None, :] * w[None, :, :]
    tl.store(y_ptr + rows[:, None] * stride_y + cols_n[None, :], tl.sum(acc, axis=2).to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols_n[None, :] < N))


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, block_n: int = 8, block_k: int = 256,
                  num_warps: int = 4) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS, rows contiguous) @ weight [N, K].T -> [M, N], in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    assert 0 < m <= MAX_ROWS and weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    rows = 1 if m == 1 else 2 if m == 2 else 4
    _skinny_kernel[(triton.cdiv(n, block_n),)](x, weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
                                               ROWS=rows, BLOCK_N=block_n, BLOCK_K=block_k // rows,
                                               num_warps=num_warps)
    return y
