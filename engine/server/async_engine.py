"""The server's handle on the engine: the engine loop runs in a process of its own; asyncio talks to it.

Commands are written by the event loop itself, never blocking it (`CommandPipe`); reports are read by
it as soon as their pipe is readable. A thread on either side would have to win the GIL from a busy
event loop for every message (Python hands it over every 5 ms).
The engine never waits for a client, and a client waits at most one engine step to be admitted.
"""

import asyncio
import logging
import multiprocessing
import time
from collections.abc import Callable, Sequence
from typing import Any

from engine.metrics import EngineMetrics
from engine.models.deepseek_vit import VisionConfig
from engine.sampling_params import SamplingParams
from engine.server.command_pipe import CommandPipe
from engine.server.engine_messages import (
    AbortRequests,
    AddRequests,
    Admission,
    Delta,
    Failed,
    OutputBuilder,
    Ready,
    Report,
    Stop,
)
from engine.server.engine_process import run_engine_process
from engine.server.errors import InternalError, InvalidRequest, QueueFull, ServiceUnavailable
from engine.server.report_pipe import ReportReader
from engine.server.request_log import summarize
from engine.server.request_stream import RequestStream

logger = logging.getLogger(__name__)


class PromptTooLong(ValueError):
    """The engine refused a prompt for its length."""


class AsyncEngine:
    """Admits requests (bounded waiting queue), streams their outputs, aborts, drains and stops."""

    def __init__(
        self,
        build_engine: Callable[..., Any],
        build_args: tuple,
        metrics: EngineMetrics,
        *,
        load_tokenizer: Callable[[str], Any],
        max_waiting_requests: int | None = None,
    ) -> None:
        """`build_engine(*build_args)` runs in the engine process (both must pickle); `load_tokenizer(path)`
        runs here once the engine is up."""
        self.metrics = metrics
        self.max_waiting_requests = max_waiting_requests
        self.tokenizer: Any = None  # set when ready
        self.max_model_len = 0  # set when ready
        self.vision: VisionConfig | None = None  # the model's vision_config, when ready (None: text only)
        self.error: str | None = None  # why the engine died, if it did
        self.draining = False
        self.failed = asyncio.Event()  # set if the engine died
        self.last_report = 0.0  # time.monotonic() of the engine's last message (it reports each second)
        self._build = (build_engine, build_args)
        self._load_tokenizer = load_tokenizer
        self._commands: CommandPipe | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._reports: Any = None  # the pipe the engine process reports on
        self._tasks: set[asyncio.Future] = set()
        self._ready = asyncio.Event()  # set once the engine is up (or failed to come up)
        self._idle = asyncio.Event()  # set while nothing is in flight
        self._idle.set()
        # Event-loop side bookkeeping.
        self._routes: dict[str, tuple[RequestStream, int]] = {}  # request id -> (stream, choice index)
        self._builders: dict[str, OutputBuilder] = {}  # request id -> its cumulative output
        self._admitting: dict[str, RequestStream] = {}  # streams sent to the engine, not yet acknowledged
        self._active: set[RequestStream] = set()  # admitted and neither finished nor closed
        self._num_waiting = 0  # the engine's waiting queue in its last report
        self._num_running = 0  # and what it ran
        self.max_num_seqs = 0  # what it runs at once (from Ready)
        self._num_unacked = 0  # choices sent to the engine, not yet acknowledged

    # ----------------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Starts the engine process; `wait_ready()` returns once it has built the engine."""
        self._loop = asyncio.get_running_loop()
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA state
        self._commands = CommandPipe(self._loop)
        report_reader, report_writer = ctx.Pipe(duplex=False)
        build, args = self._build
        self._process = ctx.Process(
            target=run_engine_process, args=(self._commands.reader, report_writer, build, args), name="engine-loop",
            daemon=False,  # it starts the other ranks' processes; it exits when the server's pipe closes
        )  # fmt: skip
        self._process.start()
        self._commands.reader.close()
        report_writer.close()
        self._reports = ReportReader(report_reader)
        self._loop.add_reader(self._reports.fileno(), self._read_reports)

    async def wait_ready(self) -> None:
        await self._ready.wait()

    @property
    def is_ready(self) -> bool:
        return self.tokenizer is not None and self.error is None

    @property
    def is_alive(self) -> bool:
        return self.error is None

    def silent_for(self) -> float:
        """Seconds since the engine process last reported, once it is up (0 while it loads: building the
        model sends nothing)."""
        return time.monotonic() - self.last_report if self.is_ready else 0.0

    async def stop(self) -> None:
        """Aborts what still runs, stops the engine process and waits for it."""
        self._stopping = True
        self.abort_all(ServiceUnavailable("The server is shutting down."))
        if self._process is not None:
            self._commands.send(Stop())
            await asyncio.to_thread(self._process.join, 30)
            if self._process.is_alive():
                self._process.kill()
            self._loop.remove_reader(self._reports.fileno())
            self._reports.close()
            self._commands.close()

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
        self, request_id: str, prompts: Sequence[list[int]], params: Sequence[SamplingParams], images: list | None = None
    ) -> RequestStream:
        """Hands one API request's choices to the engine; await `stream.admitted()` before reading it.
        images: the prompts' images (every choice shares one prompt when there are images)."""
        if self.draining:
            raise ServiceUnavailable("The server is draining and accepts no new requests.")
        if not self.is_ready:
            raise ServiceUnavailable("The model is not loaded yet." if self.error is None else "The engine failed.")
        limit = self.max_waiting_requests
        if limit is not None and len(prompts) > limit + self.max_num_seqs:
            raise InvalidRequest(f"This request has {len(prompts)} choices (prompts x n), more than this server ever "
                                 f"holds ({self.max_num_seqs} running + {limit} waiting); send fewer per request.",
                                 param="n")
        # what will wait: choices not yet admitted beyond the engine's free running slots
        pending = self._num_waiting + self._num_unacked
        free = max(0, self.max_num_seqs - self._num_running)
        num_waiting = max(0, pending - free)
        if limit is not None and max(0, pending + len(prompts) - free) > limit:
            raise QueueFull(
                f"The waiting queue is full ({num_waiting} waiting, at most {limit}); retry later.",
                headers={"Retry-After": "1"},
            )
        stream = RequestStream(request_id, len(prompts), self._close)
        for index, (sub_id, prompt, p) in enumerate(zip(stream.sub_request_ids, prompts, params)):
            self._routes[sub_id] = (stream, index)
            self._builders[sub_id] = OutputBuilder(sub_id, prompt, p.logprobs is not None)
        self._admitting[request_id] = stream
        self._active.add(stream)
        self._idle.clear()
        self._num_unacked += len(prompts)
        self._commands.send(AddRequests(request_id, [(rid, prompt, p, images or None) for rid, prompt, p in
                                                     zip(stream.sub_request_ids, prompts, params)]))
        return stream

    def abort_all(self, error: BaseException) -> None:
        for stream in list(self._active):
            stream.fail(error)
            stream.close()

    def _close(self, stream: RequestStream) -> None:
        running = [sub_id for sub_id in stream.sub_request_ids if self._forget(sub_id)]
        if running:
            self._commands.send(AbortRequests(running))
        self._retire(stream)

    def _forget(self, sub_id: str) -> bool:
        self._builders.pop(sub_id, None)
        self.metrics.forget(sub_id)  # its last report may never be observed (the client left first)
        return self._routes.pop(sub_id, None) is not None

    def _retire(self, stream: RequestStream) -> None:
        self._active.discard(stream)
        if not self._active:
            self._idle.set()

    # ---------------------------------------------------------------------------- on the event loop

    def _read_reports(self) -> None:
        # Everything the engine has sent so far, in one read: one wake-up may carry several steps.
        try:
            messages, closed = self._reports.read()
        except OSError:
            messages, closed = [], True
        for message in messages:
            self._on_message(message)
        if closed:
            self._loop.remove_reader(self._reports.fileno())
            self._on_message(Failed("the engine process exited unexpectedly"))

    async def _load_tokenizer_then_ready(self, ready: Ready) -> None:
        try:
            tokenizer = await asyncio.to_thread(self._load_tokenizer, ready.model_path)
        except Exception as exc:  # noqa: BLE001 - same outcome as an engine that cannot start
            self._on_failed(f"loading the tokenizer failed: {type(exc).__name__}: {exc}")
            return
        try:
            self.vision = VisionConfig.from_checkpoint(ready.model_path)
        except (OSError, ValueError) as exc:
            self._on_failed(f"reading the vision config failed: {type(exc).__name__}: {exc}")
            return
        self.tokenizer, self.max_model_len, self.max_num_seqs = tokenizer, ready.max_model_len, ready.max_num_seqs
        self._ready.set()

    def _on_message(self, message: Any) -> None:
        self.last_report = time.monotonic()
        if isinstance(message, list):  # reports of one or more passes of the engine loop, in order
            for fields in message:
                self._on_report(Report.unpack(fields))
        elif isinstance(message, Ready):
            task = asyncio.ensure_future(self._load_tokenizer_then_ready(message))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        elif isinstance(message, Failed) and not self._stopping:
            self._on_failed(message.message)

    def _on_report(self, report: Report) -> None:
        self._num_waiting, self._num_running = report.num_waiting, report.num_running
        self.metrics.set_queue(report.num_waiting, report.num_running, report.kv_cache_usage)
        if report.kv is not None:
            self.metrics.set_kv(report.kv.transfer_bytes, report.kv.pull_fallbacks, report.kv.directory_up)
        if report.spec is not None:
            self.metrics.set_spec(*report.spec)
        for admission in report.admissions:
            self._on_admission(admission)
        for request_id in report.aborted:
            self.metrics.observe_abort(request_id)
        builders = []
        for fields in report.deltas:
            delta = Delta._make(fields)
            builder = self._builders.get(delta.request_id)
            if builder is not None:  # else: aborted meanwhile
                builders.append(builder.add(delta))
        self.metrics.observe_outputs(builders, report.time)  # a builder stands for its request's last step
        for builder in builders:
            stream, index = self._routes[builder.request_id]
            if builder.finished:
                self._forget(builder.request_id)
                logger.info(summarize(builder))
            stream.put(index, builder)
            if stream.finished:
                self._retire(stream)

    def _on_admission(self, admission: Admission) -> None:
        stream = self._admitting.pop(admission.batch_id)
        self._num_unacked -= len(stream.sub_request_ids)
        if admission.error is None:
            stream.admit(None)
            return
        for sub_id in stream.sub_request_ids:
            self._forget(sub_id)
        self._retire(stream)
        stream.admit(PromptTooLong(admission.error) if admission.too_long else ValueError(admission.error))

    def _on_failed(self, message: str) -> None:
        logger.error("%s", message)
        self.error = message.splitlines()[0]
        # what failed stays in the log: a client learns that it did, not the internals
        self.abort_all(InternalError("The engine failed; this replica is restarting. Retry the request."))
        self._ready.set()
        self.failed.set()
