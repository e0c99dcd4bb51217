"""HF transformers' DeepseekV4ForCausalLM (5.24) as the correctness oracle: tiny random models on CPU.

The tiny shape follows HF's own V4 test (hidden 64, 4 heads of 32 with 8 rotary, 2 residual streams,
4 experts top-2) with small compression rates, so prompts of a few dozen tokens span several windows of
every kind: CSA pools 4 tokens (overlapping), HCA 8, the sliding window is 8. HF's initializer leaves
the position biases, sinks, mHC biases and the hash table at zero or one; they get random values here
so every term is exercised. save_hf_checkpoint / hf_logits / hf_greedy (hf_oracle) serve V4 as they are:
save_pretrained writes DeepSeek's layout (attn.wq_a, ffn.experts.E.w1, ...). HF has no MTP block;
add_mtp_block writes one (`mtp.0.*`) beside a saved checkpoint for speculative decoding.
"""

import json
from pathlib import Path

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from engine.layers.fp8 import dequantize_fp8_block, dequantize_mxfp4, quantize_fp8_block, quantize_mxfp4

VOCAB = 320

BASE = dict(
    vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=4,
    head_dim=32, partial_rotary_factor=0.25, q_lora_rank=32, o_groups=2, o_lora_rank=16,
    n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=64,
    max_position_embeddings=512, initializer_range=0.15,
    layer_types=["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention",
                 "compressed_sparse_attention"],
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    # 16 indexer heads: with ReLU scores, few heads make exact ties (all zero) that top-k breaks arbitrarily
    sliding_window=8, hc_mult=2, hc_sinkhorn_iters=3, index_n_heads=16, index_head_dim=16, index_topk=3,
    num_nextn_predict_layers=0, bos_token_id=0, eos_token_id=1,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                     "beta_fast": 32, "beta_slow": 1},
)


@torch.no_grad()
def build_v4_model(seed: int = 0, **overrides) -> DeepseekV4ForCausalLM:
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**{**BASE, **overrides})).float().eval()
    for name, p in model.named_parameters():
        if name.endswith(("position_bias", "sinks", ".base", "hc_base")):
            p.copy_(0.5 * torch.randn_like(p))
        elif name.endswith((".scale", "hc_scale")):
            p.copy_(1 + 0.3 * torch.randn_like(p))
        elif name.endswith(("norm.weight", "layernorm.weight")):
            p.copy_(1 + 0.2 * torch.randn_like(p))
    for layer in model.model.layers:
        gate = layer.mlp.gate
        if hasattr(gate, "tid2eid"):  # distinct experts per token, as DeepSeek's table has
            n, k = gate.tid2eid.shape
            gate.tid2eid.copy_(torch.stack([torch.randperm(gate.num_experts)[:k] for _ in range(n)]))
        else:
            gate.e_score_correction_bias.copy_(0.2 * torch.randn_like(gate.e_score_correction_bias))
    return model


@torch.no_grad()
def add_mtp_block(path: Path, seed: int = 0) -> None:
    """Give a saved tiny V4 checkpoint DeepSeek's MTP block `mtp.0.*` (which save_pretrained never writes):
    the layer names of a sliding-window, score-routed layer (those of a one-layer HF model, random as
    build_v4_model makes them), the kv norm spelled `attn.kv_norm` as DeepSeek's release does, and the
    block's own enorm, hnorm, e_proj, h_proj, norm and hc_head; num_nextn_predict_layers becomes 1. The
    target's tensors are untouched: the HF model saved there stays the oracle."""
    import tempfile

    from safetensors.torch import load_file, save_file

    config = json.loads((path / "config.json").read_text())
    one = build_v4_model(seed, num_hidden_layers=1, layer_types=["sliding_attention"], mlp_layer_types=["moe"])
    with tempfile.TemporaryDirectory() as tmp:
        one.save_pretrained(tmp)
        layer = load_file(Path(tmp) / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    hidden, n = config["hidden_size"], config["hc_mult"]
    mtp = {}
    for name, t in layer.items():
        if name.startswith("model.layers.0."):
            rest = name.removeprefix("model.layers.0.").replace("attn.norm.", "attn.kv_norm.")
            mtp[f"mtp.0.{rest}"] = t
    mtp.update({
        "mtp.0.enorm.weight": 1 + 0.2 * torch.randn(hidden, generator=g),
        "mtp.0.hnorm.weight": 1 + 0.2 * torch.randn(hidden, generator=g),
        "mtp.0.e_proj.weight": 0.15 * torch.randn(hidden, hidden, generator=g),
        "mtp.0.h_proj.weight": 0.15 * torch.randn(hidden, hidden, generator=g),
        "mtp.0.norm.weight": 1 + 0.2 * torch.randn(hidden, generator=g),
        "mtp.0.hc_head_fn": 0.15 * torch.randn(n, n * hidden, generator=g),
        "mtp.0.hc_head_base": 0.5 * torch.randn(n, generator=g),
        "mtp.0.hc_head_scale": 1 + 0.3 * torch.randn(1, generator=g),
    })
    save_file(mtp, path / "mtp.safetensors", metadata={"format": "pt"})
    index = path / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"].update(dict.fromkeys(mtp, "mtp.safetensors"))
        index.write_text(json.dumps(data, indent=2))
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config, indent=2))


def quantize_v4_checkpoint(model: DeepseekV4ForCausalLM, path: Path, block: tuple[int, int]) -> None:
    """Rewrite the saved checkpoint as V4 ships it: FP8 e4m3 blocks with power-of-two (E8M0) scales
    `<module>.scale` for the attention's dense projections (the indexer's wq_b too) and the shared expert,
    MXFP4 routed experts
    (e2m1 codes, E8M0 scale per 32); then give the HF model the same values, dequantized."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(file)
    hf_state = dict(model.named_parameters())
    out = {}
    for name, t in tensors.items():
        dense = any(f".attn.{p}.weight" in name for p in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "indexer.wq_b"))
        shared = ".shared_experts.w" in name
        routed = ".ffn.experts." in name
        if dense or shared:
            q, scale_inv = quantize_fp8_block(t, block)
            scale = torch.exp2(torch.ceil(torch.log2(scale_inv)))  # ue8m0: the next power of two
            q = (t / scale.repeat_interleave(block[0], 0)[: t.shape[0]].repeat_interleave(block[1], 1)[:, : t.shape[1]]
                 ).to(torch.float8_e4m3fn)
            out[name], out[name.removesuffix("weight") + "scale"] = q, scale.to(torch.float8_e8m0fnu)
            value = dequantize_fp8_block(q, scale, block)
        elif routed:
            codes, scale = quantize_mxfp4(t)
            out[name], out[name.removesuffix("weight") + "scale"] = codes.view(torch.int8), scale
            value = dequantize_mxfp4(codes, scale)
        else:
            out[name] = t
            continue
        _set_hf(model, hf_state, name, value)
    save_file(out, file, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                     "weight_block_size": list(block)}
    config["expert_dtype"] = "fp4"
    (path / "config.json").write_text(json.dumps(config, indent=2))


def _set_hf(model, state, name: str, value: torch.Tensor) -> None:
    """Write a published-layout tensor's value into the HF model's (fused) parameter."""
    parts = name.removeprefix("model.").split(".")
    layer = model.model.layers[int(parts[1])]
    if parts[3] == "experts":  # ffn.experts.E.wK.weight
        e, w = int(parts[4]), parts[5]
        inter = layer.mlp.experts.intermediate_dim
        if w == "w2":
            layer.mlp.experts.down_proj.data[e].copy_(value)
        else:
            rows = slice(0, inter) if w == "w1" else slice(inter, 2 * inter)
            layer.mlp.experts.gate_up_proj.data[e, rows].copy_(value)
    elif parts[3] == "shared_experts":
        proj = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}[parts[4]]
        getattr(layer.mlp.shared_experts, proj).weight.data.copy_(value)
    elif parts[3] == "indexer":  # attn.indexer.wq_b.weight
        layer.self_attn.compressor.indexer.q_b_proj.weight.data.copy_(value)
    else:
        proj = {"wq_a": "q_a_proj", "wq_b": "q_b_proj", "wkv": "kv_proj", "wo_a": "o_a_proj", "wo_b": "o_b_proj"}[parts[3]]
        getattr(layer.self_attn, proj).weight.data.copy_(value)
