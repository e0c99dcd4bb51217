"""DeepSeek's interleaved rotary embedding (pairs (x0, x1), (x2, x3), ... share a frequency), applied
in place to the query's rope part and the shared rope key in one launch."""

import torch
import triton
import triton.language as tl

from engine.kernels._util import check, check_last_contiguous, pow2


@triton.jit
def rotate_heads_(Q, stride_qh, num_heads, cos, sin, offs_d, mask_d, BLOCK_H: tl.constexpr):
    """One token's query heads in place, [BLOCK_H, HALF] pairs at a time; Q points at its head 0."""
    offs_h = tl.arange(0, BLOCK_H)
    for h0 in range(0, num_heads, BLOCK_H):
        mask = ((h0 + offs_h) < num_heads)[:, None] & mask_d[None, :]
        base = Q + (h0 + offs_h)[:, None] * stride_qh + 2 * offs_d[None, :]
        x1 = tl.load(base, mask=mask, other=0.0)
        x2 = tl.load(base + 1, mask=mask, other=0.0)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(base, (a * cos[None, :] - b * sin[None, :]).to(x1.dtype), mask=mask)
        tl.store(base + 1, (b * cos[None, :] + a * sin[None, :]).to(x1.dtype), mask=mask)


@triton.jit
def _rope_kernel(Q, K, Pos, Cos, Sin, stride_qt, stride_qh, stride_kt, stride_cos, num_heads,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    pos = tl.load(Pos + t)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HALF
    cos = tl.load(Cos + pos * stride_cos + offs_d, mask=mask_d, other=0.0)
    sin = tl.load(Sin + pos * stride_cos + offs_d, mask=mask_d, other=0.0)
    rotate_heads_(Q + t * stride_qt, stride_qh, num_heads, cos, sin, offs_d, mask_d, BLOCK_H)
    kbase = K + t * stride_kt + 2 * offs_d
    k1 = tl.load(kbase, mask=mask_d, other=0.0)
    k2 = tl.load(kbase + 1, mask=mask_d, other=0.0)
    a, b = k1.to(tl.float32), k2.to(tl.float32)
    tl.store(kbase, (a * cos - b * sin).to(k1.dtype), mask=mask_d)
    tl.store(kbase + 1, (b * cos + a * sin).to(k1.dtype), mask=mask_d)


def apply_rope_(q_pe: torch.Tensor, k_pe: torch.Tensor, positions: torch.Tensor,
                cos_cache: torch.Tensor, sin_cache: torch.Tensor) -> None:
    """In place. q_pe: [T, H, D] (a strided view is fine), k_pe: [T, D], positions: [T] int,
    cos/sin_cache: [max_position, D // 2] float32."""
    check(q_pe.dim() == 3 and k_pe.dim() == 2, "q_pe must be [T, H, D] and k_pe [T, D]")
    num_tokens, num_heads, dim = q_pe.shape
    check(k_pe.shape == (num_tokens, dim) and positions.shape == (num_tokens,),
          f"k_pe {tuple(k_pe.shape)} / positions {tuple(positions.shape)} do not match q_pe {tuple(q_pe.shape)}")
    check(dim % 2 == 0 and cos_cache.shape[-1] == dim // 2, f"rope dim {dim} does not match the cache")
    check(q_pe.dtype == k_pe.dtype, "q_pe and k_pe must share a dtype")
    check(cos_cache.dtype == torch.float32 and cos_cache.is_contiguous() and sin_cache.is_contiguous(),
          "cos/sin caches must be contiguous float32")
    check_last_contiguous("q_pe", q_pe)
    check_last_contiguous("k_pe", k_pe)
    if num_tokens:
        _rope_kernel[(num_tokens,)](q_pe, k_pe, positions, cos_cache, sin_cache, q_pe.stride(0), q_pe.stride(1),
                                    k_pe.stride(0), cos_cache.stride(0), num_heads, HALF=dim // 2,
                                    BLOCK_H=min(16, pow2(num_heads, 1)), BLOCK_D=pow2(dim // 2, 1))


def reference_rope(x: torch.Tensor, positions: torch.Tensor, cos_cache, sin_cache) -> torch.Tensor:
    """x: [T, ..., D] -> rotated copy, computed in float32."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos_cache.shape[-1],)
    cos, sin = cos_cache[positions].view(shape), sin_cache[positions].view(shape)
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)
