"""Fused MoE: grouped GEMMs over (token, expert) pairs sorted by expert.

Two launches: w13 (gate and up rows of one expert, SiLU(gate) * up fused in the epilogue) writes one
intermediate row per pair; w2 multiplies by the pair's routing weight; a sum over top_k finishes.
Weights are bf16/fp16/fp32, or FP8 e4m3 with [block_n, block_k] scales (activations then quantized
per token group), or MXFP4 (DeepSeek-V4's routed experts: e2m1 codes two a byte, an E8M0 scale per 32
values of a row). MXFP4 tiles are decoded in the kernel, not dequantized per expert beforehand: a
[BLOCK_K / 2, BLOCK_N] tile of bytes becomes the even-k and the odd-k halves of the weight tile in the
activations' dtype (exact: 3 significant bits times a power of two), multiplied by the even and odd
columns of the activations in two dots. Dequantizing every expert a prefill touches first would write
and read back 4 bytes of bf16 for each half byte of codes (12.9 GB a V4 Flash layer, ~5 ms on an H200)
and hold them; in the kernel the weights cross HBM once, as FP4. Activations stay in their dtype (the
dequantized weight's math). Bytes at decode: the chosen experts' weights once; FLOPs: 6 * T * top_k * H * I.
"""

import torch
import triton
import triton.language as tl

from engine.kernels._util import check, check_float, gluon_available, interpreted, mma, shared_memory, upcast_fp8_dot
from engine.kernels.fp8_gemm import FP8, TensorDescriptor, num_sms, per_token_group_quant, tile_of, tma_capable
from engine.kernels.moe_routing import align_by_expert
from engine.kernels.mxfp4 import as_bytes, check_mxfp4, e2m1, e8m0, is_mxfp4


@triton.jit
def _fp4_half_tiles(b_ptr, bs_ptr, mask, dtype):
    """A [BLOCK_K / 2, BLOCK_N] tile of packed bytes and its scales -> the weight's even-k and odd-k
    halves in `dtype` (exact)."""
    codes = tl.load(b_ptr, mask=mask, other=0)
    scale = e8m0(tl.load(bs_ptr, mask=mask, other=0))
    return (e2m1(codes & 15) * scale).to(dtype), (e2m1(codes >> 4) * scale).to(dtype)


@triton.jit
def _fp4_decoded_loop(A, B, BS, K, N, rows, mask_m, expert, offs_n, mask_n, stride_am, stride_be, stride_bn,
                      stride_bse, stride_bsn, acc, acc_up, GATED: tl.constexpr, BLOCK_K: tl.constexpr,
                      UPCAST: tl.constexpr):
    """The K loop of `_fp4_gemm_tile` decoding its tiles: per step a [BLOCK_K / 2, BLOCK_N] tile of bytes
    becomes the weight's even-k and odd-k halves, times the activations' even and odd columns."""
    HALF: tl.constexpr = BLOCK_K // 2
    offs_j = tl.arange(0, HALF)  # byte j of a K step: values 2j and 2j + 1
    a_ptr = A + rows[:, None] * stride_am + 2 * offs_j[None, :]
    b_ptr = B + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_j[:, None]
    bs_ptr = BS + expert * stride_bse + offs_n[None, :].to(tl.int64) * stride_bsn + offs_j[:, None] // 16
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        mask_k = 2 * offs_j < K - kb * BLOCK_K
        mask_a = mask_m[:, None] & mask_k[None, :]
        even = tl.load(a_ptr, mask=mask_a, other=0.0)
        odd = tl.load(a_ptr + 1, mask=mask_a, other=0.0)
        mask_b = mask_n[None, :] & mask_k[:, None]
        lo, hi = _fp4_half_tiles(b_ptr, bs_ptr, mask_b, even.dtype)
        acc += mma(even, lo, UPCAST) + mma(odd, hi, UPCAST)
        if GATED:
            lo, hi = _fp4_half_tiles(b_ptr + N * stride_bn, bs_ptr + N * stride_bsn, mask_b, even.dtype)
            acc_up += mma(even, lo, UPCAST) + mma(odd, hi, UPCAST)
        a_ptr += BLOCK_K
        b_ptr += HALF
        bs_ptr += BLOCK_K // 32
    return acc, acc_up


@triton.jit
def _fp4_dot_scaled_loop(A, B, BS, K, N, rows, mask_m, expert, offs_n, mask_n, stride_am, stride_be, stride_bn,
                         stride_bse, stride_bsn, acc, acc_up, GATED: tl.constexpr, BLOCK_K: tl.constexpr,
                         A_FORMAT: tl.constexpr):
    """The K loop of `_fp4_gemm_tile` through `tl.dot_scaled`: per step the activations [BLOCK_M, BLOCK_K],
    the codes [BLOCK_K / 2, BLOCK_N] (packed along K) and their scales [BLOCK_N, BLOCK_K / 32]. The codes
    are loaded in that shape rather than loaded [BLOCK_N, BLOCK_K / 2] and `tl.trans`-posed: the
    transposed form gave unrelated outputs on Hopper with Triton 3.6 (a candidate fix, to be checked on
    the card)."""
    offs_k = tl.arange(0, BLOCK_K)
    offs_j = tl.arange(0, BLOCK_K // 2)
    offs_g = tl.arange(0, BLOCK_K // 32)
    a_ptr = A + rows[:, None] * stride_am + offs_k[None, :]
    b_ptr = B + expert * stride_be + offs_j[:, None] + offs_n[None, :].to(tl.int64) * stride_bn
    bs_ptr = BS + expert * stride_bse + offs_n[:, None].to(tl.int64) * stride_bsn + offs_g[None, :]
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        left = K - kb * BLOCK_K
        a = tl.load(a_ptr, mask=mask_m[:, None] & (offs_k < left)[None, :], other=0.0)
        mask_b = (2 * offs_j < left)[:, None] & mask_n[None, :]
        mask_s = mask_n[:, None] & (32 * offs_g < left)[None, :]
        b = tl.load(b_ptr, mask=mask_b, other=0)
        acc = tl.dot_scaled(a, None, A_FORMAT, b, tl.load(bs_ptr, mask=mask_s, other=0), "e2m1", acc)
        if GATED:
            u = tl.load(b_ptr + N * stride_bn, mask=mask_b, other=0)
            u_s = tl.load(bs_ptr + N * stride_bsn, mask=mask_s, other=0)
            acc_up = tl.dot_scaled(a, None, A_FORMAT, u, u_s, "e2m1", acc_up)
        a_ptr += BLOCK_K
        b_ptr += BLOCK_K // 2
        bs_ptr += BLOCK_K // 32
    return acc, acc_up


@triton.jit
def _fp4_gemm_tile(A, B, BS, C, Weights, SortedIds, BlockExpert, NumPadded, N, K, num_pairs, top_k, limit,
                   stride_am, stride_be, stride_bn, stride_bse, stride_bsn, stride_cm, pid_m, pid_n,
                   GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, A_BY_TOKEN: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                   DOT_SCALED: tl.constexpr = None):
    """`_moe_gemm_kernel`'s tile over MXFP4 weights: B [E, rows, K / 2] codes, BS [E, rows, K / 32] E8M0.
    DOT_SCALED (the activations' format, "bf16" or "fp16"; None: decode here): the codes and scales go to
    `tl.dot_scaled` as they are, and Triton widens them for the tensor cores."""
    if pid_m * BLOCK_M < tl.load(NumPadded):
        ids = tl.load(SortedIds + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        mask_m = ids < num_pairs
        rows = (ids // top_k if A_BY_TOKEN else ids).to(tl.int64)
        expert = tl.load(BlockExpert + pid_m).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if DOT_SCALED is not None:
            acc, acc_up = _fp4_dot_scaled_loop(A, B, BS, K, N, rows, mask_m, expert, offs_n, mask_n, stride_am,
                                               stride_be, stride_bn, stride_bse, stride_bsn, acc, acc_up, GATED,
                                               BLOCK_K, DOT_SCALED)
        else:
            acc, acc_up = _fp4_decoded_loop(A, B, BS, K, N, rows, mask_m, expert, offs_n, mask_n, stride_am,
                                            stride_be, stride_bn, stride_bse, stride_bsn, acc, acc_up, GATED,
                                            BLOCK_K, UPCAST)
        if GATED:  # V4 clamps both pre-activations (limit inf: none)
            acc = tl.minimum(acc, limit)
            acc = acc / (1.0 + tl.exp(-acc)) * tl.maximum(tl.minimum(acc_up, limit), -limit)
        if MUL_WEIGHT:
            acc = acc * tl.load(Weights + ids, mask=mask_m, other=0.0)[:, None]
        c_ptr = C + ids[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
        tl.store(c_ptr, acc.to(C.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["num_pairs"])  # varies with the batch: one compiled variant
def _moe_gemm_kernel(A, AS, B, BS, C, Weights, SortedIds, BlockExpert, NumPadded, N, K, num_pairs, top_k, limit,
                     stride_am, stride_asm, stride_be, stride_bn, stride_bse, stride_bsn, stride_cm,
                     GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, A_BY_TOKEN: tl.constexpr, USE_FP8: tl.constexpr,
                     GROUP_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     UPCAST: tl.constexpr, USE_FP4: tl.constexpr = False, FP4_DOT_SCALED: tl.constexpr = None):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if USE_FP4:
        _fp4_gemm_tile(A, B, BS, C, Weights, SortedIds, BlockExpert, NumPadded, N, K, num_pairs, top_k, limit,
                       stride_am, stride_be, stride_bn, stride_bse, stride_bsn, stride_cm, pid_m, pid_n,
                       GATED, MUL_WEIGHT, A_BY_TOKEN, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, FP4_DOT_SCALED)
    elif pid_m * BLOCK_M < tl.load(NumPadded):
        ids = tl.load(SortedIds + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        mask_m = ids < num_pairs
        rows = (ids // top_k if A_BY_TOKEN else ids).to(tl.int64)
        expert = tl.load(BlockExpert + pid_m).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_n = offs_n < N
        a_ptr = A + rows[:, None] * stride_am + offs_k[None, :]
        b_ptr = B + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
        up_ptr = b_ptr + N * stride_bn
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            mask_k = offs_k < K - kb * BLOCK_K
            a = tl.load(a_ptr, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            b = tl.load(b_ptr, mask=mask_n[None, :] & mask_k[:, None], other=0.0)
            if USE_FP8:
                a_s = tl.load(AS + rows * stride_asm + kb, mask=mask_m, other=0.0)
                bs_ptr = BS + expert * stride_bse + kb
                b_s = tl.load(bs_ptr + (offs_n // GROUP_N) * stride_bsn, mask=mask_n, other=0.0)
                acc += mma(a, b, UPCAST) * a_s[:, None] * b_s[None, :]
                if GATED:
                    u = tl.load(up_ptr, mask=mask_n[None, :] & mask_k[:, None], other=0.0)
                    u_s = tl.load(bs_ptr + ((offs_n + N) // GROUP_N) * stride_bsn, mask=mask_n, other=0.0)
                    acc_up += mma(a, u, UPCAST) * a_s[:, None] * u_s[None, :]
            else:
                acc += mma(a, b, UPCAST)
                if GATED:
                    acc_up += mma(a, tl.load(up_ptr, mask=mask_n[None, :] & mask_k[:, None], other=0.0), UPCAST)
            a_ptr += BLOCK_K
            b_ptr += BLOCK_K
            up_ptr += BLOCK_K
        if GATED:  # V4 clamps both pre-activations (limit inf: none)
            acc = tl.minimum(acc, limit)
            acc = acc / (1.0 + tl.exp(-acc)) * tl.maximum(tl.minimum(acc_up, limit), -limit)
        if MUL_WEIGHT:
            acc = acc * tl.load(Weights + ids, mask=mask_m, other=0.0)[:, None]
        c_ptr = C + ids[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
        tl.store(c_ptr, acc.to(C.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _scaled_step(a, b, a_s, b_s, UPCAST: tl.constexpr, SCALED: tl.constexpr):
    """One K step's product: FP8 times its row and tile scales, or (SCALED false) the plain product."""
    if SCALED:
        return mma(a, b.T, UPCAST) * (a_s * b_s)[:, None]
    return mma(a, b.T, UPCAST)


@triton.jit(do_not_specialize=["num_pairs"])  # varies with the batch: one compiled variant
def _moe_gemm_tma_kernel(A, a_desc, AS, b_desc, BS, C, Weights, SortedIds, BlockExpert, NumPadded, N, K, num_pairs,
                         top_k, limit, stride_am, stride_asm, stride_ask, stride_bse, stride_bsn, stride_cm,
                         NUM_PROGRAMS: tl.constexpr, GATED: tl.constexpr, GROUP_N: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                         UPCAST: tl.constexpr, FLATTEN: tl.constexpr, SCALED: tl.constexpr = True):
    """Grouped GEMM, persistent over (row block, column block) work items of the expert-sorted pairs.

    GATED (w13): A rows are gathered by token (pointer loads: the copy engine cannot gather on sm_90; a
    copy of them in the pairs' sorted order read by TMA measured slower on an H200); gate and up tiles of the expert arrive by TMA, SiLU(gate) * up is written at the pair's sorted
    position. Else (w2): A is that sorted intermediate, read by TMA; the routing weight multiplies and
    each pair's row is scattered back to its id. B is [E * rows, K]: a tile never crosses an expert
    (BLOCK_N divides N and the weight block, so each K step has one weight scale per tile).
    SCALED: FP8 with DeepSeek's block scales, each K step's product scaled before it is added; else bf16
    or fp16, the products accumulated in the tensor cores' own accumulator."""
    num_m = tl.load(NumPadded) // BLOCK_M
    num_n = N // BLOCK_N
    k_steps = tl.cdiv(K, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_PROGRAMS, flatten=FLATTEN):
        pid_m, pid_n = tile_of(tile, num_m, num_n, GROUP_M)
        expert = tl.load(BlockExpert + pid_m).to(tl.int64)
        pos = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        ids = tl.load(SortedIds + pos)
        mask_m = ids < num_pairs
        rows = tl.where(mask_m, ids // top_k, 0).to(tl.int64) if GATED else pos.to(tl.int64)
        b_row = (expert * (2 * N if GATED else N) + pid_n * BLOCK_N).to(tl.int32)
        bs_ptr = BS + expert * stride_bse + (pid_n * BLOCK_N // GROUP_N) * stride_bsn
        up_bs_ptr = BS + expert * stride_bse + ((N + pid_n * BLOCK_N) // GROUP_N) * stride_bsn
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for kb in range(k_steps):
            if GATED:
                a = tl.load(A + rows[:, None] * stride_am + kb * BLOCK_K + offs_k[None, :],
                            mask=mask_m[:, None] & (offs_k < K - kb * BLOCK_K)[None, :], other=0.0)
            else:
                a = a_desc.load([pid_m * BLOCK_M, kb * BLOCK_K])
            if SCALED:
                a_s = tl.load(AS + rows * stride_asm + kb * stride_ask)
                b_s, u_s = tl.load(bs_ptr + kb), tl.load(up_bs_ptr + kb)
            else:
                a_s, b_s, u_s = 1.0, 1.0, 1.0
            b = b_desc.load([b_row, kb * BLOCK_K])
            acc += _scaled_step(a, b, a_s, b_s, UPCAST, SCALED)
            if GATED:
                u = b_desc.load([b_row + N, kb * BLOCK_K])
                acc_up += _scaled_step(a, u, a_s, u_s, UPCAST, SCALED)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if GATED:  # V4 clamps both pre-activations (limit inf: none)
            acc = tl.minimum(acc, limit)
            acc = acc / (1.0 + tl.exp(-acc)) * tl.maximum(tl.minimum(acc_up, limit), -limit)
            tl.store(C + pos[:, None].to(tl.int64) * stride_cm + offs_n[None, :], acc.to(C.dtype.element_ty))
        else:
            acc = acc * tl.load(Weights + ids, mask=mask_m, other=0.0)[:, None]
            tl.store(C + ids[:, None].to(tl.int64) * stride_cm + offs_n[None, :], acc.to(C.dtype.element_ty),
                     mask=mask_m[:, None])


def _config(pairs_per_expert: float, on_gpu: bool, gated: bool, block_k: int | None, half: bool = False):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by how many rows an expert gets. half: bf16 or
    fp16 weights on a GPU with the shared memory for four 48 KB stages (BIG_TILE_SHARED_MEMORY), whose
    large batches take 128 x 256 outputs a program (the gated GEMM's 128 gate and 128 up columns). On
    the H200 at V2-Lite's experts 2.00 vs 2.11 ms at 8k tokens, 7.73 vs 8.68 ms at 32k, 0.62 vs 0.65 at
    2k, against 128 x 128 in three stages (benchmarks/grouped_gemm_tiles.py); there the TMA kernel
    (`tma_config`) takes these batches where the shapes divide its tiles."""
    if not on_gpu:
        return 16, 32, block_k or 32, 4, 1
    if pairs_per_expert <= 16:
        return 16, 64, block_k or 128, 4, 4
    if pairs_per_expert <= 128:
        return 64, 64 if gated else 128, block_k or 64, 4, 3
    if half:
        return 128, 128 if gated else 256, 64, 8, 4
    return 128, 64 if gated else 128, block_k or 64, 8, 3


def _launch(a, a_scale, w, w_scale, out, weights, align, num_pairs, top_k, gated, by_token, cfg, block,
            limit: float = float("inf"), fp4_dot_scaled: bool = False):
    sorted_ids, block_expert, num_padded = align
    bm, bn, bk, warps, stages = cfg
    n = w.shape[1] // 2 if gated else w.shape[1]
    fp4 = is_mxfp4(w)
    fp8 = w_scale is not None and not fp4
    k = 2 * w.shape[2] if fp4 else w.shape[2]
    if fp4:
        w, w_scale = as_bytes(w), as_bytes(w_scale)
    grid = (sorted_ids.shape[0] // bm, triton.cdiv(n, bn))
    _moe_gemm_kernel[grid](a, a_scale if fp8 else a, w, w_scale if fp8 or fp4 else w, out, weights, sorted_ids,
                           block_expert, num_padded, n, k, num_pairs, top_k, limit, a.stride(0),
                           a_scale.stride(0) if fp8 else 0, w.stride(0), w.stride(1),
                           w_scale.stride(0) if fp8 or fp4 else 0, w_scale.stride(1) if fp8 or fp4 else 0,
                           out.stride(0), GATED=gated, MUL_WEIGHT=not gated, A_BY_TOKEN=by_token, USE_FP8=fp8,
                           GROUP_N=block[0] if fp8 else 1, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                           UPCAST=upcast_fp8_dot(a, bk) if fp8 else interpreted(a), USE_FP4=fp4,
                           FP4_DOT_SCALED=DOT_SCALED_FORMATS[a.dtype] if fp4 and fp4_dot_scaled else None,
                           num_warps=warps, num_stages=stages)


# the activations' formats `tl.dot_scaled` takes beside MXFP4 weights
DOT_SCALED_FORMATS = {torch.bfloat16: "bf16", torch.float16: "fp16"}
# FP8 experts' prefill GEMMs on Hopper through the warp-specialised Gluon kernels (`fused_moe_gluon`): the
# same outputs 1.17x faster at 32k tokens of V3's experts on an H200; with the Gluon attention, 7-16 % more
# V3-slice prefill tokens/s at 8k-32k in the engine on an H100 (`bench --no-gluon` measures without them)
GLUON = True


# (fewest pairs per expert, BLOCK_M, BLOCK_N of w13's gate and up tiles, BLOCK_N of w2, num_warps,
# num_stages, programs per SM): the persistent TMA kernels from this many rows per expert on; the first
# row that fits wins. On the H200 64-row tiles two to an SM beat 128-row ones at 8 warps (10.7 vs
# 12.7 ms at 8k tokens of V3's experts), three to an SM (14.0) and the pointer kernels (14.1 ms); at 64
# rows per expert (2k tokens) 4.36 vs 4.67 ms.
TMA_CONFIGS = [(48, 64, 64, 128, 4, 4, 2)]
# bf16 / fp16 experts: the same kernel without scales, 128 x 256 outputs a program (gate and up 128
# columns each), one program per SM, from the rows where the pointer kernels take 128-row tiles. On the
# H200 at V2-Lite's experts against the pointer kernels' best tiles: 0.60 vs 0.63 ms at 2k tokens, 1.83
# vs 1.84 at 8k, 7.12 vs 7.86 at 32k; 64-row tiles two to an SM, or 128 x 128, lost to both.
HALF_TMA_CONFIG = (129, 128, 128, 256, 8, 4, 1)
# the 128 x 256 tiles: four 48 KB stages, 224 KB with the TMA kernel's barriers and epilogue (sm_90 and
# sm_100 give a program 227 KB)
BIG_TILE_SHARED_MEMORY = 227 * 1024
# K step of the bf16 / fp16 TMA grouped GEMM: 128-byte rows, as the FP8 one's 128 values
HALF_TMA_BLOCK_K = 64


def tma_config(pairs_per_expert: float, block: tuple[int, int] | None, inter: int, hidden: int, x: torch.Tensor,
               half: bool = False):
    """The TMA grouped GEMM's tiles for this batch, or None where the pointer kernels stay (few rows per
    expert, float32 or MXFP4 experts, no sm_90, shapes the tiles or the copy engine do not divide).
    block: FP8 experts' weight block; half (block None): bf16 / fp16 experts."""
    if (block is None and not half) or TensorDescriptor is None:
        return None
    if interpreted(x):  # the same kernel bodies on small tiles
        bn = min(block[0], 32) if block else 32
        return 16, bn, bn, 4, 1, 1
    if not tma_capable(x.device):
        return None
    if half:
        min_rows, bm, bn13, bn2, warps, stages, per_sm = HALF_TMA_CONFIG
        fits = inter % bn13 == 0 and hidden % bn2 == 0
        return (bm, bn13, bn2, warps, stages, per_sm) if pairs_per_expert >= min_rows and fits else None
    for min_rows, bm, bn13, bn2, warps, stages, per_sm in TMA_CONFIGS:
        if pairs_per_expert >= min_rows:
            bn13, bn2 = min(bn13, block[0]), min(bn2, block[0])  # one weight scale per tile and K step
            fits = (block[0] % bn13 == 0 and block[0] % bn2 == 0 and inter % bn13 == 0 and hidden % bn2 == 0
                    and inter % 16 == 0 and hidden % 16 == 0)
            return (bm, bn13, bn2, warps, stages, per_sm) if fits else None
    return None


def _launch_tma(a, a_s, w, w_s, out, weights, align, num_pairs, top_k, gated, block, bm, bn, warps, stages, per_sm,
                limit: float = float("inf"), flatten: bool = True):
    """One grouped GEMM through `_moe_gemm_tma_kernel`: FP8 weights with their scales (w_s) and block, or
    bf16 / fp16 (64-wide K steps, no scales)."""
    sorted_ids, block_expert, num_padded = align
    n = w.shape[1] // 2 if gated else w.shape[1]
    k = w.shape[2]
    scaled = w.dtype == FP8
    bk = block[1] if scaled else HALF_TMA_BLOCK_K
    if not scaled:
        a_s, w_s = a, w  # no scales: pointers the kernel never reads
    b_desc = TensorDescriptor.from_tensor(w.view(-1, k), [bn, bk])
    a_desc = a if gated else TensorDescriptor.from_tensor(a, [bm, bk])  # w13 gathers its token rows by pointer
    programs = min(per_sm * num_sms(a.device), sorted_ids.shape[0] // bm * (n // bn))
    _moe_gemm_tma_kernel[(programs,)](a, a_desc, a_s, b_desc, w_s, out, weights, sorted_ids, block_expert, num_padded,
                                      n, k, num_pairs, top_k, limit, a.stride(0), a_s.stride(0), a_s.stride(1),
                                      w_s.stride(0), w_s.stride(1), out.stride(0), NUM_PROGRAMS=programs, GATED=gated,
                                      GROUP_N=block[0] if scaled else bn, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                      GROUP_M=8, UPCAST=upcast_fp8_dot(a, bk) if scaled else interpreted(a),
                                      FLATTEN=flatten, SCALED=scaled,
                                      num_warps=warps, num_stages=stages)


def sort_rows(a: torch.Tensor, a_s: torch.Tensor | None, sorted_ids: torch.Tensor, num_pairs: int, top_k: int
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The w13 input's token rows copied into the pairs' expert-sorted order, so the Gluon GEMM
    (`fused_moe_gluon`) reads them by TMA: a [T, K] (FP8 or half) -> [P, K], row i the token of sorted pair i (padding slots: token 0's
    row, whose outputs nothing reads); its group scales a_s [T, K / g] with the tokens contiguous (as
    `per_token_group_quant(..., k_major_scales=True)` writes them) -> [P, K / g], the same layout."""
    rows = torch.where(sorted_ids < num_pairs, sorted_ids // top_k, 0)
    # FP8 rows copied as bytes (an index over FP8 values is not implemented everywhere)
    out = a.view(torch.uint8).index_select(0, rows).view(a.dtype) if a.element_size() == 1 else a.index_select(0, rows)
    if a_s is None:
        return out, None
    return out, a_s.t().index_select(1, rows).t()


def fused_experts_tma(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block, cfg,
                      swiglu_limit: float | None = None, flatten: bool = True) -> torch.Tensor:
    """`fused_experts` through the persistent TMA kernels (cfg from `tma_config`). FP8 experts: x is
    quantized once (K-major scales), w13 writes SiLU(gate) * up in expert-sorted order, that intermediate
    is quantized and read by TMA in w2. bf16 / fp16 experts (no scales, block None): the same without
    the quantizations."""
    num_tokens, hidden = x.shape
    num_experts, inter, top_k = w13.shape[0], w13.shape[1] // 2, topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    bm, bn13, bn2, warps, stages, per_sm = cfg
    fp8 = w13.dtype == FP8
    align = align_by_expert(topk_ids, num_experts, bm)
    a, a_s = per_token_group_quant(x, block[1], k_major_scales=True) if fp8 else (x, None)
    inter_out = torch.empty(align[0].shape[0], inter, dtype=x.dtype, device=x.device)
    _launch_tma(a, a_s, w13, w13_scale, inter_out, topk_weights, align, num_pairs, top_k, True, block, bm, bn13,
                warps, stages, per_sm, float("inf") if swiglu_limit is None else float(swiglu_limit), flatten)
    a, a_s = per_token_group_quant(inter_out, block[1], k_major_scales=True) if fp8 else (inter_out, None)
    pair_out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _launch_tma(a, a_s, w2, w2_scale, pair_out, topk_weights, align, num_pairs, top_k, False, block, bm, bn2, warps,
                stages, per_sm, flatten=flatten)
    return pair_out.view(num_tokens, top_k, hidden).sum(dim=1)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                  block: tuple[int, int] | None = None, swiglu_limit: float | None = None,
                  tma_path: bool | None = None, fp4_dot_scaled: bool = False) -> torch.Tensor:
    """x: [T, H]; w13: [E, 2I, H] (gate rows, then up rows); w2: [E, H, I]; topk_weights [T, k] float32;
    topk_ids [T, k] int -> [T, H] = sum_k weight * w2_e(SiLU(gate_e x) * up_e x). FP8 weights need their
    scales ([E, ceil(2I / bn), ceil(H / bk)] and [E, ceil(H / bn), ceil(I / bk)]) and block.
    `swiglu_limit` l: SiLU(min(gate, l)) * clamp(up, -l, l) (DeepSeek-V4). `tma_path`: None chooses by
    rows per expert (`tma_config`; the pointer kernels under the interpreter), True / False forces.
    MXFP4 experts: w13 / w2 the packed codes [E, 2I, H / 2] / [E, H, I / 2] (int8 or uint8), the scales
    their E8M0 bytes [E, 2I, H / 32] / [E, H, I / 32], no block (the pointer kernels, tiles decoded;
    fp4_dot_scaled: bf16 / fp16 activations, codes and scales handed to `tl.dot_scaled` instead)."""
    check_float("x", x)
    check(x.dim() == 2 and x.stride(-1) == 1, f"x must be [T, H] contiguous, got {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    fp4 = is_mxfp4(w13)
    if fp4:
        check(is_mxfp4(w2) and w2.shape[:2] == (num_experts, hidden), "w13 and w2 must both be MXFP4")
        check_mxfp4("w13", w13, w13_scale, 2 * inter, hidden)
        check_mxfp4("w2", w2, w2_scale, hidden, 2 * w2.shape[2])
        inter = 2 * w2.shape[2]
        check(two_inter == 2 * inter, f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit hidden={hidden}")
    else:
        check(w13.shape == (num_experts, 2 * inter, hidden) and w2.shape == (num_experts, hidden, inter),
              f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit hidden={hidden}")
    check(w13.is_contiguous() and w2.is_contiguous(), "expert weights must be contiguous")
    check(topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == num_tokens, "one top-k row per token")
    check(topk_weights.dtype == torch.float32 and topk_weights.is_contiguous(), "topk_weights must be contiguous float32")
    fp8 = w13.dtype == FP8
    if fp8:
        check(block is not None and w13_scale is not None and w2_scale is not None and w2.dtype == FP8,
              "FP8 experts need w13_scale, w2_scale and the block size")
        check(block[1] >= 16 and block[1] & (block[1] - 1) == 0, f"block_k must be a power of two >= 16, got {block}")
        check(w13_scale.dtype == torch.float32 and w2_scale.dtype == torch.float32, "scales must be float32")
        check(w13_scale.shape == (num_experts, -(-2 * inter // block[0]), -(-hidden // block[1]))
              and w2_scale.shape == (num_experts, -(-hidden // block[0]), -(-inter // block[1])),
              f"scale shapes {tuple(w13_scale.shape)}, {tuple(w2_scale.shape)} do not match block {block}")
    elif not fp4:
        check(w13.dtype == x.dtype and w2.dtype == x.dtype, f"expert weights ({w13.dtype}) must match x ({x.dtype})")
    check(not fp4_dot_scaled or (fp4 and x.dtype in DOT_SCALED_FORMATS),
          "fp4_dot_scaled takes MXFP4 experts and bf16 or fp16 activations")
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    # bf16 / fp16 experts take the 128 x 256 tiles where they fit the chip's shared memory
    half = w13.dtype in (torch.bfloat16, torch.float16) and (interpreted(x)
                                                             or shared_memory(x.device) >= BIG_TILE_SHARED_MEMORY)
    tma = tma_config(num_pairs / num_experts, block, inter, hidden, x, half) if fp8 or half else None
    check(not tma_path or tma is not None, "the TMA grouped GEMM does not take these experts or this batch")
    if tma is not None and (not interpreted(x) if tma_path is None else tma_path):
        if GLUON and fp8 and tma_path is None and gluon_available():
            from engine.kernels import fused_moe_gluon

            if fused_moe_gluon.applies(x, w13, w2, block, swiglu_limit):
                return fused_moe_gluon.ws_fused_experts(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
        return fused_experts_tma(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block, tma, swiglu_limit)
    bk = block[1] if fp8 else None
    cfg13 = _config(num_pairs / num_experts, not interpreted(x), True, bk, half)
    cfg2 = _config(num_pairs / num_experts, not interpreted(x), False, bk, half)
    check(cfg13[0] == cfg2[0], "both GEMMs must share BLOCK_M (one alignment)")
    align = align_by_expert(topk_ids, num_experts, cfg13[0])
    inter_out = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    a, a_s = per_token_group_quant(x, block[1]) if fp8 else (x, None)
    _launch(a, a_s, w13, w13_scale, inter_out, topk_weights, align, num_pairs, top_k, True, True, cfg13, block,
            float("inf") if swiglu_limit is None else float(swiglu_limit), fp4_dot_scaled)
    a, a_s = per_token_group_quant(inter_out, block[1]) if fp8 else (inter_out, None)
    pair_out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _launch(a, a_s, w2, w2_scale, pair_out, topk_weights, align, num_pairs, top_k, False, False, cfg2, block,
            fp4_dot_scaled=fp4_dot_scaled)
    return pair_out.view(num_tokens, top_k, hidden).sum(dim=1)


def reference_fused_experts(x, w13, w2, topk_weights, topk_ids, swiglu_limit: float | None = None):
    """Loop over (token, k) in float32 with dequantized weights."""
    lim = float("inf") if swiglu_limit is None else swiglu_limit
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            h = w13[e].float() @ x[t].float()
            y = w2[e].float() @ (torch.nn.functional.silu(h[:inter].clamp(max=lim)) * h[inter:].clamp(-lim, lim))
            out[t] += topk_weights[t, k] * y
    return out.to(x.dtype)
