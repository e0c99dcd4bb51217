"""MLA's new-token bookkeeping in one launch: normalize the compressed KV, rotate the shared rope key and
the queries' rope parts, write the latent row [c_kv | k_pe] into its paged cache slot (into an FP8 cache's
block sections, c_kv quantized on the way).

The unfused path takes four launches per layer for this (kv_a_layernorm, rope, concatenation, cache
write), each moving a few kilobytes at decode: pure launch latency. Rounding follows the reference
layers: c_kv normalized in float32, rounded to the activation dtype, times the weight, rounded again;
rope in float32 on the activation-dtype inputs.
"""

import torch
import triton
import triton.language as tl

from engine.kernels._util import check, check_last_contiguous, interpreted, pdl, pow2, wait_for_inputs
from engine.kernels.rotary import rotate_heads_
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
def _latent_write_kernel(KV, NormW, Q, Pos, Cos, Sin, Cache, CacheR, CacheS, Slots, eps, stride_kv, stride_qt,
                         stride_qh, stride_cos, stride_cb, stride_ct, stride_rb, stride_rt, stride_sb, page, num_heads,
                         LORA: tl.constexpr, HALF: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_D: tl.constexpr, FP8: tl.constexpr, EXACT_CAST: tl.constexpr, PDL: tl.constexpr):
    t = tl.program_id(0)
    wait_for_inputs(PDL)
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
    kbase = KV + t * stride_kv + LORA + 2 * offs_d
    k1 = tl.load(kbase, mask=mask_d, other=0.0)
    k2 = tl.load(kbase + 1, mask=mask_d, other=0.0)
    ka, kb = k1.to(tl.float32), k2.to(tl.float32)
    out = CacheR.dtype.element_ty
    tl.store(rrow + 2 * offs_d, (ka * cos - kb * sin).to(k1.dtype).to(out), mask=mask_d)
    tl.store(rrow + 2 * offs_d + 1, (kb * cos + ka * sin).to(k1.dtype).to(out), mask=mask_d)
    rotate_heads_(Q + t * stride_qt, stride_qh, num_heads, cos, sin, offs_d, mask_d, BLOCK_H)

def write_latent_(kv_cache: torch.Tensor, kv: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                  q_pe: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """kv: [T, kv_lora + rope] (kv_a_proj_with_mqa's output) -> kv_cache rows at slot_mapping, as
    [RMSNorm(c_kv) | rope(k_pe)]; q_pe: [T, H, rope] (a strided view is fine) rotated in place.
    kv_cache: [blocks, block_size, kv_lora + rope], or an FP8 latent cache [blocks, block_size, token_bytes]
    uint8 (`engine.layers.fp8_latent`: c_kv quantized per token into its block's sections, k_pe in kv's
    dtype); cos/sin_cache:
    [max_position, rope // 2] float32."""
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
    if num_tokens:
        num_heads = q_pe.shape[1]
        on = pdl(kv)
        _latent_write_kernel[(num_tokens,)](
            kv, norm_weight, q_pe, positions, cos_cache, sin_cache, cache, cache_r, cache_s, slot_mapping, eps,
            kv.stride(0), q_pe.stride(0), q_pe.stride(1), cos_cache.stride(0), cache.stride(0), cache.stride(1),
            cache_r.stride(0), cache_r.stride(1), cache_s.stride(0), kv_cache.shape[1], num_heads, LORA=lora, HALF=rope // 2, BLOCK_C=pow2(lora), BLOCK_H=min(16, pow2(num_heads, 1)),
            BLOCK_D=pow2(rope // 2, 1), FP8=fp8, EXACT_CAST=interpreted(kv), PDL=on, launch_pdl=on)
