"""FP8 e4m3 weights with one float32 scale per [128, 128] block, as DeepSeek-V3/R1 ship them.

The checkpoint stores `weight` (float8_e4m3fn) and `weight_scale_inv` [ceil(out/128), ceil(in/128)]:
the real weight is weight * weight_scale_inv, block by block.
"""

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _expand(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    return scale.repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, : shape[1]]


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """[out, in] fp8 + [ceil(out/b0), ceil(in/b1)] scales -> float32 [out, in]."""
    expected = (-(-weight.shape[0] // block[0]), -(-weight.shape[1] // block[1]))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {expected} for weight {tuple(weight.shape)}")
    return weight.float() * _expand(scale_inv.float(), weight.shape, block)


def quantize_fp8_block(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] -> (fp8 weight, float32 scale_inv), each block scaled so its max maps to FP8_MAX."""
    out_f, in_f = weight.shape
    rows, cols = -(-out_f // block[0]), -(-in_f // block[1])
    padded = torch.zeros(rows * block[0], cols * block[1], dtype=torch.float32, device=weight.device)
    padded[:out_f, :in_f] = weight.float()
    amax = padded.view(rows, block[0], cols, block[1]).abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / FP8_MAX
    q = (weight.float() / _expand(scale_inv, weight.shape, block)).to(torch.float8_e4m3fn)
    return q, scale_inv


def quantize_activations_reference(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., K] -> float32 x after FP8 per-token-group quantization (scale = group amax / FP8_MAX) and
    back: what the FP8 kernels feed their GEMMs, emulated in PyTorch."""
    k = x.shape[-1]
    flat = x.reshape(-1, k).float()
    groups = torch.nn.functional.pad(flat, (0, (-k) % group)).view(flat.shape[0], -1, group)
    scale = groups.abs().amax(-1, keepdim=True).clamp(min=1e-10) / FP8_MAX
    return ((groups / scale).to(torch.float8_e4m3fn).float() * scale).view(flat.shape[0], -1)[:, :k].view(x.shape)


# OCP MXFP4: e2m1 codes (sign bit 3), two per byte (the low nibble holds the even index), and one
# power-of-two scale (E8M0) per 32 consecutive values of a row, as DeepSeek-V4 ships its routed experts
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MXFP4_GROUP = 32


def dequantize_mxfp4(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes [out, in / 2] (int8 or uint8) + scale [out, in / 32] (E8M0 or float) -> float32 [out, in]."""
    out_f, half = codes.shape
    expected = (out_f, 2 * half // MXFP4_GROUP)
    if tuple(scale.shape) != expected:
        raise ValueError(f"MXFP4 scale has shape {tuple(scale.shape)}, expected {expected} for codes {tuple(codes.shape)}")
    b = codes.view(torch.uint8).to(torch.int32)
    nibbles = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)  # [out, in], even index first
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    values = table[nibbles & 0x7] * torch.where(nibbles & 0x8 != 0, -1.0, 1.0)
    return values * scale.float().repeat_interleave(MXFP4_GROUP, dim=1)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] -> (codes uint8 [out, in / 2], E8M0 scale [out, in / 32]): per group of 32 the
    smallest power of two that brings its amax within 6, each value rounded to the nearest e2m1 code."""
    out_f, in_f = weight.shape
    groups = weight.float().view(out_f, in_f // MXFP4_GROUP, MXFP4_GROUP)
    amax = groups.abs().amax(-1).clamp(min=2.0**-126)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 6.0)))
    scaled = (groups / scale[..., None]).view(out_f, in_f)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=weight.device)
    code = (scaled.abs()[..., None] - table).abs().argmin(-1) | torch.where(scaled < 0, 8, 0)
    codes = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)
    return codes, scale.to(torch.float8_e8m0fnu)
