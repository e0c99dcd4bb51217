"""DeepSeek-V4 against HF transformers 5.24's DeepseekV4ForCausalLM on tiny random checkpoints (float32, CPU).

The tiny model (hf_oracle_v4.BASE) has a sliding-window-only layer, an HCA layer pooling 8 tokens and
two CSA layers pooling overlapping windows of 4 through the indexer (top-3), the first layer
hash-routed; prompts of 40-100 tokens span many windows of each. HF runs one unpadded sequence at a
time (V4 changes with left padding by design).
"""

import pytest
import torch

from engine import LLM
from engine.config import ModelConfig, required_block_size
from tests.engine import test_hf_parity
from tests.engine.hf_oracle import hf_greedy, hf_logits, prompts, save_hf_checkpoint
from tests.engine.hf_oracle_v4 import VOCAB, build_v4_model, quantize_v4_checkpoint

NEW_TOKENS = test_hf_parity.NEW_TOKENS
GREEDY = test_hf_parity.GREEDY


def check_parity(hf, path, batch, **engine_args):
    """Prompt logits within 1e-4, 32 identical greedy tokens (tests/engine/test_hf_parity.py)."""
    return test_hf_parity.check_parity(hf, path, batch, show_progress=False, **engine_args)


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    hf = build_v4_model(seed=1)
    return hf, save_hf_checkpoint(hf, tmp_path_factory.mktemp("v4") / "ckpt")


def test_config_reads_both_spellings(v4):
    _, path = v4
    cfg = ModelConfig.from_dir(path)
    assert cfg.compress_ratios == (0, 8, 4, 4) and cfg.csa_ratio == 4
    assert [cfg.layer_kind(i) for i in range(4)] == ["window", "hca", "csa", "csa"]
    assert cfg.hash_layers == (True, False, False, False)
    assert cfg.compress_rope_scaling.attention_factor == 1.0  # V4 does not scale cos/sin
    # DeepSeek's own config.json: a ratio per layer, the hash layers by count, flat YaRN
    published = ModelConfig.from_hf({
        "architectures": ["DeepseekV4ForCausalLM"], "vocab_size": 129280, "hidden_size": 4096,
        "num_hidden_layers": 4, "num_attention_heads": 64, "head_dim": 512, "qk_rope_head_dim": 64,
        "q_lora_rank": 1024, "moe_intermediate_size": 2048, "n_routed_experts": 256, "num_experts_per_tok": 6,
        "compress_ratios": [0, 0, 4, 128], "num_hash_layers": 3, "compress_rope_theta": 160000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
    })
    assert [published.layer_kind(i) for i in range(4)] == ["window", "window", "csa", "hca"]
    assert published.hash_layers == (True, True, True, False)
    assert published.compress_rope_theta == 160000 and published.compress_rope_scaling.factor == 16
    assert required_block_size(published, 16) == 128  # a page holds whole windows of every kind


def test_prompts_longer_than_many_windows_match_hf(v4):
    hf, path = v4
    check_parity(hf, path, prompts(0, [5, 17, 40, 70, 100], VOCAB))


@pytest.fixture(scope="module")
def chunked(v4):
    """The chunked prefill's prompts and HF's references for them, the same at either budget."""
    hf, _ = v4
    batch = prompts(1, [45, 30, 61], VOCAB)
    return batch, test_hf_parity.references(hf, batch)


@pytest.mark.parametrize("budget", [5, 7])
def test_chunked_prefill_across_window_boundaries_matches_hf(v4, chunked, budget):
    hf, path = v4
    batch, refs = chunked
    # chunks of 5 or 7 tokens start and end inside CSA (4) and HCA (8) windows: each resumes the open
    # pooling state its block carries
    check_parity(hf, path, batch, refs=refs, max_num_batched_tokens=budget, block_size=8)


def test_preemption_matches_hf(v4):
    hf, path = v4
    batch = prompts(2, [40, 36, 44, 30], VOCAB)
    # 20 blocks of 8 tokens hold ~2 of these sequences at full length: the rest get preempted
    llm = check_parity(hf, path, batch, num_kv_blocks=20, block_size=8, enable_prefix_caching=False)
    assert llm.engine.scheduler.num_preemptions > 0


def test_a_cached_prefix_resumes_the_compressors_state(v4):
    """Turn 2 over turn 1's cached blocks equals a fresh prefill: the prefix ends where a CSA window's
    series A (the next entry's first half) is open in the last cached block's state row."""
    hf, path = v4
    llm = LLM(str(path), dtype="float32", device="cpu", show_progress=False, block_size=8)
    turn1 = prompts(3, [43], VOCAB)[0]
    first = llm.generate([turn1], GREEDY)[0]
    turn2 = turn1 + first.token_ids + prompts(4, [13], VOCAB)[0]
    again = llm.generate([turn2], GREEDY)[0]
    assert again.num_cached_tokens >= 64  # whole blocks of turn 1 (8 tokens each)
    assert again.token_ids == hf_greedy(hf, turn2, NEW_TOKENS)
    ours = llm.score([turn2])[0]  # scored over the cached prefix too
    assert (ours - hf_logits(hf, turn2)).abs().max().item() <= 1e-4


def test_fp8_blocks_and_mxfp4_experts_match_hf_on_dequantized_weights(tmp_path):
    hf = build_v4_model(seed=5)
    path = save_hf_checkpoint(hf, tmp_path / "ckpt")
    quantize_v4_checkpoint(hf, path, (16, 16))  # the oracle runs the same values, dequantized
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes["model.layers.1.attn.wq_b.weight"] == "F8_E4M3"
    assert dtypes["model.layers.1.attn.wq_b.scale"] == "F8_E8M0"
    assert dtypes["model.layers.1.ffn.experts.0.w1.weight"] == "I8"
    check_parity(hf, path, prompts(5, [33, 60], VOCAB))


def test_sharded_checkpoint_matches_hf(tmp_path):
    hf = build_v4_model(seed=6)
    path = save_hf_checkpoint(hf, tmp_path / "ckpt", max_shard_size="60KB")
    assert len(list(path.glob("*.safetensors"))) > 3
    check_parity(hf, path, prompts(6, [25, 50], VOCAB))


def test_two_ranks_match_hf(v4):
    """Heads, output groups and the shared expert split over two ranks, the routed experts partitioned
    (expert parallel); window, entries, indexer and state replicated."""
    hf, path = v4
    check_parity(hf, path, prompts(7, [38, 20, 57], VOCAB), max_num_batched_tokens=16, tensor_parallel_size=2,
                 enable_expert_parallel=True)


def test_random_weights_run(tmp_path):
    """No checkpoint (benchmarks): random weights, a random hash table."""
    hf = build_v4_model(seed=8)
    path = save_hf_checkpoint(hf, tmp_path / "ckpt")
    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner

    runner = ModelRunner(EngineConfig(model=str(path), dtype="float32", device="cpu", block_size=8),
                         ModelConfig.from_dir(path), None, 128)
    tid2eid = runner.model.layers[0].ffn.gate.tid2eid
    assert tid2eid.min() >= 0 and tid2eid.max() < 4 and tid2eid.unique().numel() > 1
    assert torch.isfinite(runner.model.hc_head_fn).all()


def test_a_prefix_pulled_from_another_replica_matches_hf(v4, redis_server):
    """Turn 2 lands on replica b: every cache kind of turn 1's blocks (window rows, entries, indexer keys,
    open pooling state) comes over TCP from replica a, and b continues exactly as HF does."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from tests.engine.test_kv_reuse import run, wait_published

    hf, path = v4
    args = dict(model=str(path), dtype="float32", device="cpu", block_size=8, kv_directory=redis_server.url,
                kv_transfer_port=0, kv_pull_policy="always", kv_min_prefix_tokens=8, show_progress=False)
    a = LLMEngine(EngineConfig(replica_id="a", **args))
    b = LLMEngine(EngineConfig(replica_id="b", **args))
    try:
        turn1 = prompts(9, [51], VOCAB)[0]
        run(a, "t1", turn1)
        wait_published(a, redis_server, 6)
        turn2 = turn1 + prompts(10, [9], VOCAB)[0]
        second = run(b, "t2", turn2)
        assert second.num_remote_cached_tokens == 48 and b.kv.stats.pulls == 1
        assert second.token_ids == hf_greedy(hf, turn2, len(second.token_ids))
    finally:
        a.shutdown()
        b.shutdown()


def test_serve_a_v4_checkpoint_over_the_openai_api(v4, tmp_path):
    """`deepseek-engine serve --model <V4 dir>`: the official client, streamed and not, greedy as HF."""
    from openai import OpenAI

    from engine.tokenizer import Tokenizer
    from tests.engine.conftest_server import MODEL_NAME, ServerProcess

    hf, path = v4
    server = ServerProcess(path, tmp_path / "serve.log").wait_ready()
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        ids = prompts(11, [37], VOCAB)[0]
        out = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=12, temperature=0.0,
                                        extra_body={"ignore_eos": True})
        text = out.choices[0].text
        assert out.usage.completion_tokens == 12
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=MODEL_NAME, prompt=ids, max_tokens=12, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True}))
        assert streamed == text
        assert text == Tokenizer(path).decode(hf_greedy(hf, ids, 12))
    finally:
        server.stop()


def test_decode_steps_without_host_lists_match_hf(v4):
    """The decode path CUDA graphs capture (every shape fixed by the batch and max_model_len, entries
    gathered up to max_entries and masked, a closing window's entry written by mask), on the CPU."""
    hf, path = v4
    llm = LLM(str(path), dtype="float32", device="cpu", show_progress=False, block_size=8, max_model_len=256)
    for attn in llm.engine.runner.model.attention_layers():
        attn.use_kernels, attn.pool_kernels = True, False  # the PyTorch path (the Triton kernels: test_fast_path)
    batch = prompts(12, [9, 41, 23, 66], VOCAB)
    outs = llm.generate(batch, GREEDY)
    for ids, out in zip(batch, outs):
        assert out.token_ids == hf_greedy(hf, ids, NEW_TOKENS)


def test_prefill_attends_in_pieces_of_queries(v4, monkeypatch):
    """Long chunks attend 256 queries at a time (bounded logits); pieces of 7 split windows and chunks."""
    from engine.models.deepseek_v4 import Attention

    monkeypatch.setattr(Attention, "query_piece", 7)
    hf, path = v4
    check_parity(hf, path, prompts(13, [50, 23], VOCAB), block_size=8)
