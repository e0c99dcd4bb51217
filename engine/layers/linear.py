"""Linear layers that know how to load (and, under tensor parallelism, shard) their weights.

Each parameter carries a `weight_loader(param, loaded_weight, shard_id=None)`; the checkpoint loader
only maps names. With `tp_size > 1` a column-parallel layer keeps rows [rank * n / tp, ...) of the
output features and a row-parallel layer the matching input columns (its partial sums are reduced
by the caller's process group, which arrives with multi-GPU support).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ParallelContext:
    tp_rank: int = 0
    tp_size: int = 1


SINGLE = ParallelContext()


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={d}")
    return n // d


class Linear(nn.Module):
    """y = x W^T (replicated on every rank)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, par: ParallelContext = SINGLE):
        super().__init__()
        self.par = par
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        _copy_checked(param.data, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(Linear):
    """Output features split across tensor-parallel ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, par: ParallelContext = SINGLE):
        super().__init__(in_features, _divide(out_features, par.tp_size, "out_features"), bias, par)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        n = param.shape[0]
        _copy_checked(param.data, loaded.narrow(0, self.par.tp_rank * n, n) if self.par.tp_size > 1 else loaded)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections stored as one (gate_proj + up_proj -> gate_up_proj)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False, par: ParallelContext = SINGLE):
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias, par)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        tp = self.par.tp_size
        offset = sum(self.out_sizes[:shard_id]) // tp
        n = self.out_sizes[shard_id] // tp
        shard = loaded.narrow(0, self.par.tp_rank * n, n) if tp > 1 else loaded
        _copy_checked(param.data.narrow(0, offset, n), shard)


class RowParallelLinear(Linear):
    """Input features split across tensor-parallel ranks; outputs are partial sums to all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, par: ParallelContext = SINGLE):
        super().__init__(_divide(in_features, par.tp_size, "in_features"), out_features, bias, par)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if param.dim() == 2 and self.par.tp_size > 1:
            n = param.shape[1]
            loaded = loaded.narrow(1, self.par.tp_rank * n, n)
        _copy_checked(param.data, loaded)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch: checkpoint tensor {tuple(src.shape)}, model expects {tuple(dst.shape)}")
    dst.copy_(src)
