"""DeepSeek-V4's RMSNorm (float32 weight, one rounding at the end) and its interleaved RoPE on the last
`rope` channels, each row in one launch, fused where a row takes both.

At a decode step these are the small kernels that fill a V4 layer: each PyTorch RMSNorm is ~7 launches
(cast, square, mean, rsqrt, two products, cast) and each RoPE ~12 (two gathers, the float copy, four
products, the stack, the cast, the concatenation), on rows of 512 to 4,096 values; each is one launch
here, a program per row. The references are the model's own modules (`deepseek_v4.RMSNorm`, `Rope`),
whose rounding this follows: the norm in float32, rounded once; RoPE of the (rounded) row in float32,
rounded once; the channels before the rotary ones pass through.
"""

import torch
import triton
import triton.language as tl

from engine.kernels._util import check, check_float, interpreted, pow2


@triton.jit
def _norm_rope_kernel(X, W, Pos, Cos, Sin, Y, num_rows, rows_per_token, dim, eps, stride_cos, NORM: tl.constexpr,
                      ROPE: tl.constexpr, INVERSE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
    # BLOCK_R rows of `dim` contiguous values a program
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs = tl.arange(0, BLOCK)
    mask = (rows < num_rows)[:, None] & (offs < dim)[None, :]
    base = rows.to(tl.int64)[:, None] * dim
    x = tl.load(X + base + offs[None, :], mask=mask, other=0.0)
    y = x
    if NORM:
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / dim + eps)[:, None]
        w = tl.load(W + offs, mask=offs < dim, other=0.0)[None, :]
        y = (w * (xf * rstd)).to(x.dtype)
    if ROPE > 0:
        pair = offs ^ 1  # the other channel of each rotary pair, normed the same way
        y_p = tl.load(X + base + pair[None, :], mask=mask, other=0.0)
        if NORM:
            w_p = tl.load(W + pair, mask=offs < dim, other=0.0)[None, :]
            y_p = (w_p * (y_p.to(tl.float32) * rstd)).to(x.dtype)
        t = tl.load(Pos + rows // rows_per_token, mask=rows < num_rows, other=0)
        k = (offs - (dim - ROPE)) // 2
        rot = mask & (offs >= dim - ROPE)[None, :]
        at = t[:, None] * stride_cos + k[None, :]
        cos = tl.load(Cos + at, mask=rot, other=1.0)
        sin = tl.load(Sin + at, mask=rot, other=0.0)
        if INVERSE:
            sin = -sin
        # interleaved pairs (2i, 2i + 1): even = y cos - y' sin, odd = y cos + y' sin
        p = y_p.to(tl.float32)
        out = y.to(tl.float32) * cos + tl.where((offs % 2 == 0)[None, :], -p, p) * sin
        y = tl.where(rot, out.to(x.dtype), y)
    tl.store(Y + base + offs[None, :], y, mask=mask)


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 0.0,
              positions: torch.Tensor | None = None, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
              inverse: bool = False) -> torch.Tensor:
    """x [N, ..., D] contiguous -> a new [N, ..., D] in x's dtype: with weight (float32 [D]) the RMSNorm
    weight * (x * rsqrt(mean(x^2) + eps)); with positions [N] and cos, sin [max_position, rope / 2]
    (float32) the last `rope` channels rotated by positions[n] (inverse: by -theta), after the norm."""
    check_float("x", x)
    check(x.dim() >= 2 and x.is_contiguous(), f"x must be [N, ..., D] and contiguous, got {tuple(x.shape)}")
    dim = x.shape[-1]
    if weight is not None:
        check(weight.shape == (dim,) and weight.dtype == torch.float32, "weight must be float32 [D]")
    rope = 0
    if positions is not None:
        check(cos is not None and sin is not None and cos.shape == sin.shape and cos.dtype == torch.float32
              and cos.is_contiguous() and sin.is_contiguous(), "cos and sin must be float32 [max_position, rope / 2]")
        rope = 2 * cos.shape[1]
        check(rope <= dim and (dim - rope) % 2 == 0, f"rope {rope} does not fit D {dim}")
        check(positions.shape == (x.shape[0],) and not positions.is_floating_point(), "positions must be integer [N]")
    else:
        check(weight is not None, "nothing to do: neither a norm weight nor positions")
    y = torch.empty_like(x)
    rows = x.numel() // dim
    if rows == 0:
        return y
    block = pow2(dim)
    # a row a program on a GPU (what was measured); the interpreter runs programs one after another,
    # so there a program takes 4,096 values
    block_r = max(1, 4096 // block) if interpreted(x) else 1
    dummy = x if positions is None else positions
    _norm_rope_kernel[(triton.cdiv(rows, block_r),)](
        x, weight if weight is not None else x, dummy, cos if cos is not None else x, sin if sin is not None else x,
        y, rows, rows // x.shape[0], dim, eps, cos.stride(0) if cos is not None else 0, NORM=weight is not None,
        ROPE=rope, INVERSE=inverse, BLOCK_R=block_r, BLOCK=block, num_warps=4 if dim <= 4096 else 8)
    return y
