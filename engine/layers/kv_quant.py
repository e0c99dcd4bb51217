"""Block-quantized cache rows (DeepSeek-V4.1): the model was trained with its caches quantized, so the
quantization is part of its numerics, not a storage choice.

Three codecs, each over blocks of the last dimension:
  - window KV: FP8 e4m3, one ue8m0 (power-of-two) scale per 32 values, amax floor 1e-4;
  - compressed KV: FP4 e2m1, one e4m3 scale per 16 values, amax floor 6 * 2^-9;
  - indexer queries and keys: FP4 e2m1, one ue8m0 scale per 32 values, amax floor 6 * 2^-126.
A codec whose block does not divide the row is skipped (the values pass through), as the reference does.

`fake` is quantize-then-dequantize in float32; `encode` packs a row into bytes (FP8: a code per value;
FP4: two codes a byte, the even index in the low nibble; then the scales: ue8m0 as its exponent byte,
e4m3 as its bits) and `decode` unpacks it to the same values `fake` gives.
"""

from dataclasses import dataclass

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
# e2m1 magnitudes by code (bit 3 is the sign)
FP4_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# midpoints between neighbouring magnitudes; a tie goes to the even code (round to nearest even): up
# where the upper neighbour's code is even
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_UP = (False, True, False, True, False, True, False)


def pow2_ceil(t: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2 t) for float32 t > 0, from the bits (exponent, plus one if any mantissa bit is set)."""
    bits = t.float().contiguous().view(torch.int32)
    k = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return torch.exp2(k.float())


def e2m1_codes(q: torch.Tensor) -> torch.Tensor:
    """float32 values already within [-6, 6] -> e2m1 codes (uint8, sign in bit 3), nearest, ties to even."""
    mag = q.abs().unsqueeze(-1)
    mids = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=q.device)
    up = torch.tensor(_TIE_UP, device=q.device)
    codes = ((mag > mids) | ((mag == mids) & up)).sum(-1).to(torch.uint8)
    return codes | (torch.signbit(q).to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    grid = torch.tensor(FP4_GRID, dtype=torch.float32, device=codes.device)
    lut = torch.cat([grid, -grid])
    return lut[codes.long()]


@dataclass(frozen=True)
class BlockCodec:
    fmt: str  # "fp8" | "fp4"
    block: int
    scale: str  # "ue8m0" | "e4m3"
    floor: float  # the least amax a block's scale is taken from

    def applies(self, dim: int) -> bool:
        return dim % self.block == 0

    def row_bytes(self, dim: int) -> int:
        codes = dim if self.fmt == "fp8" else dim // 2
        return codes + dim // self.block

    def _scales(self, blocks: torch.Tensor) -> torch.Tensor:
        amax = blocks.abs().amax(-1).clamp_min(self.floor)
        qmax = FP8_MAX if self.fmt == "fp8" else FP4_MAX
        if self.scale == "e4m3":
            return (amax / qmax).to(torch.float8_e4m3fn).float()
        return pow2_ceil(amax * (1.0 / qmax))

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., dim] -> (codes [..., dim / block, block] uint8 (fp8: the e4m3 bits), scales [..., dim / block])."""
        blocks = x.float().unflatten(-1, (-1, self.block))
        scale = self._scales(blocks)
        qmax = FP8_MAX if self.fmt == "fp8" else FP4_MAX
        q = (blocks / scale.unsqueeze(-1)).clamp(-qmax, qmax)
        codes = q.to(torch.float8_e4m3fn).view(torch.uint8) if self.fmt == "fp8" else e2m1_codes(q)
        return codes, scale

    def _values(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        v = codes.view(torch.float8_e4m3fn).float() if self.fmt == "fp8" else e2m1_values(codes)
        return (v * scale.unsqueeze(-1)).flatten(-2)

    def fake(self, x: torch.Tensor) -> torch.Tensor:
        """Quantize and dequantize (the reference's fake quantization); rows it cannot block pass through."""
        if not self.applies(x.shape[-1]):
            return x
        return self._values(*self._quantize(x)).to(x.dtype)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> rows [..., row_bytes(dim)] uint8."""
        codes, scale = self._quantize(x)
        codes = codes.flatten(-2)
        if self.fmt == "fp4":
            codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
        if self.scale == "e4m3":
            sbytes = scale.to(torch.float8_e4m3fn).view(torch.uint8)
        else:  # a power of two: its biased exponent
            sbytes = ((scale.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
        return torch.cat([codes, sbytes], -1)

    def decode(self, rows: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
        """rows [..., row_bytes(dim)] uint8 -> values [..., dim] (what `fake` gives)."""
        n = dim if self.fmt == "fp8" else dim // 2
        codes, sbytes = rows[..., :n], rows[..., n:]
        if self.fmt == "fp4":
            codes = torch.stack([codes & 0xF, codes >> 4], -1).flatten(-2)
        if self.scale == "e4m3":
            scale = sbytes.contiguous().view(torch.float8_e4m3fn).float()
        else:
            scale = (sbytes.to(torch.int32) << 23).view(torch.float32)
        return self._values(codes.unflatten(-1, (-1, self.block)), scale).to(dtype)


WINDOW_FP8 = BlockCodec("fp8", 32, "ue8m0", 1e-4)
COMPRESSED_FP4 = BlockCodec("fp4", 16, "e4m3", 6.0 * 2.0**-9)
INDEXER_FP4 = BlockCodec("fp4", 32, "ue8m0", 6.0 * 2.0**-126)
