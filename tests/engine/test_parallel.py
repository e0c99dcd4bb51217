"""Tensor and expert parallelism on CPU (gloo, one process per rank) against HF transformers: the same
oracle cases as tests/engine/test_hf_parity.py (float32 logits within 1e-4, identical greedy tokens)
at TP=2, TP=4, EP=2 and TP=2 + EP, and a rank's loading of its slice alone."""

import json

import pytest
import torch
from safetensors.torch import load_file

from engine.config import EngineConfig, ModelConfig
from engine.model_runner import ModelRunner
from engine.parallel import ParallelContext
from tests.engine import test_hf_parity
from tests.engine.hf_oracle import YARN, build_hf_model, prompts, quantize_hf_checkpoint, save_hf_checkpoint

# on CPU whatever the machine: one GPU cannot hold several ranks
PARALLEL = {
    "tp2": dict(tensor_parallel_size=2, device="cpu"),
    "tp4": dict(tensor_parallel_size=4, device="cpu"),
    "ep2": dict(tensor_parallel_size=2, enable_expert_parallel=True, device="cpu"),
    "tp2+ep": dict(tensor_parallel_size=2, enable_expert_parallel=True, max_num_seqs=3, device="cpu"),
}


def check_parity(path, batch, refs, **engine_args):
    llm = test_hf_parity.check_parity(None, path, batch, refs, **engine_args)
    llm.engine.shutdown()  # the other ranks' processes go now, not when the test session ends
    return llm


@pytest.fixture(params=list(PARALLEL), ids=list(PARALLEL))
def parallel(request):
    return PARALLEL[request.param]


@pytest.fixture(scope="module")
def made() -> dict:
    """The oracles made so far, by test."""
    return {}


@pytest.fixture
def oracle(made, tmp_path_factory, request):
    """oracle(make) -> (checkpoint, prompts, HF's references) of this test; make(directory) -> (HF model,
    its checkpoint there, prompts) runs at the test's first layout only: the same seed, config and prompts
    give the others the same oracle."""

    def get(make):
        name = request.function.__name__
        if name not in made:
            hf, path, batch = make(tmp_path_factory.mktemp(name))
            made[name] = path, batch, test_hf_parity.references(hf, batch)
        return made[name]

    return get


def test_mixed_batch_and_chunked_prefill_match_hf(oracle, parallel):
    def make(where):
        hf = build_hf_model(seed=1, rope_parameters=YARN)
        return hf, save_hf_checkpoint(hf, where / "ckpt"), prompts(0, [5, 17, 33, 64])

    # a 7-token budget splits the longer prompts into chunks over their cached prefix, mixed with decodes
    check_parity(*oracle(make), max_num_batched_tokens=7, block_size=4, **parallel)


def test_preemption_matches_hf(oracle, parallel):
    def make(where):
        hf = build_hf_model(seed=3)
        return hf, save_hf_checkpoint(hf, where / "ckpt"), prompts(2, [20, 24, 28, 18])

    llm = check_parity(*oracle(make), num_kv_blocks=30, block_size=4, enable_prefix_caching=False, **parallel)
    assert llm.engine.scheduler.num_preemptions > 0


def test_sharded_checkpoint_and_prefix_cache_match_hf(oracle, parallel):
    def make(where):
        hf = build_hf_model(seed=4, q_lora_rank=None)
        batch = prompts(3, [11, 40])
        return hf, save_hf_checkpoint(hf, where / "ckpt", max_shard_size="40KB"), batch + [batch[1] + [7, 8, 9]]

    llm = check_parity(*oracle(make), block_size=4, **parallel)
    assert llm.engine.block_manager.hash_to_block  # the third prompt reused the second's blocks


def test_fp8_block_scaled_weights_match_hf(oracle, parallel):
    def make(where):
        hf = build_hf_model(seed=5, rope_parameters=YARN)
        path = save_hf_checkpoint(hf, where / "ckpt")
        quantize_hf_checkpoint(hf, path, (8, 8))  # blocks that tile every projection's slice at TP=4
        return hf, path, prompts(4, [13, 29])

    check_parity(*oracle(make), **parallel)


def test_fp8_blocks_that_do_not_tile_a_rank_slice_are_refused(tmp_path):
    cfg = ModelConfig.from_hf({**json.loads(json.dumps(_tiny_config())),
                               "quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16]}})
    from engine.models.deepseek_v3 import DeepseekV3ForCausalLM

    with pytest.raises(ValueError, match="do not tile"):
        DeepseekV3ForCausalLM(cfg, 64, ParallelContext(0, 4))


def _tiny_config() -> dict:
    hf = build_hf_model(seed=0)
    return {**hf.config.to_dict(), "architectures": ["DeepseekV3ForCausalLM"]}


@pytest.mark.parametrize("ep", [False, True], ids=["tp", "ep"])
def test_a_rank_reads_only_its_slice(tmp_path, monkeypatch, ep):
    """Rank 1 of 2 holds its half of the heads, the vocabulary and the experts' width (or, with expert
    parallelism, experts 4..7 whole), and reads from disk only those regions (safetensors slicing):
    never another rank's experts, and half of each split matrix."""
    import engine.loader as loader

    hf = build_hf_model(seed=7)
    path = save_hf_checkpoint(hf, tmp_path / "ckpt")
    reads = {}
    real_read = loader.CheckpointTensor.read

    def recording_read(self):
        reads[self.name] = tuple(self.shape)
        return real_read(self)

    monkeypatch.setattr(loader.CheckpointTensor, "read", recording_read)
    cfg = ModelConfig.from_dir(path)
    runner = ModelRunner(EngineConfig(model=str(path), dtype="float32", device="cpu", show_progress=False), cfg, path,
                         64, ParallelContext(1, 2, enable_expert_parallel=ep))
    full = load_file(str(path / "model.safetensors"))
    layer = runner.model.model.layers[1]
    experts = layer.mlp.experts
    down = "model.layers.1.mlp.experts.{}.down_proj.weight"
    if ep:
        assert experts.num_experts == 4 and experts.expert_offset == 4
        assert torch.equal(experts.w2[0], full[down.format(4)])
        assert down.format(0) not in reads and reads[down.format(4)] == tuple(full[down.format(4)].shape)
    else:
        inter = experts.inter
        assert torch.equal(experts.w2[0], full[down.format(0)][:, inter:])
        assert reads[down.format(0)] == (full[down.format(0)].shape[0], inter)  # its columns only
    q_b = "model.layers.0.self_attn.q_b_proj.weight"
    assert reads[q_b] == (full[q_b].shape[0] // 2, full[q_b].shape[1])  # its heads' rows only
    o = "model.layers.0.self_attn.o_proj.weight"
    assert reads[o] == (full[o].shape[0], full[o].shape[1] // 2)
    heads = runner.model.model.layers[0].self_attn.num_heads
    assert heads == cfg.num_attention_heads // 2
    emb = runner.model.model.embed_tokens
    assert torch.equal(emb.weight, full["model.embed_tokens.weight"][emb.start : emb.start + emb.num_local])
    assert reads["model.embed_tokens.weight"][0] == emb.num_local


def test_async_scheduling_over_two_ranks_gives_the_synchronous_tokens(tmp_path):
    """With async scheduling a decode step's inputs are rank 0's draws still on its device: they are
    broadcast inside the step, so rank 1 embeds the same tokens (seeded sampling and greedy alike)."""
    from engine import LLM, SamplingParams

    path = save_hf_checkpoint(build_hf_model(seed=8), tmp_path / "ckpt")
    batch = prompts(8, [6, 15, 9])
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=20, seed=4, max_tokens=10, ignore_eos=True)]
    sync = LLM(str(path), dtype="float32", device="cpu")
    want = [o.token_ids for o in sync.generate(batch, params)]
    llm = LLM(str(path), dtype="float32", device="cpu", tensor_parallel_size=2, async_scheduling="on")
    try:
        execute, ahead = llm.engine.executor.execute, []
        llm.engine.executor.execute = lambda plan, inputs=None, offsets=None: ahead.append(
            plan.input_ids is None) or execute(plan, inputs, offsets)
        assert [o.token_ids for o in llm.generate(batch, params)] == want
        assert ahead.count(True) >= 8  # decode steps went ahead on the draws in flight
    finally:
        llm.engine.shutdown()
