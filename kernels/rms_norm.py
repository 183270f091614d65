"""Triton RMSNorm, with the residual add before it, launched behind the kernel ahead of it.

Steps of more rows than the skinny projections take run each decoder layer's two norms as
kernels of their own between cuBLAS projections: 57 a step for Qwen3-0.6B, ~2 us each, most
of it the launch and the wait for the projection ahead, not the bytes. On sm_90 and newer
this kernel is launched with programmatic dependent launch (PDL): it may start while the
projection ahead finishes, loads the norm's weight (which no step writes) and then waits
(``griddepcontrol.wait``) before it reads x.

One program per row. Rounding follows the layers one by one, as ``dataplane/layers/layernorm``
does in torch: the sum ``x + residual`` is rounded to x's dtype (and written out as the new
residual), normalised in float32, rounded, then scaled by the weight and rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from twinplane.kernels.device import launch_pdl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, sum_ptr, w_ptr, y_ptr, stride_x, stride_res, stride_sum, stride_y, eps,
                     D: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    weight = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # from here on, what the kernel ahead wrote is visible
    dtype = y_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(dtype)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
    x = x.to(tl.float32)
    x = x * tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    tl.store(y_ptr + row * stride_y + cols, (weight * x.to(dtype).to(tl.float32)).to(dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual) for x [T, D] with contiguous rows; without
    a residual, (rms_norm(x) * weight, x). Outputs are new tensors in x's dtype."""
    assert x.dim() == 2 and x.stride(1) == 1 and weight.shape == (x.shape[1],), (
        f"x {tuple(x.shape)} stride {x.stride()}, weight {tuple(weight.shape)}")
    assert residual is None or (residual.shape == x.shape and residual.stride(1) == 1)
    y = torch.empty_like(x)
    summed = x if residual is None else torch.empty_like(x)
    if x.shape[0]:
        d = x.shape[1]
        block = triton.next_power_of_2(d)
        pdl = launch_pdl(x.device)
        _rms_norm_kernel[(x.shape[0],)](
            x, x if residual is None else residual, summed, weight, y, x.stride(0),
            0 if residual is None else residual.stride(0), summed.stride(0), y.stride(0), eps,
            D=d, BLOCK=block, ADD=residual is not None, PDL=pdl, num_warps=max(1, min(16, block // 256)),
            launch_pdl=pdl)
    return y, summed
