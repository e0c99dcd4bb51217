"""The image processor: decoding and its refusals, the resize plan, patches, placement in the prompt."""

import base64
import dataclasses
import io

import numpy as np
import pytest
from PIL import Image

from engine.models.deepseek_vit import VisionConfig
from engine.multimodal import (
    ImageError,
    ImageLimits,
    ImageProcessor,
    check_spans,
    decode_data_url,
    place_images,
    plan_size,
)

TINY = VisionConfig(hidden_size=32, num_attention_heads=2, patch_size=2, downsample_ratio=3, min_pixels=36 * 36,
                    max_image_tokens=40, image_token_id=7)
NOISE = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))


def encode(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def test_released_config_plan_for_a_544_square():
    # 544^2 = min_pixels: no upscaling; 544 rounds up to 39 patches of 14; 13 x 13 tokens + 13 newlines + 2
    processed = ImageProcessor(VisionConfig()).process(encode(Image.new("RGB", (544, 544), (10, 20, 30))))
    assert processed.grid == (39, 39)
    assert processed.num_tokens == 13 * 14 + 2 == 184
    assert processed.pixel_values.shape == (39 * 39, 3 * 14 * 14)


@pytest.mark.parametrize("size", [(1, 1), (5, 300), (300, 5), (36, 36), (40, 30), (500, 333), (2000, 90), (7, 7000)])
def test_plan_stays_in_the_budget_on_whole_patches(size):
    box_h, box_w = plan_size(*size, TINY)
    assert box_h % TINY.patch_size == 0 and box_w % TINY.patch_size == 0 and box_h > 0 and box_w > 0
    assert TINY.num_image_tokens((box_h // 2, box_w // 2)) <= TINY.max_image_tokens


def test_small_images_are_upscaled_to_min_pixels():
    roomy = dataclasses.replace(TINY, max_image_tokens=1000)
    assert plan_size(6, 6, roomy) == (36, 36)  # 36 px -> 36^2 px, aspect kept
    assert plan_size(6, 12, roomy) == (50, 26)  # int(6 * sqrt(18)) = 25 -> 26 wide, int(12 * sqrt(18)) = 50 high


def test_pixels_patches_and_gray_padding():
    # a 36x30 red image: its box is 36 wide, 28 high; fit to 34x28, one gray column either side
    processed = ImageProcessor(TINY).process(encode(Image.new("RGB", (36, 30), (255, 0, 0))))
    assert plan_size(36, 30, TINY) == (28, 36)
    assert processed.grid == (14, 18)
    # patches back to the picture: [h, w, channel, row, col] -> [channel, H, W]
    picture = processed.pixel_values.numpy().reshape(14, 18, 3, 2, 2).transpose(2, 0, 3, 1, 4).reshape(3, 28, 36)
    np.testing.assert_allclose(picture[:, :, 0], 127 / 255 * 2 - 1, atol=1e-6)
    np.testing.assert_allclose(picture[:, :, -1], 127 / 255 * 2 - 1, atol=1e-6)
    np.testing.assert_allclose(picture[0, :, 1:-1], 1.0, atol=1e-6)  # red: 255 -> 1
    np.testing.assert_allclose(picture[1:, :, 1:-1], -1.0, atol=1e-6)  # 0 -> -1


def test_transparency_is_composited_over_white():
    processed = ImageProcessor(TINY).process(encode(Image.new("RGBA", (36, 36), (0, 0, 0, 0))))
    np.testing.assert_allclose(processed.pixel_values.numpy(), 1.0, atol=1e-6)


def test_content_hash_follows_the_pixels():
    processor = ImageProcessor(TINY)
    a = encode(Image.new("RGB", (36, 36), (1, 2, 3)))
    b = encode(Image.new("RGB", (36, 36), (1, 2, 4)))
    assert processor.process(a).content_hash == processor.process(a).content_hash
    assert processor.process(a).content_hash != processor.process(b).content_hash


def test_jpeg_decodes():
    processed = ImageProcessor(TINY).process(encode(Image.new("RGB", (50, 40), (0, 128, 255)), "JPEG"))
    assert processed.num_tokens <= TINY.max_image_tokens


@pytest.mark.parametrize("data, message", [
    (b"not an image at all", "not an image"),
    (encode(Image.new("RGB", (8, 8)), "GIF"), "GIF images are not supported"),
    (encode(NOISE)[:len(encode(NOISE)) // 2], "malformed"),
])
def test_refusals_say_why(data, message):
    with pytest.raises(ImageError, match=message):
        ImageProcessor(TINY).process(data)


def test_limits_on_bytes_and_pixels():
    data = encode(Image.new("RGB", (100, 100)))
    with pytest.raises(ImageError, match="bytes"):
        ImageProcessor(TINY, ImageLimits(max_bytes=len(data) - 1)).process(data)
    with pytest.raises(ImageError, match="100x100 pixels"):
        ImageProcessor(TINY, ImageLimits(max_pixels=9999)).process(data)


def test_data_urls():
    assert decode_data_url("data:image/png;base64," + base64.b64encode(b"abc").decode()) == b"abc"
    for bad, message in [("http://x/y.png", "data URL"), ("data:image/png;base64,@@@", "base64"),
                         ("data:text/plain;base64,YWJj", "not an image")]:
        with pytest.raises(ImageError, match=message):
            decode_data_url(bad)


def test_place_images_expands_placeholders_in_order():
    processor = ImageProcessor(TINY)
    images = [processor.process(encode(Image.new("RGB", size))) for size in [(36, 36), (80, 36)]]
    ids = place_images([1, 7, 2, 7, 3], images, image_token_id=7)
    n0, n1 = images[0].num_tokens, images[1].num_tokens
    assert ids == [1] + [7] * n0 + [2] + [7] * n1 + [3]
    assert images[0].span == (1, 1 + n0) and images[1].span == (2 + n0, 2 + n0 + n1)
    check_spans(ids, images, 7)
    with pytest.raises(ImageError, match="2 image placeholder"):
        place_images([7, 7], images[:1], 7)
    images[1].offset = 0
    with pytest.raises(ValueError, match="in order"):
        check_spans(ids, images, 7)
