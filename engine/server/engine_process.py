"""The engine loop's own process: it owns the LLMEngine, applies commands, steps, and reports back.

A process rather than a thread: the server's event loop (HTTP, JSON, SSE) and the engine's Python
(scheduler, sampler, kernel launches) then never wait on each other's GIL, so serving many streams
costs the engine nothing but the pickling of each step's deltas.
"""

import gc
import logging
import select
import signal
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from engine.server.engine_messages import (
    AbortRequests,
    AddRequests,
    Admission,
    Delta,
    Failed,
    KVSnapshot,
    Ready,
    Report,
    Stop,
)
from engine.server.report_pipe import ReportWriter

logger = logging.getLogger(__name__)

# An idle engine still reports this often (its heartbeat: the server's /health, and the KV directory's
# health as the engine last saw it, stay current without traffic)
HEARTBEAT_SECONDS = 1.0


def build_llm_engine(config: Any) -> Any:
    """The default engine builder (importable by name, so the spawned process can run it)."""
    import os

    import torch

    from engine.llm_engine import LLMEngine  # torch loads in the engine process only

    if "OMP_NUM_THREADS" not in os.environ and not torch.cuda.is_available():
        # On CPU, leave a core to the HTTP server: OpenMP workers that spin for a core the event loop
        # holds slow every step down by orders of magnitude (3 vs 866 tokens/s seen on 2 cores).
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    return LLMEngine(config)


def run_engine_process(
    commands: Connection, reports: Connection, build: Callable[..., Any], build_args: tuple
) -> None:
    """Entry point of the engine process."""
    # Ctrl-C (and a SIGTERM sent to the process group) reach this process too, but the server decides
    # when it stops: after the drain. If the server dies, the pipe closes and this process exits.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    reports = ReportWriter(reports)
    try:
        engine = build(*build_args)
    except BaseException as exc:  # noqa: BLE001 - reported to the server, which exits non-zero
        reports.send(Failed(f"building the engine failed: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    # The engine's objects (model, pool, graphs, scheduler) live as long as this process: out of the
    # cyclic collector's generations, its passes no longer walk them during steps (vLLM does the same).
    # Measured on an H200: a 2k-token prefill, bound by the host, 7-10 % faster (docs/perf.md).
    gc.collect()
    gc.freeze()
    reports.send(Ready(model_path=str(engine.model_path), max_model_len=engine.max_model_len,
                       max_num_seqs=getattr(getattr(engine, "config", None), "max_num_seqs", 0)))
    try:
        EngineLoop(engine, commands, reports).run()
    except (EOFError, BrokenPipeError):
        pass  # the server is gone
    except BaseException as exc:  # noqa: BLE001
        reports.send(Failed(f"the engine loop failed: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        engine.shutdown()  # the KV directory entries and the transfer server go with this process


class EngineLoop:
    """schedule -> step -> report, with the server's commands applied between steps.

    Every pass costs the step's own host time plus what reporting adds, at one stream once per token:
    a poll of the command pipe (one `poll(2)` on a registered descriptor; `Connection.poll` builds a
    selector each call, ~10 us) and one report packed as tuples (`ReportWriter`)."""

    def __init__(self, engine: Any, commands: Connection, reports: ReportWriter) -> None:
        self.engine = engine
        self.commands = commands
        self.reports = reports
        self._poller = select.poll()
        self._poller.register(commands.fileno(), select.POLLIN)
        self.live: set[str] = set()  # request ids the engine holds
        self._last_queue: tuple | None = None
        self._last_kv: KVSnapshot | None = None
        self._last_spec: tuple[int, int] | None = None
        self._last_sent = 0.0

    def run(self) -> None:
        engine = self.engine
        poll = self._poller.poll
        while True:
            if not engine.has_unfinished_requests():
                self.reports.flush(force=True)  # nothing held while the engine sleeps
                poll(HEARTBEAT_SECONDS * 1000)  # idle: sleep until the server sends something
            report = Report(time=0.0, num_waiting=0, num_running=0, kv_cache_usage=0.0)  # filled in by _send
            while poll(0):
                command = self.commands.recv()
                if isinstance(command, Stop):
                    return
                if isinstance(command, AddRequests):
                    report.admissions.append(self._add(command))
                elif isinstance(command, AbortRequests):
                    report.aborted.extend(self._abort(command.request_ids))
            if engine.has_unfinished_requests():
                outputs = engine.step()
                report.deltas = [tuple(Delta.of(out)) for out in outputs]
                self.live.difference_update(out.request_id for out in outputs if out.finished)
            self._send(report)

    def _send(self, report: Report) -> None:
        engine = self.engine
        queue = (engine.num_waiting, engine.num_running, engine.kv_cache_usage)
        kv = KVSnapshot.of(engine.kv) if getattr(engine, "kv", None) is not None else None
        if kv != self._last_kv:
            report.kv = self._last_kv = kv
        speculator = getattr(engine, "speculator", None)
        spec = (speculator.num_draft_tokens, speculator.num_accepted_tokens) if speculator is not None else None
        if spec != self._last_spec:
            report.spec = self._last_spec = spec
        now = time.monotonic()
        if (report.admissions or report.deltas or report.aborted or report.kv or report.spec
                or queue != self._last_queue or now - self._last_sent >= HEARTBEAT_SECONDS):
            report.time = now
            report.num_waiting, report.num_running, report.kv_cache_usage = queue
            self._last_queue, self._last_sent = queue, now
            self.reports.add(report.pack())
        self.reports.flush()

    def _add(self, command: AddRequests) -> Admission:
        added = []
        try:
            for request_id, prompt, params, images in command.requests:
                self.engine.add_request(request_id, prompt, params, images=images)
                added.append(request_id)
        except ValueError as exc:
            # All choices or none: a half-admitted request would hold KV blocks nobody reads.
            for request_id in added:
                self.engine.abort_request(request_id)
            too_long = type(exc).__name__ == "PromptTooLongError"
            return Admission(command.batch_id, error=str(exc), too_long=too_long)
        self.live.update(added)
        return Admission(command.batch_id)

    def _abort(self, request_ids: list[str]) -> list[str]:
        aborted = [r for r in request_ids if r in self.live]
        for request_id in aborted:
            self.live.discard(request_id)
            self.engine.abort_request(request_id)
        return aborted
