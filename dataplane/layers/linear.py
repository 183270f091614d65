"""Linear layers split over tensor-parallel ranks, each owning its ``weight_loader``.

A checkpoint tensor always arrives whole (the Hugging Face shape); the layer keeps the
slice that belongs to its rank. Column-parallel layers split the output features, the
row-parallel layer splits the input features and sums the partial results (all-reduce).
Packed layers (``MergedColumnParallelLinear``, ``QKVParallelLinear``) fuse several
checkpoint tensors into one matmul; their loaders take a ``shard_id`` saying which part
of the packed output a checkpoint tensor fills.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from twinplane.dataplane.distributed import tp_rank, tp_world_size


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) on cuBLAS, but on CUDA 1-4 rows take the skinny Triton kernel
    (``kernels/skinny_gemm.py``) and outputs of one wave of tiles without bias quack's GEMM
    (``kernels/wave_gemm.py``)."""
    if x.is_cuda:
        from twinplane.kernels import skinny_gemm, wave_gemm  # imports triton

        if skinny_gemm.supports(x, weight):
            return skinny_gemm.skinny_linear(x, weight, bias)
        if bias is None and wave_gemm.supports(x, weight):
            return wave_gemm.wave_linear(x, weight)
    return F.linear(x, weight, bias)


def _divide(numerator: int, denominator: int) -> int:
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


def _copy_checked(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:  # a checkpoint that config.json does not describe
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


class LinearBase(nn.Module):
    """Holds ``weight`` [out, in] (and ``bias`` [out]) of this rank's shard."""

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_world_size()
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole matrix."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        _copy_checked(param, loaded)


class ColumnParallelLinear(LinearBase):
    """Output features split evenly over ranks; the output stays sharded."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, _divide(output_size, tp_world_size()), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        shard = param.shape[0]
        _copy_checked(param, loaded.narrow(0, self.tp_rank * shard, shard))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs (e.g. gate and up) computed by one matmul."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:  # type: ignore[override]
        assert 0 <= shard_id < len(self.output_sizes), f"shard_id {shard_id} out of range"
        offset = _divide(sum(self.output_sizes[:shard_id]), self.tp_size)
        size = _divide(self.output_sizes[shard_id], self.tp_size)
        _copy_checked(param.data.narrow(0, offset, size), loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections in one matmul, split by attention head.

    When there are fewer KV heads than ranks, each KV head is replicated on
    ``tp_size // total_num_kv_heads`` consecutive ranks.
    """

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False) -> None:
        tp_size = tp_world_size()
        self.head_dim = head_dim
        self.num_heads = _divide(total_num_heads, tp_size)
        if total_num_kv_heads >= tp_size:
            self.num_kv_heads = _divide(total_num_kv_heads, tp_size)
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = _divide(tp_size, total_num_kv_heads)
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:  # type: ignore[override]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, index = 0, q_size, self.tp_rank
        elif shard_id == "k":
            offset, size, index = q_size, kv_size, self.tp_rank // self.kv_replicas
        elif shard_id == "v":
            offset, size, index = q_size + kv_size, kv_size, self.tp_rank // self.kv_replicas
        else:
            raise AssertionError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        _copy_checked(param.data.narrow(0, offset, size), loaded.narrow(0, index * size, size))


class RowParallelLinear(LinearBase):
    """Input features split over ranks; partial outputs are summed across ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(_divide(input_size, tp_world_size()), output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.dim() == 1:  # the bias is added once, after the reduction
            _copy_checked(param, loaded)
            return
        shard = param.shape[1]
        _copy_checked(param, loaded.narrow(1, self.tp_rank * shard, shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y
