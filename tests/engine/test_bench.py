"""`deepseek-engine bench` end to end on the toy preset (CPU, reference path, HF peer), the presets'
shapes, and the byte / FLOP accounting behind the floors."""

import json

import pytest
import torch

from engine.bench.presets import PRESETS, preset_config
from engine.bench.report import write_plot
from engine.bench.roofline import PhaseCosts, expected_experts
from engine.cli import main
from engine.config import ModelConfig
from engine.layers.fp8_latent import FP8LatentLayout
from engine.models.deepseek_v3 import DeepseekV3ForCausalLM


def test_bench_writes_results_and_plot_with_the_peer(tmp_path):
    rc = main(["bench", "--preset", "tiny", "--device", "cpu", "--prompt-lens", "32,64", "--concurrency", "1,2",
               "--decode-context", "16", "--decode-steps", "2", "--hf-decode-steps", "2", "--repeats", "1",
               "--long-contexts", "48,96", "--turns", "48:16,16:32", "--compare-hf", "--out", str(tmp_path)])
    assert rc == 0
    result = json.loads((tmp_path / "tiny.json").read_text())
    # one stream after longer prompts: its own rows, each against a floor that grows with the context
    long = result["long_context_decode"]
    assert set(result["long_context_decode_tok_s"]) == {"48", "96"}
    assert [long[c]["context"] for c in ("48", "96")] == [48 + 3 + 1, 96 + 3 + 1]  # + warm-up, half the timed steps
    assert long["96"]["bytes"] > long["48"]["bytes"] > result["decode"]["1"]["bytes"]
    # a next turn over a cached prefix: the new tokens' rate, against floors that count the whole context
    turn = result["turn"]
    assert set(result["turn_tok_s"]) == {"48:16", "16:32"} and all(v > 0 for v in result["turn_tok_s"].values())
    assert (turn["48:16"]["prefix"], turn["48:16"]["new"]) == (48, 16)
    assert turn["48:16"]["flops"] > result["prefill"]["32"]["flops"] / 2 and turn["48:16"]["bytes"] > 0
    for key in ("preset", "gpu", "date", "command", "ceilings", "ttft_s", "prefill_tok_s", "decode_tok_s", "hf"):
        assert key in result
    assert result["preset"] == "tiny" and result["gpu"] == "cpu" and result["command"].startswith("deepseek-engine bench")
    assert result["pdl"] is False  # programmatic dependent launch: CUDA on Hopper or later only
    assert set(result["prefill_tok_s"]) == {"32", "64"} and set(result["decode_tok_s"]) == {"1", "2"}
    assert all(v > 0 for v in [*result["prefill_tok_s"].values(), *result["decode_tok_s"].values(), *result["ttft_s"].values()])
    assert result["ceilings"]["copy_bytes_per_s"] > 0 and result["ceilings"]["bf16_flops_per_s"] > 0
    for phase in (*result["prefill"].values(), *result["decode"].values()):
        assert phase["bytes"] > 0 and phase["flops"] > 0 and 0 < phase["bandwidth_fraction"]
    assert [layer["kind"] for layer in result["layers"]] == ["dense", "moe", "moe"]
    hf = result["hf"]
    assert set(hf["prefill_tok_s"]) == {"32", "64"} and all(v > 0 for v in hf["decode_tok_s"].values())
    assert set(result["speedup"]["decode"]) == {"1", "2"}
    assert (tmp_path / "tiny.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a phase that failed leaves its error in the JSON; the plot draws the others
    result["layers"] = {"error": "out of memory"}
    (tmp_path / "tiny.png").unlink()
    write_plot(result, tmp_path)
    assert (tmp_path / "tiny.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_takes_the_fp8_latent_cache_and_counts_its_bytes(tmp_path):
    decode_bytes = {}
    for dtype in ("auto", "fp8"):
        rc = main(["bench", "--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--prompt-lens", "32",
                   "--concurrency", "1", "--decode-context", "64", "--decode-steps", "2", "--repeats", "1",
                   "--kv-cache-dtype", dtype, "--no-pdl", "--no-gluon", "--no-fold-chunks",
                   "--no-shared-early", "--expert-dot", "--no-projection-dot", "--no-grouped-dot",
                   "--out", str(tmp_path / dtype)])
        assert rc == 0
        result = json.loads((tmp_path / dtype / "tiny.json").read_text())
        assert result["kv_cache_dtype"] == dtype and result["decode_tok_s"]["1"] > 0
        # neither runs on a CPU: the results say what ran
        assert result["gluon_prefill"] is False and result["gluon_decode"] is False
        assert result["fold_chunks"] is False and result["shared_early"] is False
        assert result["expert_dot"] is False and result["projection_dot"] is False and result["grouped_dot"] is False
        decode_bytes[dtype] = result["decode"]["1"]["bytes"]
    from engine.kernels import _util, fused_moe, gemv, mla_decode, mla_prefill, moe_gemv
    from engine.layers import attention

    # a run's --no-pdl does not outlive it, nor its --no-gluon, --no-fold-chunks, --no-shared-early,
    # --expert-dot, --no-projection-dot or --no-grouped-dot
    assert _util.PDL
    assert mla_prefill.GLUON and fused_moe.GLUON and mla_decode.GLUON
    assert attention.FOLD_CHUNKS
    assert moe_gemv.SHARED_EARLY and not moe_gemv.DOT and gemv.DOT and gemv.DOT_GROUPS
    cfg = ModelConfig.from_hf(preset_config("tiny"))
    # the same weights; per token and layer the cache's own bytes: float32 rows against e4m3 sections
    token_bytes = FP8LatentLayout(cfg.kv_lora_rank, cfg.qk_rope_head_dim, torch.float32).token_bytes
    context = 64 + 3 + 1  # the prompt, the warm-up steps and half the timed ones
    saved = cfg.num_hidden_layers * context * (cfg.kv_cache_dim * 4 - token_bytes)
    assert decode_bytes["auto"] - decode_bytes["fp8"] == pytest.approx(saved)


def test_bench_over_two_ranks_writes_its_figures(tmp_path):
    """`--tensor-parallel-size 2 --enable-expert-parallel`: the steps through the executor, two processes."""
    rc = main(["bench", "--preset", "tiny", "--device", "cpu", "--prompt-lens", "32", "--concurrency", "1,3",
               "--decode-context", "16", "--decode-steps", "3", "--repeats", "1", "--tensor-parallel-size", "2",
               "--enable-expert-parallel", "--out", str(tmp_path)])
    assert rc == 0
    result = json.loads((tmp_path / "tiny-tp2-ep.json").read_text())
    assert (result["tensor_parallel_size"], result["enable_expert_parallel"]) == (2, True)
    assert set(result["decode_tok_s"]) == {"1", "3"} and all(v > 0 for v in result["decode_tok_s"].values())
    assert result["prefill_tok_s"]["32"] > 0 and result["command"].endswith("--out " + str(tmp_path))


def test_bench_rejects_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--preset", "tiny", "--prompt-lens", "0,5"])
    assert e.value.code == 2 and "positive integers" in capsys.readouterr().err
    assert main(["bench", "--model", str(tmp_path / "missing"), "--device", "cpu", "--out", str(tmp_path)]) == 2
    assert "neither a directory" in capsys.readouterr().err
    assert main(["bench", "--preset", "v4-tiny", "--device", "cpu", "--turns", "64:16", "--out", str(tmp_path)]) == 2
    assert "--turns is measured for V3-family models on one rank" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--preset", "tiny", "--turns", "64"])
    assert "PREFIX:NEW" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.json"))


def _costs(name: str) -> tuple[PhaseCosts, DeepseekV3ForCausalLM]:
    cfg = ModelConfig.from_hf(preset_config(name))
    with torch.device("meta"):
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = DeepseekV3ForCausalLM(cfg, max_position=64)
        finally:
            torch.set_default_dtype(default)
    return PhaseCosts(model, cfg, kv_elem_bytes=2), model


def test_v2_lite_preset_has_v2_lites_size_and_bandwidth_floor():
    costs, model = _costs("v2-lite")
    total = sum(p.numel() for p in model.parameters())
    assert abs(total / 1e9 - 15.7) < 0.1  # DeepSeek-V2-Lite: 15.7 B parameters
    n_bytes, flops = costs.decode(batch=1, context=1)
    # one stream reads the active weights once: ~2.66 B active parameters less the unread embedding
    assert 4.6e9 < n_bytes < 5.1e9
    assert abs(flops / 2 / 1e9 - 2.45) < 0.1  # every active weight except the embedding, once
    assert 790 < 4.22e12 / n_bytes < 920  # the issue's ~790 tokens/s floor counts the embedding in


def test_v3_slice_keeps_fp8_blocks_and_counts_them_as_bytes():
    costs, model = _costs("v3-slice")
    experts = model.model.layers[1].mlp.experts
    assert experts.w13.dtype == torch.float8_e4m3fn and experts.w13_scale_inv.shape == (256, 32, 56)
    per_expert = costs.layers[1]["expert_bytes"]
    assert abs(per_expert - 3 * 7168 * 2048 * (1 + 1 / 128**2 * 4)) < 1e4  # FP8 weights + float32 block scales
    layer_bytes, _ = costs.decode_layer(1, batch=1, context=1)
    assert abs(layer_bytes - costs.layers[1]["rest_bytes"] - 8 * per_expert - 1152) < 1.0


def test_a_turn_costs_its_new_tokens_over_the_whole_context():
    costs, _ = _costs("v2-lite")
    cfg = costs.cfg
    # no prefix: the prompt's own prefill plus the expansion of its latents through W_UKV
    expand = 2.0 * 2048 * cfg.kv_lora_rank * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    assert costs.turn(0, 2048)[1] == pytest.approx(costs.prefill(2048)[1] + len(costs.layers) * expand)
    # a longer prefix: more attention, expansion and cache read; the weights' FLOPs stay the new tokens'
    (b1, f1), (b2, f2) = costs.turn(16384, 1024), costs.turn(32768, 1024)
    assert b2 - b1 == pytest.approx(16384 * costs.kv_row * len(costs.layers))
    per_token = cfg.num_attention_heads * 1024 * (2 * cfg.qk_head_dim + 2 * cfg.v_head_dim) + expand / 2048
    assert f2 - f1 == pytest.approx(16384 * per_token * len(costs.layers))


def test_expected_experts():
    assert expected_experts(64, 6, 1) == pytest.approx(6)
    assert expected_experts(64, 6, 10_000) == pytest.approx(64)
    assert 6 < expected_experts(64, 6, 8) < 48


def test_presets_are_valid_configs():
    for name in PRESETS:
        ModelConfig.from_hf(preset_config(name))
    with pytest.raises(ValueError, match="unknown preset"):
        preset_config("v9")


def test_v4_bench_writes_layers_floors_and_the_peer(tmp_path):
    rc = main(["bench", "--preset", "v4-tiny", "--device", "cpu", "--dtype", "float32", "--prompt-lens", "64,256",
               "--concurrency", "1,2", "--decode-context", "140", "--decode-steps", "2", "--hf-decode-steps", "2",
               "--repeats", "1", "--compare-hf", "--out", str(tmp_path)])
    assert rc == 0
    result = json.loads((tmp_path / "v4-tiny.json").read_text())
    assert result["layer_kinds"] == ["window", "window", "csa", "hca"]
    assert [layer["kind"] for layer in result["layers"]] == result["layer_kinds"]
    assert all(layer["bandwidth_floor_s"] > 0 and layer["ratio_to_bandwidth_floor"] > 0 for layer in result["layers"])
    assert all(v > 0 for v in [*result["prefill_tok_s"].values(), *result["decode_tok_s"].values()])
    assert all(v > 0 for v in [*result["hf"]["prefill_tok_s"].values(), *result["hf"]["decode_tok_s"].values()])
    assert set(result["speedup"]["decode"]) == {"1", "2"}


@pytest.mark.parametrize("weights", ["checkpoint", "bf16"])
def test_v4_slice_floors_count_window_entries_and_indexer_keys(weights):
    """V4 Flash's first four layers: ~27 B parameters, 256 experts of 3 x 4096 x 2048 (as shipped: MXFP4,
    17 bytes per 32 values with their E8M0 scales; or bf16); one stream at 8k context reads its active
    weights plus 128 window rows, 512 CSA entries, 2k indexer keys, 64 HCA entries."""
    from engine.bench.v4 import V4Costs
    from engine.models.deepseek_v4 import DeepseekV4ForCausalLM

    hf = preset_config("v4-slice")
    if weights == "bf16":
        hf = {k: v for k, v in hf.items() if k not in ("quantization_config", "expert_dtype")}
    cfg = ModelConfig.from_hf(hf)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = DeepseekV4ForCausalLM(cfg, max_position=16384)
    finally:
        torch.set_default_dtype(default)
    values = sum(p.numel() * (2 if p.dtype == torch.int8 else 1) for n, p in model.named_parameters()
                 if not n.endswith("_scale_inv"))  # two e2m1 codes a byte
    assert abs(values / 1e9 - 27.4) < 0.5
    costs = V4Costs(model, cfg, 2)
    per_expert = costs.layers[0]["expert_bytes"]
    assert per_expert == (3 * 4096 * 2048 * 17 // 32 if weights == "checkpoint" else 3 * 4096 * 2048 * 2)
    assert costs.layers[0]["expert_numel"] == 3 * 4096 * 2048
    wq_b = model.layers[0].attn.wq_b
    assert (wq_b.weight.dtype == torch.float8_e4m3fn) == (weights == "checkpoint")
    window, _ = costs.decode_layer(0, batch=1, context=8192)
    csa, _ = costs.decode_layer(2, batch=1, context=8192)
    hca, _ = costs.decode_layer(3, batch=1, context=8192)
    base = lambda i: costs.layers[i]["rest_bytes"] + 6 * per_expert
    assert window - base(0) == pytest.approx(128 * 512 * 2)
    assert csa - base(2) == pytest.approx((128 + 512) * 512 * 2 + 2048 * 128 * 2)
    assert hca - base(3) == pytest.approx((128 + 64) * 512 * 2)


def test_v41_bench_writes_layers_floors_and_the_host_tables_variant(tmp_path):
    """The V4.1 preset at a toy size: a window-only Engram layer, a KV source, a reuse and a reindex layer,
    each against its floors; decode again with the Engram tables in host memory; no peer to compare."""
    args = ["bench", "--preset", "v41-tiny", "--device", "cpu", "--dtype", "float32", "--prompt-lens", "64,256",
            "--concurrency", "1,2", "--decode-context", "140", "--decode-steps", "2", "--repeats", "1",
            "--out", str(tmp_path)]
    assert main(args) == 0
    result = json.loads((tmp_path / "v41-tiny.json").read_text())
    assert result["layer_kinds"] == ["window+engram", "source", "reuse", "reindex"]
    assert [layer["kind"] for layer in result["layers"]] == result["layer_kinds"]
    assert all(layer["bandwidth_floor_s"] > 0 and layer["ratio_to_bandwidth_floor"] > 0 for layer in result["layers"])
    assert all(v > 0 for v in [*result["prefill_tok_s"].values(), *result["decode_tok_s"].values()])
    host = result["variants"]["engram_host"]
    assert host["engram_tables"] == "host" and set(host["decode_tok_s"]) == {"1", "2"}
    assert all(v > 0 for v in host["decode_tok_s"].values())
    assert main(args + ["--compare-hf"]) == 2  # no transformers release has V4.1


def test_v41_slice_floors_count_quantized_rows_candidates_and_engram_rows():
    """V4.1 Flash's shapes in four layers: 384 experts of 3 x 5120 x 2304; one stream at 64k context reads
    its active weights plus FP8 window rows (528 B), FP4 entries (288 B) and indexer keys (68 B; the
    reindex layer only inside 2048 candidate blocks of 8), and 24 Engram rows of 256, never the table."""
    from engine.bench.v41 import V41Costs
    from engine.layers.engram import hash_primes
    from engine.models.deepseek_v41 import DeepseekV41ForCausalLM

    hf = preset_config("v41-slice")
    cfg = ModelConfig.from_hf(hf)
    primes = hash_primes(1, cfg.engram_max_ngram_size, cfg.engram_n_heads, cfg.engram_vocab_size)[0]
    assert cfg.engram_num_embeddings == (sum(p for heads in primes for p in heads),)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = DeepseekV41ForCausalLM(cfg, max_position=1 << 20)
    finally:
        torch.set_default_dtype(default)
    assert abs(sum(p.numel() for p in model.parameters()) / 1e9 - 57.7) < 0.5
    costs = V41Costs(model, cfg, 2)
    assert costs.layers[0]["expert_bytes"] == 3 * 5120 * 2304 * 2
    ctx = 65536
    extra = [costs.decode_layer(i, 1, ctx)[0] - costs.layers[i]["rest_bytes"] - 6 * costs.layers[i]["expert_bytes"]
             for i in range(4)]
    window, entries = 128 * 528, 512 * 288
    assert extra[0] == pytest.approx(window + 24 * 256 * 2)  # window only, Engram's rows
    assert extra[1] == pytest.approx(window + entries + ctx // 2 * 68)  # the source scores every key
    assert extra[2] == pytest.approx(window + entries)  # reuse: the source's picks
    assert extra[3] == pytest.approx(window + entries + 2048 * 8 * 68)  # reindex: inside the candidate blocks
    table = model.layers[0].engram.embed.weight
    assert costs.layers[0]["rest_bytes"] < 0.7e9 < table.numel() * 2  # the table is not counted as read
