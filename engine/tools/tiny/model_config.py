"""The shape of deepseek-tiny: a DeepSeek-V3 config scaled down (MLA, sigmoid-routed MoE with a shared expert, MTP)."""

VOCAB_SIZE = 8192
MAX_LEN = 1024


def tiny_config(vocab_size: int = VOCAB_SIZE, max_len: int = MAX_LEN) -> dict:
    """config.json fields as DeepSeek publishes them for V3 (transformers reads them as they are)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "intermediate_size": 640,  # the dense first layer
        "moe_intermediate_size": 160,
        "num_hidden_layers": 6,
        "num_nextn_predict_layers": 1,  # one MTP layer, stored as model.layers.6.*
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "q_lora_rank": 128,
        "kv_lora_rank": 128,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "hidden_act": "silu",
        "max_position_embeddings": max_len,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.02,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "use_cache": True,
        "torch_dtype": "bfloat16",
    }
