"""Server-sent events as OpenAI streams them, and the response that carries them."""

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from engine.server.errors import APIError
from engine.server.request_stream import RequestStream


def sse(payload: BaseModel | dict | str) -> str:
    """One server-sent event."""
    if isinstance(payload, BaseModel):
        payload = payload.model_dump_json()
    elif isinstance(payload, dict):
        payload = json.dumps(payload)
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def guard_events(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Ends a stream that fails midway with OpenAI's in-stream error event instead of a cut connection."""
    try:
        async for event in events:
            yield event
    except APIError as exc:
        yield sse(exc.body())


class EventStreamResponse(StreamingResponse):
    """SSE response that closes its RequestStream however it ends (done, client gone, shutdown)."""

    def __init__(self, events: AsyncIterator[str], stream: RequestStream) -> None:
        super().__init__(guard_events(events), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._request_stream = stream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._request_stream.close()
