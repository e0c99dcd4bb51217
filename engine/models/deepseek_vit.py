"""DeepSeek-ViT, the aligner and the image framing of DeepSeek V4.1's image input.

An image becomes a span of the prompt: IMAGE_START, then for each row of the aligner's grid its tokens
and one IMAGE_NEWLINE, then IMAGE_END. Every position of the span carries `image_token_id` in the
prompt; the model replaces the span's token embeddings with `embed_image`'s rows (aligner outputs at
the image slots, the learned `image_start` / `image_newline` / `image_end` vectors at the delimiters),
and V4.1's routers score the whole span with `gate.bias_vl` instead of `gate.bias`.

Module and tensor names are the checkpoint's (`vision.*`, `aligner.*`, `image_start` ...), so a model
that mixes in `VisionLanguageModel` loads them by name. The tower and the aligner run in float32
whatever the text model's dtype (the released weights are bf16; the reference computes them in fp32).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class VisionConfig:
    """A checkpoint's `vision_config` (and its composite config's `image_token_id`)."""

    hidden_size: int = 1024
    intermediate_size: int = 2816
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    patch_size: int = 14
    downsample_ratio: int = 3  # the aligner's window side: r x r ViT patches per LLM token
    rope_theta: float = 10000.0
    max_image_tokens: int = 1024  # span length, delimiters included
    min_pixels: int = 544 * 544  # smaller images are upscaled to about this many pixels
    max_wh_ratio: float | None = None  # wider images are squeezed into the planned box
    image_token_id: int = 129264

    @classmethod
    def from_dict(cls, vision: dict, image_token_id: int | None = None) -> "VisionConfig":
        fields = {k: v for k, v in vision.items() if k in cls.__dataclass_fields__ and (v is not None or k == "max_wh_ratio")}
        if image_token_id is not None:
            fields["image_token_id"] = image_token_id
        config = cls(**fields)
        head_dim = config.hidden_size // config.num_attention_heads
        if config.hidden_size % config.num_attention_heads or head_dim % 4:
            raise ValueError(f"vision hidden_size {config.hidden_size} over {config.num_attention_heads} heads leaves "
                             "no head width the 2D rope splits into row and column pairs")
        return config

    @classmethod
    def from_checkpoint(cls, path) -> "VisionConfig | None":
        """The vision config of a checkpoint directory's config.json; None when it has none."""
        import json
        from pathlib import Path

        cfg = json.loads((Path(path) / "config.json").read_text())
        vision = cfg.get("vision_config")
        if not vision:
            return None
        return cls.from_dict(vision, cfg.get("image_token_id"))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def llm_grid(self, grid: tuple[int, int]) -> tuple[int, int]:
        """ViT patch grid (rows, columns) -> the aligner's token grid (zero-padded up to whole windows)."""
        r = self.downsample_ratio
        return -(-grid[0] // r), -(-grid[1] // r)

    def num_image_tokens(self, grid: tuple[int, int]) -> int:
        """Span length of an image with this ViT patch grid: rows x (columns + newline) + start + end."""
        n_h, n_w = self.llm_grid(grid)
        return n_h * (n_w + 1) + 2


class VisionRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return self.weight.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rope_2d(grid: tuple[int, int], head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [h*w, head_dim] of the axial 2D rope, patches in row-major order: the first half of the
    head's rotation angles are the patch's row times head_dim/4 frequencies, then its column times the
    same; channel i pairs with channel i + head_dim/2 (a rotate-half layout)."""
    n_h, n_w = grid
    quarter = head_dim // 4
    inv_freq = 1.0 / (theta ** (torch.arange(quarter, dtype=torch.float32, device=device) * 2 / (head_dim // 2)))
    rows = torch.arange(n_h, device=device, dtype=torch.float32).repeat_interleave(n_w)
    cols = torch.arange(n_w, device=device, dtype=torch.float32).repeat(n_h)
    angles = torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1)  # [h*w, head_dim/2]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [P, heads, head_dim]; cos, sin [P, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.wqkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, dtype=torch.float32)  # [q; k; v] rows
        self.wo = nn.Linear(config.hidden_size, config.hidden_size, dtype=torch.float32)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [P, hidden], one image's patches: every patch attends to every patch of the image."""
        q, k, v = self.wqkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))  # [H, P, D]
        return self.wo(out.transpose(0, 1).reshape(x.shape[0], -1))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False, dtype=torch.float32)  # [gate; up]
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.norm1 = VisionRMSNorm(config.hidden_size)
        self.attn = VisionAttention(config)
        self.norm2 = VisionRMSNorm(config.hidden_size)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        # one linear map of each flattened (channel, row, column) patch: a stride-p convolution as a matrix
        self.proj = nn.Linear(3 * config.patch_size**2, config.hidden_size, dtype=torch.float32)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values)


class DeepseekViT(nn.Module):
    """The vision tower (`vision.*`): patch embedding, pre-norm blocks with 2D rope, a final norm."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.num_hidden_layers))
        self.norm = VisionRMSNorm(config.hidden_size)

    def forward(self, pixel_values: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """pixel_values [h*w, 3*p*p] (one image's patches, row-major) -> features [h*w, hidden] float32."""
        c = self.config
        if pixel_values.shape != (grid[0] * grid[1], 3 * c.patch_size**2):
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)} do not hold a {grid[0]} x {grid[1]} grid of "
                             f"{c.patch_size}-pixel patches")
        cos, sin = rope_2d(grid, c.head_dim, c.rope_theta, pixel_values.device)
        x = self.patch_embed(pixel_values.float())
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


class Aligner(nn.Module):
    """`aligner.*`: each r x r window of ViT features (zero-padded to whole windows), unfolded channel
    first, through a two-layer GELU MLP into one text-width token."""

    def __init__(self, config: VisionConfig, text_hidden_size: int):
        super().__init__()
        self.ratio = config.downsample_ratio
        self.w1 = nn.Linear(config.hidden_size * self.ratio**2, text_hidden_size, dtype=torch.float32)
        self.w2 = nn.Linear(text_hidden_size, text_hidden_size, dtype=torch.float32)

    def forward(self, features: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """features [h*w, C] -> [ceil(h/r) * ceil(w/r), text hidden], windows in reading order."""
        r, (n_h, n_w) = self.ratio, grid
        x = features.view(n_h, n_w, -1).permute(2, 0, 1)  # [C, h, w]
        x = F.pad(x, (0, -n_w % r, 0, -n_h % r))
        x = F.unfold(x[None], r, stride=r)[0].transpose(0, 1)  # [windows, C*r*r], (c, row, column) order
        return self.w2(F.gelu(self.w1(x)))


class VisionLanguageModel:
    """Mixin of a text model that takes images: `init_vision` adds the tower, the aligner and the span
    delimiters under the checkpoint's names; `embed_image` turns one image into its span's embeddings.

    The engine's side of the contract (see docs/engine.md, "Image input"): the model runner calls
    `embed_image` once per image of a request and hands the rows to the model's forward as an
    `ImageEmbeds` (`image_embeds=`) on each step whose tokens the span covers; the forward overwrites
    those token embeddings and routes `is_image` tokens with `gate.bias_vl`.
    """

    vision_config: VisionConfig

    def init_vision(self, config: VisionConfig, text_hidden_size: int) -> None:
        self.vision_config = config
        self.vision = DeepseekViT(config)
        self.aligner = Aligner(config, text_hidden_size)
        for name in ("image_start", "image_end", "image_newline"):
            setattr(self, name, nn.Parameter(torch.zeros(text_hidden_size, dtype=torch.float32)))

    def embed_image(self, pixel_values: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """One image's patches [h*w, 3*p*p] and ViT grid (h, w) -> its span's embeddings
        [num_image_tokens(grid), text hidden] float32, in span order."""
        return frame_image(self.aligner(self.vision(pixel_values, grid), grid), self.vision_config.llm_grid(grid),
                           self.image_start, self.image_newline, self.image_end)


def frame_image(tokens: torch.Tensor, llm_grid: tuple[int, int], start: torch.Tensor, newline: torch.Tensor,
                end: torch.Tensor) -> torch.Tensor:
    """Aligner rows [n_h*n_w, D] -> the span [n_h*(n_w+1)+2, D]: start, each row then a newline, end."""
    n_h, n_w = llm_grid
    rows = tokens.view(n_h, n_w, -1)
    rows = torch.cat([rows, newline.to(tokens.dtype).expand(n_h, 1, -1)], dim=1).reshape(n_h * (n_w + 1), -1)
    return torch.cat([start.to(tokens.dtype)[None], rows, end.to(tokens.dtype)[None]])


@dataclass
class ImageEmbeds:
    """What a step's forward gets for the image tokens it covers: token `index[i]` of the step (flat)
    takes `embeds[i]` instead of its token embedding; `is_image` [T] marks them (every span position,
    delimiters included) for the routers' `bias_vl`."""

    index: torch.Tensor  # [K] int64
    embeds: torch.Tensor  # [K, hidden]
    is_image: torch.Tensor  # [T] bool

    def merge(self, h: torch.Tensor) -> torch.Tensor:
        """Token embeddings h [T, hidden] with the image rows written in."""
        return h.index_copy(0, self.index, self.embeds.to(h.dtype))

