"""MLA's new-token bookkeeping in one launch: normalize the compressed KV, rotate the shared rope key and
the queries' rope parts, write the latent row [c_kv | k_pe] into its paged cache slot (into an FP8 cache's
block sections, c_kv quantized on the way). For one decoding token the same launch also absorbs the
queries through W_UK (`write_latent_absorbed_`), the two jobs independent. And the way back for the
prefill paths: the latent rows of given slots of an FP8 cache, decoded in one launch (`gather_latent`).

The unfused path takes four launches per layer for this (kv_a_layernorm, rope, concatenation, cache
write), each moving a few kilobytes at decode: pure launch latency. Rounding follows the reference
layers: c_kv normalized in float32, rounded to the activation dtype, times the weight, rounded again;
rope in float32 on the activation-dtype inputs.
"""

import torch
import triton
import triton.language as tl

from engine.kernels._util import check, check_last_contiguous, interpreted, pdl, pow2, wait_for_inputs
from engine.kernels.gemv import PREFETCH, gemv_block, tile
from engine.kernels.rotary import rotate_heads_, rotate_pair
from engine.layers.fp8_latent import FP8_MAX as _FP8_MAX, MIN_SCALE as _MIN_SCALE, FP8LatentLayout

FP8_MAX: tl.constexpr = tl.constexpr(_FP8_MAX)
MIN_SCALE: tl.constexpr = tl.constexpr(_MIN_SCALE)


@triton.jit
def _e4m3_grid(x):
    """x (float32, |x| <= 448) rounded to e4m3's grid, nearest with ties to even, still in float32: the
    interpreter's float8 cast drops the carry when rounding up crosses a power of two (126.3 -> -64 for
    -128), so there the cast gets values it only has to copy. Step 2^(e - 3), 2^-9 for subnormals."""
    e = tl.maximum(((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    big = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True) * 12582912.0  # 1.5 * 2^23 steps
    return (x + big) - big


@triton.jit
def _write_token(t, KV, NormW, Q, Pos, Cos, Sin, Cache, CacheR, CacheS, Slots, eps, stride_kv, stride_qt, stride_qh,
                 stride_cos, stride_cb, stride_ct, stride_rb, stride_rt, stride_sb, page, num_heads, LORA: tl.constexpr,
                 HALF: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                 FP8: tl.constexpr, EXACT_CAST: tl.constexpr, SPLIT_PAIRS: tl.constexpr):
    """Token t's latent row into its cache slot, its queries' rope parts rotated in place."""
    slot = tl.load(Slots + t).to(tl.int64)
    blk, tok = slot // page, slot % page
    # c_kv's and k_pe's rows: one row (k_pe a view LORA values in), or (FP8) in their sections of the block
    row = Cache + blk * stride_cb + tok * stride_ct
    rrow = CacheR + blk * stride_rb + tok * stride_rt
    # c_kv: RMSNorm as layers.norm.RMSNorm rounds it
    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < LORA
    c = tl.load(KV + t * stride_kv + offs_c, mask=mask_c, other=0.0)
    cf = c.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(cf * cf, axis=0) / LORA + eps)
    normed = (cf * rstd).to(c.dtype).to(tl.float32)
    w = tl.load(NormW + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    c_kv = (w * normed).to(c.dtype)
    if FP8:  # as fp8_latent.FP8LatentLayout.quantize: one float32 scale per token, amax / 448
        cf = c_kv.to(tl.float32)
        scale = tl.maximum(tl.max(tl.where(mask_c, tl.abs(cf), 0.0), axis=0) / FP8_MAX, MIN_SCALE)
        qv = tl.clamp(cf / scale, -FP8_MAX, FP8_MAX)
        if EXACT_CAST:
            qv = _e4m3_grid(qv)
        tl.store(row + offs_c, qv.to(Cache.dtype.element_ty), mask=mask_c)
        tl.store(CacheS + blk * stride_sb + tok, scale)
    else:
        tl.store(row + offs_c, c_kv.to(Cache.dtype.element_ty), mask=mask_c)
    # rope: pairs (x0, x1), (x2, x3), ... share a frequency
    pos = tl.load(Pos + t)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HALF
    cos = tl.load(Cos + pos * stride_cos + offs_d, mask=mask_d, other=0.0)
    sin = tl.load(Sin + pos * stride_cos + offs_d, mask=mask_d, other=0.0)
    out = CacheR.dtype.element_ty
    if SPLIT_PAIRS:  # the row loaded and stored whole, its pairs split in registers (`rotate_heads_`)
        offs_r = tl.arange(0, 2 * BLOCK_D)
        k = tl.load(KV + t * stride_kv + LORA + offs_r)
        k1, k2 = tl.split(tl.reshape(k, [BLOCK_D, 2]))
        r1, r2 = rotate_pair(k1, k2, cos, sin)
        tl.store(rrow + offs_r, tl.reshape(tl.join(r1.to(out), r2.to(out)), [2 * BLOCK_D]))
    else:
        kbase = KV + t * stride_kv + LORA + 2 * offs_d
        r1, r2 = rotate_pair(tl.load(kbase, mask=mask_d, other=0.0), tl.load(kbase + 1, mask=mask_d, other=0.0),
                             cos, sin)
        tl.store(rrow + 2 * offs_d, r1.to(out), mask=mask_d)
        tl.store(rrow + 2 * offs_d + 1, r2.to(out), mask=mask_d)
    rotate_heads_(Q + t * stride_qt, stride_qh, num_heads, cos, sin, offs_d, mask_d, BLOCK_H, BLOCK_D, SPLIT_PAIRS)


@triton.jit
def _latent_write_kernel(KV, NormW, Q, Pos, Cos, Sin, Cache, CacheR, CacheS, Slots, eps, stride_kv, stride_qt,
                         stride_qh, stride_cos, stride_cb, stride_ct, stride_rb, stride_rt, stride_sb, page, num_heads,
                         LORA: tl.constexpr, HALF: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_D: tl.constexpr, FP8: tl.constexpr, EXACT_CAST: tl.constexpr,
                         SPLIT_PAIRS: tl.constexpr, PDL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)  # t * q's row stride passes 2^31 from 87k tokens at 128 heads
    wait_for_inputs(PDL)
    _write_token(t, KV, NormW, Q, Pos, Cos, Sin, Cache, CacheR, CacheS, Slots, eps, stride_kv, stride_qt, stride_qh,
                 stride_cos, stride_cb, stride_ct, stride_rb, stride_rt, stride_sb, page, num_heads, LORA, HALF, BLOCK_C,
                 BLOCK_H, BLOCK_D, FP8, EXACT_CAST, SPLIT_PAIRS)


@triton.jit
def _write_absorb_kernel(KV, NormW, Q, Pos, Cos, Sin, Cache, CacheR, CacheS, Slots, eps, stride_kv, stride_qt,
                         stride_qh, stride_cos, stride_cb, stride_ct, stride_rb, stride_rt, stride_sb, page, num_heads,
                         QN, W, QLat, nope, rows, num_gemv, stride_w, LORA: tl.constexpr, HALF: tl.constexpr,
                         BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
                         EXACT_CAST: tl.constexpr, SPLIT_PAIRS: tl.constexpr, GROUP_K: tl.constexpr, GROUPS: tl.constexpr,
                         BLOCK_N: tl.constexpr, WAIT_FIRST: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr):
    # programs [0, num_gemv): the absorption's GEMV (`gemv` with one group a head: BLOCK_N rows of
    # W_UK^T, all of one head, times that head's q_nope); the last program: the token's latent write
    pid = tl.program_id(0)
    if pid < num_gemv:
        gemv_block(QN, W, W, QLat, 0, pid, rows, nope, LORA, 0, stride_qh, stride_w, 0, 0, False, 1, GROUP_K, GROUPS,
                   False, BLOCK_N, WAIT_FIRST, PREFETCH)
    else:
        wait_for_inputs(PDL)
        _write_token(0, KV, NormW, Q, Pos, Cos, Sin, Cache, CacheR, CacheS, Slots, eps, stride_kv, stride_qt,
                     stride_qh, stride_cos, stride_cb, stride_ct, stride_rb, stride_rt, stride_sb, page, num_heads, LORA,
                     HALF, BLOCK_C, BLOCK_H, BLOCK_D, FP8, EXACT_CAST, SPLIT_PAIRS)


def write_latent_(kv_cache: torch.Tensor, kv: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                  q_pe: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, split_pairs: bool = True) -> None:
    """kv: [T, kv_lora + rope] (kv_a_proj_with_mqa's output) -> kv_cache rows at slot_mapping, as
    [RMSNorm(c_kv) | rope(k_pe)]; q_pe: [T, H, rope] (a strided view is fine) rotated in place.
    kv_cache: [blocks, block_size, kv_lora + rope], or an FP8 latent cache [blocks, block_size, token_bytes]
    uint8 (`engine.layers.fp8_latent`: c_kv quantized per token into its block's sections, k_pe in kv's
    dtype); cos/sin_cache: [max_position, rope // 2] float32. split_pairs=False loads and stores the rope
    pairs' halves apart (`rotate_heads_`), for benchmarks and tests."""
    args, consts = _write_args(kv_cache, kv, norm_weight, eps, q_pe, positions, cos_cache, sin_cache, slot_mapping)
    if kv.shape[0]:
        on = pdl(kv)
        consts["SPLIT_PAIRS"] = consts["SPLIT_PAIRS"] and split_pairs
        _latent_write_kernel[(kv.shape[0],)](*args, **consts, PDL=on, launch_pdl=on)


def write_latent_absorbed_(kv_cache: torch.Tensor, kv: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                           q_nope: torch.Tensor, q_pe: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
                           sin_cache: torch.Tensor, slot_mapping: torch.Tensor, w_uk_t: torch.Tensor) -> torch.Tensor:
    """`write_latent_` for one token, its queries' absorption through W_UK in the same launch ->
    q_latent [1, H, kv_lora], what `gemv(q_nope, w_uk_t, groups=H)` gives (the same programs, the same
    bits). q_nope [1, H, nope] (a strided view is fine), w_uk_t [H * kv_lora, nope]
    (`layers.attention.AbsorbWeights`). The two are independent (q_nope is not rotated): one launch, the
    write beside the GEMV's programs, instead of two in a row at every decode layer."""
    args, consts = _write_args(kv_cache, kv, norm_weight, eps, q_pe, positions, cos_cache, sin_cache, slot_mapping)
    check(kv.shape[0] == 1 and q_nope.shape[:2] == q_pe.shape[:2] and q_nope.stride(-1) == 1,
          f"one token's q_nope [1, H, nope] contiguous in nope, got {tuple(q_nope.shape)}")
    check(q_nope.stride(0) == q_pe.stride(0) and q_nope.stride(1) == q_pe.stride(1),
          "q_nope and q_pe must be views of one query tensor")
    num_heads, nope = q_nope.shape[1], q_nope.shape[2]
    lora = consts["LORA"]
    check(w_uk_t.shape == (num_heads * lora, nope) and w_uk_t.dtype == q_nope.dtype and w_uk_t.is_contiguous(),
          f"w_uk_t must be [{num_heads * lora}, {nope}] in q's dtype, contiguous")
    rows = num_heads * lora
    block_n, k_groups, warps = tile(rows, nope, q_nope, None, lora)
    q_latent = torch.empty(1, num_heads, lora, dtype=q_nope.dtype, device=q_nope.device)
    num_gemv = triton.cdiv(rows, block_n)
    on = pdl(kv)
    _write_absorb_kernel[(num_gemv + 1,)](
        *args, q_nope, w_uk_t, q_latent, nope, rows, num_gemv, w_uk_t.stride(0), **consts,
        GROUP_K=128, GROUPS=k_groups, BLOCK_N=block_n, WAIT_FIRST=on and not PREFETCH["bf16"],
        PREFETCH=on and PREFETCH["bf16"], PDL=on, launch_pdl=on, num_warps=warps)
    return q_latent


def _write_args(kv_cache, kv, norm_weight, eps, q_pe, positions, cos_cache, sin_cache, slot_mapping
                ) -> tuple[tuple, dict]:
    """The write's contract checked -> (its kernels' arguments, constants)."""
    check(kv.dim() == 2 and q_pe.dim() == 3, "kv must be [T, kv_lora + rope] and q_pe [T, H, rope]")
    num_tokens, width = kv.shape
    rope = q_pe.shape[2]
    lora = width - rope
    check(norm_weight.shape == (lora,) and norm_weight.dtype == kv.dtype,
          f"norm weight {tuple(norm_weight.shape)} {norm_weight.dtype} does not match c_kv ({lora}, {kv.dtype})")
    fp8 = kv_cache.dtype == torch.uint8
    check(kv_cache.dim() == 3 and kv_cache.is_contiguous(), f"the cache must be 3-D and contiguous, got {tuple(kv_cache.shape)}")
    if fp8:
        cache, cache_r, cache_s = FP8LatentLayout(lora, rope, kv.dtype).views(kv_cache)
    else:
        check(kv_cache.shape[-1] == width, f"cache rows must be {width} wide, got {tuple(kv_cache.shape)}")
        cache, cache_r, cache_s = kv_cache, kv_cache[..., lora:], kv_cache[..., 0]  # no scales
    check(q_pe.shape[0] == num_tokens and positions.shape == (num_tokens,) and slot_mapping.shape == (num_tokens,),
          "q_pe, positions and slot_mapping need one row per token")
    check(q_pe.dtype == kv.dtype and rope % 2 == 0 and cos_cache.shape[-1] == rope // 2
          and cos_cache.dtype == torch.float32 and cos_cache.is_contiguous() and sin_cache.is_contiguous(),
          "rope parts and cos/sin caches do not match")
    check_last_contiguous("kv", kv)
    check_last_contiguous("q_pe", q_pe)
    num_heads = q_pe.shape[1]
    args = (kv, norm_weight, q_pe, positions, cos_cache, sin_cache, cache, cache_r, cache_s, slot_mapping, eps,
            kv.stride(0), q_pe.stride(0), q_pe.stride(1), cos_cache.stride(0), cache.stride(0), cache.stride(1),
            cache_r.stride(0), cache_r.stride(1), cache_s.stride(0), kv_cache.shape[1], num_heads)
    return args, dict(LORA=lora, HALF=rope // 2, BLOCK_C=pow2(lora), BLOCK_H=min(16, pow2(num_heads, 1)),
                      BLOCK_D=pow2(rope // 2, 1), FP8=fp8, EXACT_CAST=interpreted(kv),
                      SPLIT_PAIRS=pow2(rope // 2, 1) == rope // 2)


@triton.jit
def _gather_kernel(Cache, CacheR, CacheS, Slots, Out, num_rows, stride_cb, stride_ct, stride_rb, stride_rt, stride_sb,
                   stride_o, page, LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
    # BLOCK_T rows a program: each row's c_kv (LORA bytes), k_pe and scale, one wide load per field
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < num_rows
    slot = tl.load(Slots + offs_t, mask=mask_t, other=0).to(tl.int64)
    blk, tok = slot // page, slot % page
    offs_c, offs_r = tl.arange(0, BLOCK_C), tl.arange(0, BLOCK_R)
    mask_c, mask_r = offs_c < LORA, offs_r < ROPE
    codes = tl.load(Cache + (blk * stride_cb + tok * stride_ct)[:, None] + offs_c[None, :],
                    mask=mask_t[:, None] & mask_c[None, :], other=0.0)
    scale = tl.load(CacheS + blk * stride_sb + tok, mask=mask_t, other=0.0)
    # as fp8_latent.FP8LatentLayout.rows: the code widened, times its row's scale in float32, rounded once
    c_kv = codes.to(tl.float32) * scale[:, None]
    out = Out + offs_t.to(tl.int64)[:, None] * stride_o
    tl.store(out + offs_c[None, :], c_kv.to(Out.dtype.element_ty), mask=mask_t[:, None] & mask_c[None, :])
    k_pe = tl.load(CacheR + (blk * stride_rb + tok * stride_rt)[:, None] + offs_r[None, :],
                   mask=mask_t[:, None] & mask_r[None, :], other=0.0)
    tl.store(out + LORA + offs_r[None, :], k_pe.to(tl.float32).to(Out.dtype.element_ty),
             mask=mask_t[:, None] & mask_r[None, :])


def gather_latent(kv_cache: torch.Tensor, slots: torch.Tensor, kv_lora: int, rope: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """The latents [T, kv_lora + rope] in `dtype` at flat slots [T] (block * page + offset) of an FP8 latent
    cache [blocks, page, token_bytes] uint8 whose k_pe is stored in `dtype`: what
    `fp8_latent.latent_rows` computes (the same bits) in one launch instead of three gathers, two casts, a
    product and a concatenation (the prefill paths read every context row of every layer this way)."""
    check(kv_cache.dtype == torch.uint8 and kv_cache.dim() == 3 and kv_cache.is_contiguous(),
          f"gather_latent reads an FP8 latent cache (uint8, 3-D, contiguous), got {kv_cache.dtype} {tuple(kv_cache.shape)}")
    check(slots.dim() == 1 and not slots.is_floating_point(), "slots must be a 1-D integer tensor")
    cache, cache_r, cache_s = FP8LatentLayout(kv_lora, rope, dtype).views(kv_cache)
    slots = slots.contiguous()
    out = torch.empty(slots.shape[0], kv_lora + rope, dtype=dtype, device=kv_cache.device)
    block_t = 64 if interpreted(kv_cache) else 16  # the interpreter pays per program: few, wide ones
    if slots.shape[0]:
        _gather_kernel[(triton.cdiv(slots.shape[0], block_t),)](
            cache, cache_r, cache_s, slots, out, slots.shape[0], cache.stride(0), cache.stride(1), cache_r.stride(0),
            cache_r.stride(1), cache_s.stride(0), out.stride(0), kv_cache.shape[1], LORA=kv_lora, ROPE=rope,
            BLOCK_T=block_t, BLOCK_C=pow2(kv_lora), BLOCK_R=pow2(rope))
    return out
