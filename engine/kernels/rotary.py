"""DeepSeek's interleaved rotary embedding (pairs (x0, x1), (x2, x3), ... share a frequency): the
in-kernel rotation of a token's query heads (used by `latent_cache.write_latent_`, which rotates the
shared rope key and the queries in the same launch as the cache write), and its PyTorch reference."""

import torch
import triton
import triton.language as tl


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


def reference_rope(x: torch.Tensor, positions: torch.Tensor, cos_cache, sin_cache) -> torch.Tensor:
    """x: [T, ..., D] -> rotated copy, computed in float32."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos_cache.shape[-1],)
    cos, sin = cos_cache[positions].view(shape), sin_cache[positions].view(shape)
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)
