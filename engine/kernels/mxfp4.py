"""MXFP4 weights inside kernels: e2m1 codes and E8M0 scales decoded in registers, and the GEMV loop over
packed rows that `moe_gemv` runs for DeepSeek-V4's routed experts.

Layout (OCP MX, as V4 ships its experts): a row of K values is K / 2 bytes, two e2m1 codes a byte (the
even index in the low nibble; sign in bit 3), and K / 32 E8M0 bytes, each the exponent b of the scale
2^(b - 127) of 32 consecutive values.

Decoding costs no table: an e2m1 code's three magnitude bits put at bits 9-11 of a float16 (its sign at
bit 15) make the float16 code_value * 2^-14, exactly (code 1, 0.5, lands on the subnormal 2^-15); the
2^14 goes into the scale, built as float32 bits ((b + 14) << 23). Every value and scale is exact, so
the products are the dequantized weight's.

That decode costs several instructions per value (mask, shift, or, convert), one code at a time: the
GEMV of a token's experts decoding so was bound by them, not by its bytes (88.9 us a token against 58.5
for the word decode in PTX on an H200, docs/perf.md; since removed). `fp4_gemv_words` reads the codes as
32-bit words of 8 and decodes two values at once: a word shifted so that nibbles k and k + 4 sit at the
top of its two 16-bit halves gives, with one mask of the signs and one of the magnitudes moved down three
bits, two float16 lanes (value * 2^-14 each, as above) in four integer operations; each lane widens to
float32 in one instruction. Its activations are read in order or as 8 planes (plane k holds values
8j + k), contiguous in j when the caller lays them out so. The same decode in inline PTX
(`e2m1_words_asm`, `lop3` and `cvt`) runs on the GPU only: the interpreter cannot run PTX, and takes the
Triton form.
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
def e8m0_exact(exponents):
    """E8M0 scale bytes b -> 2^(b - 127), float32, exact for every b in [0, 254] (b = 0 is the float32
    subnormal 2^-127; the words' 2^14 is applied once per output, so no scale overflows)."""
    b = exponents.to(tl.uint32)
    return tl.where(b == 0, 0x00400000, b << 23).to(tl.float32, bitcast=True)


@triton.jit
def _f16_lanes(p):
    """uint32 holding two float16 bit patterns -> (low, high) as float32."""
    lo = p.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (p >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _e2m1_pair(w):
    """uint32 with codes at bits 12-15 and 28-31 -> their two float16 patterns (value * 2^-14)."""
    return (w & 0x80008000) | ((w >> 3) & 0x0E000E00)


@triton.jit
def e2m1_words(q):
    """uint32 words of 8 e2m1 codes (nibble k: value k) -> their 8 values * 2^-14, float32, in order.
    Shifted left by 12 - 4k, nibbles k and k + 4 sit at bits 12-15 and 28-31: the signs stay, the
    magnitudes move down 3 bits to float16's bits 9-11 (see `e2m1`)."""
    v0, v4 = _f16_lanes(_e2m1_pair(q << 12))
    v1, v5 = _f16_lanes(_e2m1_pair(q << 8))
    v2, v6 = _f16_lanes(_e2m1_pair(q << 4))
    v3, v7 = _f16_lanes(_e2m1_pair(q))
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def e2m1_words_asm(q):
    """`e2m1_words` in PTX: per pair a shift, an and and a lop3 (shift-or-mask in one), then cvt."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 w, m, p;
        .reg .b16 l, h;
        shl.b32 w, $8, 12;  shr.b32 m, w, 3;  and.b32 m, m, 0x0E000E00;
        lop3.b32 p, w, 0x80008000, m, 0xEA;  mov.b32 {l, h}, p;  cvt.f32.f16 $0, l;  cvt.f32.f16 $4, h;
        shl.b32 w, $8, 8;   shr.b32 m, w, 3;  and.b32 m, m, 0x0E000E00;
        lop3.b32 p, w, 0x80008000, m, 0xEA;  mov.b32 {l, h}, p;  cvt.f32.f16 $1, l;  cvt.f32.f16 $5, h;
        shl.b32 w, $8, 4;   shr.b32 m, w, 3;  and.b32 m, m, 0x0E000E00;
        lop3.b32 p, w, 0x80008000, m, 0xEA;  mov.b32 {l, h}, p;  cvt.f32.f16 $2, l;  cvt.f32.f16 $6, h;
        shr.b32 m, $8, 3;   and.b32 m, m, 0x0E000E00;
        lop3.b32 p, $8, 0x80008000, m, 0xEA;  mov.b32 {l, h}, p;  cvt.f32.f16 $3, l;  cvt.f32.f16 $7, h;
        }""",
        "=r,=r,=r,=r,=r,=r,=r,=r,r", [q], dtype=(tl.float32,) * 8, is_pure=True, pack=1)


@triton.jit
def _load(ptrs, mask, EVEN: tl.constexpr):
    """tl.load, without its mask where the shapes divide the tiles (no predicates, no zeroed registers)."""
    if EVEN:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=mask, other=0)


@triton.jit
def _scaled_words(w_ptrs, s_ptrs, mask, k0, x0, x1, x2, x3, x4, x5, x6, x7, EVEN: tl.constexpr, ASM: tl.constexpr):
    """One step of `fp4_gemv_words` for one block of rows: [BLOCK_N, GROUPS, 4] products summed per word
    and scaled (the activations [1, GROUPS, 4] per value of a word, float32)."""
    q = _load(w_ptrs + k0 // 8, mask, EVEN).to(tl.uint32, bitcast=True)
    # [BLOCK_N, GROUPS, 1]: a 2-D load would take a layout of its own, converted through shared memory
    scale = e8m0_exact(_load(s_ptrs[:, :, None] + k0 // 32, mask, EVEN))
    if ASM:
        v0, v1, v2, v3, v4, v5, v6, v7 = e2m1_words_asm(q)
    else:
        v0, v1, v2, v3, v4, v5, v6, v7 = e2m1_words(q)
    part = v0 * x0 + v1 * x1 + v2 * x2 + v3 * x3 + v4 * x4 + v5 * x5 + v6 * x6 + v7 * x7
    return part * scale


@triton.jit
def fp4_gemv_words(wa_ptrs, sa_ptrs, mask_a, wb_ptrs, sb_ptrs, mask_b, x_ptrs, K, X_PLANE: tl.constexpr,
                   GROUPS: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr, ASM: tl.constexpr):
    """sum_k w[n, k] x[k] over K for two blocks of BLOCK_N packed rows (a and b) that share the
    activations' loads, the codes read as 32-bit words -> ([BLOCK_N], [BLOCK_N]) float32.
    w*_ptrs [BLOCK_N, GROUPS, 4]: each row's word 4g + j (int32 pointers; values 32g + 8j .. 32g + 8j + 7);
    s*_ptrs [BLOCK_N, GROUPS]: each row's scale byte g; mask_* [BLOCK_N] rows that exist. x_ptrs
    [GROUPS, 4]: X_PLANE > 0: float32 activations as 8 planes X_PLANE apart (value 8w + k at plane k, word
    w), pointing at words 4g + j of plane 0; X_PLANE = 0: the activations in order (any float dtype),
    pointing at value 8(4g + j). K is a multiple of 32; EVEN: of GROUPS * 32, and the rows fill the blocks.
    Each thread holds 4 words of a row in each block: the eight activations of a word are loaded and
    widened once for both. A word's products are summed, then scaled."""
    word: tl.constexpr = 1 if X_PLANE else 8  # elements between two words' activations
    plane: tl.constexpr = X_PLANE if X_PLANE else 1  # elements between a word's consecutive values
    offs_g = tl.arange(0, GROUPS)
    acc_a = tl.zeros([BLOCK_N, GROUPS, 4], tl.float32)
    acc_b = tl.zeros([BLOCK_N, GROUPS, 4], tl.float32)
    for k0 in range(0, K, GROUPS * 32):
        mask_g = offs_g * 32 < K - k0
        xs = x_ptrs + k0 // 8 * word
        m = mask_g[:, None]
        x0 = _load(xs, m, EVEN).to(tl.float32)[None]
        x1 = _load(xs + plane, m, EVEN).to(tl.float32)[None]
        x2 = _load(xs + 2 * plane, m, EVEN).to(tl.float32)[None]
        x3 = _load(xs + 3 * plane, m, EVEN).to(tl.float32)[None]
        x4 = _load(xs + 4 * plane, m, EVEN).to(tl.float32)[None]
        x5 = _load(xs + 5 * plane, m, EVEN).to(tl.float32)[None]
        x6 = _load(xs + 6 * plane, m, EVEN).to(tl.float32)[None]
        x7 = _load(xs + 7 * plane, m, EVEN).to(tl.float32)[None]
        acc_a += _scaled_words(wa_ptrs, sa_ptrs, mask_a[:, None, None] & mask_g[None, :, None], k0, x0, x1, x2, x3,
                               x4, x5, x6, x7, EVEN, ASM)
        acc_b += _scaled_words(wb_ptrs, sb_ptrs, mask_b[:, None, None] & mask_g[None, :, None], k0, x0, x1, x2, x3,
                               x4, x5, x6, x7, EVEN, ASM)
    # the 2^14 the float16 lanes left out
    return tl.sum(tl.sum(acc_a, axis=2), axis=1) * 16384.0, tl.sum(tl.sum(acc_b, axis=2), axis=1) * 16384.0


@triton.jit
def _dequant_kernel(C, S, Out, num_bytes, BLOCK: tl.constexpr):
    """One program per BLOCK bytes of the flat codes (rows are whole groups: byte i's scale is i // 16):
    both codes of each byte, scaled, into the output's values 2i and 2i + 1, joined in registers so the
    2 * BLOCK values are stored as one contiguous run (two stores of every other value, 2 bytes at a
    4-byte stride, took 1.6x the time on an H200: docs/perf.md)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_bytes
    codes = tl.load(C + offs, mask=mask, other=0)
    scale = e8m0(tl.load(S + offs // 16, mask=mask, other=0))
    out = Out.dtype.element_ty
    pairs = tl.join((e2m1(codes & 15) * scale).to(out), (e2m1(codes >> 4) * scale).to(out))  # [BLOCK, 2]
    offs2 = tl.program_id(0).to(tl.int64) * (2 * BLOCK) + tl.arange(0, 2 * BLOCK)
    # value v is byte v // 2's (in 64 bits: 2 * num_bytes may not fit the 32 bits num_bytes arrives in)
    tl.store(Out + offs2, tl.reshape(pairs, [2 * BLOCK]), mask=offs2 // 2 < num_bytes)


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


@triton.jit
def _gemv_kernel(X, W, WS, Out, N, K, stride_xm, stride_wn, stride_sn, stride_om, GROUPS: tl.constexpr,
                 BLOCK_N: tl.constexpr, EVEN: tl.constexpr, ASM: tl.constexpr):
    """One program per (row of x, 2 * BLOCK_N outputs): Out[m, n] = sum_k x[m, k] w[n, k], the codes
    decoded as words (`fp4_gemv_words`, activations in order)."""
    m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_g = tl.arange(0, GROUPS)
    x = X + m * stride_xm
    for half in tl.static_range(2):
        offs_n = (2 * pid_n + half) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = offs_n.to(tl.int64)
        s_ptrs = WS + rows[:, None] * stride_sn + offs_g[None, :]
        offs_w = offs_g[:, None] * 4 + tl.arange(0, 4)[None, :]
        w_ptrs = W + rows[:, None, None] * stride_wn + offs_w[None, :, :]
        # the second block is masked off: a program's rows here are one block at a time
        y, _ = fp4_gemv_words(w_ptrs, s_ptrs, offs_n < N, w_ptrs, s_ptrs, offs_n < 0, x + 8 * offs_w, K, 0,
                              GROUPS, BLOCK_N, False, ASM)
        tl.store(Out + m * stride_om + offs_n, y.to(Out.dtype.element_ty), mask=offs_n < N)


def gemv(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, decode: str = "words",
         config: tuple[int, int, int] = (8, 16, 4)) -> torch.Tensor:
    """x [M, K] @ w.T for one MXFP4 matrix w (codes [N, K / 2], E8M0 scale [N, K / 32]) -> [M, N] in x's
    dtype: the experts' word loop on a single matrix, for their tests.
    decode "words" or "asm" (the same in inline PTX; "words" under the interpreter, which runs no PTX);
    config (BLOCK_N, groups of 32 per step, num_warps)."""
    n, half = codes.shape
    check(x.dim() == 2 and x.shape[1] == 2 * half and x.stride(-1) == 1, f"x must be [M, {2 * half}], contiguous rows")
    check_mxfp4("w", codes[None], scale[None] if scale is not None else None, n, 2 * half)
    check(decode in ("words", "asm"), f"decode must be words or asm, got {decode!r}")
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    block_n, groups, warps = config
    w = as_words(codes)
    _gemv_kernel[(x.shape[0], triton.cdiv(n, 2 * block_n))](
        x, w, as_bytes(scale), out, n, 2 * half, x.stride(0), w.stride(0), scale.stride(0), out.stride(0),
        GROUPS=groups, BLOCK_N=block_n, EVEN=False, ASM=decode == "asm" and not interpreted(x),
        num_warps=warps)
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


def as_words(codes: torch.Tensor) -> torch.Tensor:
    """Codes [..., cols / 2] as 32-bit words [..., cols / 8] (8 codes each; `fp4_gemv_words`)."""
    check(codes.data_ptr() % 4 == 0, "MXFP4 codes must start on a 4-byte boundary to be read as words")
    return codes.view(torch.int32)


def dequantize_experts(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes [E, rows, cols / 2] + scale [E, rows, cols / 32] -> float32 [E, rows, cols] (the reference)."""
    from engine.layers.fp8 import dequantize_mxfp4

    return torch.stack([dequantize_mxfp4(c, s) for c, s in zip(codes, scale)])
