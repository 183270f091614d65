"""Triton projections of 1-4 rows (decode steps of a few sequences), with the RMSNorm before
them and SiLU-and-mul after them folded in where the layer has them.

At 1-4 rows a decode step's projections read their weights and little else, so each should
take its weights' bytes at the memory bandwidth. A launched kernel does not: cuBLAS and every
separately launched Triton kernel measured on an H200 cost ~3 us beyond their bytes (launch,
first loads, tail; BENCHMARKS.md), and Qwen3-0.6B has 112 projections a token.

So each program owns BLOCK_N output features and loads their whole [BLOCK_N, K] slice of W
into registers *before* it waits for the kernel ahead of it. On sm_90 and newer the kernels
are launched with programmatic dependent launch (PDL): a kernel may start as soon as every
program of the one ahead has started, loads its weights (nothing in a step writes them) while
that one runs, and waits (``griddepcontrol.wait``: the kernel ahead has finished and its
writes are visible) only before it reads x. Decode attention and its merge are launched the
same way, so a layer's kernels overlap each other's launch and weight loads instead of
running one ramp at a time. Nothing is written before the wait, so a kernel never races the
one ahead.

Every program reads all of x anyway, so two neighbours of the projections ride along:
- the RMSNorm before q/k/v and gate/up, with the residual add before it (program 0 writes the
  sum: the new residual);
- SiLU-and-mul after gate/up: a program owns the same features of the gate and the up half,
  and writes silu(gate) * up.
Rounding follows the layers one by one: the sum and the normalised row are rounded to x's
dtype as torch's ops round them, and gate and up are rounded before SiLU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from twinplane.kernels.device import launch_pdl, sm_count

MAX_ROWS = 4
MAX_K_PAD = 16384  # a program holds BLOCK_N x K_PAD weights in registers; at least one row of them
WEIGHT_BYTES_PER_PROGRAM = 32 << 10  # at most; see _program_shape
MAX_BLOCK_N = 8


@triton.jit
def _skinny_kernel(x_ptr, res_ptr, sum_ptr, norm_ptr, w_ptr, b_ptr, y_ptr, N, eps,
                   stride_x, stride_res, stride_sum, stride_y,
                   ROWS: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                   ADD: tl.constexpr, NORM: tl.constexpr, GLU: tl.constexpr, BIAS: tl.constexpr,
                   PDL: tl.constexpr):
    pid = tl.program_id(0)
    feats = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, K_PAD)
    feat_ok = feats < N
    k_ok = ks < K
    w_mask = feat_ok[:, None] & k_ok[None, :]
    w = tl.load(w_ptr + feats[:, None].to(tl.int64) * K + ks[None, :], mask=w_mask, other=0.0)
    if GLU:  # the up half's rows for the same features
        w_up = tl.load(w_ptr + (feats[:, None] + N).to(tl.int64) * K + ks[None, :], mask=w_mask, other=0.0)
    if BIAS:
        bias = tl.load(b_ptr + feats, mask=feat_ok, other=0.0).to(tl.float32)
        if GLU:
            bias_up = tl.load(b_ptr + N + feats, mask=feat_ok, other=0.0).to(tl.float32)
    if NORM:
        norm = tl.load(norm_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # from here on, what the kernel ahead wrote is visible

    dtype = y_ptr.dtype.element_ty
    for r in tl.static_range(ROWS):
        x = tl.load(x_ptr + r * stride_x + ks, mask=k_ok, other=0.0)
        if ADD:
            x = (x.to(tl.float32) + tl.load(res_ptr + r * stride_res + ks, mask=k_ok, other=0.0).to(tl.float32))
            x = x.to(dtype)
            if pid == 0:
                tl.store(sum_ptr + r * stride_sum + ks, x, mask=k_ok)
        x = x.to(tl.float32)
        if NORM:
            x = x * tl.rsqrt(tl.sum(x * x, 0) / K + eps)
            x = (norm * x.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        y = tl.sum(w.to(tl.float32) * x[None, :], 1)
        if BIAS:
            y += bias
        if GLU:
            up = tl.sum(w_up.to(tl.float32) * x[None, :], 1)
            if BIAS:
                up += bias_up
            gate = y.to(dtype).to(tl.float32)
            y = gate / (1.0 + tl.exp(-gate)) * up.to(dtype).to(tl.float32)
        tl.store(y_ptr + r * stride_y + feats, y.to(dtype), mask=feat_ok)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes x @ weight.T: 1-4 rows of x with contiguous features and a
    contiguous weight whose rows fit a program's registers."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.stride(1) == 1 and weight.is_contiguous()
            and weight.shape[1] == x.shape[1] and triton.next_power_of_2(weight.shape[1]) <= MAX_K_PAD)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) @ weight [N, K].T (+ bias) -> [M, N], in x's dtype."""
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    _launch(x, None, None, None, 0.0, weight, bias, y, glu=False)
    return y


def skinny_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                       weight: torch.Tensor, bias: torch.Tensor | None = None,
                       glu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) @ weight.T (+ bias), x + residual); without a residual, x alone.

    With ``glu`` the weight packs gate and up halves ([2 * N, K], gate first) and the output is
    silu(gate) * up, [M, N].
    """
    n = weight.shape[0] // 2 if glu else weight.shape[0]
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    summed = x if residual is None else torch.empty_like(x)
    _launch(x, residual, summed, norm_weight, eps, weight, bias, y, glu=glu)
    return y, summed


def _launch(x, residual, summed, norm_weight, eps, weight, bias, y, glu: bool) -> None:
    assert supports(x, weight), (f"skinny kernel: x {tuple(x.shape)} stride {x.stride()}, weight "
                                 f"{tuple(weight.shape)} contiguous={weight.is_contiguous()}")
    assert residual is None or (residual.shape == x.shape and residual.stride(1) == 1)
    n, k = y.shape[1], x.shape[1]
    k_pad = triton.next_power_of_2(k)
    block_n, num_warps = _program_shape(n, k_pad, weight.element_size() * (2 if glu else 1), x.device)
    pdl = launch_pdl(x.device)
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        x, x if residual is None else residual, y if summed is None else summed,
        x if norm_weight is None else norm_weight, weight, x if bias is None else bias, y, n, eps,
        x.stride(0), 0 if residual is None else residual.stride(0), 0 if summed is None else summed.stride(0),
        y.stride(0), ROWS=x.shape[0], K=k, K_PAD=k_pad, BLOCK_N=block_n, ADD=residual is not None,
        NORM=norm_weight is not None, GLU=glu, BIAS=bias is not None, PDL=pdl, num_warps=num_warps, launch_pdl=pdl)


def _program_shape(n: int, k_pad: int, bytes_per_weight: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_N, warps): at most MAX_BLOCK_N features and WEIGHT_BYTES_PER_PROGRAM of weights a
    program, in 4 warps, and programs for at least half the SMs. Small programs, several of them
    an SM, measured fastest on an H200 for Qwen3-0.6B's four projections at 1, 2 and 4 rows
    (BENCHMARKS.md): 8 features of q/k/v, o and gate/up, 4 of down; programs of 64 KB in 8 warps,
    one an SM, took 8-20% longer."""
    block_n = max(1, min(MAX_BLOCK_N, WEIGHT_BYTES_PER_PROGRAM // (k_pad * bytes_per_weight)))
    sms = sm_count(device)
    while block_n > 1 and triton.cdiv(n, block_n) < sms // 2:
        block_n //= 2
    return block_n, 4
