"""DeepSeek-ViT, the aligner and the image framing against plain PyTorch written out here: attention by
an explicit softmax, the 2D rope by rotating each channel pair by its own angle, the aligner's windows
gathered one by one."""

import math

import pytest
import torch
from torch import nn

from engine.models.deepseek_vit import (
    Aligner,
    DeepseekViT,
    ImageEmbeds,
    VisionConfig,
    VisionLanguageModel,
    rope_2d,
)

CONFIG = VisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, patch_size=2,
                      downsample_ratio=3, rope_theta=10000.0, image_token_id=7)
GRID = (4, 5)  # neither side a multiple of the 3x3 window: the aligner pads both


def randomize(module: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if p.dim() == 1 and p.shape[0] == 32 else 0.0))


def ref_rope(x: torch.Tensor, grid: tuple[int, int], theta: float) -> torch.Tensor:
    """x [P, heads, D]: channel i and channel i + D/2 rotate together by angle row * f_i (i < D/4) or
    column * f_(i - D/4), with f_j = theta ** (-4j / D)."""
    out = x.clone()
    d = x.shape[-1]
    for p in range(x.shape[0]):
        row, col = divmod(p, grid[1])
        for i in range(d // 2):
            freq = theta ** (-4 * (i % (d // 4)) / d)
            angle = (row if i < d // 4 else col) * freq
            c, s = math.cos(angle), math.sin(angle)
            a, b = x[p, :, i], x[p, :, i + d // 2]
            out[p, :, i] = a * c - b * s
            out[p, :, i + d // 2] = a * s + b * c
    return out


def ref_rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)


def ref_vit(vit: DeepseekViT, pixels: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    c = vit.config
    heads, d = c.num_attention_heads, c.head_dim
    x = pixels @ vit.patch_embed.proj.weight.T + vit.patch_embed.proj.bias
    for block in vit.blocks:
        h = ref_rms(x, block.norm1.weight)
        qkv = h @ block.attn.wqkv.weight.T + block.attn.wqkv.bias
        q, k, v = (qkv[:, i * c.hidden_size:(i + 1) * c.hidden_size].reshape(-1, heads, d) for i in range(3))
        q, k = ref_rope(q, grid, c.rope_theta), ref_rope(k, grid, c.rope_theta)
        scores = torch.einsum("phd,qhd->hpq", q, k) / math.sqrt(d)
        weights = torch.exp(scores - scores.max(-1, keepdim=True).values)
        weights = weights / weights.sum(-1, keepdim=True)
        attn = torch.einsum("hpq,qhd->phd", weights, v).reshape(-1, c.hidden_size)
        x = x + attn @ block.attn.wo.weight.T + block.attn.wo.bias
        h = ref_rms(x, block.norm2.weight)
        gu = h @ block.mlp.w1.weight.T
        gate, up = gu[:, :c.intermediate_size], gu[:, c.intermediate_size:]
        x = x + (gate * torch.sigmoid(gate) * up) @ block.mlp.w2.weight.T
    return ref_rms(x, vit.norm.weight)


def ref_aligner(aligner: Aligner, feats: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    r, (n_h, n_w) = aligner.ratio, grid
    grid_feats = feats.view(n_h, n_w, -1)
    rows = []
    for wi in range(-(-n_h // r)):
        for wj in range(-(-n_w // r)):
            window = torch.zeros(feats.shape[-1], r, r)  # (channel, row, column): zeros past the grid
            for a in range(r):
                for b in range(r):
                    if wi * r + a < n_h and wj * r + b < n_w:
                        window[:, a, b] = grid_feats[wi * r + a, wj * r + b]
            rows.append(window.flatten())
    x = torch.stack(rows) @ aligner.w1.weight.T + aligner.w1.bias
    x = 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    return x @ aligner.w2.weight.T + aligner.w2.bias


class TinyVLM(nn.Module, VisionLanguageModel):
    def __init__(self):
        super().__init__()
        self.init_vision(CONFIG, text_hidden_size=24)


def test_rope_2d_rotates_each_pair_by_its_row_or_column_angle():
    x = torch.randn(GRID[0] * GRID[1], 2, 16, dtype=torch.float64)
    cos, sin = rope_2d(GRID, 16, 100.0, x.device)
    half = torch.cat([-x[..., 8:], x[..., :8]], dim=-1)
    ours = x * cos[:, None].double() + half * sin[:, None].double()
    torch.testing.assert_close(ours, ref_rope(x, GRID, 100.0), rtol=1e-6, atol=1e-6)


def test_vit_matches_the_reference():
    vit = DeepseekViT(CONFIG)
    randomize(vit, 0)
    pixels = torch.randn(GRID[0] * GRID[1], 3 * CONFIG.patch_size**2)
    with torch.no_grad():
        torch.testing.assert_close(vit(pixels, GRID), ref_vit(vit, pixels, GRID), rtol=1e-4, atol=1e-4)


def test_vit_attention_sees_patch_positions():
    """Swapping two patches changes the others' outputs only through the rope: the tower is not a bag of patches."""
    vit = DeepseekViT(CONFIG)
    randomize(vit, 1)
    pixels = torch.randn(GRID[0] * GRID[1], 3 * CONFIG.patch_size**2)
    swapped = pixels.clone()
    swapped[[0, 7]] = pixels[[7, 0]]
    with torch.no_grad():
        assert not torch.allclose(vit(pixels, GRID)[3], vit(swapped, GRID)[3], atol=1e-4)


def test_aligner_matches_the_reference_with_padding():
    aligner = Aligner(CONFIG, 24)
    randomize(aligner, 2)
    feats = torch.randn(GRID[0] * GRID[1], CONFIG.hidden_size)
    with torch.no_grad():
        out = aligner(feats, GRID)
    assert out.shape == (2 * 2, 24)
    torch.testing.assert_close(out, ref_aligner(aligner, feats, GRID), rtol=1e-4, atol=1e-4)


def test_embed_image_frames_the_span():
    model = TinyVLM()
    randomize(model, 3)
    pixels = torch.randn(GRID[0] * GRID[1], 3 * CONFIG.patch_size**2)
    with torch.no_grad():
        span = model.embed_image(pixels, GRID)
        tokens = ref_aligner(model.aligner, ref_vit(model.vision, pixels, GRID), GRID)
    n_h, n_w = CONFIG.llm_grid(GRID)
    expected = [model.image_start]
    for i in range(n_h):
        expected += [tokens[i * n_w + j] for j in range(n_w)] + [model.image_newline]
    expected.append(model.image_end)
    assert span.shape[0] == CONFIG.num_image_tokens(GRID) == n_h * (n_w + 1) + 2
    torch.testing.assert_close(span, torch.stack(expected).detach(), rtol=1e-4, atol=1e-4)


def test_checkpoint_names():
    names = {n for n, _ in TinyVLM().named_parameters()}
    assert {"vision.patch_embed.proj.weight", "vision.blocks.1.attn.wqkv.bias", "vision.blocks.0.attn.wo.weight",
            "vision.blocks.0.mlp.w1.weight", "vision.blocks.0.mlp.w2.weight", "vision.blocks.0.norm1.weight",
            "vision.norm.weight", "aligner.w1.weight", "aligner.w2.bias", "image_start", "image_end",
            "image_newline"} <= names
    assert all(p.dtype == torch.float32 for p in TinyVLM().parameters())


def test_image_embeds_merge_writes_rows_in():
    h = torch.zeros(5, 3)
    merged = ImageEmbeds(torch.tensor([1, 3]), torch.ones(2, 3), torch.tensor([0, 1, 0, 1, 0], dtype=torch.bool)).merge(h)
    assert merged[:, 0].tolist() == [0, 1, 0, 1, 0]


def test_config_from_a_checkpoint_dict():
    c = VisionConfig.from_dict({"model_type": "deepseek_v41_vision", "hidden_size": 64, "num_attention_heads": 4,
                                "max_wh_ratio": None, "patch_size": 14}, image_token_id=5)
    assert (c.hidden_size, c.head_dim, c.patch_size, c.image_token_id, c.max_wh_ratio) == (64, 16, 14, 5, None)
    with pytest.raises(ValueError, match="2D rope"):
        VisionConfig.from_dict({"hidden_size": 36, "num_attention_heads": 4})
