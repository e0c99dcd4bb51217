"""Sampling on the GPU without a host round trip: one program per row scans the vocabulary once,
keeping the running argmax of logits / temperature + Gumbel noise (the Gumbel-max trick draws from
softmax(logits / temperature) exactly); temperature 0 is greedy (plain argmax, first index on ties).

The noise comes from Philox keyed by (seed, step, vocabulary index): a replayed CUDA graph draws fresh
numbers when the step tensor advances, and a run with the same seeds repeats exactly.
"""

import torch
import triton
import triton.language as tl

from engine.kernels._util import check, interpreted


@triton.jit
def _argmax_row(Logits, row, stride_l, vocab, BLOCK_V: tl.constexpr):
    """The row's greedy draw: the first index of its largest logit, as torch.argmax."""
    best_val = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_V], tl.int32)
    for v0 in range(0, vocab, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(Logits + row * stride_l + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        better = x > best_val  # strict: earlier chunks win ties, like argmax
        best_idx = tl.where(better, offs, best_idx)
        best_val = tl.where(better, x, best_val)
    top = tl.max(best_val, axis=0)
    return tl.min(tl.where(best_val == top, best_idx, vocab), axis=0)


# a column of a step's output buffer starts at any 8-byte offset, with any stride: one variant for all
@triton.jit(do_not_specialize=["stride_o"], do_not_specialize_on_alignment=["Out"])
def _greedy_kernel(Logits, Out, stride_l, stride_o, vocab, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    tl.store(Out + row * stride_o, _argmax_row(Logits, row, stride_l, vocab, BLOCK_V).to(Out.dtype.element_ty))


@triton.jit
def _sample_kernel(Logits, Temperature, Seeds, Step, Out, stride_l, vocab, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    temp = tl.load(Temperature + row)
    seed = tl.load(Seeds + row)
    step = tl.load(Step)
    greedy = temp <= 0.0
    inv_t = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, temp))
    if greedy:  # no noise to draw: a plain scan
        idx = _argmax_row(Logits, row, stride_l, vocab, BLOCK_V)
    else:
        best_val = tl.full([BLOCK_V], float("-inf"), tl.float32)
        best_idx = tl.zeros([BLOCK_V], tl.int32)
        for v0 in range(0, vocab, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            x = tl.load(Logits + row * stride_l + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32) * inv_t
            u = tl.rand(seed + step * 1000003, offs)
            x = x - tl.log(-tl.log(tl.maximum(u, 1e-20)))
            better = x > best_val
            best_idx = tl.where(better, offs, best_idx)
            best_val = tl.where(better, x, best_val)
        top = tl.max(best_val, axis=0)
        idx = tl.min(tl.where(best_val == top, best_idx, vocab), axis=0)
    tl.store(Out + row, idx.to(Out.dtype.element_ty))


def sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, step: torch.Tensor,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """logits: [B, V] float; temperature: [B] float32 (0 = greedy); seeds: [B] int64; step: [1] int64
    (advance it between steps) -> token ids [B] int64, on the device."""
    check(logits.dim() == 2 and logits.stride(-1) == 1, "logits must be [B, V], contiguous in V")
    batch, vocab = logits.shape
    check(temperature.shape == (batch,) and temperature.dtype == torch.float32, "temperature must be float32 [B]")
    check(seeds.shape == (batch,) and seeds.dtype == torch.int64, "seeds must be int64 [B]")
    check(step.shape == (1,) and step.dtype == torch.int64, "step must be int64 [1]")
    if out is None:
        out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch:
        _sample_kernel[(batch,)](logits, temperature, seeds, step, out, logits.stride(0), vocab,
                                 BLOCK_V=128 if interpreted(logits) else 4096, num_warps=8)
    return out


def reference_greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def greedy(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] (any float dtype: the head's own, no float32 copy needed) -> argmax [B] int64, into
    `out` ([B], any stride: a column of a step's output buffer) if given."""
    check(logits.dim() == 2 and logits.stride(-1) == 1, "logits must be [B, V], contiguous in V")
    batch, vocab = logits.shape
    if out is None:
        out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    check(out.shape == (batch,), "out must be [B]")
    if batch:
        _greedy_kernel[(batch,)](logits, out, logits.stride(0), out.stride(0), vocab,
                                 BLOCK_V=128 if interpreted(logits) else 4096, num_warps=8)
    return out


# splitmix64's constants as the int64 patterns that hold them (products wrap modulo 2**64 either way)
_GOLDEN, _MIX1, _MIX2 = (c - (1 << 64) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


@triton.jit
def _shr(z, bits: tl.constexpr):
    """Logical right shift of int64 bit patterns."""
    return (z.to(tl.uint64, bitcast=True) >> bits).to(tl.int64, bitcast=True)


@triton.jit
def _noise_keys_kernel(Seeds, Positions, Out, n, golden, mix1, mix2, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    z = tl.load(Seeds + offs, mask=mask, other=0) * golden + tl.load(Positions + offs, mask=mask, other=0) + 1
    z = (z ^ _shr(z, 30)) * mix1
    z = (z ^ _shr(z, 27)) * mix2
    tl.store(Out + offs, _shr(z ^ _shr(z, 31), 1), mask=mask)


def noise_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`engine.sampler.noise_key` of int64 [R] seeds (their 64-bit patterns) and output positions, in one
    launch (the same arithmetic as PyTorch ops is ~14 launches: most of a graphed draw's cost)."""
    check(seeds.shape == positions.shape and seeds.dim() == 1 and seeds.dtype == positions.dtype == torch.int64,
          "seeds and positions must be int64 [R]")
    out = torch.empty_like(seeds)
    n = seeds.numel()
    if n:
        block = 128
        _noise_keys_kernel[(triton.cdiv(n, block),)](seeds.contiguous(), positions.contiguous(), out, n,
                                                     _GOLDEN, _MIX1, _MIX2, BLOCK=block, num_warps=1)
    return out
