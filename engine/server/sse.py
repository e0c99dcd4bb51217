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


class ChunkFrames:
    """The frames of a stream's most common chunks (one choice's text, no logprobs), written without pydantic.

    They are the per-token work of a stream on the event loop: building and serializing the chunk's
    models cost more than the rest of a token's path through the server. Only the text changes from one
    chunk to the next; the rest of the JSON is written once. The same JSON as the models' (tests compare).
    """

    def __init__(self, object_: str, request_id: str, created: int, model: str, include_usage: bool) -> None:
        self._head = (f'data: {{"id":{_json(request_id)},"object":"{object_}","created":{created},'
                      f'"model":{_json(model)},"choices":[{{"index":')
        self._tail = ',"usage":null}\n\n' if include_usage else "}\n\n"

    def completion_text(self, index: int, text: str, finish_reason: str | None) -> str:
        """A /v1/completions chunk: `text` of choice `index`."""
        return (f'{self._head}{index},"text":{_json(text)},"logprobs":null,'
                f'"finish_reason":{_json(finish_reason)}}}]{self._tail}')

    def chat_delta(self, index: int, content: str | None, reasoning: str | None) -> str:
        """A chat chunk whose delta holds answer and/or reasoning text (None: the key is absent)."""
        fields = []
        if content is not None:
            fields.append(f'"content":{_json(content)}')
        if reasoning is not None:
            fields.append(f'"reasoning_content":{_json(reasoning)}')
        return f'{self._head}{index},"delta":{{{",".join(fields)}}},"logprobs":null,"finish_reason":null}}]{self._tail}'


def _json(value: str | None) -> str:
    return json.dumps(value, ensure_ascii=False)


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
