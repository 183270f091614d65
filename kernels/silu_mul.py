"""Triton kernel for the gated MLP's activation: silu(gate) * up, gate and up packed in one row.

One program per (token, tile of BLOCK features): it loads the tile of the gate half and the
same tile of the up half (each a contiguous run of BLOCK values), computes in float32 and
rounds once. The feature count is a compile-time constant, so every load is a full-width
vector load. torch.compile's shape-dynamic twin, which could not know that, was 2-3.4x slower
from 160 tokens up on an H200 (8,192 tokens: 121 against 35 us). On sm_90 and newer it is
launched with programmatic dependent launch, behind the gate/up projection: it starts while
that one finishes and waits for it (``griddepcontrol.wait``) before it reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from twinplane.kernels.device import launch_pdl

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, D: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + D + cols, mask=mask).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2 * d] (rows contiguous) -> silu(x[:, :d]) * x[:, d:] as [T, d], in x's dtype."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(1) == 1, "x must be [T, 2 * d] with contiguous rows"
    d = x.shape[1] // 2
    out = torch.empty(x.shape[0], d, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        pdl = launch_pdl(x.device)
        _silu_mul_kernel[(x.shape[0], triton.cdiv(d, BLOCK))](x, out, x.stride(0), out.stride(0), D=d, BLOCK=BLOCK,
                                                              PDL=pdl, launch_pdl=pdl)
    return out
