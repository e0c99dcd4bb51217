"""SwiGLU's activation in one pass: silu(gate) * up from the gate/up projection's output.

PyTorch runs it as two kernels over strided halves of [T, 2I] (`chunk` views), each a generic
elementwise kernel reading and writing the whole width: in a 128k-token `v2-lite` prefill those were the
largest of the PyTorch kernels (docs/perf.md, "The rope pairs split in registers"). One program here
reads a row's gate and up blocks once and writes the product. Rounding as PyTorch's: silu in float32,
rounded to the activations' dtype, then the product in float32, rounded again.
"""

import torch
import triton
import triton.language as tl

from engine.kernels._util import check, check_float, pow2


@triton.jit
def _swiglu_kernel(X, Out, stride_x, stride_o, inter, BLOCK: tl.constexpr):
    row, cb = tl.program_id(0).to(tl.int64), tl.program_id(1)  # row * stride passes 2^31 on long prefills
    offs = cb * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(X + row * stride_x + inter + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(Out + row * stride_o + offs, (act.to(tl.float32) * up.to(tl.float32)).to(Out.dtype.element_ty),
             mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] ([gate | up], rows contiguous) -> silu(gate) * up [T, I] in x's dtype."""
    check_float("x", x)
    check(x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(1) == 1,
          f"x must be [T, 2I] with contiguous rows, got shape {tuple(x.shape)}")
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    if rows:
        block = min(pow2(inter), 2048)
        _swiglu_kernel[(rows, triton.cdiv(inter, block))](x, out, x.stride(0), out.stride(0), inter, BLOCK=block,
                                                         num_warps=4)
    return out


def reference_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
