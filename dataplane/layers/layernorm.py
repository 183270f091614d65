"""RMSNorm, optionally fused with the residual add that precedes it.

On CUDA one Triton kernel (``kernels/rms_norm.py``) does the add and the norm, launched behind
the kernel ahead of it; on CPU the functions below run as they are, and they are what the
kernel's rounding follows.
"""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dim, in float32, cast back to x's dtype."""
    if x.is_cuda:
        from twinplane.kernels.rms_norm import rms_norm as norm_kernel  # imports triton

        return norm_kernel(x.reshape(-1, x.shape[-1]), weight, eps)[0].view(x.shape)
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), x and residual [T, D]."""
    if x.is_cuda:
        from twinplane.kernels.rms_norm import rms_norm as norm_kernel

        return norm_kernel(x, weight, eps, residual)
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, computed in float32 and cast back to the input dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: norm(x). With it: (norm(x + residual), x + residual)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
