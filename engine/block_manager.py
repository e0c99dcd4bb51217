"""Paged KV cache bookkeeping: free blocks, per-sequence block tables, and the local prefix cache.

A block holds `block_size` consecutive raw tokens of one sequence. Pages stay in raw-token coordinates
so a model with several cache kinds per layer (a sliding-window ring, r-times compressed caches) keeps
one block table: block i covers tokens [i * block_size, (i + 1) * block_size) in every kind.

Full blocks are keyed by a chained hash of their tokens (and the model), so a later request with the
same prefix reuses them; blocks nobody references stay cached until evicted, least recently used first.

A sliding-window kind (V4) may live in pages of its own, fewer than the blocks (`num_window_pages`):
a sequence holds pages only for the blocks its next queries may read (those covering its last `window`
tokens before its first uncomputed one) and the blocks it grows into (a prefill chunk writes a window
row for every token); the blocks behind slide out as it computes (`slide`), their pages freed, or,
where the block is cached, kept for the prefix cache while the pages last (least recently used
evicted first). A prefix hit of L blocks needs the pages of the blocks covering the window before token
L * block_size, so a hit is cut back to the longest prefix whose trailing pages are present. Each
change of a block's page is queued for the next plan (`take_window_deltas`), which the workers apply
to the device's block -> page map before the step (the step in flight, queued earlier, read the old
one). A page taken back is reused only by a later plan, after the steps queued before it.
"""

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from engine.sequence import Sequence


def block_hash(parent: bytes, token_ids: list[int], extra: bytes = b"") -> bytes:
    """Chained hash: a block's key covers every token before it too. extra: the content of the images
    whose spans the block covers (their placeholder ids alone would make every image alike)."""
    return hashlib.blake2b(parent + np.asarray(token_ids, dtype=np.int64).tobytes() + extra, digest_size=16).digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    token_ids: list[int] = field(default_factory=list)
    generation: int = 0  # bumped whenever the block's content is dropped, so readers can detect reuse


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, salt: str = "",
                 window: int | None = None, num_window_pages: int | None = None):
        """window, num_window_pages: the sliding window (tokens) and its pages, when the window kinds live
        in pages of their own (None: a page per block, nothing to track)."""
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.window = window if num_window_pages is not None else None
        self.num_window_pages = num_window_pages or 0
        self.scratch_page = self.num_window_pages
        # blocks before a cut whose window rows its first query reads: ceil((window - 1) / block_size)
        self.window_tail = -(-(window - 1) // block_size) if self.window else 0
        self.page_of: list[int | None] = [None] * num_blocks
        self.window_refs = [0] * num_blocks  # sequences whose window covers the block
        self.free_pages: list[int] = list(range(self.num_window_pages - 1, -1, -1))
        # blocks nobody's window covers whose page is kept for the prefix cache, eviction order first
        self.kept_pages: OrderedDict[int, None] = OrderedDict()
        self.page_generation = [0] * self.num_window_pages  # bumped when a page leaves its block
        self.window_first: dict[str, int] = {}  # request id -> its first block whose page it holds
        self._window_deltas: dict[int, int] = {}  # block -> page (the scratch page: none), for the next plan
        self._pinned_pages: dict[int, int] = {}  # block -> references `install` took on its page, until `unpin`
        self.enable_prefix_caching = enable_prefix_caching
        self.root_hash = hashlib.blake2b(salt.encode(), digest_size=16).digest()
        self.hash_to_block: dict[bytes, int] = {}
        # unreferenced blocks, eviction order first; cached ones are kept towards the end
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.num_hashed_blocks: dict[str, int] = {}  # request id -> leading blocks already hashed
        # observers of the prefix cache's content (the cross-replica KV directory)
        self.on_cached: Callable[[list[bytes]], None] | None = None
        self.on_evicted: Callable[[list[bytes]], None] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """The fraction of the KV cache the running sequences hold: of the blocks, or, where the window
        kinds have pages of their own and those run out first, of the pages (admission stops at
        either, so the metric the autoscaler reads must see either)."""
        blocks = 1.0 - len(self.free) / len(self.blocks)
        if not self.window or not self.num_window_pages:
            return blocks
        return max(blocks, self.num_held_pages / self.num_window_pages)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- admission ---------------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks that hold this sequence's leading full blocks (never the whole sequence:
        the last token is always computed so the step yields logits)."""
        if not self.enable_prefix_caching or seq.collect_logits:  # scoring needs every position computed
            return []
        hits, parent = [], self.root_hash
        max_blocks = (seq.num_tokens - 1) // self.block_size
        for i in range(max_blocks):
            tokens = seq.token_ids(i * self.block_size, (i + 1) * self.block_size)
            parent = self._hash(seq, i, parent, tokens)
            block_id = self.hash_to_block.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        return hits[: self.windowed_cut(hits)]

    def windowed_cut(self, block_ids: list[int], present=None) -> int:
        """The longest leading run of these blocks (a prefix from block 0) whose trailing window pages are
        present: a cut at L needs the pages of blocks [L - window_tail, L). present(i): whether block_ids[i]
        has its page (default: it has one now)."""
        n = len(block_ids)
        if not self.window:
            return n
        present = present or (lambda i: self.page_of[block_ids[i]] is not None)
        while n:
            lacking = [i for i in range(max(0, n - self.window_tail), n) if not present(i)]
            if not lacking:
                break
            n = lacking[-1]  # every cut in (i, i + window_tail] needs block i
        return n

    def can_admit(self, seq: Sequence, num_new_tokens: int) -> tuple[bool, list[int]]:
        hits = self.match_prefix(seq)
        reused_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        end = len(hits) * self.block_size + num_new_tokens
        need = self.blocks_needed(end) - len(hits)
        if self.window:
            first = self._first_window_block(len(hits) * self.block_size)
            kept = sum(1 for b in hits[first:] if self.window_refs[b] == 0)  # pages taken off the kept list
            if need > self.num_available_pages - kept:
                return False, hits
        return need <= len(self.free) - reused_free, hits

    def admit(self, seq: Sequence, hits: list[int]) -> None:
        """Attach prefix-cache hits to a sequence that holds no blocks yet."""
        assert not seq.block_table
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.num_computed_tokens = len(hits) * self.block_size
        self.num_hashed_blocks[seq.request_id] = len(hits)
        if self.window:
            first = self._first_window_block(seq.num_computed_tokens)
            for block_id in hits[first:]:  # match_prefix left only hits whose trailing pages are present
                self._ref_page(block_id)
            self.window_first[seq.request_id] = first

    # -- growth ------------------------------------------------------------------------------------
    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        need = self.blocks_needed(num_tokens) - len(seq.block_table)
        if self.window and need > self.num_available_pages:
            return False
        return need <= len(self.free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Give the sequence blocks for its first `num_tokens` tokens (and their window pages)."""
        for _ in range(self.blocks_needed(num_tokens) - len(seq.block_table)):
            block = self._take_free()
            block.ref_count = 1
            seq.block_table.append(block.block_id)
            if self.window:
                self.window_first.setdefault(seq.request_id, 0)
                self._give_page(block.block_id)
                self.window_refs[block.block_id] = 1

    # -- the window's pages --------------------------------------------------------------------------
    def _first_window_block(self, num_computed: int) -> int:
        """The first block a query at position num_computed (or later) may read the window rows of."""
        return max(0, num_computed - self.window + 1) // self.block_size

    @property
    def num_available_pages(self) -> int:
        """Window pages a sequence may take: free ones and those only the prefix cache keeps."""
        return len(self.free_pages) + len(self.kept_pages)

    @property
    def num_held_pages(self) -> int:
        """Window pages the running sequences' windows hold."""
        return self.num_window_pages - self.num_available_pages

    def slide(self, seq: Sequence) -> None:
        """Take back the pages of the blocks behind the window of the sequence's next query (at its
        num_computed_tokens, which counts the steps in flight: what they read was queued before)."""
        if not self.window or seq.request_id not in self.window_first:
            return
        first, new = self.window_first[seq.request_id], self._first_window_block(seq.num_computed_tokens)
        for block_id in seq.block_table[first:new]:
            self._unref_page(block_id)
        self.window_first[seq.request_id] = max(first, new)

    def _take_page(self) -> int:
        if self.free_pages:
            return self.free_pages.pop()
        block_id, _ = self.kept_pages.popitem(last=False)  # the least recently kept cached block loses it
        return self._drop_page(block_id)

    def _give_page(self, block_id: int) -> None:
        if self.page_of[block_id] is None:
            page = self.page_of[block_id] = self._take_page()
            self._window_deltas[block_id] = page

    def _drop_page(self, block_id: int) -> int:
        """Unmap a block's page -> the page (the caller frees or reuses it)."""
        page = self.page_of[block_id]
        self.page_of[block_id] = None
        self.page_generation[page] += 1
        self._window_deltas[block_id] = self.scratch_page
        return page

    def _ref_page(self, block_id: int) -> None:
        if self.window_refs[block_id] == 0:
            self.kept_pages.pop(block_id, None)
        self.window_refs[block_id] += 1

    def _unref_page(self, block_id: int) -> None:
        self.window_refs[block_id] -= 1
        if self.window_refs[block_id] or self.page_of[block_id] is None:
            return
        h = self.blocks[block_id].hash
        if self.enable_prefix_caching and h is not None and self.hash_to_block.get(h) == block_id:
            self.kept_pages[block_id] = None  # a hit may read it (most recently kept last)
        else:
            self.free_pages.append(self._drop_page(block_id))

    def take_window_deltas(self) -> list[tuple[int, int]]:
        """(block, page) changes since the last call, for the next plan (the scratch page: none)."""
        deltas, self._window_deltas = list(self._window_deltas.items()), {}
        return deltas

    def _take_free(self) -> Block:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if self.window and self.page_of[block_id] is not None:  # unreferenced: its page was only kept
            del self.kept_pages[block_id]
            self.free_pages.append(self._drop_page(block_id))
        if block.hash is not None:  # evict its cached content
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
                if self.on_evicted:
                    self.on_evicted([block.hash])
            block.hash, block.token_ids = None, []
        block.generation += 1
        return block

    def commit(self, seq: Sequence) -> None:
        """Register the sequence's newly completed full blocks in the prefix cache: those whose tokens are
        computed (or being computed by a step in flight) and known to the host."""
        if not self.enable_prefix_caching:
            return
        done = self.num_hashed_blocks.get(seq.request_id, 0)
        full = min(min(seq.num_computed_tokens, seq.num_tokens) // self.block_size, len(seq.block_table))
        parent = self.blocks[seq.block_table[done - 1]].hash if done else self.root_hash
        new = []
        for i in range(done, full):
            tokens = seq.token_ids(i * self.block_size, (i + 1) * self.block_size)
            parent = self._hash(seq, i, parent, tokens)
            block = self.blocks[seq.block_table[i]]
            block.hash, block.token_ids = parent, tokens
            if self.hash_to_block.setdefault(parent, block.block_id) == block.block_id:
                new.append(parent)
        self.num_hashed_blocks[seq.request_id] = full
        if new and self.on_cached:
            self.on_cached(new)

    def prefix_hashes(self, seq: Sequence) -> list[bytes]:
        """Chained hashes of the sequence's full blocks, leaving at least its last token out."""
        hashes, parent = [], self.root_hash
        for i in range((seq.num_tokens - 1) // self.block_size):
            parent = self._hash(seq, i, parent, seq.token_ids(i * self.block_size, (i + 1) * self.block_size))
            hashes.append(parent)
        return hashes

    def _hash(self, seq: Sequence, i: int, parent: bytes, tokens: list[int]) -> bytes:
        """Block i's chained hash: its tokens and the images it covers."""
        extra = seq.image_key(i * self.block_size, (i + 1) * self.block_size) if seq.images else b""
        return block_hash(parent, tokens, extra)

    def install(self, hashes: list[bytes], token_ids: list[list[int]], window_from: int = 0) -> list[int] | None:
        """Take free blocks for content that arrived from elsewhere (a peer), cached under `hashes` and
        pinned (ref_count 1) until `unpin`; the caller writes the KV rows (the window's into `page_of`).
        window_from: where the window has pages, the blocks from this index on get pages too, pinned
        alike (those the cut after the last block reads). None if space is short."""
        if len(hashes) > len(self.free):
            return None
        if self.window and len(hashes) - window_from > self.num_available_pages:
            return None
        ids = []
        for h, tokens in zip(hashes, token_ids):
            if h in self.hash_to_block:  # appeared locally meanwhile: pin that one
                block = self.blocks[self.hash_to_block[h]]
                if block.ref_count == 0:
                    del self.free[block.block_id]
                block.ref_count += 1
                ids.append(block.block_id)
                continue
            block = self._take_free()
            block.ref_count, block.hash, block.token_ids = 1, h, tokens
            self.hash_to_block[h] = block.block_id
            ids.append(block.block_id)
        if self.window:
            for block_id in ids[window_from:]:
                self._ref_page(block_id)
                self._give_page(block_id)
                self._pinned_pages[block_id] = self._pinned_pages.get(block_id, 0) + 1
        return ids

    def announce(self, hashes: list[bytes]) -> None:
        """Tell the observers that installed blocks now hold their content."""
        if hashes and self.on_cached:
            self.on_cached(hashes)

    def unpin(self, block_ids: list[int]) -> None:
        """Drop the references `install` took (on the blocks, and on the window pages it gave)."""
        for block_id in block_ids:
            if self._pinned_pages.get(block_id):
                self._pinned_pages[block_id] -= 1
                if not self._pinned_pages[block_id]:
                    del self._pinned_pages[block_id]
                self._unref_page(block_id)
        self._drop_refs(block_ids)

    def _drop_refs(self, block_ids: list[int]) -> None:
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                if block.hash is None:
                    self.free.move_to_end(block_id, last=False)

    def lookup_cached(self, hashes: list[bytes]) -> list[tuple[int, int]]:
        """(block id, generation) of the leading hashes held here; safe to call from another thread
        (the caller re-checks the generations after copying the rows)."""
        out = []
        for h in hashes:
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.hash != h:
                break
            out.append((block_id, block.generation))
        return out

    def still_valid(self, held: list[tuple[int, int]]) -> int:
        """How many of the leading (block id, generation) pairs were not reused since lookup_cached."""
        for n, (block_id, gen) in enumerate(held):
            if self.blocks[block_id].generation != gen:
                return n
        return len(held)

    def lookup_pages(self, held: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """(window page, its generation) of each block of a lookup_cached answer, (-1, -1) where it has none;
        safe to call from another thread (the caller re-checks them after copying: `pages_unchanged`)."""
        out = []
        for block_id, _ in held:
            page = self.page_of[block_id]
            gen = self.page_generation[page] if page is not None else -1
            # the engine loop may move the page meanwhile: one read again after its generation is the same
            out.append((page, gen) if page is not None and self.page_of[block_id] == page else (-1, -1))
        return out

    def pages_unchanged(self, pages: list[tuple[int, int]]) -> list[bool]:
        """Which of lookup_pages' pages still hold what they held then (never moved since)."""
        return [page >= 0 and self.page_generation[page] == gen for page, gen in pages]

    def release(self, seq: Sequence) -> None:
        """Drop the sequence's references; unreferenced blocks become free (cached ones last, and
        blocks without cached content first in line for reuse), and so do their window pages."""
        if self.window and seq.request_id in self.window_first:
            for block_id in seq.block_table[self.window_first.pop(seq.request_id):]:
                self._unref_page(block_id)
        self._drop_refs(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        self.num_hashed_blocks.pop(seq.request_id, None)
