"""Fused elementwise kernels on CUDA through torch.compile, plain torch elsewhere.

A decode step of a small model is launch-bound: a rotary embedding in torch ops is several
tiny kernels per layer (the norms have a Triton kernel of their own, ``kernels/rms_norm.py``).
Compiling these pure functions turns each into one Triton kernel, and the CUDA graphs replay
those. On CPU the eager functions run as they are.

Shapes follow torch.compile's default: the first call compiles for its exact shape, the
first call with another token count recompiles with that dimension dynamic (and one token,
which torch always specializes, gets its own), and feature sizes stay constants. Constant
feature sizes let the kernels use full-width vector loads: compiled with every dimension
dynamic, the RMSNorms compiled this way ran 1.3-1.6x slower on an H200.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def on_cuda(eager: Callable) -> Callable:
    """``eager`` for CPU tensors, its torch.compile'd twin for CUDA tensors (first argument decides)."""
    compiled = torch.compile(eager)

    def dispatch(x: torch.Tensor, *args):
        return compiled(x, *args) if x.is_cuda else eager(x, *args)

    dispatch.__doc__ = eager.__doc__
    return dispatch
