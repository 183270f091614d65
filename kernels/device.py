"""What the kernels' launches ask of the CUDA device."""

from __future__ import annotations

import functools

import torch


@functools.cache
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of CUDA device ``device_index`` (asked once per device)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """SMs of a CUDA device; 4 for CPU tensors (Triton's interpreter), as a nominal count."""
    return num_sms(device.index or 0) if device.type == "cuda" else 4


@functools.cache
def capability(device_index: int) -> tuple[int, int]:
    """Compute capability of CUDA device ``device_index`` (asked once per device)."""
    return torch.cuda.get_device_capability(device_index)


def runs_ptx(device: torch.device) -> bool:
    """Whether kernels on ``device`` may hold inline PTX: NVIDIA GPUs (not ROCm, and never Triton's
    interpreter, which runs no PTX)."""
    return device.type == "cuda" and torch.version.hip is None


def launch_pdl(device: torch.device) -> bool:
    """Whether kernels on ``device`` are launched with programmatic dependent launch: NVIDIA GPUs
    of sm_90 and newer."""
    return runs_ptx(device) and capability(device.index or 0)[0] >= 9


def e4m3_in_ptx(device: torch.device) -> bool:
    """Whether kernels on ``device`` may convert float8 e4m3 with PTX's ``cvt.rn.f16x2.e4m3x2``: NVIDIA
    GPUs of sm_89 and newer."""
    return runs_ptx(device) and capability(device.index or 0) >= (8, 9)
