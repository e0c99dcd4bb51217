"""Paged-cache bookkeeping and the local prefix cache, without a model."""

import torch

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def seq(rid: str, ids: list[int]) -> Sequence:
    return Sequence(rid, ids, SamplingParams(), torch.Generator())


def run_prefill(bm: BlockManager, s: Sequence) -> None:
    """What the scheduler and engine do for a whole-prompt prefill."""
    ok, hits = bm.can_admit(s, s.num_tokens)
    assert ok
    bm.admit(s, hits)
    bm.grow(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.commit(s)


def test_prefix_hits_are_full_blocks_and_never_the_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq("a", list(range(10)))  # blocks [0-3] [4-7] [8,9]
    run_prefill(bm, a)
    assert bm.match_prefix(seq("b", list(range(10)))) == a.block_table[:2]
    assert bm.match_prefix(seq("c", list(range(8)))) == a.block_table[:1]  # 8 tokens: last one recomputed
    assert bm.match_prefix(seq("d", [0, 1, 2, 99] + list(range(4, 10)))) == []  # chained: a change early misses all
    bm.release(a)
    assert bm.usage == 0.0
    assert bm.match_prefix(seq("e", list(range(10)))) != []  # unreferenced blocks stay cached


def test_shared_blocks_are_reference_counted():
    bm = BlockManager(num_blocks=16, block_size=4)
    a, b = seq("a", list(range(12))), seq("b", list(range(12)))
    run_prefill(bm, a)
    run_prefill(bm, b)
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached_tokens == 0
    assert bm.num_free_blocks == 16 - 4
    bm.release(a)
    assert bm.num_free_blocks == 16 - 3  # b still holds the shared two and its own third
    bm.release(b)
    assert bm.num_free_blocks == 16


def test_eviction_takes_uncached_blocks_first_then_least_recently_used():
    bm = BlockManager(num_blocks=6, block_size=2)
    old, new = seq("old", [1, 2, 3, 4, 5]), seq("new", [7, 8, 9, 10, 11])
    run_prefill(bm, old)  # 3 blocks, 2 of them full and cached
    bm.release(old)
    run_prefill(bm, new)
    bm.release(new)
    filler = seq("filler", [0] * 5)  # needs 3 blocks: the 2 partial ones, then old's oldest cached one
    bm.grow(filler, 5)
    assert bm.match_prefix(seq("x", [7, 8, 9, 10, 11])) != []  # new's prefix survives
    assert len(bm.match_prefix(seq("y", [1, 2, 3, 4, 5]))) < 2  # old's lost at least a block


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = seq("a", [1, 2, 3, 4, 5])
    run_prefill(bm, a)
    assert bm.match_prefix(seq("b", [1, 2, 3, 4, 5])) == []
