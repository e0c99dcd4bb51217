"""Linear layers that know how to load (and, under tensor parallelism, shard) their weights.

Each parameter carries a `weight_loader(param, loaded_weight, shard_id=None)`; the checkpoint loader
only maps names. With `tp_size > 1` a column-parallel layer keeps rows [rank * n / tp, ...) of the
output features and a row-parallel layer the matching input columns (its partial sums are reduced
by the caller's process group, which arrives with multi-GPU support).

Given a QuantConfig, a layer keeps DeepSeek's FP8 e4m3 weight and its `weight_scale_inv` blocks as
the checkpoint stores them and multiplies through the FP8 block-scaled kernel (or, on the reference
path, dequantizes on the fly).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import QuantConfig
from engine.layers.fp8 import dequantize_fp8_block, quantize_activations_reference


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

    use_kernels = False  # the model runner switches the Triton fast path on per instance
    # on the fast path, inputs of at most this many rows (and no bias) run as GEMVs (kernels.gemv): at one
    # row they beat the GEMM libraries on an H200 for every DeepSeek projection measured but V3's q_b
    # (15.3 vs 14.2 us); from two rows on the GEMM wins for most (benchmarks/gemv_configs.py, docs/perf.md)
    gemv_max_tokens = 1

    def __init__(self, in_features: int, out_features: int, bias: bool = False, par: ParallelContext = SINGLE,
                 quant: QuantConfig | None = None):
        super().__init__()
        self.par = par
        self.in_features, self.out_features = in_features, out_features
        self.block = quant.weight_block_size if quant is not None else None
        if self.block is None:
            self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        else:
            if par.tp_size > 1:
                raise ValueError("FP8 block-scaled weights under tensor parallelism are not supported yet")
            b0, b1 = self.block
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn),
                                       requires_grad=False)
            self.weight_scale_inv = nn.Parameter(
                torch.empty(-(-out_features // b0), -(-in_features // b1), dtype=torch.float32), requires_grad=False)
            self.weight_scale_inv.weight_loader = self.scale_loader
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        _copy_checked(param.data, loaded)

    def scale_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        _copy_checked(param.data, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.use_kernels and self.bias is None and x.dim() == 2 and x.shape[0] <= self.gemv_max_tokens
                and x.stride(-1) == 1):
            from engine.kernels.gemv import gemv

            return gemv(x, self.weight, self.weight_scale_inv if self.block else None, self.block)
        if self.block is None:
            return F.linear(x, self.weight, self.bias)
        if self.use_kernels:
            from engine.kernels.fp8_gemm import fp8_linear  # first use: Triton picks compiled or interpreted then

            return fp8_linear(x, self.weight, self.weight_scale_inv, self.block, self.bias)
        # the same math in PyTorch: FP8 activations per token group, FP8 weight blocks, float32 products
        w = dequantize_fp8_block(self.weight, self.weight_scale_inv, self.block)
        y = F.linear(quantize_activations_reference(x, self.block[1]), w).to(x.dtype)
        return y if self.bias is None else y + self.bias


class ColumnParallelLinear(Linear):
    """Output features split across tensor-parallel ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, par: ParallelContext = SINGLE,
                 quant: QuantConfig | None = None):
        super().__init__(in_features, _divide(out_features, par.tp_size, "out_features"), bias, par, quant)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        n = param.shape[0]
        _copy_checked(param.data, loaded.narrow(0, self.par.tp_rank * n, n) if self.par.tp_size > 1 else loaded)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections stored as one (gate_proj + up_proj -> gate_up_proj)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False, par: ParallelContext = SINGLE,
                 quant: QuantConfig | None = None):
        self.out_sizes = out_sizes
        if quant is not None and any(n % quant.weight_block_size[0] for n in out_sizes):
            raise ValueError(f"FP8 blocks of {quant.weight_block_size[0]} rows do not tile the projections {out_sizes}")
        super().__init__(in_features, sum(out_sizes), bias, par, quant)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        tp = self.par.tp_size
        offset = sum(self.out_sizes[:shard_id]) // tp
        n = self.out_sizes[shard_id] // tp
        shard = loaded.narrow(0, self.par.tp_rank * n, n) if tp > 1 else loaded
        _copy_checked(param.data.narrow(0, offset, n), shard)

    def scale_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        rows = self.block[0]
        offset, n = sum(self.out_sizes[:shard_id]) // rows, self.out_sizes[shard_id] // rows
        _copy_checked(param.data.narrow(0, offset, n), loaded)


class RowParallelLinear(Linear):
    """Input features split across tensor-parallel ranks; outputs are partial sums to all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, par: ParallelContext = SINGLE,
                 quant: QuantConfig | None = None):
        super().__init__(_divide(in_features, par.tp_size, "in_features"), out_features, bias, par, quant)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if param.dim() == 2 and self.par.tp_size > 1:
            n = param.shape[1]
            loaded = loaded.narrow(1, self.par.tp_rank * n, n)
        _copy_checked(param.data, loaded)


def fuse_linears(*layers: Linear) -> Linear | None:
    """One layer computing several layers' outputs side by side, for projections of the same input:
    one GEMM instead of several small ones at decode. The layers' weights (and FP8 scales) become views
    of the fused layer's, so nothing is held twice and later loads still land in the right rows.
    None where they cannot share a GEMM (biases, different quantization, FP8 rows off the block grid)."""
    first = layers[0]
    if any(m.bias is not None or m.block != first.block or m.in_features != first.in_features for m in layers):
        return None
    if first.block is not None and any(m.out_features % first.block[0] for m in layers[:-1]):
        return None
    quant = QuantConfig(weight_block_size=first.block) if first.block is not None else None
    with torch.device("meta"):  # shapes only: the parameters are the layers' weights, concatenated below
        fused = Linear(first.in_features, sum(m.out_features for m in layers), par=first.par, quant=quant)
    fused.use_kernels = first.use_kernels
    names = ["weight"] + (["weight_scale_inv"] if first.block is not None else [])
    for name in names:
        merged = torch.cat([getattr(m, name).data for m in layers])
        setattr(fused, name, nn.Parameter(merged, requires_grad=False))
        start = 0
        for m in layers:
            rows = getattr(m, name).shape[0]
            getattr(m, name).data = merged[start : start + rows]
            start += rows
    return fused


def _copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch: checkpoint tensor {tuple(src.shape)}, model expects {tuple(dst.shape)}")
    dst.copy_(src)
