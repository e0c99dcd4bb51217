"""The KV cache's memory: one tensor per (layer, kind), each described by a `KVCacheSpec`.

Pages are in raw-token coordinates for every kind, so one block table serves them all: block `i`
covers tokens [i * block_size, (i + 1) * block_size) in each, and a kind compressed r times holds
block_size / r rows of it. V3's MLA has one kind (`latent`); V4's compressed caches, indexer keys
and compressor state are further specs of the same blocks. The prefix cache and the KV transfer move
blocks as the specs lay them out (`block_bytes`, `caches`).

A kind with a `window` (V4's sliding window: a row per token, read only for the last `window` tokens)
may live in pages of its own, fewer than the blocks: `window_page[block]` (on the device) names the
page holding a block's window rows, the scratch page where the block has none (the block manager
gives pages to the blocks a sequence's window covers and to those a step writes, and takes them back
behind the window). Block tables, plans and graphs stay one table of blocks; whatever addresses the
window looks its page up through `window_page` (`window_slots`). Without `num_window_pages` each block
has its own page (the identity), as when every kind lived in the blocks.

The pool holds one block (and one page) past `num_blocks`: the scratch block that warm-up steps and the
padding rows of CUDA-graph steps write into, so they never touch a sequence's block.
"""

from dataclasses import dataclass

import torch

from engine.copies import to_device

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


def block_bytes(specs: list[KVCacheSpec], block_size: int, windowed: bool | None = None) -> int:
    """Bytes one block takes over every layer and kind (on one rank); windowed True: the window kinds'
    only (a window page), False: every other kind's (a block whose window lives in pages)."""
    return sum(s.block_bytes(block_size) for s in specs if windowed is None or (s.window is not None) == windowed)


def window_of(specs: list[KVCacheSpec]) -> int | None:
    """The longest sliding window among the specs (tokens), None without a window kind."""
    windows = [s.window for s in specs if s.window is not None]
    return max(windows) if windows else None


class KVPool:
    """Allocates [num_blocks + 1, rows_per_block, row_width] per spec (the last block is scratch); the window
    kinds [num_window_pages + 1, block_size, row_width] (the last page is scratch) where they have pages of
    their own."""

    def __init__(self, specs: list[KVCacheSpec], num_blocks: int, block_size: int, device: torch.device,
                 num_window_pages: int | None = None):
        self.specs, self.num_blocks, self.block_size = list(specs), num_blocks, block_size
        self.scratch_block = num_blocks
        # None: a page per block, block i's page i
        self.num_window_pages = num_window_pages
        pages = num_blocks if num_window_pages is None else num_window_pages
        self.scratch_page = pages
        self._caches = {
            (s.layer, s.kind): torch.zeros((pages if s.window is not None else num_blocks) + 1,
                                           s.rows_per_block(block_size), s.row_width, dtype=s.dtype, device=device)
            for s in self.specs
        }
        # block -> its window page [num_blocks + 1] int32, updated in place by the plans' deltas (graphs hold it)
        if num_window_pages is None:
            self.window_page = torch.arange(num_blocks + 1, dtype=torch.int32, device=device)
        else:
            self.window_page = torch.full((num_blocks + 1,), self.scratch_page, dtype=torch.int32, device=device)

    @property
    def has_window_pages(self) -> bool:
        """Whether the window kinds live in pages of their own (fewer than the blocks)."""
        return self.num_window_pages is not None

    def map_window(self, deltas: list[tuple[int, int]]) -> None:
        """(block, page) pairs from a plan (the scratch page: the block has none now); one block each."""
        if deltas:
            dev = self.window_page.device
            self.window_page.index_copy_(0, to_device([b for b, _ in deltas], torch.long, dev),
                                         to_device([p for _, p in deltas], torch.int32, dev))

    def is_window(self, i: int) -> bool:
        """Whether `caches[i]` is paged by window page rather than by block."""
        return self.specs[i].window is not None

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
    def window_page_bytes(self) -> int:
        return block_bytes(self.specs, self.block_size, windowed=True)


def window_slots(pages: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots in block coordinates (block * block_size + offset) -> the same rows of the window pages
    through `KVPool.window_page` (int64, any shape)."""
    return pages[torch.div(slots, block_size, rounding_mode="floor")].long() * block_size + slots % block_size

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size
