"""The FP8 latent cache (`--kv-cache-dtype fp8`): MLA's [c_kv | k_pe] in a little over half the bytes.

A uint8 cache [blocks, page, token_bytes] holds each block (page) as three contiguous sections, not as
token rows:
    [c_kv float8_e4m3fn [page, kv_lora] | k_pe in the activation dtype [page, rope] | scale float32 [page]]
For V3 in bf16: 512 + 128 + 4 = 644 bytes a token against 1152, 56 %. A token's c_kv is 512 aligned bytes
(16-byte loads with no field boundary inside), the k_pe rows and the scales of a tile are each one
contiguous run: a reader's loads are as wide as the bf16 cache's. Sections start 16-byte aligned when
kv_lora is a multiple of 16; blocks do when the page holds a multiple of 4 tokens.

- One scale per token, not per block: decode writes one token at a time, and a block scale fixed by its
  first tokens would clip later, larger ones (or force re-quantizing the block on the device); a
  token's own amax also keeps an outlier token from coarsening its neighbours. 4 bytes in 644.
- k_pe stays in the activation dtype: it is 64 of 576 values (a fifth of the bf16 row's bytes would
  shrink by 64), and it carries position through the rotation, where e4m3's 3 mantissa bits would blur
  the phase differences that tell near from far tokens apart.
- c_kv is the normalized latent (kv_a_layernorm's output), so its per-token range is narrow and e4m3
  with a per-token scale keeps ~2 significant digits of each value.

The cache writer quantizes (`engine.kernels.latent_cache`), the decode kernel dequantizes in its loads,
the fast prefill path gathers through `latent_cache.gather_latent` (the same bits as `latent_rows`, one
launch), and every other reader goes through `dequantized` / `latent_rows`. A uint8 latent cache is an FP8 one:
the readers tell the layout from the cache's dtype, kv_lora from the queries and the rope dtype from the
activations. The pool, the prefix cache and the KV transfer move whole blocks as bytes, whatever is
inside them.
"""

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value
MIN_SCALE = 1e-12  # an all-zero c_kv (warm-up rows) still gets a finite scale


@dataclass(frozen=True)
class FP8LatentLayout:
    kv_lora: int
    rope: int
    rope_dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.kv_lora % 16 or self.rope * self.rope_elem % 4:
            raise ValueError(f"the FP8 latent cache needs kv_lora_rank a multiple of 16 and rope bytes of 4, got "
                             f"{self.kv_lora} and {self.rope} x {self.rope_elem}")

    @property
    def rope_elem(self) -> int:
        return torch.empty((), dtype=self.rope_dtype).element_size()

    @property
    def token_bytes(self) -> int:
        """A token's share of a block: its c_kv, k_pe and scale (the cache's last dimension)."""
        return self.kv_lora + self.rope * self.rope_elem + 4

    def views(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A uint8 cache [..., page, token_bytes] (pages contiguous) as (c_kv float8 [..., page, kv_lora],
        k_pe [..., page, rope], scale float32 [..., page]), views of the same memory."""
        if cache.dtype != torch.uint8 or cache.shape[-1] != self.token_bytes:
            raise ValueError(f"an FP8 latent cache is uint8 pages of {self.token_bytes} bytes a token, got "
                             f"{cache.dtype} with {cache.shape[-1]}")
        if cache.stride(-1) != 1 or cache.stride(-2) != self.token_bytes:
            raise ValueError("an FP8 latent cache's pages must be contiguous")
        page = cache.shape[-2]
        flat = cache.flatten(-2)  # [..., page * token_bytes]: one block's bytes
        c_end = page * self.kv_lora
        r_end = c_end + page * self.rope * self.rope_elem
        c_kv = flat[..., :c_end].view(FP8).unflatten(-1, (page, self.kv_lora))
        k_pe = flat[..., c_end:r_end].view(self.rope_dtype).unflatten(-1, (page, self.rope))
        scale = flat[..., r_end:].view(torch.float32)
        return c_kv, k_pe, scale

    def _quantized(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """latent [..., kv_lora + rope] -> (c_kv float8, k_pe, scale). The kernel writer computes the same:
        scale = amax(|c_kv|) / 448 in float32, c_kv / scale rounded to nearest."""
        c = latent[..., : self.kv_lora].float()
        s = (c.abs().amax(-1) / FP8_MAX).clamp_min(MIN_SCALE)
        c_kv = (c / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return c_kv, latent[..., self.kv_lora :].to(self.rope_dtype), s

    def quantize(self, latent: torch.Tensor) -> torch.Tensor:
        """latent pages [..., page, kv_lora + rope] (c_kv | k_pe) -> cache pages [..., page, token_bytes] uint8."""
        pages = torch.zeros(*latent.shape[:-1], self.token_bytes, dtype=torch.uint8, device=latent.device)
        for view, part in zip(self.views(pages), self._quantized(latent)):
            view.copy_(part)
        return pages

    def dequantize(self, pages: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """pages [..., page, token_bytes] uint8 -> latent [..., page, kv_lora + rope] in `dtype` (default the
        rope dtype)."""
        c_kv, k_pe, scale = self.views(pages)
        return torch.cat([c_kv.float() * scale[..., None], k_pe.float()], -1).to(dtype or self.rope_dtype)

    def write(self, cache: torch.Tensor, slots: torch.Tensor, latent: torch.Tensor) -> None:
        """latent [T, kv_lora + rope] -> the cache's flat slots [T] (block * page + offset), quantized."""
        blk, tok = slots // cache.shape[-2], slots % cache.shape[-2]
        for view, part in zip(self.views(cache), self._quantized(latent)):
            view[blk, tok] = part

    def rows(self, cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The latents at flat slots [T] of a cache [blocks, page, token_bytes] -> [T, kv_lora + rope]."""
        blk, tok = slots // cache.shape[-2], slots % cache.shape[-2]
        c_kv, k_pe, scale = (v[blk, tok] for v in self.views(cache))
        return torch.cat([c_kv.float() * scale[..., None], k_pe.float()], -1).to(dtype or self.rope_dtype)


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.uint8


def dequantized(pages: torch.Tensor, kv_lora: int, rope: int, dtype: torch.dtype) -> torch.Tensor:
    """Latent pages [..., page, width] from any cache in `dtype`: the FP8 ones decoded, the others cast (a
    bf16 cache under float32 activations) or as they are."""
    if not is_fp8(pages):
        return pages.to(dtype)
    return FP8LatentLayout(kv_lora, rope, dtype).dequantize(pages, dtype)


def latent_rows(cache: torch.Tensor, slots: torch.Tensor, kv_lora: int, rope: int, dtype: torch.dtype) -> torch.Tensor:
    """The latents [T, kv_lora + rope] at flat slots [T] of any latent cache [blocks, page, width], in `dtype`."""
    if not is_fp8(cache):
        return cache.view(-1, cache.shape[-1])[slots].to(dtype)
    return FP8LatentLayout(kv_lora, rope, dtype).rows(cache, slots, dtype)
