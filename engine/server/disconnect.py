"""Noticing that a client went away while its (non-streamed) request was still being worked on."""

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client went away before its response was ready."""


async def until_disconnected(raw: Request, work: Awaitable[T]) -> T:
    """Runs `work` unless the client disconnects first (then it is cancelled: ClientDisconnected)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
            raise ClientDisconnected()
        return task.result()
    finally:
        watcher.cancel()
        task.cancel()


async def _disconnect(raw: Request) -> None:
    # The body has been read: the next ASGI message is the disconnect.
    while (await raw.receive())["type"] != "http.disconnect":
        pass
