"""Engine behaviour on a tiny random checkpoint: batching, sampling controls, caching, aborts."""

import pytest

from engine import LLM, SamplingParams
from tests.engine.hf_oracle import prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module", params=["off", "on"], ids=["sync", "async"])
def llm(random_checkpoint, request):
    """Every behaviour holds with async scheduling too (a decode step launched before the host reads
    the tokens of the step before it)."""
    return LLM(str(random_checkpoint), dtype="float32", block_size=4, async_scheduling=request.param)


def test_same_greedy_tokens_alone_and_batched(llm):
    batch = prompts(7, [6, 19, 3, 40, 11], vocab=512)
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in batch]
    together = [o.token_ids for o in llm.generate(batch, GREEDY)]
    assert alone == together


def test_text_prompts_get_bos_and_detokenized_text(llm):
    out = llm.generate("Hello world", GREEDY)[0]
    assert out.prompt_token_ids[0] == llm.tokenizer.bos_token_id
    assert out.text == llm.tokenizer.decode(out.token_ids)


def test_seed_makes_sampling_reproducible(llm):
    p = prompts(8, [12], vocab=512)[0]
    a = SamplingParams(temperature=1.0, top_p=0.95, seed=123, max_tokens=20, ignore_eos=True)
    b = SamplingParams(temperature=1.0, top_p=0.95, seed=124, max_tokens=20, ignore_eos=True)
    first = llm.generate([p, p], [a, b])
    again = llm.generate([p], a)[0]
    assert first[0].token_ids == again.token_ids
    assert first[0].token_ids != first[1].token_ids


def test_top_k_one_and_tiny_top_p_are_greedy(llm):
    p = prompts(9, [10], vocab=512)[0]
    greedy = llm.generate(p, GREEDY)[0].token_ids
    for params in (SamplingParams(temperature=1.0, top_k=1, max_tokens=24, ignore_eos=True, seed=1),
                   SamplingParams(temperature=0.7, top_p=1e-6, max_tokens=24, ignore_eos=True, seed=2)):
        assert llm.generate(p, params)[0].token_ids == greedy


def test_stop_token_ids_and_max_tokens(llm):
    p = prompts(10, [9], vocab=512)[0]
    full = llm.generate(p, GREEDY)[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 24
    stop_at = full.token_ids[5]
    first = full.token_ids.index(stop_at)
    out = llm.generate(p, SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_at]))[0]
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop"


def test_stop_strings_trim_the_text(llm):
    p = "The quick brown fox"
    full = llm.generate(p, GREEDY)[0]
    text = full.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop
    out = llm.generate(p, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]
    kept = llm.generate(p, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop],
                                          include_stop_str_in_output=True))[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_logprobs_hold_the_chosen_token_and_top_k(llm):
    out = llm.generate(prompts(11, [8], vocab=512)[0],
                       SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3))[0]
    assert len(out.logprobs) == 6
    for token, lp in zip(out.token_ids, out.logprobs):
        assert token in lp and 3 <= len(lp) <= 4
        assert lp[token] == max(lp.values()) <= 0.0  # greedy picks the most likely token


def test_prefix_cache_reuses_full_blocks_with_identical_output(llm):
    p = prompts(12, [37], vocab=512)[0]
    cold = llm.generate(p, GREEDY)[0]
    warm = llm.generate(p, GREEDY)[0]
    assert warm.token_ids == cold.token_ids
    assert warm.num_cached_tokens == 36  # 9 full blocks of 4; the last token is always recomputed
    longer = llm.generate(p + [5, 6, 7], GREEDY)[0]
    assert longer.num_cached_tokens == 36


def test_abort_frees_blocks_at_any_point(llm):
    eng = llm.engine
    eng.add_request("a", prompts(13, [30], vocab=512)[0], GREEDY)
    eng.add_request("b", prompts(14, [30], vocab=512)[0], GREEDY)
    eng.abort_request("b")  # still waiting
    eng.step()
    eng.step()
    assert eng.num_running == 1 and eng.kv_cache_usage > 0
    eng.abort_request("a")  # mid-decode
    assert not eng.has_unfinished_requests()
    assert eng.kv_cache_usage == 0.0
    eng.abort_request("never-existed")  # harmless


def test_generation_stops_at_max_model_len(random_checkpoint):
    llm = LLM(str(random_checkpoint), dtype="float32", max_model_len=20)
    out = llm.generate(prompts(15, [15], vocab=512)[0], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_presence_and_frequency_penalties_discourage_repeats(llm):
    p = "Hello world"  # this random model loops on it greedily
    plain = llm.generate(p, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0].token_ids
    penalized = llm.generate(p, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                               presence_penalty=2.0, frequency_penalty=2.0))[0].token_ids
    assert len(set(plain)) < len(plain) / 2
    assert len(set(penalized)) > len(set(plain))


def test_score_computes_every_position_even_when_the_prefix_is_cached(llm):
    p = prompts(17, [21], vocab=512)[0]
    llm.generate(p, GREEDY)  # leaves the prompt's blocks in the prefix cache
    first, second = llm.score([p, p])
    assert first.shape == second.shape == (21, 512)
    assert (first - second).abs().max().item() == 0.0


def test_dummy_load_format_needs_only_the_config_and_tokenizer(random_checkpoint, tmp_path):
    """load_format="dummy" measures a model's shapes without its weights: random ones from the seed."""
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((random_checkpoint / name).read_bytes())
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with pytest.raises(Exception):
        LLM(str(tmp_path), dtype="float32", show_progress=False)  # no weights to load
    first = LLM(str(tmp_path), dtype="float32", load_format="dummy", seed=3).generate([[5, 6, 7]], greedy)
    again = LLM(str(tmp_path), dtype="float32", load_format="dummy", seed=3).generate([[5, 6, 7]], greedy)
    loaded = LLM(str(random_checkpoint), dtype="float32").generate([[5, 6, 7]], greedy)
    assert first[0].token_ids == again[0].token_ids  # the seed decides the weights
    assert first[0].token_ids != loaded[0].token_ids  # and they are not the checkpoint's
    with pytest.raises(ValueError, match="load_format"):
        LLM(str(tmp_path), load_format="pt")
