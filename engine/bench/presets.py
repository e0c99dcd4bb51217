"""Named DeepSeek shapes for benchmarks with random weights (HF config.json dicts)."""

_COMMON = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, kv_lora_rank=512, hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0,
    scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1, bos_token_id=0, eos_token_id=1,
    tie_word_embeddings=False, num_nextn_predict_layers=0, torch_dtype="bfloat16", max_position_embeddings=163840,
)

# DeepSeek's V4 config.json keys: a compression ratio per layer, the hash layers by count, YaRN for the
# compressed layers' rope
_V4 = dict(
    architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", n_shared_experts=1, scoring_func="sqrtsoftplus",
    norm_topk_prob=True, routed_scaling_factor=1.5, swiglu_limit=10.0, hc_eps=1e-6, rms_norm_eps=1e-6,
    rope_theta=10000.0, compress_rope_theta=160000.0, max_position_embeddings=1048576,
    rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                  "beta_slow": 1},
    bos_token_id=0, eos_token_id=1, tie_word_embeddings=False, num_nextn_predict_layers=0, torch_dtype="bfloat16",
)

# DeepSeek's V4.1 config keys (the flat `deepseek_v41_text` form): every shared-cache and Engram id written
# out, numbered over the layers a preset keeps
_V41 = dict(
    _V4, architectures=["DeepseekV41ForCausalLM"], model_type="deepseek_v41_text", num_hash_layers=0,
    rms_norm_eps=1e-20, gate_temp=1.0, engram_max_ngram_size=4, engram_pad_id=2,
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
    # DeepSeek-V4 Flash's real layer shapes, its first 4 layers as it orders them: two sliding-window-only
    # layers, a CSA (ratio 4, indexer top-512) and an HCA (ratio 128) layer, the first three hash-routed;
    # 256 experts top-6, 4 residual streams. Weights as Flash ships them: the dense projections of attention
    # (wq_a, wq_b, wkv, wo_a, wo_b, the indexer's wq_b) and the shared expert FP8 e4m3 in 128x128 blocks,
    # the routed experts MXFP4; bf16 the compressors' wkv / wgate, the indexer's weights_proj, embedding and
    # head; float32 norms, router, mHC, sinks and position biases (`--weights bf16`: all bf16)
    "v4-slice": dict(
        _V4, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                  "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
        expert_dtype="fp4", vocab_size=129280, hidden_size=4096, num_hidden_layers=4, num_attention_heads=64, head_dim=512,
        qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, moe_intermediate_size=2048,
        n_routed_experts=256, num_experts_per_tok=6, compress_ratios=[0, 0, 4, 128], num_hash_layers=3,
        sliding_window=128, hc_mult=4, hc_sinkhorn_iters=20, index_n_heads=64, index_head_dim=128,
        index_topk=512,
    ),
    # the V4 architecture at a toy size (tests, smoke runs)
    "v4-tiny": dict(
        _V4, vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=32,
        qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16, moe_intermediate_size=32,
        n_routed_experts=8, num_experts_per_tok=2, compress_ratios=[0, 0, 4, 128],
        num_hash_layers=1, sliding_window=8, hc_mult=2, hc_sinkhorn_iters=3, index_n_heads=4, index_head_dim=16,
        index_topk=4, max_position_embeddings=8192,
    ),
    # DeepSeek-V4.1 Flash's real layer shapes (hidden 5120, 64 heads of 512, q_lora 1280, o_groups 8 x 1024,
    # 384 experts of 3 x 5120 x 2304 top-6 + 1 shared, 4 streams, window 128, indexer 32 x 128 top-512) in
    # four layers, 27 GB each in bf16 (five would not fit one H200): Flash's layer 1 (window only, Engram),
    # layer 2 (KV source, ratio 2, its indexer; the candidate source, as Flash's layer 20 is), layer 3
    # (reuses layer 2's entries and picks) and a reindex layer (its own indexer over the source's keys,
    # inside the candidate blocks, as Flash's layers 24-36; those read the ratio-1 source 20, this one
    # ratio 2). The Engram table is scaled down: primes above 200,000 instead of 16,000,000, so 4.8 M rows
    # of 256 (2.5 GB in bf16) instead of 384 M; a token still gathers 24 rows, as in Flash.
    "v41-slice": dict(
        _V41, vocab_size=129280, hidden_size=5120, num_hidden_layers=4, num_attention_heads=64,
        num_key_value_heads=1, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1280, o_groups=8, o_lora_rank=1024,
        moe_intermediate_size=2304, n_routed_experts=384, num_experts_per_tok=6, compress_ratios=[0, 2, 2, 2],
        kv_source_layer_ids=[1], index_source_layer_ids=[1, 3], candidate_source_layer_id=1,
        candidate_topk_blocks=2048, candidate_block_size=8, sliding_window=128, hc_mult=4, hc_sinkhorn_iters=20,
        index_n_heads=32, index_head_dim=128, index_topk=512, engram_layer_ids=[0], engram_n_heads=8,
        engram_head_dim=256, engram_vocab_size=200_000, engram_compressed_vocab_size=99092,
        engram_num_embeddings=[4_803_306],  # the sum of the layer's 24 hash primes
    ),
    # the V4.1 architecture at a toy size, the same four kinds of layer (tests, smoke runs)
    "v41-tiny": dict(
        _V41, vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
        head_dim=64, qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=16, moe_intermediate_size=32,
        n_routed_experts=8, num_experts_per_tok=2, compress_ratios=[0, 2, 2, 2], kv_source_layer_ids=[1],
        index_source_layer_ids=[1, 3], candidate_source_layer_id=1, candidate_topk_blocks=3, candidate_block_size=4,
        sliding_window=8, hc_mult=2, hc_sinkhorn_iters=3, index_n_heads=4, index_head_dim=32, index_topk=4,
        engram_layer_ids=[0], engram_max_ngram_size=3, engram_n_heads=2, engram_head_dim=16, engram_vocab_size=64,
        engram_compressed_vocab_size=400, engram_num_embeddings=[290], max_position_embeddings=8192,
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
