"""Bad input is a clear exception that names the problem."""

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.llm_engine import PromptTooLongError
from engine.loader import CheckpointError
from engine.tools.make_random_checkpoint import make_random_checkpoint


@pytest.mark.parametrize("field, value, words", [
    ("temperature", -0.5, "temperature"),
    ("top_p", 0.0, "top_p"),
    ("top_p", 1.5, "top_p"),
    ("top_k", 0, "top_k"),
    ("max_tokens", 0, "max_tokens"),
    ("logprobs", 50, "logprobs"),
    ("presence_penalty", 3.0, "presence_penalty"),
    ("stop", [""], "stop"),
])
def test_invalid_sampling_values(field, value, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**{field: value})


def test_prompt_longer_than_max_model_len(random_checkpoint):
    llm = LLM(str(random_checkpoint), dtype="float32", max_model_len=16)
    with pytest.raises(PromptTooLongError, match="16"):
        llm.generate([[5] * 16], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match=r"\[0, 512\)"):
        llm.generate([[5, 100000]], SamplingParams(max_tokens=1))
    assert not llm.engine.has_unfinished_requests()  # nothing half-submitted stays queued


def test_unsupported_architecture(tmp_path):
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM"):
        ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})


def test_deepseek_and_transformers_config_forms_agree():
    published = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
                 "num_hidden_layers": 1, "num_attention_heads": 1, "kv_lora_rank": 4, "qk_nope_head_dim": 2,
                 "qk_rope_head_dim": 2, "v_head_dim": 2, "torch_dtype": "bfloat16", "rope_theta": 10000,
                 "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                  "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}
    hf5 = {k: v for k, v in published.items() if k not in ("torch_dtype", "rope_theta", "rope_scaling")}
    hf5["dtype"] = "bfloat16"
    hf5["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000, "factor": 40,
                              "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                              "mscale": 1.0, "mscale_all_dim": 1.0}
    assert ModelConfig.from_hf(published) == ModelConfig.from_hf(hf5)


@pytest.fixture
def sharded(tmp_path):
    return make_random_checkpoint(tmp_path / "ckpt", seed=1, max_shard_tensors=20)


def test_missing_shard(sharded):
    victim = sorted(sharded.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        LLM(str(sharded), dtype="float32")


def test_corrupt_shard(sharded):
    victim = sorted(sharded.glob("model-*.safetensors"))[0]
    victim.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(CheckpointError, match=victim.name):
        LLM(str(sharded), dtype="float32")


def _rewrite(path, change):
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    change(tensors)
    save_file(tensors, str(f))


def test_missing_extra_and_misshaped_tensors(tmp_path):
    src = make_random_checkpoint(tmp_path / "src", seed=2)
    cases = {
        "lacks 1 tensor": lambda t: t.pop("model.layers.0.self_attn.o_proj.weight"),
        "unexpected tensor model.layers.0.self_attn.bogus.weight": lambda t: t.__setitem__(
            "model.layers.0.self_attn.bogus.weight", t["model.norm.weight"].clone()),
        r"model.layers.1.mlp.experts.3.up_proj.weight: shape mismatch": lambda t: t.__setitem__(
            "model.layers.1.mlp.experts.3.up_proj.weight", t["model.layers.1.mlp.experts.3.up_proj.weight"][:-1].clone()),
    }
    for i, (message, change) in enumerate(cases.items()):
        path = tmp_path / f"case{i}"
        shutil.copytree(src, path)
        _rewrite(path, change)
        with pytest.raises(CheckpointError, match=message):
            LLM(str(path), dtype="float32")


def test_mtp_layer_is_skipped_on_purpose(tmp_path):
    path = make_random_checkpoint(tmp_path / "ckpt", seed=3)
    _rewrite(path, lambda t: t.__setitem__("model.layers.3.eh_proj.weight", t["model.layers.0.self_attn.o_proj.weight"].clone()))
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 3
    LLM(str(path), dtype="float32")  # layer 3 is the MTP layer: loads without complaint


def test_missing_model_dir_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a directory"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(tmp_path))
