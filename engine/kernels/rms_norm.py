"""RMSNorm over the last dimension, optionally fused with the residual add that precedes it.

Rounding follows the reference layer exactly: the sum is rounded to the activation dtype (it is the
new residual), normalized in float32, rounded again, then multiplied by the weight.
"""

import torch
import triton
import triton.language as tl

from engine.kernels._util import check, check_float, pdl, pow2, wait_for_inputs


@triton.jit
def _rms_norm_kernel(X, Res, W, Y, ResOut, stride_x, stride_r, stride_y, stride_ro, dim, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < dim
    w = tl.load(W + offs, mask=mask, other=0.0)  # a constant: loaded while the previous kernel finishes
    wait_for_inputs(PDL)
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
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
    """x: [T, D] -> norm(x) [T, D]; with residual: (norm(x + residual), x + residual)."""
    check_float("x", x)
    check(x.dim() == 2 and x.stride(-1) == 1, f"x must be [T, D] contiguous in D, got shape {tuple(x.shape)}")
    check(weight.shape == (x.shape[1],), f"weight shape {tuple(weight.shape)} does not match D={x.shape[1]}")
    check(weight.dtype == x.dtype, f"weight dtype {weight.dtype} differs from x dtype {x.dtype}")
    y = torch.empty_like(x)
    res_out = y
    if residual is not None:
        check(residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1,
              "residual must match x in shape and dtype")
        res_out = torch.empty_like(x)
    if x.shape[0]:
        r = residual if residual is not None else x
        on = pdl(x)
        _rms_norm_kernel[(x.shape[0],)](x, r, weight, y, res_out, x.stride(0), r.stride(0), y.stride(0),
                                        res_out.stride(0), x.shape[1], eps, HAS_RESIDUAL=residual is not None,
                                        BLOCK=pow2(x.shape[1]), PDL=on, launch_pdl=on,
                                        num_warps=4 if x.shape[1] <= 4096 else 8)
    return y if residual is None else (y, res_out)


def reference_rms_norm(x, weight, eps, residual=None):
    if residual is not None:
        x = x + residual
    xf = x.float()
    y = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if residual is None else (y, x)
