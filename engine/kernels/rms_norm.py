"""RMSNorm over the last dimension, optionally fused with the residual add that precedes it, and with the
sum of a MoE layer's slots before that (x [T, slots, D]: `moe_gemv(..., sum_slots=False)`'s partial
outputs, one launch fewer a layer at decode).

Rounding follows the reference layer exactly: the sum is rounded to the activation dtype (it is the
new residual), normalized in float32, rounded again, then multiplied by the weight. Slots are summed
in float32, in order, and rounded to the activation dtype, as `moe_gemv`'s own sum does.
"""

import torch
import triton
import triton.language as tl

from engine.kernels._util import check, check_float, pdl, pow2, wait_for_inputs


@triton.jit
def _rms_norm_kernel(X, Res, W, Y, ResOut, stride_x, stride_xs, stride_r, stride_y, stride_ro, dim, eps,
                     SLOTS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # rows past 2^31 / stride (300k tokens at V3's 7168) stay in range
    offs = tl.arange(0, BLOCK)
    mask = offs < dim
    w = tl.load(W + offs, mask=mask, other=0.0)  # a constant: loaded while the previous kernel finishes
    wait_for_inputs(PDL)
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if SLOTS > 1:  # the MoE layer's slots, summed in order in float32 (every load issued at once)
        acc = x.to(tl.float32)
        for s in tl.static_range(1, SLOTS):
            acc += tl.load(X + row * stride_x + s * stride_xs + offs, mask=mask, other=0.0).to(tl.float32)
        x = acc.to(x.dtype)
    if HAS_RESIDUAL:
        r = tl.load(Res + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(ResOut + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / dim + eps)
    normed = (xf * rstd).to(x.dtype)
    tl.store(Y + row * stride_y + offs, (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x: [T, D] (or [T, slots, D], summed over the slots first) -> norm(x) [T, D]; with residual:
    (norm(x + residual), x + residual)."""
    check_float("x", x)
    check(x.dim() in (2, 3) and x.stride(-1) == 1,
          f"x must be [T, D] or [T, slots, D], contiguous in D, got shape {tuple(x.shape)}")
    num_tokens, dim = x.shape[0], x.shape[-1]
    check(weight.shape == (dim,), f"weight shape {tuple(weight.shape)} does not match D={dim}")
    check(weight.dtype == x.dtype, f"weight dtype {weight.dtype} differs from x dtype {x.dtype}")
    y = torch.empty(num_tokens, dim, dtype=x.dtype, device=x.device)
    res_out = y
    if residual is not None:
        check(residual.shape == (num_tokens, dim) and residual.dtype == x.dtype and residual.stride(-1) == 1,
              "residual must be [T, D] in x's dtype")
        res_out = torch.empty_like(y)
    if num_tokens:
        r = residual if residual is not None else y
        on = pdl(x)
        _rms_norm_kernel[(num_tokens,)](x, r, weight, y, res_out, x.stride(0), x.stride(1) if x.dim() == 3 else 0,
                                        r.stride(0), y.stride(0), res_out.stride(0), dim, eps,
                                        SLOTS=x.shape[1] if x.dim() == 3 else 1, HAS_RESIDUAL=residual is not None,
                                        BLOCK=pow2(dim), PDL=on, launch_pdl=on, num_warps=4 if dim <= 4096 else 8)
    return y if residual is None else (y, res_out)


def reference_rms_norm(x, weight, eps, residual=None):
    if x.dim() == 3:
        x = x.float().sum(1).to(x.dtype)
    if residual is not None:
        x = x + residual
    xf = x.float()
    y = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if residual is None else (y, x)
