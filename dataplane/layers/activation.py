"""Activation of gated MLPs: SiLU of the first half times the second half."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2 * d] -> [T, d]: silu(gate) * up. One Triton kernel on CUDA (float32 inside, one
    rounding), plain torch elsewhere."""
    if x.is_cuda:
        from twinplane.kernels.silu_mul import silu_mul  # imports triton

        return silu_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """[T, 2 * d] -> [T, d]: silu(gate) * up, with gate and up packed on the last dim."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
