"""Activation of gated MLPs: SiLU of the first half times the second half."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from twinplane.dataplane.layers.fusion import on_cuda


@on_cuda
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """[..., 2 * d] -> [..., d]: silu(gate) * up, with gate and up packed on the last dim."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
