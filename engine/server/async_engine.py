"""The bridge between asyncio and the synchronous engine: the engine loop runs on a thread of its own.

The engine loop thread owns the LLMEngine (built there, stepped there, never touched elsewhere except
for its tokenizer and config). The event loop sends it commands through a queue; the loop thread posts
each step's outputs back in one callback. Generation therefore never waits on a client, and a client
never waits on more than one engine step to be admitted.
"""

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from engine.metrics import EngineMetrics
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.server.errors import InternalError, QueueFull, ServiceUnavailable
from engine.server.request_log import summarize
from engine.server.request_stream import RequestStream

logger = logging.getLogger(__name__)

_STOP = ("stop",)


class AsyncEngine:
    """Admits requests (bounded waiting queue), streams their outputs, aborts, drains and stops."""

    def __init__(
        self,
        build_engine: Callable[[], Any],
        metrics: EngineMetrics,
        *,
        max_waiting_requests: int | None = None,
    ) -> None:
        self.metrics = metrics
        self.max_waiting_requests = max_waiting_requests
        self.engine: Any = None  # the LLMEngine, once the loop thread has built it
        self.error: BaseException | None = None  # why the engine loop died, if it did
        self.draining = False
        self._build_engine = build_engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Event-loop side bookkeeping.
        self._routes: dict[str, tuple[RequestStream, int]] = {}  # sub-request id -> (stream, choice index)
        self._active: set[RequestStream] = set()  # admitted and neither finished nor closed
        self._num_unacked = 0  # sub-requests sent to the loop thread, not yet acknowledged
        # The engine's waiting queue as the loop thread last saw it (it writes, the event loop reads).
        # Admitted requests count here and in _num_unacked until their ack arrives: briefly too many.
        self._num_waiting = 0
        self._idle = asyncio.Event()  # set while nothing is in flight
        self._idle.set()
        self._ready = asyncio.Event()  # set once the engine is built (or failed to build)
        self.failed = asyncio.Event()  # set if the engine loop died

    # ----------------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Starts the loop thread, which builds the engine; `wait_ready()` returns once it is built."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def wait_ready(self) -> None:
        await self._ready.wait()

    @property
    def is_ready(self) -> bool:
        return self.engine is not None and self.error is None

    @property
    def is_alive(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    async def stop(self) -> None:
        """Aborts what still runs, stops the loop thread and waits for it."""
        self.abort_all(ServiceUnavailable("The server is shutting down."))
        self._commands.put(_STOP)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    async def drain(self, timeout: float) -> bool:
        """Refuses new work, waits up to `timeout` s for the work in flight; True if all of it finished."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            self.abort_all(ServiceUnavailable("The server shut down before this request finished."))
            return False

    # ------------------------------------------------------------------------------------- requests

    @property
    def num_active(self) -> int:
        return len(self._active)

    def submit(
        self, request_id: str, prompts: Sequence[list[int]], params: Sequence[SamplingParams]
    ) -> RequestStream:
        """Hands one API request's choices to the engine; await `stream.admitted()` before reading it."""
        if self.draining:
            raise ServiceUnavailable("The server is draining and accepts no new requests.")
        if not self.is_ready:
            raise ServiceUnavailable("The model is not loaded yet." if self.error is None else "The engine failed.")
        num_waiting = self._num_waiting + self._num_unacked
        if self.max_waiting_requests is not None and num_waiting + len(prompts) > self.max_waiting_requests:
            raise QueueFull(
                f"The waiting queue is full ({num_waiting} waiting, at most {self.max_waiting_requests}); "
                "retry later.",
                headers={"Retry-After": "1"},
            )
        stream = RequestStream(request_id, len(prompts), self._close)
        for index, sub_id in enumerate(stream.sub_request_ids):
            self._routes[sub_id] = (stream, index)
        self._active.add(stream)
        self._idle.clear()
        self._num_unacked += len(prompts)
        self._commands.put(("add", stream, list(zip(stream.sub_request_ids, prompts, params))))
        return stream

    def abort_all(self, error: BaseException) -> None:
        for stream in list(self._active):
            stream.fail(error)
            stream.close()

    def _close(self, stream: RequestStream) -> None:
        running = [sub_id for sub_id in stream.sub_request_ids if self._routes.pop(sub_id, None) is not None]
        if running:
            self._commands.put(("abort", running))
        self._retire(stream)

    def _retire(self, stream: RequestStream) -> None:
        self._active.discard(stream)
        if not self._active:
            self._idle.set()

    # ------------------------------------------------------------------- event-loop side of the bridge

    def _post(self, callback: Callable, *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the event loop is closed: the process is exiting
            pass

    def _on_ready(self) -> None:
        self._ready.set()

    def _on_admitted(self, acks: list[tuple[RequestStream, int, BaseException | None]]) -> None:
        for stream, num_choices, error in acks:
            self._num_unacked -= num_choices
            if error is not None:
                for sub_id in stream.sub_request_ids:
                    self._routes.pop(sub_id, None)
                self._retire(stream)
            stream.admit(error)

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is None:  # aborted meanwhile
                continue
            stream, index = route
            if out.finished:
                del self._routes[out.request_id]
                logger.info(summarize(out))
            stream.put(index, out)
            if stream.finished:
                self._retire(stream)

    def _on_fatal(self, error: BaseException) -> None:
        self.error = error
        self.abort_all(InternalError(f"The engine failed: {type(error).__name__}: {error}"))
        self._ready.set()
        self.failed.set()

    # --------------------------------------------------------------------------- the engine loop thread

    def _run(self) -> None:
        try:
            engine = self._build_engine()
        except BaseException as exc:  # noqa: BLE001 - reported to the event loop, which exits the server
            logger.exception("building the engine failed")
            self._post(self._on_fatal, exc)
            return
        self.engine = engine
        self._post(self._on_ready)
        live: set[str] = set()  # sub-request ids the engine holds
        try:
            while True:
                commands = self._take_commands(block=not engine.has_unfinished_requests())
                acks = []
                for command in commands:
                    if command is _STOP:
                        return
                    if command[0] == "add":
                        acks.append(self._add(engine, live, *command[1:]))
                    else:
                        self._abort(engine, live, command[1])
                self._publish_queue(engine)
                if acks:
                    self._post(self._on_admitted, acks)
                if not engine.has_unfinished_requests():
                    continue
                outputs = engine.step()
                self.metrics.observe_outputs(outputs, time.monotonic())
                for out in outputs:
                    if out.finished:
                        live.discard(out.request_id)
                self._publish_queue(engine)
                if outputs:
                    self._post(self._on_outputs, outputs)
        except BaseException as exc:  # noqa: BLE001 - same: the server must learn that its engine is gone
            logger.exception("the engine loop failed")
            self._post(self._on_fatal, exc)

    def _take_commands(self, block: bool) -> list:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _add(
        self, engine: Any, live: set[str], stream: RequestStream, items: list[tuple[str, list[int], SamplingParams]]
    ) -> tuple[RequestStream, int, BaseException | None]:
        added = []
        try:
            for sub_id, prompt, params in items:
                engine.add_request(sub_id, prompt, params)
                added.append(sub_id)
        except ValueError as exc:
            # All choices or none: a half-admitted request would hold KV blocks nobody reads.
            for sub_id in added:
                engine.abort_request(sub_id)
            return stream, len(items), exc
        live.update(added)
        return stream, len(items), None

    def _abort(self, engine: Any, live: set[str], sub_ids: list[str]) -> None:
        for sub_id in sub_ids:
            if sub_id in live:
                live.discard(sub_id)
                engine.abort_request(sub_id)
                self.metrics.observe_abort(sub_id)

    def _publish_queue(self, engine: Any) -> None:
        self._num_waiting = engine.num_waiting
        self.metrics.set_queue(self._num_waiting, engine.num_running, engine.kv_cache_usage)
