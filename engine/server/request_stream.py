"""One API request's view of the engine: the newest output of each of its sub-requests (its choices)."""

import asyncio
from collections.abc import AsyncIterator, Callable

from engine.outputs import RequestOutput
from engine.server.engine_messages import OutputBuilder


class RequestStream:
    """Iterating yields `{choice index: output}` batches until every choice has finished.

    A consumer slower than the engine gets its outputs merged rather than queued: each choice's deltas
    accumulate in its `OutputBuilder` and the consumer takes one output per choice when it reads, so
    memory per request stays one output per choice however slow the client, the server does no work
    per step beyond appending, and the engine never waits for anyone.
    Only the event loop's thread touches a stream; `close()` aborts whatever is still running.
    """

    def __init__(self, request_id: str, num_choices: int, on_close: Callable[["RequestStream"], None]) -> None:
        self.request_id = request_id
        self.sub_request_ids = [f"{request_id}-{i}" for i in range(num_choices)]
        self.closed = False
        self._on_close = on_close
        self._pending: dict[int, OutputBuilder] = {}  # choices with news since the last read
        self._unfinished = set(range(num_choices))
        self._changed = asyncio.Event()
        self._error: BaseException | None = None
        self._admitted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # A refusal nobody awaits any more (the client left) is not an "exception never retrieved".
        self._admitted.add_done_callback(lambda f: f.cancelled() or f.exception())

    @property
    def finished(self) -> bool:
        return not self._unfinished

    async def admitted(self) -> None:
        """Returns once the engine holds every choice; raises the engine's refusal (ValueError) otherwise."""
        try:
            await asyncio.shield(self._admitted)
        except BaseException:
            self.close()
            raise

    def __aiter__(self) -> AsyncIterator[dict[int, RequestOutput]]:
        return self._batches()

    async def _batches(self) -> AsyncIterator[dict[int, RequestOutput]]:
        while True:
            if self._error is not None:
                raise self._error
            if self._pending:
                pending, self._pending = self._pending, {}
                yield {index: builder.output() for index, builder in pending.items()}
            elif not self._unfinished:
                return
            else:
                self._changed.clear()
                await self._changed.wait()

    def close(self) -> None:
        """Idempotent; aborts the choices that have not finished."""
        if not self.closed:
            self.closed = True
            self._on_close(self)

    # ------------------------------------------------------------------ fed by the engine bridge (event loop)

    def admit(self, error: BaseException | None) -> None:
        if self._admitted.done():
            return
        if error is None:
            self._admitted.set_result(None)
        else:
            self._admitted.set_exception(error)
            self._unfinished.clear()

    def put(self, index: int, builder: OutputBuilder) -> None:
        """Choice `index` gained a delta (already added to its builder)."""
        self._pending[index] = builder
        if builder.finished:
            self._unfinished.discard(index)
        self._changed.set()

    def fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self.admit(error)
        self._changed.set()
