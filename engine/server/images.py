"""Image content parts -> ImageInputs: data URLs decoded, http(s) URLs fetched (only when the server is
told to, with a size and a time limit), then decoded and cut into patches off the event loop."""

import asyncio
from dataclasses import dataclass

import httpx

from engine.models.deepseek_vit import VisionConfig
from engine.multimodal import ImageError, ImageInput, ImageLimits, ImageProcessor, decode_data_url


@dataclass(frozen=True)
class ImageSettings:
    fetch_urls: bool = False  # http(s) image URLs: fetched by the server, or refused
    fetch_timeout: float = 10.0  # seconds for a whole fetch
    limits: ImageLimits = ImageLimits()


class ImageLoader:
    def __init__(self, settings: ImageSettings):
        self.settings = settings

    async def load(self, urls: list[str], vision: VisionConfig) -> list[ImageInput]:
        """Every image of a request, in order; ImageError (a 400) for the first one that fails, its
        `index` set to that image's place in `urls`."""
        if len(urls) > self.settings.limits.max_images:
            raise ImageError(f"this request has {len(urls)} images; this server takes at most "
                             f"{self.settings.limits.max_images} per request")
        processor = ImageProcessor(vision, self.settings.limits)
        images = []
        for index, url in enumerate(urls):
            try:
                images.append(await asyncio.to_thread(processor.process, await self.fetch(url)))
            except ImageError as e:
                e.index = index
                raise
        return images

    async def fetch(self, url: str) -> bytes:
        if url.startswith("data:"):
            return decode_data_url(url)
        if not url.startswith(("http://", "https://")):
            raise ImageError("an image URL must be a data: URL (data:image/png;base64,...) or an http(s) URL")
        if not self.settings.fetch_urls:
            raise ImageError("this server does not fetch image URLs (start it with --enable-image-urls); "
                             "send the image inline as a data URL")
        try:
            return await asyncio.wait_for(self._get(url), self.settings.fetch_timeout)
        except asyncio.TimeoutError:
            raise ImageError(f"fetching the image URL took longer than {self.settings.fetch_timeout:g} s") from None
        except httpx.HTTPError as e:
            raise ImageError(f"fetching the image URL failed: {type(e).__name__}") from None

    async def _get(self, url: str) -> bytes:
        limit = self.settings.limits.max_bytes
        async with httpx.AsyncClient(follow_redirects=True, timeout=self.settings.fetch_timeout) as client:
            async with client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise ImageError(f"fetching the image URL answered HTTP {response.status_code}")
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > limit:
                    raise ImageError(f"the image at the URL is {declared} bytes; this server takes images of at "
                                     f"most {limit} bytes")
                data = bytearray()
                async for chunk in response.aiter_bytes():
                    data += chunk
                    if len(data) > limit:
                        raise ImageError(f"the image at the URL is larger than {limit} bytes, the most this "
                                         "server takes")
                return bytes(data)
