"""Routed experts for a handful of tokens, as GEMVs over (token, expert) pairs: no sort by expert.

At decode an expert meets about one token, so the grouped GEMM's sort (about 27 small launches) and its
16-row tiles buy nothing; here one program computes BLOCK_N outputs of one pair by multiply-and-sum,
reading the expert's rows once. Three launches for the whole MoE: w13 (SiLU(gate) * up fused), w2
(times the routing weight), the sum over top_k. FP8 experts multiply the same FP8 math as the grouped
kernel: activations quantized per group of block_k, weight blocks scaled.

Bytes: the chosen experts' weights (an expert picked by two tokens is read twice); FLOPs: as the GEMM.
"""

import torch
import triton
import triton.language as tl

from engine.kernels._util import check, check_float, interpreted, pow2
from engine.kernels.fp8_gemm import FP8, _round_to_e4m3


@triton.jit
def _moe_gemv_kernel(A, B, BS, C, Weights, Ids, N, K, top_k, stride_am, stride_be, stride_bn, stride_bse, stride_bsn,
                     stride_cm, GATED: tl.constexpr, A_BY_TOKEN: tl.constexpr, USE_FP8: tl.constexpr,
                     GROUP_N: tl.constexpr, PRE_ROUND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pair, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(Ids + pair).to(tl.int64)
    row = (pair // top_k) if A_BY_TOKEN else pair
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    b_rows = B + expert * stride_be + offs_n[:, None].to(tl.int64) * stride_bn
    acc = tl.zeros([BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_N], tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(A + row * stride_am + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        if USE_FP8:  # the activation group as the FP8 GEMM sees it (BLOCK_K is the scale block)
            scale = tl.maximum(tl.max(tl.abs(a), axis=0), 1e-10) / 448.0
            q = a / scale
            if PRE_ROUND:
                q = _round_to_e4m3(q)
            a = q.to(tl.float8e4nv).to(tl.float32) * scale
        mask = mask_n[:, None] & mask_k[None, :]
        w = tl.load(b_rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        if USE_FP8:
            bs = BS + expert * stride_bse + kb
            w = w * tl.load(bs + (offs_n // GROUP_N) * stride_bsn, mask=mask_n, other=0.0)[:, None]
        acc += tl.sum(w * a[None, :], axis=1)
        if GATED:
            u = tl.load(b_rows + N * stride_bn + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
            if USE_FP8:
                u = u * tl.load(bs + ((offs_n + N) // GROUP_N) * stride_bsn, mask=mask_n, other=0.0)[:, None]
            acc_up += tl.sum(u * a[None, :], axis=1)
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    else:
        acc = acc * tl.load(Weights + pair)
    tl.store(C + pair * stride_cm + offs_n, acc.to(C.dtype.element_ty), mask=mask_n)


def moe_gemv(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
             w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
             block: tuple[int, int] | None = None) -> torch.Tensor:
    """Same contract as `fused_moe.fused_experts`; meant for T * top_k up to a few dozen pairs."""
    check_float("x", x)
    check(x.dim() == 2 and x.stride(-1) == 1, f"x must be [T, H] contiguous, got {tuple(x.shape)}")
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
    num_pairs = num_tokens * top_k
    if num_tokens == 0:
        return torch.empty_like(x)
    block_k = block[1] if fp8 else (256 if x.is_cuda else 32)
    block_n = 32 if x.is_cuda else 16
    inter_out = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    pair_out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    ids = topk_ids.int()
    for a, w, s, out, n, k, gated in ((x, w13, w13_scale, inter_out, inter, hidden, True),
                                      (inter_out, w2, w2_scale, pair_out, hidden, inter, False)):
        _moe_gemv_kernel[(num_pairs, triton.cdiv(n, block_n))](
            a, w, s if fp8 else w, out, topk_weights, ids, n, k, top_k, a.stride(0), w.stride(0), w.stride(1),
            s.stride(0) if fp8 else 0, s.stride(1) if fp8 else 0, out.stride(0), GATED=gated, A_BY_TOKEN=gated,
            USE_FP8=fp8, GROUP_N=block[0] if fp8 else 1, PRE_ROUND=fp8 and interpreted(x), BLOCK_N=block_n,
            BLOCK_K=block_k, num_warps=4)
    return pair_out.view(num_tokens, top_k, hidden).sum(dim=1)
