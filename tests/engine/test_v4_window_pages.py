"""DeepSeek-V4's sliding window in pages of its own: a sequence holds the pages of its window and of what
its step writes, the prefix cache keeps cached blocks' pages while they last and cuts a hit back to the
longest prefix whose trailing pages are present, preemption and KV transfer move what a cut needs. HF
transformers 5.24 is the oracle (tiny random checkpoint, float32, CPU).

The tiny model's window is 16 tokens and its pages 8: a query reads the window rows of its own block
and the block before, so a cut at block L needs the pages of blocks L - 2 and L - 1.
"""

import pytest
import torch

from engine import LLM
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.engine.hf_oracle import hf_greedy, hf_logits, prompts, save_hf_checkpoint
from tests.engine.hf_oracle_v4 import VOCAB, build_v4_model

BS, WINDOW = 8, 16
TAIL = 2  # blocks before a cut whose window rows its first query reads


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    hf = build_v4_model(seed=21, sliding_window=WINDOW)
    return hf, save_hf_checkpoint(hf, tmp_path_factory.mktemp("v4w") / "ckpt")


def engine(path, **args) -> LLMEngine:
    base = dict(model=str(path), dtype="float32", device="cpu", block_size=BS, num_kv_blocks=64, max_num_seqs=1,
                max_num_batched_tokens=56, num_window_pages=10, show_progress=False)
    return LLMEngine(EngineConfig(**{**base, **args}))


def run(eng: LLMEngine, rid: str, prompt: list[int], max_tokens: int = 8, logprobs: int | None = None,
        watch=None):
    eng.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                                logprobs=logprobs))
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                return out
        if watch is not None:
            watch(eng)
    raise AssertionError("request vanished")


def check_logprobs(hf, prompt: list[int], out) -> None:
    """The engine's logprobs of each drawn token (its top 5 and the token) within 1e-4 of HF's fresh
    prefill over the prompt and the tokens before it."""
    ids = prompt + out.token_ids
    ref = torch.log_softmax(hf_logits(hf, ids[:-1]), -1)[len(prompt) - 1:]
    for i, top in enumerate(out.logprobs):
        for token, value in top.items():
            assert abs(value - ref[i, token].item()) <= 1e-4, (i, token)


def test_a_long_prompt_and_its_decode_hold_only_the_windows_pages(v4):
    """100 tokens in chunks of 24, then 32 decodes: the pool has 10 pages for 64 blocks, and between steps
    the sequence holds the pages of its window's blocks and the block it writes, never more."""
    hf, path = v4
    eng = engine(path, max_num_batched_tokens=24)
    pool, bm = eng.runner.kv_pool, eng.block_manager
    assert pool.has_window_pages and pool.cache(0, "window").shape[0] == 11  # 10 pages + the scratch page
    assert pool.cache(1, "compressed").shape[0] == 65  # the other kinds keep a row set per block
    held = []

    def watch(e):
        seqs = e.scheduler.running
        held.append(bm.num_held_pages)
        # the usage the metrics export (and the autoscaler reads) sees the pages, fuller than the blocks here
        assert e.kv_cache_usage == max(bm.num_held_pages / 10, 1 - bm.num_free_blocks / 64)
        for seq in seqs:
            paged = [i for i, b in enumerate(seq.block_table) if bm.page_of[b] is not None and bm.window_refs[b]]
            # from the blocks the last step's queries read (its first at most 24 tokens back) to the last
            assert paged == list(range(paged[0], len(seq.block_table)))
            assert paged[0] >= max(0, seq.num_computed_tokens - 24 - WINDOW + 1) // BS
            assert len(paged) <= TAIL + 1 + 24 // BS + 1

    prompt = prompts(30, [100], VOCAB)[0]
    out = run(eng, "long", prompt, max_tokens=32, logprobs=5, watch=watch)
    assert out.token_ids == hf_greedy(hf, prompt, 32)
    check_logprobs(hf, prompt, out)
    # the sequence reached 17 blocks; during the decodes it held 3 or 4 pages
    assert len(held) > 32 and max(held[-20:]) <= TAIL + 2 and max(held) <= 10
    assert max(held) / 10 > (100 + 32) / BS / 64  # at its peak the pages were the fuller pool
    assert bm.num_held_pages == 0  # finished: kept for the prefix cache or free, none held
    eng.shutdown()


def test_a_hit_whose_trailing_pages_are_present_reuses_the_whole_prefix(v4):
    hf, path = v4
    eng = engine(path)
    turn1 = prompts(31, [56], VOCAB)[0]
    first = run(eng, "t1", turn1)
    turn2 = turn1 + first.token_ids + prompts(32, [9], VOCAB)[0]
    second = run(eng, "t2", turn2, logprobs=5)
    assert second.num_cached_tokens == 56  # turn 1's 7 hashed blocks (its 8th was not full when it ended)
    assert second.token_ids == hf_greedy(hf, turn2, 8)
    check_logprobs(hf, turn2, second)
    eng.shutdown()


def test_a_hit_whose_trailing_pages_were_evicted_falls_back_to_the_longest_valid_prefix(v4):
    """Turn 1 (7 cached blocks); a request sharing its first 3 blocks touches the pages of blocks 1 and 2
    again; an unrelated prompt of 8 blocks (two chunks) then evicts the least recently kept pages
    (blocks 0, 3-6 of turn 1). Turn 2's hit of 7 blocks lacks the pages before cuts 7 .. 4; cut 3 has
    blocks 1 and 2."""
    hf, path = v4
    eng = engine(path)
    bm = eng.block_manager
    turn1 = prompts(33, [56], VOCAB)[0]
    first = run(eng, "t1", turn1)
    blocks = [bm.hash_to_block[h] for h in bm.prefix_hashes(_seq(turn1, first))[:7]]
    assert all(bm.page_of[b] is not None for b in blocks)  # every one kept while the pages last
    shared = run(eng, "shared", turn1[:24] + prompts(34, [4], VOCAB)[0], max_tokens=1)
    assert shared.num_cached_tokens == 24
    run(eng, "other", prompts(35, [64], VOCAB)[0], max_tokens=1)
    assert [bm.page_of[b] is not None for b in blocks] == [False, True, True, False, False, False, False]
    turn2 = turn1 + first.token_ids + prompts(36, [9], VOCAB)[0]
    second = run(eng, "t2", turn2, logprobs=5)
    assert second.num_cached_tokens == 3 * BS
    assert second.token_ids == hf_greedy(hf, turn2, 8)
    check_logprobs(hf, turn2, second)
    eng.shutdown()


def _seq(prompt, out):
    from engine.sequence import Sequence

    return Sequence("probe", prompt + out.token_ids, SamplingParams())


def test_too_few_window_pages_for_one_step_are_refused(v4):
    _, path = v4
    with pytest.raises(ValueError, match="num_window_pages 9 cannot hold one sequence's step"):
        engine(path, num_window_pages=9)  # 2 window blocks + 7 of a 56-token chunk + 1 where it starts inside one


def test_preemption_by_window_pages_matches_hf(v4):
    """Blocks for all, window pages for fewer: the scheduler preempts by the pages, recomputes, and every
    sequence ends as HF's greedy run."""
    hf, path = v4
    batch = prompts(37, [40, 36, 44, 30], VOCAB)
    llm = LLM(str(path), dtype="float32", device="cpu", show_progress=False, block_size=BS, num_kv_blocks=64,
              max_num_seqs=4, max_num_batched_tokens=24, num_window_pages=9, enable_prefix_caching=False)
    outs = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    for ids, out in zip(batch, outs):
        assert out.token_ids == hf_greedy(hf, ids, 24)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == 64 and llm.engine.block_manager.num_held_pages == 0


def test_a_pull_from_a_sender_that_evicted_old_window_pages_matches_hf(v4, redis_server):
    """Replica a ran a 100-token turn with 10 window pages: the pages of its first blocks are gone, those
    of its last blocks kept. Replica b pulls all 13 blocks (every block's entries, indexer keys and
    state), then the window rows of the last two, and continues exactly as HF. Once a's later prompts
    took those two pages, a pull from a finds no window rows to go with the blocks: it recomputes."""
    hf, path = v4
    from tests.engine.test_kv_reuse import wait_published

    kv = dict(kv_directory=redis_server.url, kv_transfer_port=0, kv_pull_policy="always", kv_min_prefix_tokens=8)
    a = engine(path, replica_id="a", max_num_batched_tokens=24, **kv)
    b = engine(path, replica_id="b", **kv)
    try:
        turn1 = prompts(38, [100], VOCAB)[0]
        first = run(a, "t1", turn1)
        wait_published(a, redis_server, 13)
        bm = a.block_manager
        blocks = [bm.hash_to_block[h] for h in bm.prefix_hashes(_seq(turn1, first))[:13]]
        paged = [bm.page_of[b] is not None for b in blocks]
        assert not paged[0] and paged[-TAIL:] == [True] * TAIL
        turn2 = turn1 + first.token_ids + prompts(39, [9], VOCAB)[0]
        second = run(b, "t2", turn2, logprobs=5)
        assert second.num_remote_cached_tokens == 13 * BS and b.kv.stats.pulls == 1
        # the other kinds of 13 blocks, the window rows (and the byte that vouches for them) of 2
        assert b.kv.stats.transfer_bytes == 13 * b.kv.block_bytes + TAIL * b.kv.window_bytes
        assert b.kv.stats.transfer_bytes < 13 * (b.kv.block_bytes + b.kv.window_bytes - 1)  # every window row
        assert second.token_ids == hf_greedy(hf, turn2, 8)
        check_logprobs(hf, turn2, second)
        # the puller took the window rows of the cut's last two blocks only
        got = [b.block_manager.hash_to_block[h] for h in b.block_manager.prefix_hashes(_seq(turn1, first))[:13]]
        assert [b.block_manager.page_of[i] is not None for i in got] == [False] * (13 - TAIL) + [True] * TAIL
    finally:
        b.shutdown()
    # a's later prompts take the pages of turn 1's last blocks: a still serves the 13 blocks, their window
    # sections marked as not theirs, and the puller keeps none of them (no cut has its window rows)
    c = engine(path, replica_id="c", **kv)
    try:
        run(a, "other", prompts(40, [120], VOCAB)[0], max_tokens=1)
        assert not any(bm.page_of[b] is not None for b in blocks)
        turn3 = turn1 + first.token_ids + prompts(41, [5], VOCAB)[0]
        third = run(c, "t3", turn3, logprobs=5)
        assert third.num_remote_cached_tokens == 0 and c.kv.stats.fallbacks.get("window_evicted") == 1
        assert third.token_ids == hf_greedy(hf, turn3, 8)
        check_logprobs(hf, turn3, third)
    finally:
        a.shutdown()
        c.shutdown()
