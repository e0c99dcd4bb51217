"""HF transformers' DeepseekV3ForCausalLM as the correctness oracle: tiny random models on CPU."""

from pathlib import Path

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, DynamicCache

from engine.tools.tokenizer_files import write_tokenizer

VOCAB = 384

BASE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
    first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
    max_position_embeddings=1024, initializer_range=0.15, rms_norm_eps=1e-6,
    bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
)

YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=256,
            beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)


def build_hf_model(seed: int = 0, **overrides) -> DeepseekV3ForCausalLM:
    cfg = {**BASE, **overrides}
    cfg.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**cfg)).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                # non-zero correction biases, so choosing experts by biased scores but weighting by
                # unbiased ones is exercised
                gate.e_score_correction_bias.copy_(0.2 * torch.randn_like(gate.e_score_correction_bias))
    return model


def save_hf_checkpoint(model: DeepseekV3ForCausalLM, path: Path, **save_kwargs) -> Path:
    """save_pretrained writes the layout DeepSeek publishes (per-expert tensors); add a tokenizer."""
    model.save_pretrained(path, **save_kwargs)
    write_tokenizer(path, model.config.vocab_size)
    return path


@torch.no_grad()
def hf_logits(model: DeepseekV3ForCausalLM, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(model: DeepseekV3ForCausalLM, ids: list[int], n: int) -> list[int]:
    """Greedy continuation with HF's own KV cache (it matches HF's full forward to ~3e-7 in fp32);
    EOS does not stop it, like ignore_eos on our side."""
    cache = DynamicCache(config=model.config)
    logits = model(torch.tensor([ids]), cache=cache, use_cache=True).logits
    out = []
    for _ in range(n):
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        logits = model(torch.tensor([[nxt]]), cache=cache, use_cache=True).logits
    return out


def prompts(seed: int, lengths: list[int], vocab: int = VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def quantize_hf_checkpoint(hf: DeepseekV3ForCausalLM, path: Path, block: tuple[int, int]) -> None:
    """Rewrite a saved checkpoint with FP8 e4m3 block-scaled weights, and set the oracle's weights to the
    same FP8 values dequantized (so both run the same numbers)."""
    import json

    from safetensors.torch import load_file, save_file

    from engine.tools.make_random_checkpoint import quantize_checkpoint

    tensors = quantize_checkpoint(load_file(str(path / "model.safetensors")), block)
    assert any(t.dtype == torch.float8_e4m3fn for t in tensors.values())
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)}
    (path / "config.json").write_text(json.dumps(cfg))
    state = hf.state_dict()
    b0, b1 = block
    with torch.no_grad():
        for name, t in tensors.items():
            if t.dtype == torch.float8_e4m3fn:
                scale = tensors[name + "_scale_inv"]
                deq = t.float() * scale.repeat_interleave(b0, 0)[: t.shape[0]].repeat_interleave(b1, 1)[:, : t.shape[1]]
                _set_hf_weight(hf, state, name, deq)


def _set_hf_weight(hf, state, name, value):
    """Write a published-layout tensor into HF's in-memory (fused-expert) layout."""
    if ".experts." in name:
        prefix, rest = name.split(".experts.")
        e, proj = int(rest.split(".")[0]), rest.split(".")[1]
        experts = hf.get_submodule(prefix + ".experts")
        inter = experts.down_proj.shape[-1]
        if proj == "down_proj":
            experts.down_proj[e].copy_(value)
        else:
            rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
            experts.gate_up_proj[e, rows].copy_(value)
    else:
        state[name].copy_(value)
