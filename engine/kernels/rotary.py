"""DeepSeek's interleaved rotary embedding (pairs (x0, x1), (x2, x3), ... share a frequency): the
in-kernel rotation of a token's query heads (used by `latent_cache.write_latent_`, which rotates the
shared rope key and the queries in the same launch as the cache write), and its PyTorch reference."""

import torch
import triton
import triton.language as tl


@triton.jit
def rotate_pair(x1, x2, cos, sin):
    """A rope pair's halves (x0, x1) -> rotated, computed in float32 and rounded to the inputs' dtype."""
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    return (a * cos - b * sin).to(x1.dtype), (b * cos + a * sin).to(x1.dtype)


@triton.jit
def rotate_heads_(Q, stride_qh, num_heads, cos, sin, offs_d, mask_d, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                  SPLIT_PAIRS: tl.constexpr):
    """One token's query heads in place, [BLOCK_H, HALF] pairs at a time; Q points at its head 0.

    SPLIT_PAIRS (HALF a power of two): each head's rope part loaded and stored whole (vectorized), its
    pairs split and joined in registers. Loading the even and odd elements apart and storing them apart
    (the other path) makes every store a 2-byte one at a 4-byte stride, which measured 14x slower on an
    H200 for a prefill's rows (benchmarks/latent_write.py)."""
    offs_h = tl.arange(0, BLOCK_H)
    for h0 in range(0, num_heads, BLOCK_H):
        if SPLIT_PAIRS:
            offs_r = tl.arange(0, 2 * BLOCK_D)
            mask = ((h0 + offs_h) < num_heads)[:, None]
            base = Q + (h0 + offs_h)[:, None] * stride_qh + offs_r[None, :]
            x = tl.load(base, mask=mask, other=0.0)
            x1, x2 = tl.split(tl.reshape(x, [BLOCK_H, BLOCK_D, 2]))
            y1, y2 = rotate_pair(x1, x2, cos[None, :], sin[None, :])
            tl.store(base, tl.reshape(tl.join(y1, y2), [BLOCK_H, 2 * BLOCK_D]), mask=mask)
        else:
            mask = ((h0 + offs_h) < num_heads)[:, None] & mask_d[None, :]
            base = Q + (h0 + offs_h)[:, None] * stride_qh + 2 * offs_d[None, :]
            y1, y2 = rotate_pair(tl.load(base, mask=mask, other=0.0), tl.load(base + 1, mask=mask, other=0.0),
                                 cos[None, :], sin[None, :])
            tl.store(base, y1, mask=mask)
            tl.store(base + 1, y2, mask=mask)


def reference_rope(x: torch.Tensor, positions: torch.Tensor, cos_cache, sin_cache) -> torch.Tensor:
    """x: [T, ..., D] -> rotated copy, computed in float32."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos_cache.shape[-1],)
    cos, sin = cos_cache[positions].view(shape), sin_cache[positions].view(shape)
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)
