"""A whole MoE block for a handful of tokens, as GEMVs: routed and shared experts in three launches.

At decode an expert meets about one token, so the grouped GEMM's sort (about 27 small launches), its
16-row tiles and the shared experts' own four launches buy nothing. Here each token has `top_k + S`
slots: its routed experts, then the shared experts cut into S = shared_inter / inter pieces of the
routed experts' width (a SwiGLU MLP of width S * I is the sum of S MLPs of width I over its row
blocks), each of weight 1. Three launches:
  up:   one program per (slot, BLOCK_N outputs): SiLU(x W_gate) * (x W_up) -> act [T * slots, I]; under
        programmatic dependent launch the shared pieces' programs start while the routing still runs
  down: one program per (slot, BLOCK_N outputs): weight * act W_down -> [T * slots, hidden]
  sum:  over each token's slots, in order -> [T, hidden].
Each program multiplies elementwise into a [BLOCK_N, GROUPS, GROUP_K] accumulator and reduces it once
at the end, so a K step is loads and FMAs only (the K loop is `gemv.gemv_rows`'s); many small programs
keep enough loads in flight to stream the weights at memory bandwidth.
FP8 experts multiply the same FP8 math as the grouped kernel: activations quantized per group of
block_k, weight blocks scaled (the scale applied to the group's activations, shared by a program's rows).
MXFP4 experts (DeepSeek-V4's: e2m1 codes two a byte, an E8M0 scale per 32 values of a row) have kernels
of their own (`_up_fp4_words_kernel`, `_down_fp4_words_kernel`): a program's rows each have their own
scales, and the codes, read 8 to a 32-bit word, are decoded in registers two values per few integer
operations (`mxfp4.fp4_gemv_words`); activations stay in their dtype, the math of the dequantized weight.
Their shared experts (FP8 in V4) run apart. A program's two row blocks (gate and up rows; two halves of
the down rows) share each activation load, and act goes between the kernels as float32 planes (value n
at plane n % 8, word n // 8), so the down kernel's activation loads are contiguous.

Bytes: the chosen experts' and the shared experts' weights (an expert picked by two tokens is read
twice; MXFP4: 17 bytes per 32 values, codes and scale); FLOPs: as the GEMMs.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.kernels._util import check, check_float, interpreted, mma, pdl, upcast_fp8_dot, wait_for_inputs
from engine.kernels.fp8_gemm import FP8
from engine.kernels.gemv import DOT_STAGES, DOT_WARPS, dot_rows, e4m3_groups, fp8_groups, gemv_rows
from engine.kernels.mxfp4 import as_bytes, as_words, check_mxfp4, fp4_gemv_words, is_mxfp4


# (BLOCK_N, K groups per step, num_warps), chosen on an H200 with benchmarks/moe_gemv_configs.py
CONFIG = {"bf16": (16, 1, 4), "fp8": (8, 4, 4)}
# under programmatic dependent launch, whether the down kernel loads its expert's first weights before
# waiting for act (`gemv.gemv_rows`), by weight dtype (else it waits first). Measured on an H200
# (benchmarks/pdl_chain.py, one token's MoE block, us): V2-Lite 48.2 without PDL, 45.7 waiting first,
# 43.3 loading first; V3 (FP8) 160.6 / 156.1 / 153.3
PREFETCH = {"bf16": True, "fp8": True}
# under programmatic dependent launch, whether the up kernel's shared-expert programs stream their rows while
# the routing ahead of them runs (they need none of it) and wait only before they write. Measured on an H100
# (engine bench, one stream of V2-Lite, two shared pieces of eight slots): 430 -> 439 tok/s at 1k context,
# 369-370 -> 375-378 at 32k; eight streams and the V3 slice (one shared piece of nine) unchanged
SHARED_EARLY = True
# FP8 experts on the tensor cores (`_dot_group`): a program's `gemv.dot_rows` rows are the M of a wgmma product
# with the token's quantized K group broadcast to its 16 columns, the weights staged into shared memory by
# cp.async, `gemv.DOT_STAGES` deep, instead of widened and multiplied on the CUDA cores (an e4m3 byte there costs a
# conversion and an FMA in float32: 2.45 TB/s on an H100 where the bf16 experts read 2.72). Off until
# measured: `dot=` of `moe_gemv`, `benchmarks/moe_gemv_configs.py` times both
DOT = False
# MXFP4: the decodes of the codes, two values at a time from 32-bit words (`mxfp4.fp4_gemv_words`): "words"
# in Triton, "asm" the same in inline PTX (GPU only; "words" under the interpreter)
FP4_DECODES = ("words", "asm")
# measured on an H200 (benchmarks/v4_quant_kernels.py --sections gemv, V4 Flash's experts, top-6, each call
# on other experts): one token 61.0 us with words (16, 8, 4), 58.5 with asm (16, 8, 4) against a 19.4 us
# floor; eight tokens 383 / 382 us. Not kept, since removed: one code at a time (88.9 us at one token, 540
# at eight) and x read by the up kernel as float32 planes after a copy launch (60.9 us with asm)
FP4_DECODE = "asm"
# (BLOCK_N, groups of 32 values per step, num_warps) by decode: BLOCK_N * groups = 32 * num_warps, one
# 16-byte chunk of a row per thread (wider, the scales' loads take a layout of their own, moved through
# shared memory every step)
FP4_CONFIG = {"words": (16, 8, 4), "asm": (16, 8, 4)}
FP4_INTERPRETED_CONFIG = (64, 2, 4)  # few, wide programs; two groups a step (a K remainder in the tests)
INTERPRETED_CONFIG = (16, 1, 4)  # the interpreter pays per program: few, wide ones
TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


class SharedExperts(NamedTuple):
    """The shared experts' SwiGLU MLP: gate_up [2 * Is, H] (gate rows then up rows), down [H, Is],
    with their FP8 block scales when the weights are FP8."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None


@triton.jit
def _slot(Ids, W, WS, SW, SWS, pair, slots, top_k, stride_we, stride_wn, stride_wse, stride_wsn, stride_sn, stride_ssn):
    """One (token, slot) program's operands: slots below top_k are the token's routed experts, the rest the
    shared pieces -> (token, piece index (-1 when routed), pick, matrix base, its row stride, scale base,
    its row stride)."""
    token, slot = pair // slots, pair % slots
    routed = slot < top_k
    pick = token * top_k + tl.minimum(slot, top_k - 1)
    expert = tl.load(Ids + pick, mask=routed, other=0).to(tl.int64)  # a shared piece reads no id
    w = tl.where(routed, W + expert * stride_we, SW)
    s = tl.where(routed, WS + expert * stride_wse, SWS)
    return (token, tl.where(routed, -1, slot - top_k), pick, w, tl.where(routed, stride_wn, stride_sn), s,
            tl.where(routed, stride_wsn, stride_ssn))


@triton.jit
def _dot_group(w, codes, UPCAST: tl.constexpr):
    """w [BLOCK_N, GROUP_K] e4m3 times one row of codes [1, GROUP_K] -> [BLOCK_N, 16] float32, every column
    the same: the codes broadcast to the 16 columns of a tensor-core product (the rows are its M)."""
    # UPCAST (the interpreter, or K groups under 32): float32 holds every e4m3 product exactly
    return mma(w, tl.trans(tl.broadcast_to(codes, [16, codes.shape[1]])), UPCAST)


@triton.jit
def _column0(acc):
    """[BLOCK_N, 16] -> its first column [BLOCK_N]."""
    return tl.sum(tl.where(tl.arange(0, 16)[None, :] == 0, acc, 0.0), axis=1)


@triton.jit
def _up_kernel(X, W, WS, SW, SWS, Act, Ids, N, K, top_k, slots, shared_up, limit, stride_xm, stride_we, stride_wn,
               stride_wse, stride_wsn, stride_sn, stride_ssn, stride_am,
               USE_FP8: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, GROUPS: tl.constexpr,
               PRE_ROUND: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr, SHARED_EARLY: tl.constexpr,
               DOT: tl.constexpr, UPCAST: tl.constexpr, STAGES: tl.constexpr):
    pair, pid_n = tl.program_id(0), tl.program_id(1)
    # under PDL a shared piece needs nothing of the routing, which the kernel ahead computes: it streams its
    # rows during the routing and waits only before it writes (x was made two launches back, by the norm)
    if SHARED_EARLY:
        if pair % slots >= top_k:
            tl.extra.cuda.gdc_launch_dependents()  # the routed programs release the next kernel after waiting
        else:
            wait_for_inputs(PDL)  # the expert ids are the routing's output
    else:
        wait_for_inputs(PDL)
    token, piece, _, w, row_stride, s, srow = _slot(Ids, W, WS, SW, SWS, pair, slots, top_k, stride_we, stride_wn,
                                                    stride_wse, stride_wsn, stride_sn, stride_ssn)
    # routed: rows [0, N) gate and [N, 2N) up of its expert; shared piece p: rows p*N.. and Is + p*N..
    row0 = tl.where(piece < 0, 0, piece * N)
    up = tl.where(piece < 0, N, shared_up)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    if USE_FP8:  # BLOCK_N divides GROUP_N: the program's rows share one scale per K group
        gate_scales = s + ((row0 + pid_n * BLOCK_N) // GROUP_N) * srow
        up_scales = s + ((row0 + pid_n * BLOCK_N + up) // GROUP_N) * srow
    if DOT:  # FP8 on the tensor cores; K a multiple of GROUP_K, one K group a product
        offs_k = tl.arange(0, GROUP_K)
        gate_rows = w + (row0 + offs_n)[:, None].to(tl.int64) * row_stride + offs_k[None, :]
        up_rows = gate_rows + up.to(tl.int64) * row_stride
        acc = tl.zeros([BLOCK_N, 16], tl.float32)
        acc_up = tl.zeros([BLOCK_N, 16], tl.float32)
        for k0 in tl.range(0, K, GROUP_K, num_stages=STAGES):
            # the token's K group as [1, GROUP_K] codes and a [1] scale
            codes, a_scale = e4m3_groups(tl.load(X + token * stride_xm + k0 + offs_k)[None, :].to(tl.float32),
                                         PRE_ROUND)
            g = _dot_group(tl.load(gate_rows + k0, mask=mask_n[:, None], other=0.0), codes, UPCAST)
            u = _dot_group(tl.load(up_rows + k0, mask=mask_n[:, None], other=0.0), codes, UPCAST)
            acc += g * (a_scale * tl.load(gate_scales + k0 // GROUP_K))
            acc_up += u * (a_scale * tl.load(up_scales + k0 // GROUP_K))
        gate = _column0(acc)
        up = _column0(acc_up)
    else:
        offs_g = tl.arange(0, GROUPS)
        offs_k = offs_g[:, None] * GROUP_K + tl.arange(0, GROUP_K)[None, :]  # [GROUPS, GROUP_K]
        gate_ptrs = w + (row0 + offs_n)[:, None, None].to(tl.int64) * row_stride + offs_k[None, :, :]
        up_ptrs = gate_ptrs + up.to(tl.int64) * row_stride
        # products accumulate elementwise and are reduced once at the end: no cross-thread sum per K step
        acc = tl.zeros([BLOCK_N, GROUPS, GROUP_K], tl.float32)
        acc_up = tl.zeros([BLOCK_N, GROUPS, GROUP_K], tl.float32)
        for k0 in range(0, K, GROUPS * GROUP_K):
            mask_k = offs_k < K - k0
            mask = mask_n[:, None, None] & mask_k[None, :, :]
            g = tl.load(gate_ptrs + k0, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(up_ptrs + k0, mask=mask, other=0.0).to(tl.float32)
            a = tl.load(X + token * stride_xm + k0 + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            a_up = a
            if USE_FP8:  # the block scales go onto the activations (one per GROUP_K), not every weight
                a = fp8_groups(a, PRE_ROUND)
                mask_g = offs_g * GROUP_K < K - k0
                a_up = a * tl.load(up_scales + k0 // GROUP_K + offs_g, mask=mask_g, other=0.0)[:, None]
                a = a * tl.load(gate_scales + k0 // GROUP_K + offs_g, mask=mask_g, other=0.0)[:, None]
            acc += g * a[None, :, :]
            acc_up += u * a_up[None, :, :]
        gate = tl.sum(tl.sum(acc, axis=2), axis=1)
        up = tl.sum(tl.sum(acc_up, axis=2), axis=1)
    gate = tl.minimum(gate, limit)  # V4 clamps both pre-activations
    up = tl.maximum(tl.minimum(up, limit), -limit)
    out = gate / (1.0 + tl.exp(-gate)) * up
    if SHARED_EARLY:
        if pair % slots >= top_k:  # nothing written before the kernel ahead is done (its buffers may be reused)
            tl.extra.cuda.gdc_wait()
    tl.store(Act + pair * stride_am + offs_n, out.to(Act.dtype.element_ty), mask=mask_n)


@triton.jit
def _down_kernel(Act, W, WS, SW, SWS, Out, Weights, Ids, N, K, top_k, slots, stride_am, stride_we, stride_wn,
                 stride_wse, stride_wsn, stride_sn, stride_ssn, stride_om,
                 USE_FP8: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, GROUPS: tl.constexpr,
                 PRE_ROUND: tl.constexpr, BLOCK_N: tl.constexpr, WAIT_FIRST: tl.constexpr, PREFETCH: tl.constexpr,
                 DOT: tl.constexpr, UPCAST: tl.constexpr, STAGES: tl.constexpr):
    pair, pid_n = tl.program_id(0), tl.program_id(1)
    wait_for_inputs(WAIT_FIRST)
    # PREFETCH: the ids and routing weights come from before the up kernel (which waited for them): read before
    # `gemv_rows` waits for act, with the expert's first weights
    _, piece, pick, w, row_stride, s, srow = _slot(Ids, W, WS, SW, SWS, pair, slots, top_k, stride_we, stride_wn,
                                                   stride_wse, stride_wsn, stride_sn, stride_ssn)
    weight = tl.where(piece < 0, tl.load(Weights + pick), 1.0)
    # routed: its expert's [N, K]; shared piece p: columns [p*K, (p+1)*K) of the shared [N, Is]
    col0 = tl.where(piece < 0, 0, piece * K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    scales = s + ((pid_n * BLOCK_N) // GROUP_N) * srow + col0 // GROUP_K
    if DOT:  # FP8 on the tensor cores (as the up kernel); the weights staged only after the wait
        wait_for_inputs(PREFETCH)
        offs_k = tl.arange(0, GROUP_K)
        rows = w + offs_n[:, None].to(tl.int64) * row_stride + col0 + offs_k[None, :]
        acc = tl.zeros([BLOCK_N, 16], tl.float32)
        for k0 in tl.range(0, K, GROUP_K, num_stages=STAGES):
            codes, a_scale = e4m3_groups(tl.load(Act + pair * stride_am + k0 + offs_k)[None, :].to(tl.float32),
                                         PRE_ROUND)
            p = _dot_group(tl.load(rows + k0, mask=(offs_n < N)[:, None], other=0.0), codes, UPCAST)
            acc += p * (a_scale * tl.load(scales + k0 // GROUP_K))
        y = _column0(acc)
    else:
        offs_k = tl.arange(0, GROUPS)[:, None] * GROUP_K + tl.arange(0, GROUP_K)[None, :]
        w_ptrs = w + offs_n[:, None, None].to(tl.int64) * row_stride + col0 + offs_k[None, :, :]
        y = gemv_rows(w_ptrs, Act + pair * stride_am + offs_k, scales, offs_n < N, K, USE_FP8, GROUP_K, GROUPS,
                      PRE_ROUND, BLOCK_N, PREFETCH)
    # rounded to the activation dtype before the weight, as the reference path's expert outputs are
    y = y.to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + pair * stride_om + offs_n, (y * weight).to(Out.dtype.element_ty), mask=offs_n < N)


@triton.jit
def _fp4_words(W, WS, expert, row0, N, stride_we, stride_wn, stride_se, stride_sn, GROUPS: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Pointers of BLOCK_N rows from row0 of the expert, as 32-bit words (W int32, strides in words), for
    `fp4_gemv_words`."""
    offs_n = row0 + tl.arange(0, BLOCK_N)
    offs_g = tl.arange(0, GROUPS)
    offs_w = offs_g[:, None] * 4 + tl.arange(0, 4)[None, :]  # [GROUPS, 4] words of a step
    rows = offs_n.to(tl.int64)
    w_ptrs = W + expert * stride_we + rows[:, None, None] * stride_wn + offs_w[None, :, :]
    s_ptrs = WS + expert * stride_se + rows[:, None] * stride_sn + offs_g[None, :]
    return offs_n, offs_n < N, w_ptrs, s_ptrs


@triton.jit
def _x_words(X, X_PLANE: tl.constexpr, GROUPS: tl.constexpr):
    """[GROUPS, 4] pointers at the activations of a step's words: word w of plane 0 where X_PLANE > 0 (act
    between the kernels, as float32 planes), else value 8w (x in order)."""
    offs_w = tl.arange(0, GROUPS)[:, None] * 4 + tl.arange(0, 4)[None, :]
    return X + (offs_w if X_PLANE else 8 * offs_w)


@triton.jit
def _up_fp4_words_kernel(X, W, WS, Act, Ids, N, K, top_k, limit, stride_xm, stride_we, stride_wn, stride_se, stride_sn,
                         stride_am, ACT_PLANE: tl.constexpr, ACT_DTYPE: tl.constexpr, GROUPS: tl.constexpr,
                         BLOCK_N: tl.constexpr, EVEN: tl.constexpr, ASM: tl.constexpr):
    """One program per (token, k) pair and BLOCK_N outputs: SiLU(min(gate, l)) * clamp(up, -l, l) of its
    expert's packed w13 (gate rows [0, N), up rows [N, 2N)), read as 32-bit words of codes
    (`mxfp4.fp4_gemv_words`, gate and up rows sharing the activations); x in order; writes act as float32
    planes ACT_PLANE apart (value n at plane n % 8, word n // 8) for the down kernel, its values rounded
    to ACT_DTYPE (x's) first."""
    pair, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(Ids + pair).to(tl.int64)
    offs_n, mask_n, gate_ptrs, gate_scales = _fp4_words(W, WS, expert, pid_n * BLOCK_N, N, stride_we, stride_wn,
                                                        stride_se, stride_sn, GROUPS, BLOCK_N)
    x = _x_words(X + (pair // top_k) * stride_xm, 0, GROUPS)
    gate, up = fp4_gemv_words(gate_ptrs, gate_scales, mask_n, gate_ptrs + N * stride_wn, gate_scales + N * stride_sn,
                              mask_n, x, K, 0, GROUPS, BLOCK_N, EVEN, ASM)
    gate = tl.minimum(gate, limit)
    up = tl.maximum(tl.minimum(up, limit), -limit)
    out = (gate / (1.0 + tl.exp(-gate)) * up).to(ACT_DTYPE).to(tl.float32)
    tl.store(Act + pair * stride_am + (offs_n % 8) * ACT_PLANE + offs_n // 8, out, mask=mask_n)


@triton.jit
def _down_fp4_words_kernel(Act, W, WS, Out, Weights, Ids, N, K, stride_am, stride_we, stride_wn, stride_se, stride_sn,
                           stride_om, ACT_PLANE: tl.constexpr, GROUPS: tl.constexpr, BLOCK_N: tl.constexpr,
                           EVEN: tl.constexpr, ASM: tl.constexpr):
    """One program per pair and 2 * BLOCK_N outputs (two blocks sharing act's loads): weight * (act W_down
    of its expert), the codes read as 32-bit words, act as the up kernel's float32 planes."""
    pair, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(Ids + pair).to(tl.int64)
    offs_a, mask_a, wa, sa = _fp4_words(W, WS, expert, pid_n * 2 * BLOCK_N, N, stride_we, stride_wn, stride_se,
                                        stride_sn, GROUPS, BLOCK_N)
    offs_b, mask_b, wb, sb = _fp4_words(W, WS, expert, pid_n * 2 * BLOCK_N + BLOCK_N, N, stride_we, stride_wn,
                                        stride_se, stride_sn, GROUPS, BLOCK_N)
    x = _x_words(Act + pair * stride_am, ACT_PLANE, GROUPS)
    ya, yb = fp4_gemv_words(wa, sa, mask_a, wb, sb, mask_b, x, K, ACT_PLANE, GROUPS, BLOCK_N, EVEN, ASM)
    weight = tl.load(Weights + pair)
    # rounded to the activation dtype before the weight, as the reference path's expert outputs are
    ya = ya.to(Out.dtype.element_ty).to(tl.float32)
    yb = yb.to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + pair * stride_om + offs_a, (ya * weight).to(Out.dtype.element_ty), mask=mask_a)
    tl.store(Out + pair * stride_om + offs_b, (yb * weight).to(Out.dtype.element_ty), mask=mask_b)


@triton.jit
def _sum_kernel(Partial, Out, N, slots, stride_pm, stride_om, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """Out[t] = sum over the token's slots of Partial[t * slots + s], in float32, slots in order."""
    token, pid_n = tl.program_id(0), tl.program_id(1)
    wait_for_inputs(PDL)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros([BLOCK_N], tl.float32)
    for s in range(0, slots):
        acc += tl.load(Partial + (token * slots + s) * stride_pm + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(Out + token * stride_om + offs_n, acc.to(Out.dtype.element_ty), mask=mask_n)


def moe_gemv(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
             w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
             block: tuple[int, int] | None = None, shared: SharedExperts | None = None,
             config: tuple[int, int, int] | None = None, swiglu_limit: float | None = None,
             fp4_decode: str | None = None, sum_slots: bool = True,
             dot: bool | None = None) -> torch.Tensor:
    """`fused_moe.fused_experts`'s contract, plus the shared experts' output when `shared` is given;
    meant for T * top_k up to a few dozen pairs. `config`: (BLOCK_N, K groups per step, num_warps); a
    K group is 128 columns for bf16 weights and the scale block's width for FP8 ones. `swiglu_limit` l:
    SiLU(min(gate, l)) * clamp(up, -l, l) (DeepSeek-V4). MXFP4 experts: w13 / w2 the packed codes
    [E, 2I, H / 2] / [E, H, I / 2] (int8 or uint8), w13_scale / w2_scale their E8M0 scales [E, 2I, H / 32]
    / [E, H, I / 32], no block, no shared experts; config (BLOCK_N, groups of 32 per step, num_warps);
    `fp4_decode` one of FP4_DECODES (None: FP4_DECODE; "asm" runs as "words" under the interpreter).
    sum_slots=False (bf16 and FP8 experts; MXFP4 ones always sum): the token's slots come back unsummed,
    [T, top_k (+ shared pieces), H] in x's dtype, for a consumer that sums them as it reads them
    (`rms_norm`); each slot is already weighted.
    Under programmatic dependent launch the shared experts' programs read x before the kernel ahead has
    finished (`SHARED_EARLY`): x must not be that kernel's output (in a MoE layer the router runs between
    the norm that makes x and the experts). `dot` (FP8 experts whose hidden and width are whole K groups; None:
    DOT): the products on the tensor cores (`_dot_group`), `config` then unused."""
    check_float("x", x)
    check(x.dim() == 2 and x.stride(-1) == 1, f"x must be [T, H] contiguous, got {tuple(x.shape)}")
    if is_mxfp4(w13):
        check(shared is None, "MXFP4 experts take no shared experts (V4 keeps them FP8, run apart)")
        return _moe_gemv_fp4(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, config, swiglu_limit,
                             fp4_decode or FP4_DECODE)
    num_tokens, hidden = x.shape
    num_experts, inter = w2.shape[0], w2.shape[2]
    check(w13.shape == (num_experts, 2 * inter, hidden) and w2.shape == (num_experts, hidden, inter)
          and w13.is_contiguous() and w2.is_contiguous(), "w13 [E, 2I, H] and w2 [E, H, I] must be contiguous")
    check(topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == num_tokens and topk_ids.is_contiguous()
          and topk_weights.dtype == torch.float32 and topk_weights.is_contiguous(), "one top-k row per token")
    fp8 = w13.dtype == FP8
    if fp8:
        check(block is not None and w13_scale is not None and w2_scale is not None and w2.dtype == FP8,
              "FP8 experts need w13_scale, w2_scale and the block size")
        check(block[1] & (block[1] - 1) == 0, f"block_k must be a power of two, got {block[1]}")
    else:
        check(w13.dtype == x.dtype and w2.dtype == x.dtype, f"expert weights ({w13.dtype}) must match x ({x.dtype})")
    top_k = topk_ids.shape[1]
    num_shared = 0
    if shared is not None:
        shared_inter = shared.down.shape[1]
        check(shared_inter % inter == 0 and shared.gate_up.shape == (2 * shared_inter, hidden)
              and shared.down.shape == (hidden, shared_inter) and shared.gate_up.stride(-1) == 1
              and shared.down.stride(-1) == 1 and shared.gate_up.dtype == w13.dtype and shared.down.dtype == w2.dtype,
              f"shared experts must be gate_up [2 * k * {inter}, {hidden}] and down [{hidden}, k * {inter}] "
              f"in the routed experts' dtype")
        if fp8:
            check(shared.gate_up_scale is not None and shared.down_scale is not None
                  and inter % block[0] == 0 and inter % block[1] == 0,
                  "FP8 shared experts need their scales, and blocks that tile the routed width")
        num_shared = shared_inter // inter
    if num_tokens == 0:
        return torch.empty_like(x)
    slots = top_k + num_shared
    block_n, groups, warps = config or (INTERPRETED_CONFIG if interpreted(x) else CONFIG["fp8" if fp8 else "bf16"])
    # the tensor cores' rows a program (0: not for these experts): both kernels' K whole groups
    dot_n = dot_rows(x, hidden, block) if fp8 and (DOT if dot is None else dot) and inter % block[1] == 0 else 0
    dot = dot_n > 0
    if dot:
        block_n, groups, warps = dot_n, 1, DOT_WARPS
    if fp8:
        while block[0] % block_n:  # a program's rows must sit in one scale block
            block_n //= 2
    ids = topk_ids.int()
    act = torch.empty(num_tokens * slots, inter, dtype=x.dtype, device=x.device)
    partial = torch.empty(num_tokens * slots, hidden, dtype=x.dtype, device=x.device)
    sw13, sw2 = (shared.gate_up, shared.down) if shared is not None else (w13, w2)
    s13, s2 = (w13_scale, w2_scale) if fp8 else (w13, w2)
    ss13, ss2 = ((shared.gate_up_scale, shared.down_scale) if shared is not None else (s13, s2)) if fp8 else (sw13, sw2)
    on, prefetch = pdl(x), PREFETCH["fp8" if fp8 else "bf16"]
    common = dict(USE_FP8=fp8, GROUP_N=block[0] if fp8 else 1, GROUP_K=block[1] if fp8 else 128, GROUPS=groups,
                  PRE_ROUND=fp8 and interpreted(x), BLOCK_N=block_n, DOT=dot,
                  UPCAST=dot and upcast_fp8_dot(x, block[1]), STAGES=DOT_STAGES if dot else 1, launch_pdl=on,
                  num_warps=warps)
    _up_kernel[(num_tokens * slots, triton.cdiv(inter, block_n))](
        x, w13, s13, sw13, ss13, act, ids, inter, hidden, top_k, slots, sw13.shape[0] // 2,
        float("inf") if swiglu_limit is None else float(swiglu_limit),
        x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0) if fp8 else 0, s13.stride(1) if fp8 else 0,
        sw13.stride(0), ss13.stride(0) if fp8 else 0, act.stride(0), PDL=on, SHARED_EARLY=on and SHARED_EARLY,
        **common)
    _down_kernel[(num_tokens * slots, triton.cdiv(hidden, block_n))](
        act, w2, s2, sw2, ss2, partial, topk_weights, ids, hidden, inter, top_k, slots,
        act.stride(0), w2.stride(0), w2.stride(1), s2.stride(0) if fp8 else 0, s2.stride(1) if fp8 else 0,
        sw2.stride(0), ss2.stride(0) if fp8 else 0, partial.stride(0), WAIT_FIRST=on and not prefetch,
        PREFETCH=on and prefetch, **common)
    if not sum_slots:
        return partial.view(num_tokens, slots, hidden)
    out = torch.empty_like(x)
    # torch's reduction over the middle dimension took 5 us for one token on an H200: a plain loop instead
    sum_block = 256
    _sum_kernel[(num_tokens, triton.cdiv(hidden, sum_block))](partial, out, hidden, slots, partial.stride(0),
                                                              out.stride(0), BLOCK_N=sum_block, PDL=on,
                                                              launch_pdl=on, num_warps=4)
    return out


def _moe_gemv_fp4(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None,
                  config: tuple[int, int, int] | None, swiglu_limit: float | None, decode: str) -> torch.Tensor:
    num_tokens, hidden = x.shape
    num_experts, two_inter = w13.shape[0], w13.shape[1]
    inter = two_inter // 2
    check_mxfp4("w13", w13, w13_scale, 2 * inter, hidden)
    check_mxfp4("w2", w2, w2_scale, hidden, inter)
    check(w2.shape[0] == num_experts and is_mxfp4(w2), "w13 and w2 must both be MXFP4, of the same experts")
    check(topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == num_tokens and topk_ids.is_contiguous()
          and topk_weights.dtype == torch.float32 and topk_weights.is_contiguous(), "one top-k row per token")
    check(decode in FP4_DECODES, f"MXFP4 decode must be one of {FP4_DECODES}, got {decode!r}")
    if num_tokens == 0:
        return torch.empty_like(x)
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    block_n, groups, warps = config or (FP4_INTERPRETED_CONFIG if interpreted(x) else FP4_CONFIG[decode])
    ids = topk_ids.int()
    partial = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    limit = float("inf") if swiglu_limit is None else float(swiglu_limit)
    w13, w2, s13, s2 = as_words(w13), as_words(w2), as_bytes(w13_scale), as_bytes(w2_scale)
    # act between the kernels as float32 planes (value n at plane n % 8, word n // 8), each padded to
    # 16 elements so that a plane's loads are aligned
    act_plane = triton.cdiv(inter // 8, 16) * 16
    act = torch.empty(num_pairs, 8 * act_plane, dtype=torch.float32, device=x.device)
    asm = decode == "asm" and not interpreted(x)  # the interpreter runs no PTX: the same decode in Triton
    steps = groups * 32  # K of a step: masks go where a shape leaves a remainder
    even13 = hidden % steps == 0 and inter % block_n == 0
    even2 = inter % steps == 0 and hidden % (2 * block_n) == 0
    _up_fp4_words_kernel[(num_pairs, triton.cdiv(inter, block_n))](
        x, w13, s13, act, ids, inter, hidden, top_k, limit, x.stride(0), w13.stride(0), w13.stride(1),
        s13.stride(0), s13.stride(1), act.stride(0), ACT_PLANE=act_plane, ACT_DTYPE=TL_DTYPES[x.dtype],
        GROUPS=groups, BLOCK_N=block_n, EVEN=even13, ASM=asm, num_warps=warps)
    _down_fp4_words_kernel[(num_pairs, triton.cdiv(hidden, 2 * block_n))](
        act, w2, s2, partial, topk_weights, ids, hidden, inter, act.stride(0), w2.stride(0), w2.stride(1),
        s2.stride(0), s2.stride(1), partial.stride(0), ACT_PLANE=act_plane, GROUPS=groups, BLOCK_N=block_n,
        EVEN=even2, ASM=asm, num_warps=warps)
    out = torch.empty_like(x)
    sum_block = 256
    _sum_kernel[(num_tokens, triton.cdiv(hidden, sum_block))](partial, out, hidden, top_k, partial.stride(0),
                                                              out.stride(0), BLOCK_N=sum_block, PDL=False,
                                                              num_warps=4)
    return out
