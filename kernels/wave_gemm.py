"""Projections whose output fits one wave of 64 x 64 tiles: quack's Hopper GEMM, not cuBLAS.

A decode step's projections of 5-256 rows take cuBLAS 5-8 us each, several times their
weights' bytes at the read peak; much of it is a fixed cost of every kernel (filling its load
pipeline, its last tiles and stores). quack's sm_90 GEMM (CuTe DSL, from the quack-kernels
package that FlashAttention-4 depends on) in one configuration beats it whenever its output
tiles all fit on the SMs at once: operands swapped (output features are the MMA's wide side),
64 x 64 tiles, two consumer warp groups taking turns (ping-pong), no cluster. It signals the
kernel after it to launch once its MMAs are issued (programmatic dependent launch), so that
kernel's start overlaps its end. Past one wave cuBLAS wins again. Figures: BENCHMARKS.md,
"Decode projections through quack's GEMM".

Only sm_90 (H100, H200), bf16, no bias. Anything else, a quack-kernels that is not installed,
or one whose first call fails (then logged once), leaves the projection to cuBLAS.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from twinplane.kernels.device import capability, sm_count

TILE = 64  # output features and rows a tile
log = logging.getLogger(__name__)
_failed = False  # quack's GEMM raised once: cuBLAS from then on


def one_wave(rows: int, features: int, sms: int) -> bool:
    """Whether the output's 64 x 64 tiles fit on the SMs at once."""
    return -(-rows // TILE) * -(-features // TILE) <= sms


@functools.cache
def _gemm():
    """quack's GEMM with the configuration above, or None where quack-kernels is not installed."""
    try:
        from quack.gemm_config import GemmConfig
        from quack.gemm_interface import gemm_tuned
    except Exception as exc:  # not installed, or built for another CUDA
        log.info("quack-kernels not usable (%s): projections stay on cuBLAS", exc)
        return None
    config = GemmConfig(tile_m=TILE, tile_n=TILE, pingpong=True, cluster_m=1, cluster_n=1, swap_ab=True,
                        is_dynamic_persistent=False)
    return functools.partial(gemm_tuned.fn, config=config)


def in_use(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether projections of this device and dtype go to quack where they fit one wave: bf16 on
    sm_90 with quack-kernels importable, and no call of it has failed."""
    return (not _failed and device.type == "cuda" and dtype == torch.bfloat16
            and capability(device.index or 0) == (9, 0) and _gemm() is not None)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x @ weight.T goes to quack: ``in_use`` for x, both contiguous with rows of a multiple
    of 16 bytes (TMA), and an output of one wave."""
    return (x.dim() == 2 and x.shape[0] > 0 and x.is_contiguous() and weight.is_contiguous()
            and x.dtype == weight.dtype and x.shape[1] == weight.shape[1] and x.shape[1] % 8 == 0
            and weight.shape[0] % 8 == 0 and one_wave(x.shape[0], weight.shape[0], sm_count(x.device))
            and in_use(x.device, x.dtype))


def wave_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T -> [M, N] bf16, for what ``supports`` accepts."""
    global _failed
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    try:
        _gemm()(x, weight.t(), out)
    except Exception:  # a quack-kernels whose interface or build does not match: the first call says so
        _failed = True
        log.warning("quack's GEMM failed; projections stay on cuBLAS", exc_info=True)
        return F.linear(x, weight)
    return out
