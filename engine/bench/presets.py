"""Named DeepSeek shapes for benchmarks with random weights (HF config.json dicts)."""

_COMMON = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, kv_lora_rank=512, hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0,
    scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1, bos_token_id=0, eos_token_id=1,
    tie_word_embeddings=False, num_nextn_predict_layers=0, torch_dtype="bfloat16", max_position_embeddings=163840,
)

PRESETS: dict[str, dict] = {
    # DeepSeek-V2-Lite's shape (15.7 B parameters, 2.66 B active) in the V3 architecture, bf16
    "v2-lite": dict(
        _COMMON, vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None,
        n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, n_group=1, topk_group=1,
        first_k_dense_replace=1, norm_topk_prob=False, routed_scaling_factor=1.0,
    ),
    # DeepSeek-V3's real layer shapes, FP8 block-scaled, first 4 layers (1 dense + 3 MoE) and the head
    "v3-slice": dict(
        _COMMON, vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=4, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
        first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                             "weight_block_size": [128, 128]},
    ),
    # a toy shape that runs anywhere in seconds (tests, smoke runs)
    "tiny": dict(
        _COMMON, vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1, norm_topk_prob=True,
        routed_scaling_factor=2.5, max_position_embeddings=4096,
    ),
}


def preset_config(name: str) -> dict:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return dict(PRESETS[name])
