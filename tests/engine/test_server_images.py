"""Image content parts through a real server and the official client, up to the model call: a tiny V3
checkpoint whose config.json carries a vision_config (so the server decodes, checks and places images)
but whose model has no tower (so the engine refuses what passes). Every refusal is a 400 that says why."""

import asyncio
import base64
import io
import json
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import openai
import pytest
from PIL import Image

from engine.models.deepseek_vit import VisionConfig
from engine.multimodal import ImageError
from engine.server.images import ImageLoader, ImageSettings
from engine.server.serving_chat import ChatServing
from engine.tokenizer import Tokenizer
from engine.tools.make_random_checkpoint import TINY_VISION
from tests.engine.conftest_server import MODEL_NAME, ServerProcess, tiny_checkpoint  # noqa: F401

IMAGE_TOKEN = 500


def image_bytes(size=(24, 24), fmt="PNG", color=(200, 10, 10)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format=fmt)
    return buf.getvalue()


NOISE = Image.fromarray(np.random.default_rng(0).integers(0, 256, (60, 60, 3), dtype=np.uint8))


def data_url(data: bytes, mime="image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _noise_png() -> bytes:  # 3600 pixels, but more than 4000 bytes: noise does not compress
    buf = io.BytesIO()
    NOISE.save(buf, format="PNG")
    return buf.getvalue()


NOISE_PNG = _noise_png()


class Files(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == "/slow.png":
            time.sleep(3)
        body = {"/ok.png": image_bytes(), "/slow.png": image_bytes(), "/big.png": b"\0" * 10_000}.get(self.path)
        self.send_response(200 if body else 404)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def files():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Files)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def client(tiny_checkpoint, tmp_path_factory):  # noqa: F811
    path = tmp_path_factory.mktemp("with-vision-config")
    shutil.copytree(tiny_checkpoint, path, dirs_exist_ok=True)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "vision_config": TINY_VISION, "image_token_id": IMAGE_TOKEN}))
    proc = ServerProcess(path, tmp_path_factory.mktemp("log") / "server.log", "--enable-image-urls",
                         "--max-image-size", "4000", "--max-image-pixels", "20000", "--max-images-per-request", "2",
                         "--image-fetch-timeout", "1").wait_ready()
    yield openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0)
    proc.stop()


def ask(client, *urls, text="what is this?"):
    content = [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": content}],
                                       max_tokens=2)
    error = info.value.body
    return error["message"], error.get("param")


@pytest.mark.parametrize("url, words", [
    ("data:image/png;base64,%%%", "base64 payload is malformed"),
    (data_url(b"hello, not a picture"), "not an image this server can decode"),
    (data_url(image_bytes(fmt="GIF"), "image/gif"), "GIF images are not supported"),
    (data_url(image_bytes()[:-30]), "malformed"),
    (data_url(image_bytes((200, 200))), "200x200 pixels; this server takes images of at most 20000 pixels"),
    (data_url(NOISE_PNG), "bytes; this server takes images of at most 4000 bytes"),
    ("ftp://example.com/a.png", "data: URL"),
], ids=["base64", "not-an-image", "gif", "truncated", "pixels", "bytes", "scheme"])
def test_bad_images_are_400_saying_why(client, url, words):
    message, param = ask(client, url)
    assert words in message
    assert param == "messages[0].content[1]"


def test_too_many_images(client):
    message, _ = ask(client, *[data_url(image_bytes())] * 3)
    assert "3 images; this server takes at most 2" in message


def test_a_good_image_reaches_the_engine_which_has_no_tower(client):
    message, param = ask(client, data_url(image_bytes()))
    assert "has no vision tower" in message and param == "messages"


def test_image_urls_are_fetched_with_limits(client, files):
    assert "has no vision tower" in ask(client, f"{files}/ok.png")[0]  # fetched, decoded, placed
    assert "is 10000 bytes; this server takes images of at most 4000 bytes" in ask(client, f"{files}/big.png")[0]
    assert "took longer than 1 s" in ask(client, f"{files}/slow.png")[0]
    assert "HTTP 404" in ask(client, f"{files}/missing.png")[0]


def test_the_placeholder_text_itself_is_refused(client, tiny_checkpoint):  # noqa: F811
    placeholder = Tokenizer(tiny_checkpoint).id_to_token(IMAGE_TOKEN)  # the image token's own text
    message, _ = ask(client, data_url(image_bytes()), text=f"look: {placeholder}")
    assert "image placeholder" in message


def test_urls_are_not_fetched_unless_enabled(files):
    with pytest.raises(ImageError, match="does not fetch image URLs"):
        asyncio.run(ImageLoader(ImageSettings()).load([f"{files}/ok.png"], VisionConfig.from_dict(TINY_VISION, 1)))


class _Engine:
    def __init__(self, tokenizer):
        self.tokenizer, self.vision = tokenizer, VisionConfig.from_dict(TINY_VISION, IMAGE_TOKEN)


def test_image_tokens_are_prompt_tokens(tiny_checkpoint):  # noqa: F811
    """The prompt the engine gets (whose length usage.prompt_tokens reports) holds each image's whole span."""
    serving = ChatServing(_Engine(Tokenizer(tiny_checkpoint)), MODEL_NAME)
    images = asyncio.run(serving.load_images([("p", data_url(image_bytes((24, 24))))]))
    text = f"before {serving.image_placeholder} after"
    ids = serving.encode(text, images)
    plain = serving.encode("before  after", [])
    span = VisionConfig.from_dict(TINY_VISION).num_image_tokens(images[0].grid)
    assert ids.count(IMAGE_TOKEN) == span == images[0].num_tokens
    assert ids[images[0].offset : images[0].offset + span] == [IMAGE_TOKEN] * span
    assert len(ids) >= len(plain) + span - 2
