"""Images through the engine (below the server) with a small stand-in vision-language model: the tiny
V3 text model with a vision tower mixed in, whose forward takes the hook the V4.1 model implements
(`image_embeds=`: span embeddings written over the placeholder tokens, `is_image` for bias_vl routing,
here a learned shift of the image tokens' embeddings)."""

import io

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from torch import nn

import engine.model_runner
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from engine.models.deepseek_vit import VisionConfig, VisionLanguageModel
from engine.multimodal import ImageProcessor, place_images
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence, SequenceStatus
from engine.step_plan import PlanBuilder
from engine.tools.make_random_checkpoint import TINY_VISION, add_random_vision, make_random_checkpoint

IMAGE_TOKEN = 500
VISION = VisionConfig.from_dict(TINY_VISION, IMAGE_TOKEN)


class StandInVLM(DeepseekV3ForCausalLM, VisionLanguageModel):
    """The tiny V3 model with DeepSeek-ViT and the image hook; it records what the engine hands it."""

    def __init__(self, cfg, max_position, par=engine.model_runner.SINGLE, **kwargs):
        super().__init__(cfg, max_position, par, **kwargs)
        self.init_vision(VISION, cfg.hidden_size)
        self.vl_shift = nn.Parameter(torch.zeros(cfg.hidden_size))  # stands in for gate.bias_vl
        self.embedded: list[tuple[int, int]] = []  # grids the tower ran on
        self.image_positions: list[int] = []  # positions the forward saw marked is_image

    def embed_image(self, pixel_values, grid):
        self.embedded.append(grid)
        return super().embed_image(pixel_values, grid)

    def forward(self, input_ids, positions, meta, image_embeds=None):
        h = self.model.embed_tokens(input_ids)
        if image_embeds is not None:
            h = image_embeds.merge(h) + image_embeds.is_image[:, None] * self.vl_shift
            self.image_positions += positions[image_embeds.is_image].tolist()
        residual = None
        for layer in self.model.layers:
            h, residual = layer(positions, h, residual, meta)
        return self.model.norm(h, residual)[0]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = make_random_checkpoint(tmp_path_factory.mktemp("vlm"), seed=0)
    add_random_vision(path, IMAGE_TOKEN, seed=1)
    save_file({"vl_shift": torch.randn(64, generator=torch.Generator().manual_seed(2))}, str(path / "shift.safetensors"))
    return path


@pytest.fixture
def make_engine(checkpoint, monkeypatch):
    monkeypatch.setattr(engine.model_runner, "model_class", lambda architecture: StandInVLM)
    return lambda **kw: LLMEngine(EngineConfig(**{**dict(model=str(checkpoint), dtype="float32", device="cpu",
                                                         show_progress=False, num_kv_blocks=64), **kw}))


def png(size, color) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


TEXT_BEFORE, TEXT_AFTER = list(range(2, 20)), [30, 31, 32]


def prompt_with(*images_bytes):
    processor = ImageProcessor(VISION)
    images = [processor.process(b) for b in images_bytes]
    ids = TEXT_BEFORE + sum(([IMAGE_TOKEN, 40 + i] for i in range(len(images))), []) + TEXT_AFTER
    return place_images(ids, images, IMAGE_TOKEN), images


def prompt_logits(eng: LLMEngine, ids, images) -> torch.Tensor:
    eng.add_request("score", ids, SamplingParams(temperature=0.0, max_tokens=1), collect_logits=True, images=images)
    seq = eng.requests["score"]
    while eng.has_unfinished_requests():
        eng.step()
    return torch.cat(seq.prompt_logits)[: len(ids)]


def run(eng: LLMEngine, rid: str, ids, images, max_tokens=3):
    eng.add_request(rid, ids, SamplingParams(temperature=0.0, max_tokens=max_tokens), images=images)
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id == rid and out.finished:
                final = out
    return final


def test_chunked_prefill_splits_images_but_embeds_each_once(make_engine):
    ids, images = prompt_with(png((24, 24), (200, 30, 30)), png((48, 24), (10, 90, 250)))
    spans = [image.span for image in images]
    assert spans[0][1] - spans[0][0] == 22 and spans[1][1] - spans[1][0] == 38
    whole = make_engine()
    expected = prompt_logits(whole, ids, images)
    chunked = make_engine(max_num_batched_tokens=8)  # every span crosses several steps
    got = prompt_logits(chunked, ids, images)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    model = chunked.runner.model
    assert model.embedded == [images[0].grid, images[1].grid]  # once per image, not once per chunk
    assert sorted(model.image_positions) == [p for a, b in spans for p in range(a, b)]
    assert chunked.runner.image_embeds == {}  # nothing kept past the spans


def test_the_image_changes_the_logits_after_its_start(make_engine):
    eng = make_engine()
    ids, images = prompt_with(png((24, 24), (200, 30, 30)))
    other_ids, other = prompt_with(png((24, 24), (30, 200, 30)))
    assert ids == other_ids  # the same placeholders
    a, b = prompt_logits(eng, ids, images), prompt_logits(eng, ids, other)
    start = images[0].offset
    # up to and including IMAGE_START (a learned vector, the same for every image) nothing differs
    torch.testing.assert_close(a[: start + 1], b[: start + 1])
    assert (a[start + 1 :] - b[start + 1 :]).abs().amax(dim=-1).min() > 1e-3  # every position after it does


def test_prefix_cache_hits_the_same_image_and_misses_another(make_engine):
    eng = make_engine()
    ids, images = prompt_with(png((24, 24), (200, 30, 30)))  # span [18, 40): blocks 1 and 2 touch it
    first = run(eng, "a", ids, images)
    again = run(eng, "b", ids, prompt_with(png((24, 24), (200, 30, 30)))[1])
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == 32  # the two full blocks, image tokens included
    assert again.token_ids == first.token_ids
    green = prompt_with(png((24, 24), (30, 200, 30)))[1]
    other = run(eng, "c", ids, green)
    assert other.num_cached_tokens == 16  # block 0, text only; block 1 holds the other image's tokens: a miss
    fresh = make_engine(enable_prefix_caching=False)
    assert run(fresh, "d", ids, images).token_ids == first.token_ids
    assert run(fresh, "e", ids, green).token_ids == other.token_ids


def test_a_model_without_vision_refuses_images(checkpoint, tmp_path):
    text_only = make_random_checkpoint(tmp_path, seed=0)
    eng = LLMEngine(EngineConfig(model=str(text_only), dtype="float32", device="cpu", show_progress=False,
                                 num_kv_blocks=16))
    ids, images = prompt_with(png((24, 24), (1, 2, 3)))
    with pytest.raises(ValueError, match="no vision tower"):
        eng.add_request("x", ids, SamplingParams(max_tokens=1), images=images)


def test_images_must_sit_on_placeholders(make_engine):
    eng = make_engine()
    ids, images = prompt_with(png((24, 24), (1, 2, 3)))
    ids[images[0].offset + 3] = 7
    with pytest.raises(ValueError, match="not all the image placeholder"):
        eng.add_request("x", ids, SamplingParams(max_tokens=1), images=images)


def test_plans_send_patches_once_and_again_after_a_preemption():
    ids, images = prompt_with(png((24, 24), (1, 2, 3)))
    seq = Sequence("r", ids, SamplingParams(), images=images)
    seq.status, seq.block_table = SequenceStatus.RUNNING, [0, 1, 2]
    builder = PlanBuilder(4)
    start = images[0].offset
    seq.num_computed_tokens = start - 2
    first = builder.build(ScheduledBatch(prefills=[(seq, 8)]))
    (part,) = first.images
    assert (part.index, part.first, part.count, part.last) == (2, 0, 6, False) and part.pixel_values is not None
    seq.num_computed_tokens += 8
    second = builder.build(ScheduledBatch(prefills=[(seq, 8)]))
    assert second.images[0].pixel_values is None and (second.images[0].first, second.images[0].count) == (6, 8)
    seq.status, seq.block_table = SequenceStatus.WAITING, []  # preempted in the middle of the image
    assert builder.build(ScheduledBatch()).drop_images == ["r#0"]
    seq.status, seq.block_table, seq.num_computed_tokens = SequenceStatus.RUNNING, [3, 1, 2], start + 14
    third = builder.build(ScheduledBatch(prefills=[(seq, 16)]))
    (part,) = third.images
    assert part.pixel_values is not None and (part.first, part.count, part.last) == (14, 8, True)
