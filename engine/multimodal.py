"""Images in a prompt: decode (PNG, JPEG), resize to the model's plan, cut into ViT patches, and place
each image's span of placeholder tokens in the prompt.

The resize plan is DeepSeek V4.1's: upscale an image smaller than `min_pixels` to about that many
pixels, round both sides up to whole patches, shrink (keeping the aspect ratio) until the span costs
at most `max_image_tokens`, then fit the image into that box and pad the rest gray (127). Pixels are
scaled to [-1, 1] (mean 0.5, std 0.5 per channel).
"""

import base64
import binascii
import hashlib
import io
import math
import re
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.models.deepseek_vit import VisionConfig

FORMATS = ("PNG", "JPEG")
PAD_VALUE = 127


class ImageError(ValueError):
    """An image this server cannot take, and why (the server answers 400 with the message)."""


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 20 << 20  # encoded size
    max_pixels: int = 50_000_000  # width x height of the decoded image (a small file can hold a huge one)
    max_images: int = 16  # per request


@dataclass
class ImageInput:
    """One image of a prompt, ready for the vision tower."""

    pixel_values: torch.Tensor  # [h*w, 3 * patch_size**2] float32, patches row-major, each (channel, row, col)
    grid: tuple[int, int]  # ViT patch grid (h, w)
    num_tokens: int  # its span's length in the prompt, delimiters included
    content_hash: bytes  # of the pixels the tower sees: the same image -> the same KV, another -> a miss
    offset: int = -1  # first prompt position of its span, once placed
    size: tuple[int, int] = field(default=(0, 0))  # the decoded image's (width, height), for logs

    @property
    def span(self) -> tuple[int, int]:
        return self.offset, self.offset + self.num_tokens


def _token_grid(height: int, width: int, patch: int, ratio: int) -> tuple[int, int]:
    """The aligner's token grid for a box of this many pixels."""
    return math.ceil(height // patch / ratio), math.ceil(width // patch / ratio)


def _span_len(n_h: int, n_w: int) -> int:
    return n_h * (n_w + 1) + 2


def plan_size(width: int, height: int, c: VisionConfig) -> tuple[int, int]:
    """The box (height, width) in pixels, multiples of the patch size, an image of this size is fit into."""
    p, r, budget = c.patch_size, c.downsample_ratio, c.max_image_tokens
    if c.max_wh_ratio is not None and width > height * c.max_wh_ratio:
        width = height * c.max_wh_ratio
    if width * height < c.min_pixels:
        scale = math.sqrt(c.min_pixels / (width * height))
        width, height = int(width * scale), int(height * scale)
    box_h, box_w = math.ceil(height / p) * p, math.ceil(width / p) * p
    if _span_len(*_token_grid(box_h, box_w, p, r)) <= budget:
        return box_h, box_w
    # the largest aspect-preserving token grid n_h x n_w with n_h * (n_w + 1) + 2 <= budget, in closed form
    aspect = height / width
    cols = math.sqrt((budget - 2) / aspect + 0.25) - 0.5
    rows = cols * aspect
    cell = p * r
    if cols < 1.0:  # very tall: one column
        box_h, box_w = (budget - 2) // 2 * cell, cell
    elif rows < 1.0:  # very wide: one row
        box_h, box_w = cell, (budget - 3) * cell
    else:
        scale = min(math.floor(cols) * cell / width, math.floor(rows) * cell / height)
        box_h, box_w = math.floor(height * scale / p) * p, math.floor(width * scale / p) * p
    if _span_len(*_token_grid(box_h, box_w, p, r)) > budget:
        raise ImageError(f"the image ({width}x{height}) cannot fit in {budget} image tokens")
    return box_h, box_w


def _fit(height: int, width: int, box_h: int, box_w: int) -> tuple[int, int]:
    """The aspect-preserving size inside the box: one side exact, the other rounded."""
    if width / height > box_w / box_h:
        return round(height / width * box_w), box_w
    if width / height < box_w / box_h:
        return box_h, round(width / height * box_h)
    return box_h, box_w


class ImageProcessor:
    """Encoded image bytes -> an ImageInput for one model's vision tower."""

    def __init__(self, config: VisionConfig, limits: ImageLimits = ImageLimits()):
        self.config = config
        self.limits = limits

    def open(self, data: bytes):
        """The decoded RGB image; ImageError for anything else (unknown or unsupported format, a broken
        file, too many bytes or pixels)."""
        from PIL import Image, UnidentifiedImageError

        if len(data) > self.limits.max_bytes:
            raise ImageError(f"the image is {len(data)} bytes; this server takes images of at most "
                             f"{self.limits.max_bytes} bytes")
        try:
            image = Image.open(io.BytesIO(data))  # reads the header only
        except UnidentifiedImageError:
            raise ImageError("the image data is not an image this server can decode (send PNG or JPEG)") from None
        except (OSError, ValueError) as e:
            raise ImageError(f"the image data is malformed: {e}") from None
        if image.format not in FORMATS:
            raise ImageError(f"{image.format} images are not supported; send PNG or JPEG")
        width, height = image.size
        if width < 1 or height < 1:
            raise ImageError("the image has no pixels")
        if width * height > self.limits.max_pixels:
            raise ImageError(f"the image is {width}x{height} pixels; this server takes images of at most "
                             f"{self.limits.max_pixels} pixels")
        try:
            image.load()
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            raise ImageError(f"the image data is malformed: {e}") from None
        if image.mode == "RGB":
            return image
        # transparency over white, as the reference's processor converts
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")

    def process(self, data: bytes) -> ImageInput:
        from PIL import Image

        c = self.config
        image = self.open(data)
        width, height = image.size
        box_h, box_w = plan_size(width, height, c)
        if c.max_wh_ratio is not None and width >= c.max_wh_ratio * height:
            canvas = image.resize((box_w, box_h), Image.Resampling.BICUBIC)  # very wide: squeezed into the box
        else:
            fit_h, fit_w = _fit(height, width, box_h, box_w)
            canvas = Image.new("RGB", (box_w, box_h), (PAD_VALUE,) * 3)
            top, left = round((box_h - fit_h) * 0.5), round((box_w - fit_w) * 0.5)
            canvas.paste(image.resize((fit_w, fit_h), Image.Resampling.BICUBIC), (left, top))
        pixels = np.asarray(canvas, dtype=np.uint8)  # [H, W, 3]
        grid = (box_h // c.patch_size, box_w // c.patch_size)
        digest = hashlib.blake2b(pixels.tobytes() + np.asarray(grid, np.int64).tobytes(), digest_size=16).digest()
        x = (pixels.astype(np.float32) * np.float32(1 / 255) - 0.5) / 0.5
        p = c.patch_size
        patches = x.reshape(grid[0], p, grid[1], p, 3).transpose(0, 2, 4, 1, 3).reshape(grid[0] * grid[1], 3 * p * p)
        return ImageInput(torch.from_numpy(np.ascontiguousarray(patches)), grid, c.num_image_tokens(grid), digest,
                          size=(width, height))


_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,", re.IGNORECASE)


def decode_data_url(url: str) -> bytes:
    """The bytes of a base64 `data:` URL; ImageError if it is not one."""
    m = _DATA_URL.match(url)
    if m is None:
        raise ImageError("an image data URL must look like data:image/png;base64,<data>")
    mime = (m.group("mime") or "").lower()
    if mime and not mime.startswith("image/"):
        raise ImageError(f"the data URL's media type is {mime}, not an image")
    try:
        return base64.b64decode(url[m.end():], validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the image data URL's base64 payload is malformed") from None


def place_images(prompt_ids: list[int], images: list[ImageInput], image_token_id: int) -> list[int]:
    """Expand each single `image_token_id` placeholder of the prompt into its image's span (in order),
    setting the images' offsets -> the prompt the model sees."""
    marks = [i for i, t in enumerate(prompt_ids) if t == image_token_id]
    if len(marks) != len(images):
        raise ImageError(f"the prompt holds {len(marks)} image placeholder(s) for {len(images)} image(s)")
    out: list[int] = []
    last = 0
    for mark, image in zip(marks, images):
        out += prompt_ids[last:mark]
        image.offset = len(out)
        out += [image_token_id] * image.num_tokens
        last = mark + 1
    return out + prompt_ids[last:]


def check_spans(prompt_ids: list[int], images: list[ImageInput], image_token_id: int) -> None:
    """A prompt's images must sit on spans of placeholder ids, in order, without overlap (ValueError)."""
    end = 0
    for image in images:
        start, stop = image.span
        if start < end or stop > len(prompt_ids):
            raise ValueError(f"image spans must lie inside the prompt, in order, without overlap; got {image.span}")
        if any(t != image_token_id for t in prompt_ids[start:stop]):
            raise ValueError(f"the prompt's tokens at {image.span} are not all the image placeholder {image_token_id}")
        end = stop
