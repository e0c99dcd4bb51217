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


def test_window_pages_follow_the_window_and_the_prefix_cache_keeps_them_while_they_last():
    """A window of 6 tokens over blocks of 4: a query reads its own block and the one before, so a cut at
    block L needs the pages of blocks L - 2 and L - 1."""
    bm = BlockManager(num_blocks=16, block_size=4, window=6, num_window_pages=6)
    assert bm.window_tail == 2
    a = seq("a", list(range(14)))  # 4 blocks, 3 full
    run_prefill(bm, a)
    assert bm.num_held_pages == 4 and all(bm.page_of[b] is not None for b in a.block_table)
    bm.slide(a)  # its next query at 14 reads from 9: blocks 2 and 3
    assert bm.num_held_pages == 2 and list(bm.kept_pages) == a.block_table[:2]  # cached: kept, not freed
    table = list(a.block_table)
    deltas = dict(bm.take_window_deltas())
    assert set(deltas) == set(table) and bm.take_window_deltas() == []
    bm.release(a)  # block 2 cached: kept; block 3 (2 tokens) freed
    assert bm.num_held_pages == 0 and list(bm.kept_pages) == table[:3]
    assert bm.take_window_deltas() == [(table[3], bm.scratch_page)]
    assert bm.match_prefix(seq("b", list(range(14)))) == table[:3]
    # a sequence that needs 5 pages: 3 free, then the least recently kept (blocks 0 and 1) are evicted
    c = seq("c", list(range(100, 120)))
    run_prefill(bm, c)
    assert [bm.page_of[b] is not None for b in table[:3]] == [False, False, True]
    # a hit of 3 blocks needs blocks 1 and 2, of 2 blocks 0 and 1, of 1 block block 0: none left
    assert bm.match_prefix(seq("b", list(range(14)))) == []
    bm.release(c)
    assert bm.num_available_pages == 6


def test_window_pages_short_stop_growth_and_admission():
    bm = BlockManager(num_blocks=16, block_size=4, window=6, num_window_pages=3, enable_prefix_caching=False)
    a = seq("a", list(range(8)))
    run_prefill(bm, a)  # 2 pages
    # 2 of 16 blocks but 2 of 3 pages: the usage the metrics report is the pages'
    assert bm.usage == 2 / 3
    b = seq("b", list(range(50, 58)))
    assert bm.can_admit(b, 8)[0] is False  # 2 blocks, one page left
    assert bm.can_admit(b, 4)[0] is True
    assert not bm.can_grow(a, 16) and bm.can_grow(a, 12)
    bm.release(a)
    assert bm.num_available_pages == 3 and not bm.kept_pages  # uncached: freed
