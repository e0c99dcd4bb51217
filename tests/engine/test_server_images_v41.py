"""An image through a real server to a tiny random DeepSeek V4.1 checkpoint with a tiny vision tower, with
the official client: the request succeeds, the image's tokens count in usage, the same image again hits
the prefix cache; and which V4.1 checkpoints get a tower at all."""

import base64
import io
import json
from pathlib import Path

import openai
import pytest
import torch
from PIL import Image

from engine.models.deepseek_vit import VisionConfig
from engine.multimodal import ImageProcessor
from engine.tools.make_random_checkpoint import TINY_VISION, add_random_vision, write_safetensors
from engine.tools.tokenizer_files import write_tokenizer
from engine.config import ModelConfig
from tests.engine.conftest_server import MODEL_NAME, ServerProcess

FIXTURES = Path(__file__).parent / "fixtures" / "deepseek-v41"

IMAGE_TOKEN = 380
# a tiny text model in the released checkpoint's layout: window-only, compressing (sources 1 and 3) and
# reusing layers, no Engram
TEXT = dict(
    model_type="deepseek_v41_text", architectures=["DeepseekV41ForCausalLM"], vocab_size=384, hidden_size=64,
    num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=1, head_dim=64, q_lora_rank=32,
    qk_rope_head_dim=16, o_groups=2, o_lora_rank=16, sliding_window=8, compress_ratios=[0, 2, 2, 1, 1],
    kv_source_layer_ids=[1, 3], index_source_layer_ids=[1, 3], candidate_source_layer_id=-1, index_n_heads=16,
    index_head_dim=32, index_topk=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
    moe_intermediate_size=32, scoring_func="sqrtsoftplus", norm_topk_prob=True, routed_scaling_factor=1.5,
    swiglu_limit=10.0, hc_mult=2, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-20, rope_theta=10000.0,
    compress_rope_theta=160000.0, max_position_embeddings=1024, engram_layer_ids=[], num_nextn_predict_layers=0,
    eos_token_id=None, bos_token_id=None, dtype="float32",
)


def text_tensors(t: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random tensors under the released names and shapes."""
    rnd = lambda *shape: torch.randn(*shape, generator=gen) * 0.08  # noqa: E731
    ones = lambda n: 1.0 + 0.1 * torch.randn(n, generator=gen)  # noqa: E731
    h, d, q, heads, hc = t["hidden_size"], t["head_dim"], t["q_lora_rank"], t["num_attention_heads"], t["hc_mult"]
    groups, o_rank, e, inter = t["o_groups"], t["o_lora_rank"], t["n_routed_experts"], t["moe_intermediate_size"]
    mix = (2 + hc) * hc
    out = {"embed.weight": rnd(t["vocab_size"], h), "head.weight": rnd(t["vocab_size"], h), "norm.weight": ones(h)}
    for i, ratio in enumerate(t["compress_ratios"]):
        p = f"layers.{i}."
        out |= {p + "attn_norm.weight": ones(h), p + "ffn_norm.weight": ones(h)}
        for site in ("attn", "ffn"):
            out |= {p + f"hc_{site}_fn": rnd(mix, hc * h), p + f"hc_{site}_base": rnd(mix), p + f"hc_{site}_scale": ones(3)}
        a = p + "attn."
        out |= {a + "attn_sink": rnd(heads), a + "wq_a.weight": rnd(q, h), a + "q_norm.weight": ones(q),
                a + "wq_b.weight": rnd(heads * d, q), a + "wkv.weight": rnd(d, h), a + "kv_norm.weight": ones(d),
                a + "wo_a.weight": rnd(groups * o_rank, heads * d // groups), a + "wo_b.weight": rnd(h, groups * o_rank)}
        if i in t["kv_source_layer_ids"]:
            out |= {a + "compressor.wkv.weight": rnd(d, h), a + "compressor.norm.weight": ones(d)}
            if ratio > 1:
                out[a + "compressor.wgate.weight"] = rnd(d, h)
        if i in t["index_source_layer_ids"]:
            n, k = t["index_n_heads"], t["index_head_dim"]
            out |= {a + "indexer.wq_b.weight": rnd(n * k, q), a + "indexer.weights_proj.weight": rnd(n, h)}
            if i in t["kv_source_layer_ids"]:
                out |= {a + "indexer.wk.weight": rnd(k, d), a + "indexer.k_norm.weight": ones(k)}
        f = p + "ffn."
        out |= {f + "gate.weight": rnd(e, h), f + "gate.bias": rnd(e), f + "gate.bias_vl": rnd(e) * 10}
        for name, shape in (("w1", (inter, h)), ("w2", (h, inter)), ("w3", (inter, h))):
            out[f + f"shared_experts.{name}.weight"] = rnd(*shape)
            out |= {f + f"experts.{j}.{name}.weight": rnd(*shape) for j in range(e)}
    return out


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    path = tmp_path_factory.mktemp("v41-vision")
    write_safetensors(text_tensors(TEXT, torch.Generator().manual_seed(0)), path)
    (path / "config.json").write_text(json.dumps({"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
                                                  "text_config": TEXT, "tie_word_embeddings": False}))
    write_tokenizer(path, TEXT["vocab_size"])
    add_random_vision(path, IMAGE_TOKEN, seed=1, vision=VISION)
    proc = ServerProcess(path, tmp_path_factory.mktemp("log") / "server.log").wait_ready()
    yield openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0)
    proc.stop()


VISION = {**TINY_VISION, "max_image_tokens": 64}


def png(color) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (48, 48), color).save(buf, format="PNG")
    return buf.getvalue()


def image_url(color) -> str:
    return "data:image/png;base64," + base64.b64encode(png(color)).decode()


def chat(client, url):
    content = [{"type": "text", "text": "describe"}, {"type": "image_url", "image_url": {"url": url}}]
    return client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": content}],
                                          max_tokens=4, temperature=0)


def test_image_request_counts_its_tokens_and_hits_the_cache_again(client):
    text_only = client.chat.completions.create(model=MODEL_NAME, max_tokens=1, temperature=0,
                                               messages=[{"role": "user", "content": "describe\n"}])
    first = chat(client, image_url((200, 20, 20)))
    # the span budget of 64 (delimiters and newlines included) takes a 7 x 7 grid of this square image
    span = ImageProcessor(VisionConfig.from_dict(VISION, IMAGE_TOKEN)).process(png((200, 20, 20))).num_tokens
    assert span == 7 * 8 + 2
    assert first.choices[0].finish_reason in ("length", "stop")
    assert abs(first.usage.prompt_tokens - (text_only.usage.prompt_tokens + span)) <= 2  # the newline's token(s)
    again = chat(client, image_url((200, 20, 20)))
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].message.content == first.choices[0].message.content
    other = chat(client, image_url((20, 200, 20)))
    assert other.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens_details.cached_tokens


def test_a_tower_is_built_only_where_the_checkpoint_has_its_weights(tmp_path):
    """The released config.json names a vision tower even in text-only exports (the golden fixtures'):
    those get none (and images a 400), a checkpoint with `vision.*` tensors gets one."""
    text_only = FIXTURES / "noquant_onelevel_clamp"
    assert json.loads((text_only / "config.json").read_text()).get("vision_config")
    assert ModelConfig.from_dir(text_only).vision is None
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((text_only / name).read_bytes())
    add_random_vision(tmp_path, IMAGE_TOKEN, vision=VISION)
    assert ModelConfig.from_dir(tmp_path).vision.image_token_id == IMAGE_TOKEN
