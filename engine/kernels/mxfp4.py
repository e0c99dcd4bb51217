"""MXFP4 weights inside kernels: e2m1 codes and E8M0 scales decoded in registers, and the GEMV loop over
packed rows that `moe_gemv` runs for DeepSeek-V4's routed experts.

Layout (OCP MX, as V4 ships its experts): a row of K values is K / 2 bytes, two e2m1 codes a byte (the
even index in the low nibble; sign in bit 3), and K / 32 E8M0 bytes, each the exponent b of the scale
2^(b - 127) of 32 consecutive values.

Decoding costs no table: an e2m1 code's three magnitude bits put at bits 9-11 of a float16 (its sign at
bit 15) make the float16 code_value * 2^-14, exactly (code 1, 0.5, lands on the subnormal 2^-15); the
2^14 goes into the scale, built as float32 bits ((b + 14) << 23). Every value and scale is exact, so
the products are the dequantized weight's.
"""

import torch
import triton
import triton.language as tl

from engine.kernels._util import check, interpreted

MXFP4_GROUP = 32  # values per E8M0 scale
CODE_DTYPES = (torch.int8, torch.uint8)  # the checkpoint's I8, or unsigned
SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8)  # E8M0, or its exponent bytes


@triton.jit
def e2m1(codes):
    """e2m1 codes in the low 4 bits (any integer type) -> their values * 2^-14, float32."""
    c = codes.to(tl.uint16)
    return (((c & 8) << 12) | ((c & 7) << 9)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def e8m0(exponents):
    """E8M0 scale bytes b -> 2^(b - 127) * 2^14, float32 (the factor e2m1 leaves out)."""
    return ((exponents.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)


@triton.jit
def fp4_gemv_rows(w_ptrs, s_ptrs, x_ptr, mask_n, K, GROUPS: tl.constexpr, BLOCK_N: tl.constexpr):
    """sum_k w[n, k] x[k] over K for a program's BLOCK_N packed rows -> [BLOCK_N] float32.
    w_ptrs [BLOCK_N, GROUPS, 16]: each row's byte g * 16 + j (values 2j, 2j + 1 of group g); s_ptrs
    [BLOCK_N, GROUPS]: each row's scale byte g; x_ptr: x[0]. K is a multiple of 32. Products accumulate
    elementwise and are reduced once at the end, as `gemv.gemv_rows` does."""
    offs_g = tl.arange(0, GROUPS)
    offs_b = offs_g[:, None] * 16 + tl.arange(0, 16)[None, :]  # [GROUPS, 16] bytes of a step
    acc = tl.zeros([BLOCK_N, GROUPS, 16], tl.float32)
    for k0 in range(0, K, GROUPS * 32):
        mask_g = offs_g * 32 < K - k0
        codes = tl.load(w_ptrs + k0 // 2, mask=mask_n[:, None, None] & mask_g[None, :, None], other=0)
        scale = e8m0(tl.load(s_ptrs + k0 // 32, mask=mask_n[:, None] & mask_g[None, :], other=0))
        even = tl.load(x_ptr + k0 + 2 * offs_b, mask=mask_g[:, None], other=0.0).to(tl.float32)
        odd = tl.load(x_ptr + k0 + 2 * offs_b + 1, mask=mask_g[:, None], other=0.0).to(tl.float32)
        acc += (e2m1(codes & 15) * even[None, :, :] + e2m1(codes >> 4) * odd[None, :, :]) * scale[:, :, None]
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def _dequant_kernel(C, S, Out, num_bytes, BLOCK: tl.constexpr):
    """One program per BLOCK bytes of the flat codes (rows are whole groups: byte i's scale is i // 16):
    both codes of each byte, scaled, into the output's values 2i and 2i + 1."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_bytes
    codes = tl.load(C + offs, mask=mask, other=0)
    scale = e8m0(tl.load(S + offs // 16, mask=mask, other=0))
    tl.store(Out + 2 * offs, (e2m1(codes & 15) * scale).to(Out.dtype.element_ty), mask=mask)
    tl.store(Out + 2 * offs + 1, (e2m1(codes >> 4) * scale).to(Out.dtype.element_ty), mask=mask)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [E, rows, cols / 2] + E8M0 scale [E, rows, cols / 32] -> [E, rows, cols] in dtype, in one launch
    (exact in bf16: 3 significant bits times a power of two)."""
    e, rows, half = codes.shape
    check_mxfp4("codes", codes, scale, rows, 2 * half)
    out = torch.empty(e, rows, 2 * half, dtype=dtype, device=codes.device)
    block = 16384 if interpreted(codes) else 1024  # the interpreter pays per program
    _dequant_kernel[(triton.cdiv(codes.numel(), block),)](as_bytes(codes), as_bytes(scale), out, codes.numel(),
                                                          BLOCK=block, num_warps=4)
    return out


def is_mxfp4(w: torch.Tensor) -> bool:
    """Packed e2m1 codes (the experts' stacks keep them so)."""
    return w.dtype in CODE_DTYPES


def check_mxfp4(name: str, codes: torch.Tensor, scale: torch.Tensor | None, rows: int, cols: int) -> None:
    """codes [E, rows, cols / 2] with scale [E, rows, cols / 32], both contiguous."""
    check(cols % MXFP4_GROUP == 0, f"MXFP4 {name}: {cols} columns are not whole groups of {MXFP4_GROUP}")
    check(scale is not None and scale.dtype in SCALE_DTYPES, f"MXFP4 {name} needs its E8M0 scales")
    e = codes.shape[0]
    check(codes.shape == (e, rows, cols // 2) and scale.shape == (e, rows, cols // MXFP4_GROUP)
          and codes.is_contiguous() and scale.is_contiguous(),
          f"MXFP4 {name} must be codes [E, {rows}, {cols // 2}] and scales [E, {rows}, {cols // MXFP4_GROUP}], "
          f"contiguous; got {tuple(codes.shape)} and {tuple(scale.shape)}")


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Codes or E8M0 scales as the unsigned bytes the kernels read."""
    return t.view(torch.uint8)


def dequantize_experts(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes [E, rows, cols / 2] + scale [E, rows, cols / 32] -> float32 [E, rows, cols] (the reference)."""
    from engine.layers.fp8 import dequantize_mxfp4

    return torch.stack([dequantize_mxfp4(c, s) for c, s in zip(codes, scale)])
