"""Rotary position embedding with YaRN scaling, DeepSeek's interleaved-pair layout."""

import math

import torch
from torch import nn

from engine.config import RopeScaling


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_scale(head_dim: int, scaling: RopeScaling | None) -> float:
    """1/sqrt(d), times mscale^2 when YaRN's mscale_all_dim is set (DeepSeek-V2/V3)."""
    scale = head_dim**-0.5
    if scaling is not None and scaling.mscale_all_dim:
        m = _yarn_mscale(scaling.factor, scaling.mscale_all_dim)
        scale *= m * m
    return scale


def rope_inv_freq(dim: int, theta: float, scaling: RopeScaling | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim // 2] and the factor YaRN applies to cos/sin."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv_freq = 1.0 / pos_freqs
    if scaling is None:
        return inv_freq, 1.0
    f = scaling.factor
    if scaling.attention_factor is not None:
        attn_factor = float(scaling.attention_factor)
    elif scaling.mscale and scaling.mscale_all_dim:
        attn_factor = _yarn_mscale(f, scaling.mscale) / _yarn_mscale(f, scaling.mscale_all_dim)
    else:
        attn_factor = _yarn_mscale(f)

    def correction_dim(num_rotations: float) -> float:
        orig = scaling.original_max_position_embeddings
        return dim * math.log(orig / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency (high-frequency dims)
    inv_freq = (inv_freq / f) * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq, attn_factor


class RotaryEmbedding(nn.Module):
    """Applies rope to the trailing `dim` features; pairs (x0, x1), (x2, x3), ... share a frequency."""

    def __init__(self, dim: int, max_position: int, theta: float, scaling: RopeScaling | None):
        super().__init__()
        inv_freq, attn_factor = rope_inv_freq(dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # [max_position, dim // 2] each, in float32; cast to the activation dtype on use
        self.register_buffer("cos_cache", freqs.cos() * attn_factor, persistent=False)
        self.register_buffer("sin_cache", freqs.sin() * attn_factor, persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [T, ..., dim], positions: [T]."""
        cos = self.cos_cache[positions].to(x.dtype)
        sin = self.sin_cache[positions].to(x.dtype)
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
        cos, sin = cos.view(shape), sin.view(shape)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.flatten(-2)
