"""Write a small random DeepSeek-V3-format checkpoint (config, safetensors, tokenizer) from a seed.

    python -m engine.tools.make_random_checkpoint OUT_DIR [--seed 0] [--fp8] [--max-shard-tensors N]

The tensors use the names and layout DeepSeek publishes (per-expert weights, FP8 blocks with
`weight_scale_inv` when --fp8), so the result exercises the same loading path as a real release.
"""

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.layers.fp8 import quantize_fp8_block
from engine.tools.tokenizer_files import write_tokenizer

TINY = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
    vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
    first_k_dense_replace=1, moe_layer_freq=1, norm_topk_prob=True, routed_scaling_factor=2.5,
    scoring_func="sigmoid", topk_method="noaux_tc", hidden_act="silu", rms_norm_eps=1e-6,
    max_position_embeddings=2048, rope_theta=10000.0,
    rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=512, beta_fast=32,
                      beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
    bos_token_id=0, eos_token_id=1, tie_word_embeddings=False, num_nextn_predict_layers=0,
    torch_dtype="float32",
)

# weights that DeepSeek keeps in high precision even in FP8 releases
_KEEP_HIGH_PRECISION = ("embed_tokens", "lm_head", "norm", "mlp.gate.", "layernorm")


def checkpoint_tensors(cfg: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random tensors under the published V3 names."""
    h, std = cfg["hidden_size"], 0.05
    rnd = lambda *shape: torch.randn(*shape, generator=gen) * std
    ones = lambda n: 1.0 + 0.1 * torch.randn(n, generator=gen)
    heads, nope, rope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    t = {"model.embed_tokens.weight": torch.randn(cfg["vocab_size"], h, generator=gen),
         "model.norm.weight": ones(h), "lm_head.weight": rnd(cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = ones(h)
        t[p + "post_attention_layernorm.weight"] = ones(h)
        a = p + "self_attn."
        if cfg.get("q_lora_rank"):
            t[a + "q_a_proj.weight"] = rnd(cfg["q_lora_rank"], h)
            t[a + "q_a_layernorm.weight"] = ones(cfg["q_lora_rank"])
            t[a + "q_b_proj.weight"] = rnd(heads * (nope + rope), cfg["q_lora_rank"])
        else:
            t[a + "q_proj.weight"] = rnd(heads * (nope + rope), h)
        t[a + "kv_a_proj_with_mqa.weight"] = rnd(cfg["kv_lora_rank"] + rope, h)
        t[a + "kv_a_layernorm.weight"] = ones(cfg["kv_lora_rank"])
        t[a + "kv_b_proj.weight"] = rnd(heads * (nope + v), cfg["kv_lora_rank"])
        t[a + "o_proj.weight"] = rnd(h, heads * v)
        m = p + "mlp."
        if i >= cfg["first_k_dense_replace"] and i % cfg.get("moe_layer_freq", 1) == 0:
            inter, n_exp = cfg["moe_intermediate_size"], cfg["n_routed_experts"]
            t[m + "gate.weight"] = rnd(n_exp, h) * 10
            t[m + "gate.e_score_correction_bias"] = 0.1 * torch.randn(n_exp, generator=gen)
            for e in range(n_exp):
                t[m + f"experts.{e}.gate_proj.weight"] = rnd(inter, h)
                t[m + f"experts.{e}.up_proj.weight"] = rnd(inter, h)
                t[m + f"experts.{e}.down_proj.weight"] = rnd(h, inter)
            shared = inter * cfg["n_shared_experts"]
            for name, shape in (("gate_proj", (shared, h)), ("up_proj", (shared, h)), ("down_proj", (h, shared))):
                t[m + f"shared_experts.{name}.weight"] = rnd(*shape)
        else:
            inter = cfg["intermediate_size"]
            t[m + "gate_proj.weight"] = rnd(inter, h)
            t[m + "up_proj.weight"] = rnd(inter, h)
            t[m + "down_proj.weight"] = rnd(h, inter)
    return t


def quantize_checkpoint(tensors: dict[str, torch.Tensor], block=(128, 128)) -> dict[str, torch.Tensor]:
    """Replace every 2-D projection weight by FP8 e4m3 + weight_scale_inv, as V3/R1 releases do."""
    out = {}
    for name, w in tensors.items():
        if w.dim() == 2 and name.endswith(".weight") and not any(k in name for k in _KEEP_HIGH_PRECISION):
            out[name], out[name + "_scale_inv"] = quantize_fp8_block(w, block)
        else:
            out[name] = w
    return out


def write_safetensors(tensors: dict[str, torch.Tensor], out: Path, max_shard_tensors: int | None = None) -> None:
    """One model.safetensors, or shards plus model.safetensors.index.json."""
    names = sorted(tensors)
    if not max_shard_tensors or len(names) <= max_shard_tensors:
        save_file({n: tensors[n].contiguous() for n in names}, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    chunks = [names[i : i + max_shard_tensors] for i in range(0, len(names), max_shard_tensors)]
    weight_map = {}
    for k, chunk in enumerate(chunks):
        fname = f"model-{k + 1:05d}-of-{len(chunks):05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in chunk}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in chunk})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def make_random_checkpoint(out: str | Path, seed: int = 0, fp8: bool = False, max_shard_tensors: int | None = None,
                           **overrides) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {**TINY, **overrides}
    gen = torch.Generator().manual_seed(seed)
    tensors = checkpoint_tensors(cfg, gen)
    if fp8:
        block = [16, 16]  # small blocks so tiny shapes still span several of them
        tensors = quantize_checkpoint(tensors, tuple(block))
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": block}
    write_safetensors(tensors, out, max_shard_tensors)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    write_tokenizer(out, cfg["vocab_size"])
    return out


# a vision tower small enough for CPU tests (V4.1's layout: 14-pixel patches in the release, 2 here)
TINY_VISION = dict(model_type="deepseek_v41_vision", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                   num_attention_heads=2, patch_size=2, downsample_ratio=3, rope_theta=10000.0,
                   max_image_tokens=64, min_pixels=24 * 24, max_wh_ratio=None)


def add_random_vision(out: str | Path, image_token_id: int, seed: int = 0, vision: dict | None = None,
                      std: float = 0.1) -> Path:
    """Give a checkpoint directory a random vision tower: `vision.safetensors` (`vision.*`, `aligner.*`,
    `image_start/end/newline`) and `vision_config` + `image_token_id` in its config.json."""
    from engine.models.deepseek_vit import Aligner, DeepseekViT, VisionConfig

    out = Path(out)
    cfg = json.loads((out / "config.json").read_text())
    vision = {**TINY_VISION, **(vision or {})}
    text = cfg.get("text_config", cfg)
    config = VisionConfig.from_dict(vision, image_token_id)
    gen = torch.Generator().manual_seed(seed)
    modules = {"vision": DeepseekViT(config), "aligner": Aligner(config, text["hidden_size"])}
    tensors = {f"{prefix}.{name}": std * torch.randn(p.shape, generator=gen) + name.split(".")[-2].startswith("norm")
               for prefix, module in modules.items() for name, p in module.named_parameters()}  # norms about 1
    for name in ("image_start", "image_end", "image_newline"):
        tensors[name] = torch.randn(text["hidden_size"], generator=gen)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(out / "vision.safetensors"), metadata={"format": "pt"})
    cfg["vision_config"] = vision
    cfg["image_token_id"] = image_token_id
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fp8", action="store_true", help="FP8 e4m3 block-scaled projection weights")
    ap.add_argument("--max-shard-tensors", type=int, default=None, help="split into shards of this many tensors")
    args = ap.parse_args()
    print(make_random_checkpoint(args.out, args.seed, args.fp8, args.max_shard_tensors))


if __name__ == "__main__":
    main()
