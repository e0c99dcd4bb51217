"""Linear layers that know how to load (and, under tensor parallelism, shard) their weights.

Each parameter carries a `weight_loader(param, loaded_weight, shard_id=None)`; the checkpoint loader
only maps names. With `tp_size > 1` a column-parallel layer keeps rows [rank * n / tp, ...) of the
output features and a row-parallel layer the matching input columns (its partial sums are reduced
over the ranks' process group at the end of the row-parallel layer, or once by the caller that
sums several of them: an MoE layer reduces its routed and shared experts together). FP8 128x128
block-scaled weights shard on block boundaries, their scales with them.

Given a QuantConfig, a layer keeps DeepSeek's FP8 e4m3 weight and its `weight_scale_inv` blocks as
the checkpoint stores them and multiplies through the FP8 block-scaled kernel (or, on the reference
path, dequantizes on the fly).
"""

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import QuantConfig
from engine.layers.fp8 import dequantize_fp8_block, quantize_activations_reference
from engine.loader import materialize
from engine.parallel import SINGLE, ParallelContext, divide


class Linear(nn.Module):
    """y = x W^T (replicated on every rank)."""

    use_kernels = False  # the model runner switches the Triton fast path on per instance
    # on the fast path, inputs of at most this many rows (and no bias) run as GEMVs (kernels.gemv): at one
    # row they beat the GEMM libraries on an H200 for every DeepSeek projection measured but V3's q_b
    # (15.3 vs 14.2 us); from two rows on the CUDA-core GEMV (a program a row) loses to the GEMM for most
    # (benchmarks/gemv_configs.py, docs/perf.md)
    gemv_max_tokens = 1
    # FP8 blocks the tensor-core GEMV takes (`kernels.gemv.DOT`, `dot_rows`) read the weight once for up to
    # 16 rows (one program's columns), as fast as one row: for that many rows the GEMV (H100, V3's o_proj at
    # 2 to 16 rows 49-51 us against the FP8 GEMM's 57-59; q_a + kv_a 9.3-9.6 against 25)
    dot_max_tokens = 16

    def __init__(self, in_features: int, out_features: int, bias: bool = False, par: ParallelContext = SINGLE,
                 quant: QuantConfig | None = None):
        super().__init__()
        self.par = par
        self.in_features, self.out_features = in_features, out_features
        self.block = quant.weight_block_size if quant is not None else None
        if self.block is None:
            self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        else:
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

    def _takes_gemv(self, x: torch.Tensor, groups: int = 1) -> bool:
        """Whether the fast path hands x's rows to `kernels.gemv`: up to gemv_max_tokens, or dot_max_tokens
        where its tensor-core path takes this weight."""
        if x.shape[0] <= self.gemv_max_tokens:
            return True
        if self.block is None or x.shape[0] > self.dot_max_tokens:
            return False
        from engine.kernels.gemv import dot_program_rows

        return dot_program_rows(x, self.out_features, self.in_features, self.block, groups) > 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.use_kernels and self.bias is None and x.dim() == 2 and self._takes_gemv(x)
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


    def forward_grouped(self, x: torch.Tensor, groups: int) -> torch.Tensor:
        """Block-diagonal over `groups` (DeepSeek-V4's wo_a): x [T, groups * in_features] whose slice j
        multiplies the weight's rows j * out / groups.. -> [T, out_features]."""
        num_tokens, rows = x.shape[0], self.out_features // groups
        if self.use_kernels and self._takes_gemv(x, groups) and x.is_contiguous():
            from engine.kernels.gemv import gemv  # FP8 with DOT_GROUPS: every group in one tensor-core launch

            return gemv(x, self.weight, self.weight_scale_inv if self.block else None, self.block, groups=groups)
        xs = x.view(num_tokens, groups, self.in_features)
        if self.block is not None and self.use_kernels and rows % self.block[0] == 0:  # each group its own blocks
            from engine.kernels.fp8_gemm import fp8_linear

            per = rows // self.block[0]
            return torch.cat([fp8_linear(xs[:, j].contiguous(), self.weight[j * rows: (j + 1) * rows],
                                         self.weight_scale_inv[j * per: (j + 1) * per], self.block)
                              for j in range(groups)], dim=1)
        w = self.weight if self.block is None else dequantize_fp8_block(self.weight, self.weight_scale_inv, self.block)
        a = xs if self.block is None else quantize_activations_reference(xs, self.block[1])
        y = torch.bmm(a.transpose(0, 1), w.view(groups, rows, -1).transpose(1, 2).to(a.dtype))  # [g, T, rows]
        return y.transpose(0, 1).flatten(1).to(x.dtype)


class ColumnParallelLinear(Linear):
    """Output features split across tensor-parallel ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, par: ParallelContext = SINGLE,
                 quant: QuantConfig | None = None):
        local = divide(out_features, par.tp_size, "out_features")
        if quant is not None and par.tp_size > 1 and local % quant.weight_block_size[0]:
            raise ValueError(f"FP8 blocks of {quant.weight_block_size[0]} rows do not tile {local} output features "
                             f"per rank (out_features={out_features}, tensor_parallel_size={par.tp_size})")
        super().__init__(in_features, local, bias, par, quant)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        # the weight, a bias or the FP8 scales: this rank's rows (the scales' in block units)
        n = param.shape[0]
        _copy_checked(param.data, loaded.narrow(0, self.par.tp_rank * n, n) if self.par.tp_size > 1 else loaded)

    scale_loader = weight_loader


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections stored as one (gate_proj + up_proj -> gate_up_proj)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False, par: ParallelContext = SINGLE,
                 quant: QuantConfig | None = None):
        self.out_sizes = out_sizes
        if quant is not None and any((n // par.tp_size) % quant.weight_block_size[0] for n in out_sizes):
            raise ValueError(f"FP8 blocks of {quant.weight_block_size[0]} rows do not tile the projections {out_sizes}"
                             f" split over {par.tp_size} rank(s)")
        super().__init__(in_features, sum(out_sizes), bias, par, quant)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        tp = self.par.tp_size
        offset = sum(self.out_sizes[:shard_id]) // tp
        n = self.out_sizes[shard_id] // tp
        shard = loaded.narrow(0, self.par.tp_rank * n, n) if tp > 1 else loaded
        _copy_checked(param.data.narrow(0, offset, n), shard)

    def scale_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        rows, tp = self.block[0], self.par.tp_size
        offset, n = sum(self.out_sizes[:shard_id]) // rows // tp, self.out_sizes[shard_id] // rows // tp
        shard = loaded.narrow(0, self.par.tp_rank * n, n) if tp > 1 else loaded
        _copy_checked(param.data.narrow(0, offset, n), shard)


class RowParallelLinear(Linear):
    """Input features split across tensor-parallel ranks; the partial sums are all-reduced here, or by
    the caller when `reduce_results` is False (it sums several layers' partials first)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, par: ParallelContext = SINGLE,
                 quant: QuantConfig | None = None, reduce_results: bool = True):
        local = divide(in_features, par.tp_size, "in_features")
        if quant is not None and par.tp_size > 1 and local % quant.weight_block_size[1]:
            raise ValueError(f"FP8 blocks of {quant.weight_block_size[1]} columns do not tile {local} input features "
                             f"per rank (in_features={in_features}, tensor_parallel_size={par.tp_size})")
        if bias and par.tp_size > 1:
            raise ValueError("a row-parallel layer with a bias is not supported under tensor parallelism")
        super().__init__(local, out_features, bias, par, quant)
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        # the weight or the FP8 scales: this rank's columns (the scales' in block units)
        if param.dim() == 2 and self.par.tp_size > 1:
            n = param.shape[1]
            loaded = loaded.narrow(1, self.par.tp_rank * n, n)
        _copy_checked(param.data, loaded)

    scale_loader = weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return self.par.all_reduce(y) if self.reduce_results else y


class VocabParallelEmbedding(nn.Module):
    """Token embeddings with the vocabulary split across ranks (padded to a multiple of tp): each rank
    looks up the ids it holds, zeros elsewhere, and the all-reduce assembles the rows."""

    def __init__(self, vocab_size: int, hidden: int, par: ParallelContext = SINGLE):
        super().__init__()
        self.par, self.vocab_size = par, vocab_size
        self.num_local = -(-vocab_size // par.tp_size)
        self.start = par.tp_rank * self.num_local
        self.weight = nn.Parameter(torch.zeros(self.num_local, hidden), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if loaded.shape[1:] != param.shape[1:] or loaded.shape[0] != self.vocab_size:
            raise ValueError(f"shape mismatch: checkpoint tensor {tuple(loaded.shape)}, model expects "
                             f"{(self.vocab_size, *param.shape[1:])}")
        rows = loaded.narrow(0, self.start, max(0, min(self.num_local, self.vocab_size - self.start)))
        param.data[: rows.shape[0]].copy_(materialize(rows))  # rows past the vocabulary (padding) stay zero

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.par.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        held = (local >= 0) & (local < self.num_local)
        out = F.embedding(local.clamp(0, self.num_local - 1), self.weight) * held[:, None].to(self.weight.dtype)
        return self.par.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, vocabulary-parallel like the embedding: each rank computes its slice of the
    logits and an all-gather joins them (the padding columns cut off)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        return self.par.all_gather(logits)[..., : self.vocab_size]


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


def _copy_checked(dst: torch.Tensor, src) -> None:
    """src: a tensor, or a checkpoint region (read only now, after the check)."""
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch: checkpoint tensor {tuple(src.shape)}, model expects {tuple(dst.shape)}")
    dst.copy_(materialize(src))
