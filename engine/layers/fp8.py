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
