"""Paged KV cache bookkeeping: free blocks, per-sequence block tables, and the local prefix cache.

A block holds `block_size` consecutive raw tokens of one sequence. Pages stay in raw-token coordinates
so a model with several cache kinds per layer (a sliding-window ring, r-times compressed caches) keeps
one block table: block i covers tokens [i * block_size, (i + 1) * block_size) in every kind.

Full blocks are keyed by a chained hash of their tokens (and the model), so a later request with the
same prefix reuses them; blocks nobody references stay cached until evicted, least recently used first.
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
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, salt: str = ""):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
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
        return 1.0 - len(self.free) / len(self.blocks)

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
        return hits

    def can_admit(self, seq: Sequence, num_new_tokens: int) -> tuple[bool, list[int]]:
        hits = self.match_prefix(seq)
        reused_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        need = self.blocks_needed(len(hits) * self.block_size + num_new_tokens) - len(hits)
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

    # -- growth ------------------------------------------------------------------------------------
    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(seq.block_table) <= len(self.free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Give the sequence blocks for its first `num_tokens` tokens."""
        for _ in range(self.blocks_needed(num_tokens) - len(seq.block_table)):
            block = self._take_free()
            block.ref_count = 1
            seq.block_table.append(block.block_id)

    def _take_free(self) -> Block:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
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

    def install(self, hashes: list[bytes], token_ids: list[list[int]]) -> list[int] | None:
        """Take free blocks for content that arrived from elsewhere (a peer), cached under `hashes` and
        pinned (ref_count 1) until `unpin`; the caller writes the KV rows. None if space is short."""
        if len(hashes) > len(self.free):
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
        return ids

    def announce(self, hashes: list[bytes]) -> None:
        """Tell the observers that installed blocks now hold their content."""
        if hashes and self.on_cached:
            self.on_cached(hashes)

    def unpin(self, block_ids: list[int]) -> None:
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

    def release(self, seq: Sequence) -> None:
        """Drop the sequence's references; unreferenced blocks become free (cached ones last, and
        blocks without cached content first in line for reuse)."""
        self.unpin(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        self.num_hashed_blocks.pop(seq.request_id, None)
