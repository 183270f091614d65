"""What the kernels' launch heuristics ask of the CUDA device."""

from __future__ import annotations

import functools

import torch


@functools.cache
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of CUDA device ``device_index`` (asked once per device)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count
