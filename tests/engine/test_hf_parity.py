"""Our engine against HF transformers' DeepseekV3ForCausalLM on tiny random checkpoints (float32)."""


import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.hf_oracle import (
    YARN,
    build_hf_model,
    hf_greedy,
    hf_logits,
    prompts,
    quantize_hf_checkpoint,
    save_hf_checkpoint,
)

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def references(hf, batch):
    """HF's logits over each prompt and its greedy continuation: what check_parity holds the engine to."""
    return [(hf_logits(hf, ids), hf_greedy(hf, ids, NEW_TOKENS)) for ids in batch]


def check_parity(hf, path, batch, refs=None, **engine_args):
    """refs: `references(hf, batch)` where a test already has them (hf is then not needed)."""
    # the reference path, on the CPU whatever the machine: on a GPU the Triton kernels' float32 dots run
    # in TF32 (~3e-4), and test_fast_path.py holds them to the reference path instead
    engine_args.setdefault("device", "cpu")
    llm = LLM(str(path), dtype="float32", **engine_args)
    if refs is None:
        refs = references(hf, batch)
    for ours, (ref, _) in zip(llm.score(batch), refs, strict=True):
        assert (ours - ref).abs().max().item() <= 1e-4
    outs = llm.generate(batch, GREEDY)
    for out, (_, tokens) in zip(outs, refs, strict=True):
        assert out.token_ids == tokens
        assert out.finish_reason == "length"
    assert llm.engine.kv_cache_usage == 0.0
    return llm


CASES = {
    "q_lora-group_routing-yarn": dict(rope_parameters=YARN),
    "no_q_lora": dict(q_lora_rank=None),
    "single_group_routing": dict(n_group=1, topk_group=1, num_experts_per_tok=3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_batch_of_prompts_matches_hf(tmp_path, case):
    hf = build_hf_model(seed=1, **CASES[case])
    path = save_hf_checkpoint(hf, tmp_path / "ckpt")
    check_parity(hf, path, prompts(0, [5, 17, 33, 64]))


def test_chunked_prefill_matches_hf(tmp_path):
    hf = build_hf_model(seed=2, rope_parameters=YARN)
    path = save_hf_checkpoint(hf, tmp_path / "ckpt")
    # a 7-token budget splits every prompt into chunks that attend to their cached prefix
    check_parity(hf, path, prompts(1, [30, 9, 45]), max_num_batched_tokens=7, block_size=4)


def test_preemption_matches_hf(tmp_path):
    hf = build_hf_model(seed=3)
    path = save_hf_checkpoint(hf, tmp_path / "ckpt")
    batch = prompts(2, [20, 24, 28, 18])
    # 30 blocks of 4 tokens hold ~2 of these sequences at full length: the rest get preempted
    llm = check_parity(hf, path, batch, num_kv_blocks=30, block_size=4, enable_prefix_caching=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == 30


def test_sharded_checkpoint_matches_hf(tmp_path):
    hf = build_hf_model(seed=4)
    path = save_hf_checkpoint(hf, tmp_path / "ckpt", max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 3
    check_parity(hf, path, prompts(3, [11, 40]))


def test_fp8_block_scaled_weights_match_hf_on_dequantized_weights(tmp_path):
    hf = build_hf_model(seed=5, rope_parameters=YARN)
    path = save_hf_checkpoint(hf, tmp_path / "ckpt")
    quantize_hf_checkpoint(hf, path, (16, 16))  # the oracle runs the same FP8 values, dequantized
    check_parity(hf, path, prompts(4, [13, 29]))


def test_deepseek_v2_lite_shape_matches_hf(tmp_path):
    """DeepseekV2ForCausalLM (V2-Lite's form: no q LoRA, softmax scoring, greedy top-k, 2 shared experts)."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    from tests.engine.hf_oracle import BASE

    cfg = {k: v for k, v in BASE.items() if k not in ("n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor")}
    cfg.update(q_lora_rank=None, n_shared_experts=2, topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0)
    torch.manual_seed(6)
    hf = DeepseekV2ForCausalLM(DeepseekV2Config(**cfg)).float().eval()
    path = save_hf_checkpoint(hf, tmp_path / "ckpt")
    check_parity(hf, path, prompts(5, [12, 33]))
