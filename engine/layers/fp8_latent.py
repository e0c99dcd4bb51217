"""The FP8 latent cache row (`--kv-cache-dtype fp8`): MLA's [c_kv | k_pe] in a little over half the bytes.

One token's row, as bytes of a uint8 cache [blocks, block_size, row_bytes]:
    [c_kv as float8_e4m3fn (kv_lora) | k_pe in the activation dtype (rope) | scale float32 | pad to 16]
For V3 in bf16: 512 + 128 + 4 (+ 12) = 656 bytes against 1152, 57 %.

- One scale per token, not per block: decode writes one token at a time, and a block scale fixed by its
  first tokens would clip later, larger ones (or force re-quantizing the block on the device); a
  token's own amax also keeps an outlier token from coarsening its neighbours. 4 bytes in 656.
- k_pe stays in the activation dtype: it is 64 of 576 values (a fifth of the bf16 row's bytes would
  shrink by 64), and it carries position through the rotation, where e4m3's 3 mantissa bits would blur
  the phase differences that tell near from far tokens apart.
- c_kv is the normalized latent (kv_a_layernorm's output), so its per-token range is narrow and e4m3
  with a per-token scale keeps ~2 significant digits of each value.

The cache writer quantizes (`engine.kernels.latent_cache`), the decode kernel dequantizes in its loads,
and every other reader goes through `dequantize`. A uint8 latent cache is an FP8 one: the readers tell
the layout from the cache's dtype, kv_lora from the queries and the rope dtype from the activations.
"""

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value
MIN_SCALE = 1e-12  # an all-zero c_kv (warm-up rows) still gets a finite scale


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass(frozen=True)
class FP8LatentLayout:
    kv_lora: int
    rope: int
    rope_dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.kv_lora % self.rope_elem:
            raise ValueError(f"kv_lora_rank {self.kv_lora} must be a multiple of {self.rope_elem} for the FP8 row")

    @property
    def rope_elem(self) -> int:
        return torch.empty((), dtype=self.rope_dtype).element_size()

    @property
    def scale_offset(self) -> int:
        """Byte offset of the float32 scale (k_pe's bytes start at kv_lora)."""
        return _round_up(self.kv_lora + self.rope * self.rope_elem, 4)

    @property
    def row_bytes(self) -> int:
        return _round_up(self.scale_offset + 4, 16)  # 16-byte aligned rows: wide loads

    def views(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A uint8 cache [..., row_bytes] as (c_kv float8 [..., kv_lora], k_pe [..., rope], scale [...]), views
        of the same memory."""
        if cache.dtype != torch.uint8 or cache.shape[-1] != self.row_bytes:
            raise ValueError(f"an FP8 latent cache is uint8 rows of {self.row_bytes} bytes, got "
                             f"{cache.dtype} rows of {cache.shape[-1]}")
        c_kv = cache.view(FP8)[..., : self.kv_lora]
        r0 = self.kv_lora // self.rope_elem
        k_pe = cache.view(self.rope_dtype)[..., r0 : r0 + self.rope]
        scale = cache.view(torch.float32)[..., self.scale_offset // 4]
        return c_kv, k_pe, scale

    def quantize(self, latent: torch.Tensor) -> torch.Tensor:
        """latent [..., kv_lora + rope] (c_kv | k_pe) -> rows [..., row_bytes] uint8. The kernel writer
        computes the same: scale = amax(|c_kv|) / 448 in float32, c_kv / scale rounded to nearest."""
        rows = torch.zeros(*latent.shape[:-1], self.row_bytes, dtype=torch.uint8, device=latent.device)
        c_kv, k_pe, scale = self.views(rows)
        c = latent[..., : self.kv_lora].float()
        s = (c.abs().amax(-1) / FP8_MAX).clamp_min(MIN_SCALE)
        c_kv.copy_((c / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8))
        k_pe.copy_(latent[..., self.kv_lora :].to(self.rope_dtype))
        scale.copy_(s)
        return rows

    def dequantize(self, rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """rows [..., row_bytes] uint8 -> latent [..., kv_lora + rope] in `dtype` (default the rope dtype)."""
        c_kv, k_pe, scale = self.views(rows)
        c = c_kv.float() * scale[..., None]
        return torch.cat([c, k_pe.float()], -1).to(dtype or self.rope_dtype)


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.uint8


def dequantized(cache_rows: torch.Tensor, kv_lora: int, rope: int, dtype: torch.dtype) -> torch.Tensor:
    """Latent rows from any cache in `dtype`: the FP8 ones decoded, the others cast (a bf16 cache under
    float32 activations) or as they are."""
    if not is_fp8(cache_rows):
        return cache_rows.to(dtype)
    return FP8LatentLayout(kv_lora, rope, dtype).dequantize(cache_rows, dtype)
