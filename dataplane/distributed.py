"""Tensor-parallel rank and world size, read from torch.distributed.

Layers ask here once, at construction; without an initialised process group the data
plane runs as rank 0 of 1, so every layer works unchanged on a single device.
"""

from __future__ import annotations

import torch.distributed as dist


def tp_rank() -> int:
    """This process's tensor-parallel rank (0 when torch.distributed is not initialised)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def tp_world_size() -> int:
    """Number of tensor-parallel ranks (1 when torch.distributed is not initialised)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
