"""Sampling on the GPU without a host round trip: the argmax over the vocabulary of logits / temperature +
Gumbel noise (the Gumbel-max trick draws from softmax(logits / temperature) exactly); temperature 0 is
greedy (plain argmax, first index on ties; `greedy` alone is one program per row).

The noise comes from Philox keyed by (seed, step, vocabulary index): a replayed CUDA graph draws fresh
numbers when the step tensor advances, and a run with the same seeds repeats exactly.

Top-p without a sort (`sample(..., top_p=)`): the token `engine.sampler.filter_rows` then Gumbel-max
would draw, with the same noise. Order the vocabulary by (logit descending, index ascending), the order
of the filter's stable sort: the nucleus is a prefix of it. So the perturbed argmax either lies in the
nucleus (the mass ahead of it is under top_p: done, the usual case) or every token from it on is out,
and the argmax is taken again over the tokens ahead of it. Each row is split over slices of the
vocabulary so that one row fills the chip: a first launch finds each slice's best perturbed logit (and,
for top-p, its softmax mass), a second sums each slice's mass ahead of the row's draw, a last one
decides. Top-k still sorts (`filter_rows`, before this kernel).
"""

import torch
import triton
import triton.language as tl

from engine.kernels._util import check, interpreted, pdl, pow2, wait_for_inputs
from engine.kernels.mla_decode import num_sms


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
def _greedy_kernel(Logits, Out, stride_l, stride_o, vocab, BLOCK_V: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    wait_for_inputs(PDL)
    tl.store(Out + row * stride_o, _argmax_row(Logits, row, stride_l, vocab, BLOCK_V).to(Out.dtype.element_ty))


@triton.jit
def _gumbel(x, seed, offs):
    """x + Gumbel noise from the row's Philox stream at vocabulary indices offs."""
    u = tl.rand(seed, offs)
    return x - tl.log(-tl.log(tl.maximum(u, 1e-20)))


@triton.jit
def _before(x, offs, x_b, j_b):
    """Tokens ahead of token j_b (logit x_b) in the order (logit descending, index ascending)."""
    return (x > x_b) | ((x == x_b) & (offs < j_b))


@triton.jit
def _row_params(Temperature, Seeds, Step, row):
    """(greedy?, 1 / temperature, the row's Philox seed for this step)."""
    temp = tl.load(Temperature + row)
    greedy = temp <= 0.0
    inv_t = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, temp))
    return greedy, inv_t, tl.load(Seeds + row) + tl.load(Step) * 1000003


@triton.jit
def _first_best(best_val, best_idx, best_x, vocab):
    """Per-lane running bests -> (the best value, the first index holding it, that token's logit)."""
    top = tl.max(best_val, axis=0)
    idx = tl.min(tl.where(best_val == top, best_idx, vocab), axis=0)
    return top, idx, tl.max(tl.where(best_idx == idx, best_x, float("-inf")), axis=0)


@triton.jit
def _mass_ahead(Row, lo, hi, inv_t, top, x_b, j_b, BLOCK_V: tl.constexpr):
    """Sum of exp(logit - top) over the tokens in [lo, hi) ahead of token j_b."""
    z = tl.zeros([BLOCK_V], tl.float32)
    for v0 in range(lo, hi, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(Row + offs, mask=offs < hi, other=float("-inf")).to(tl.float32) * inv_t
        z += tl.where(_before(x, offs, x_b, j_b), tl.exp(x - top), 0.0)
    return tl.sum(z, axis=0)


# a row's slice count follows the batch (one compiled variant for all)
@triton.jit(do_not_specialize=["num_splits", "slice_len"])
def _draw_split_kernel(Logits, Temperature, Seeds, Step, PartF, PartI, stride_l, vocab, slice_len, num_splits,
                       BLOCK_V: tl.constexpr, MASS: tl.constexpr):
    """One slice of a row: its best logit + noise (logit alone for a greedy row) with that token's index and
    logit, and (MASS) the slice's largest logit and sum of exp(logit - that), as an online softmax."""
    row, s = tl.program_id(0), tl.program_id(1)
    greedy, inv_t, seed = _row_params(Temperature, Seeds, Step, row)
    lo = s * slice_len
    hi = tl.minimum(lo + slice_len, vocab)
    best_val = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_V], tl.int32)
    best_x = tl.full([BLOCK_V], float("-inf"), tl.float32)
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    z = tl.zeros([BLOCK_V], tl.float32)
    for v0 in range(lo, hi, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(Logits + row * stride_l + offs, mask=offs < hi, other=float("-inf")).to(tl.float32) * inv_t
        if greedy:
            y = x
        else:
            y = _gumbel(x, seed, offs)
        better = y > best_val  # strict: earlier tokens win ties, like argmax
        best_idx = tl.where(better, offs, best_idx)
        best_x = tl.where(better, x, best_x)
        best_val = tl.where(better, y, best_val)
        if MASS:
            m_new = tl.maximum(m, x)
            safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            z = z * tl.exp(m - safe) + tl.exp(x - safe)
            m = m_new
    top, idx, x_idx = _first_best(best_val, best_idx, best_x, vocab)
    part = PartF + (row * num_splits + s) * 4
    tl.store(part, top)
    tl.store(part + 1, x_idx)
    if MASS:
        m_s = tl.max(m, axis=0)
        tl.store(part + 2, m_s)
        tl.store(part + 3, tl.sum(z * tl.exp(m - tl.where(m_s == float("-inf"), 0.0, m_s)), axis=0))
    tl.store(PartI + row * num_splits + s, idx)


@triton.jit
def _gather_draw(PartF, PartI, row, num_splits, vocab, MASS: tl.constexpr, BLOCK_S: tl.constexpr):
    """A row's slices -> (the draw's index, its logit, the row's largest logit, sum of exp(logit - it)); the
    first index among equal bests (slices lie in index order)."""
    offs = tl.arange(0, BLOCK_S)
    live = offs < num_splits
    part = PartF + (row * num_splits + offs) * 4
    val = tl.load(part, mask=live, other=float("-inf"))
    idx = tl.load(PartI + row * num_splits + offs, mask=live, other=vocab)
    top = tl.max(val, axis=0)
    j = tl.min(tl.where(val == top, idx, vocab), axis=0)
    j = tl.where(j == vocab, 0, j)  # every logit -inf: token 0, as argmax
    x_j = tl.max(tl.where(idx == j, tl.load(part + 1, mask=live, other=float("-inf")), float("-inf")), axis=0)
    m = float("-inf")
    z = 0.0
    if MASS:
        ms = tl.load(part + 2, mask=live, other=float("-inf"))
        m = tl.max(ms, axis=0)
        z = tl.sum(tl.where(live, tl.load(part + 3, mask=live, other=0.0) * tl.exp(ms - m), 0.0), axis=0)
    return j, x_j, m, z


@triton.jit(do_not_specialize=["num_splits", "slice_len"])
def _nucleus_split_kernel(Logits, Temperature, TopP, PartF, PartI, PartM, stride_l, vocab, slice_len, num_splits,
                          BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr):
    """One slice's mass ahead of the row's draw: sum of exp(logit - the row's largest) over its tokens that
    come before the draw in the nucleus order."""
    row, s = tl.program_id(0), tl.program_id(1)
    temp = tl.load(Temperature + row)
    top_p = tl.load(TopP + row)
    if (temp > 0.0) & (top_p < float("inf")):
        j, x_j, m, z = _gather_draw(PartF, PartI, row, num_splits, vocab, True, BLOCK_S)
        lo = s * slice_len
        ahead = _mass_ahead(Logits + row * stride_l, lo, tl.minimum(lo + slice_len, vocab), 1.0 / temp, m, x_j, j,
                            BLOCK_V)
        tl.store(PartM + row * num_splits + s, ahead)


@triton.jit
def _perturbed_argmax(Row, vocab, inv_t, seed, x_b, j_b, BLOCK_V: tl.constexpr):
    """The Gumbel-max draw among the row's tokens ahead of token j_b (one program) -> (its logit, index)."""
    best_val = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_V], tl.int32)
    best_x = tl.zeros([BLOCK_V], tl.float32)
    for v0 in range(0, vocab, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(Row + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32) * inv_t
        y = tl.where((offs < vocab) & _before(x, offs, x_b, j_b), _gumbel(x, seed, offs), float("-inf"))
        better = y > best_val
        best_idx = tl.where(better, offs, best_idx)
        best_x = tl.where(better, x, best_x)
        best_val = tl.where(better, y, best_val)
    _, idx, x_idx = _first_best(best_val, best_idx, best_x, vocab)
    return x_idx, idx


@triton.jit(do_not_specialize=["stride_o", "num_splits"], do_not_specialize_on_alignment=["Out"])
def _draw_finish_kernel(Logits, Temperature, Seeds, Step, TopP, PartF, PartI, PartM, Out, stride_l, stride_o, vocab,
                        num_splits, NUCLEUS: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr):
    """A row's token from its slices. NUCLEUS: kept if the mass ahead of it is under top_p of the row's
    (the first token always: nothing is ahead); else every token from it on is out of the nucleus, and
    the draw is made again over the tokens ahead of it, here in one program (rare: at top-p 0.95, one
    draw in twenty or fewer)."""
    row = tl.program_id(0)
    j, x_j, m, z = _gather_draw(PartF, PartI, row, num_splits, vocab, NUCLEUS, BLOCK_S)
    if NUCLEUS:
        greedy, inv_t, seed = _row_params(Temperature, Seeds, Step, row)
        top_p = tl.load(TopP + row)
        if (~greedy) & (top_p < float("inf")):
            offs = tl.arange(0, BLOCK_S)
            ahead = tl.sum(tl.load(PartM + row * num_splits + offs, mask=offs < num_splits, other=0.0), axis=0)
            base = Logits + row * stride_l
            while (ahead > 0.0) & (ahead >= top_p * z):
                x_j, j = _perturbed_argmax(base, vocab, inv_t, seed, x_j, j, BLOCK_V)
                ahead = _mass_ahead(base, 0, vocab, inv_t, m, x_j, j, BLOCK_V)
    tl.store(Out + row * stride_o, j.to(Out.dtype.element_ty))


def num_draw_splits(batch: int, vocab: int, block_v: int, sms: int = 132) -> int:
    """Slices per row: the batch's rows x slices fill the SMs about four times over, each slice at least
    one block of the vocabulary (a row in one program costs ~100 us for DeepSeek's 129k tokens on an
    H200, mostly the noise)."""
    return max(1, min(triton.cdiv(vocab, block_v), triton.cdiv(4 * sms, max(batch, 1)), 256))


def sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, step: torch.Tensor,
           out: torch.Tensor | None = None, top_p: torch.Tensor | None = None) -> torch.Tensor:
    """logits: [B, V] float; temperature: [B] float32 (0 = greedy); seeds: [B] int64; step: [1] int64
    (advance it between steps) -> token ids [B] int64, on the device (into `out` if given: [B], any
    stride). top_p [B] float32 (inf: off; `engine.sampler.row_filters`): the draw `filter_rows` with
    that top-p and then this kernel would make, without sorting. Two launches (three with top_p), each
    row split over slices so that one row fills the chip."""
    check(logits.dim() == 2 and logits.stride(-1) == 1, "logits must be [B, V], contiguous in V")
    batch, vocab = logits.shape
    check(temperature.shape == (batch,) and temperature.dtype == torch.float32, "temperature must be float32 [B]")
    check(seeds.shape == (batch,) and seeds.dtype == torch.int64, "seeds must be int64 [B]")
    check(step.shape == (1,) and step.dtype == torch.int64, "step must be int64 [1]")
    check(top_p is None or (top_p.shape == (batch,) and top_p.dtype == torch.float32), "top_p must be float32 [B]")
    if out is None:
        out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    check(out.shape == (batch,), "out must be [B]")
    if not batch:
        return out
    block_v = 128 if interpreted(logits) else 1024
    splits = num_draw_splits(batch, vocab, block_v, num_sms(logits.device))
    slice_len = triton.cdiv(triton.cdiv(vocab, splits), block_v) * block_v
    nucleus = top_p is not None
    part_f = torch.empty(batch, splits, 4, dtype=torch.float32, device=logits.device)
    part_i = torch.empty(batch, splits, dtype=torch.int32, device=logits.device)
    part_m = torch.empty(batch, splits, dtype=torch.float32, device=logits.device) if nucleus else part_f
    top_p = top_p if nucleus else temperature  # unread
    _draw_split_kernel[(batch, splits)](logits, temperature, seeds, step, part_f, part_i, logits.stride(0), vocab,
                                        slice_len, splits, BLOCK_V=block_v, MASS=nucleus, num_warps=4)
    block_s = pow2(splits, 2)
    if nucleus:
        _nucleus_split_kernel[(batch, splits)](logits, temperature, top_p, part_f, part_i, part_m, logits.stride(0),
                                               vocab, slice_len, splits, BLOCK_V=block_v, BLOCK_S=block_s,
                                               num_warps=4)
    _draw_finish_kernel[(batch,)](logits, temperature, seeds, step, top_p, part_f, part_i, part_m, out,
                                  logits.stride(0), out.stride(0), vocab, splits, NUCLEUS=nucleus,
                                  BLOCK_V=4 * block_v, BLOCK_S=block_s, num_warps=4)
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
        on = pdl(logits)
        _greedy_kernel[(batch,)](logits, out, logits.stride(0), out.stride(0), vocab,
                                 BLOCK_V=128 if interpreted(logits) else 4096, PDL=on, launch_pdl=on, num_warps=8)
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
