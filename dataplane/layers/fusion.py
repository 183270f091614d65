"""Fused elementwise kernels on CUDA through torch.compile, plain torch elsewhere.

A decode step of a small model is launch-bound: every RMSNorm, rotary embedding and
SiLU-and-mul is several tiny kernels per layer. Compiling these pure functions (shape-
dynamic, compiled once per process on first use) turns each into one Triton kernel,
and the CUDA graphs replay those. On CPU the eager functions run as they are.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def on_cuda(eager: Callable) -> Callable:
    """``eager`` for CPU tensors, its torch.compile'd twin for CUDA tensors (first argument decides)."""
    compiled = torch.compile(eager, dynamic=True)

    def dispatch(x: torch.Tensor, *args):
        return compiled(x, *args) if x.is_cuda else eager(x, *args)

    dispatch.__doc__ = eager.__doc__
    return dispatch
