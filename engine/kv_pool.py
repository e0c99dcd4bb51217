"""The KV cache's memory: one tensor per (layer, kind), each described by a `KVCacheSpec`.

Pages are in raw-token coordinates for every kind, so one block table serves them all: block `i`
covers tokens [i * block_size, (i + 1) * block_size) in each, and a kind compressed r times holds
block_size / r rows of it. V3's MLA has one kind (`latent`); V4's sliding-window ring, compressed
caches, indexer keys and compressor state are further specs, not another pool. The prefix cache and
the KV transfer move blocks as the specs lay them out (`block_bytes`, `caches`).

The pool holds one block past `num_blocks`: the scratch block that warm-up steps and the padding rows
of CUDA-graph steps write into, so they never touch a sequence's block.
"""

from dataclasses import dataclass

import torch

KINDS = ("latent", "window", "compressed", "indexer_keys", "compressor_state")


@dataclass(frozen=True)
class KVCacheSpec:
    kind: str  # one of KINDS
    layer: int
    row_width: int  # values per row
    dtype: torch.dtype
    compress_ratio: int = 1  # raw tokens per row
    window: int | None = None  # rows beyond this many tokens back may be evicted (sliding window)
    has_block_state: bool = False  # one row per block: state beyond the rows (a compressor's open window)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown KV cache kind {self.kind!r}; known: {', '.join(KINDS)}")

    def rows_per_block(self, block_size: int) -> int:
        if self.has_block_state:
            return 1  # the state at the block's end (or at its last token written, while it fills)
        if block_size % self.compress_ratio:
            raise ValueError(f"block_size {block_size} is not a multiple of the {self.kind} cache's "
                             f"compression ratio {self.compress_ratio}")
        return block_size // self.compress_ratio

    def block_bytes(self, block_size: int) -> int:
        return self.rows_per_block(block_size) * self.row_width * torch.empty((), dtype=self.dtype).element_size()


def block_bytes(specs: list[KVCacheSpec], block_size: int) -> int:
    """Bytes one block takes over every layer and kind (on one rank)."""
    return sum(s.block_bytes(block_size) for s in specs)


class KVPool:
    """Allocates [num_blocks + 1, rows_per_block, row_width] per spec (the last block is scratch)."""

    def __init__(self, specs: list[KVCacheSpec], num_blocks: int, block_size: int, device: torch.device):
        self.specs, self.num_blocks, self.block_size = list(specs), num_blocks, block_size
        self.scratch_block = num_blocks
        self._caches = {
            (s.layer, s.kind): torch.zeros(num_blocks + 1, s.rows_per_block(block_size), s.row_width, dtype=s.dtype,
                                           device=device)
            for s in self.specs
        }

    def cache(self, layer: int, kind: str) -> torch.Tensor:
        return self._caches[(layer, kind)]

    @property
    def caches(self) -> list[torch.Tensor]:
        """Every tensor, in spec order."""
        return [self._caches[(s.layer, s.kind)] for s in self.specs]

    @property
    def block_bytes(self) -> int:
        return block_bytes(self.specs, self.block_size)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size
