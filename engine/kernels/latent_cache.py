"""MLA's new-token bookkeeping in one launch: normalize the compressed KV, rotate the shared rope key and
the queries' rope parts, write the latent row [c_kv | k_pe] into its paged cache slot.

The unfused path takes four launches per layer for this (kv_a_layernorm, rope, concatenation, cache
write), each moving a few kilobytes at decode: pure launch latency. Rounding follows the reference
layers: c_kv normalized in float32, rounded to the activation dtype, times the weight, rounded again;
rope in float32 on the activation-dtype inputs.
"""

import torch
import triton
import triton.language as tl

from engine.kernels._util import check, check_last_contiguous, pow2
from engine.kernels.rotary import rotate_heads_


@triton.jit
def _latent_write_kernel(KV, NormW, Q, Pos, Cos, Sin, Cache, Slots, eps, stride_kv, stride_qt, stride_qh,
                         stride_cos, stride_cache, num_heads, LORA: tl.constexpr, HALF: tl.constexpr,
                         BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(Slots + t).to(tl.int64)
    row = Cache + slot * stride_cache
    # c_kv: RMSNorm as layers.norm.RMSNorm rounds it
    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < LORA
    c = tl.load(KV + t * stride_kv + offs_c, mask=mask_c, other=0.0)
    cf = c.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(cf * cf, axis=0) / LORA + eps)
    normed = (cf * rstd).to(c.dtype).to(tl.float32)
    w = tl.load(NormW + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    tl.store(row + offs_c, (w * normed).to(c.dtype).to(Cache.dtype.element_ty), mask=mask_c)
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
    out = Cache.dtype.element_ty
    tl.store(row + LORA + 2 * offs_d, (ka * cos - kb * sin).to(k1.dtype).to(out), mask=mask_d)
    tl.store(row + LORA + 2 * offs_d + 1, (kb * cos + ka * sin).to(k1.dtype).to(out), mask=mask_d)
    rotate_heads_(Q + t * stride_qt, stride_qh, num_heads, cos, sin, offs_d, mask_d, BLOCK_H)

def write_latent_(kv_cache: torch.Tensor, kv: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                  q_pe: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """kv: [T, kv_lora + rope] (kv_a_proj_with_mqa's output) -> kv_cache rows at slot_mapping, as
    [RMSNorm(c_kv) | rope(k_pe)]; q_pe: [T, H, rope] (a strided view is fine) rotated in place.
    kv_cache: [blocks, block_size, kv_lora + rope]; cos/sin_cache: [max_position, rope // 2] float32."""
    check(kv.dim() == 2 and q_pe.dim() == 3, "kv must be [T, kv_lora + rope] and q_pe [T, H, rope]")
    num_tokens, width = kv.shape
    rope = q_pe.shape[2]
    lora = width - rope
    check(norm_weight.shape == (lora,) and norm_weight.dtype == kv.dtype,
          f"norm weight {tuple(norm_weight.shape)} {norm_weight.dtype} does not match c_kv ({lora}, {kv.dtype})")
    check(kv_cache.dim() == 3 and kv_cache.shape[-1] == width and kv_cache.is_contiguous(),
          f"cache rows must be {width} wide and contiguous, got {tuple(kv_cache.shape)}")
    check(q_pe.shape[0] == num_tokens and positions.shape == (num_tokens,) and slot_mapping.shape == (num_tokens,),
          "q_pe, positions and slot_mapping need one row per token")
    check(q_pe.dtype == kv.dtype and rope % 2 == 0 and cos_cache.shape[-1] == rope // 2
          and cos_cache.dtype == torch.float32 and cos_cache.is_contiguous() and sin_cache.is_contiguous(),
          "rope parts and cos/sin caches do not match")
    check_last_contiguous("kv", kv)
    check_last_contiguous("q_pe", q_pe)
    if num_tokens:
        num_heads = q_pe.shape[1]
        _latent_write_kernel[(num_tokens,)](
            kv, norm_weight, q_pe, positions, cos_cache, sin_cache, kv_cache, slot_mapping, eps, kv.stride(0),
            q_pe.stride(0), q_pe.stride(1), cos_cache.stride(0), kv_cache.stride(1), num_heads, LORA=lora,
            HALF=rope // 2, BLOCK_C=pow2(lora), BLOCK_H=min(16, pow2(num_heads, 1)), BLOCK_D=pow2(rope // 2, 1))
