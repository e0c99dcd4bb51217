"""How fast the operator's autoscaler answers a queue spike, and what polling fleets costs it in CPU.

    python -m benchmarks.operator_autoscaling [--fleets 100] [--seconds 45] [--trials 20] [--out FILE]

Run from the repository root: it reuses the tests' Kubernetes API emulation
(tests/e2e/operator_harness.py). The operator is the real `deepseek-operator` console script in a
process of its own, so its CPU time is its own (read from /proc). The emulated API server and every
engine's /metrics (one real HTTP server rendering the engine's own exposition, one loopback
address per pod) run in this process.

1. Reaction: fleets at pollIntervalSeconds 5 (the default) and 1, one ready replica each, run
   `--trials` spikes per interval. At a random moment of the poll cycle the queue jumps from 2 to
   40 requests; the reaction time ends when the engine Deployment's new spec.replicas is in the
   API. It splits into the wait for the next poll (spike -> the first /metrics read after it) and
   the poll's own work (that read -> the write). Between spikes the queue drops back and the
   autoscaler scales back down (no scale-down window in these fleets).
2. Cost: `--fleets` fleets with two ready replicas each and a queue inside the tolerance band.
   Operator CPU seconds per wall second over `--seconds`, three times: autoscaling off (the
   operator only watches), on at the default 5 s with queues that hold still (a poll writes
   nothing), and on with queues that move every second (a poll writes the new queue depth to the
   status, which comes back to the operator as a watch event). CPU per poll is the difference to
   the idle window divided by the polls made (one pod list each).

On a 2-core machine the emulator, the engines and anything else running share the cores with the
operator: the whole machine's load is recorded beside each figure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import random
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import attrs
import kmock
from aiohttp import web

from engine.metrics import EngineMetrics
from fleet import names
from tests.e2e.operator_harness import NAMESPACE, Cluster, Emulator, declare_resources, write_kubeconfig

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
COMMAND = "python -m benchmarks.operator_autoscaling"
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "operator_autoscaling.json"
KEEP_REQUESTS = 50
# A real API server sends a watch bookmark about once a minute; Kopf reconnects a watch that has
# been silent for 70 s (settings.watching.inactivity_timeout).
BOOKMARK_SECONDS = 20.0
CALM, SPIKE = (0, 2), (30, 10)  # (waiting, running) of the reaction fleets' one replica
SPIKE_FLEETS = 4  # per poll interval; the trials are spread over them
INTERVALS = (5, 1)
DEFAULTS = {"fleets": 100, "seconds": 45.0, "trials": 20}


@attrs.define(kw_only=True)
class BenchEmulator(Emulator):
    """The tests' emulator plus what a run of minutes needs of a real API server.

    Watch bookmarks: without them Kopf reconnects every idle watch after 70 s, and kmock, which
    ignores the resourceVersion a watch resumes from, replays every object as ADDED, so each
    fleet would get a reconcile pass a minute that no real cluster causes. And it notes when each
    engine Deployment's replica count was written, with the count.
    """

    replica_writes: dict[str, list[tuple[float, int]]] = attrs.field(factory=dict, init=False)

    async def _handle(self, request: kmock.Request) -> Any:
        replicas = None
        if (request.action == kmock.action.UPDATE and request.resource is not None
                and request.resource.plural == "deployments" and isinstance(request.data, dict)):
            replicas = (request.data.get("spec") or {}).get("replicas")  # before the parent rewrites data
        response = await super()._handle(request)
        if isinstance(replicas, int):  # applied: the new count is in the API now
            self.replica_writes.setdefault(request.name, []).append((time.perf_counter(), replicas))
        return response

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        events = super()._serve_watch(request)
        resource = request.resource
        api_version = f"{resource.group}/{resource.version}" if resource.group else resource.version
        pending: asyncio.Future[Any] | None = None
        try:
            while True:
                pending = pending or asyncio.ensure_future(anext(events))
                done, _ = await asyncio.wait({pending}, timeout=BOOKMARK_SECONDS)
                if not done:
                    yield {"type": "BOOKMARK", "object": {"apiVersion": api_version,
                                                          "metadata": {"resourceVersion": str(self._revision)}}}
                    continue
                pending = None
                try:
                    event = done.pop().result()
                except StopAsyncIteration:
                    return
                yield event
        finally:
            if pending is not None:
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                    await pending
            await events.aclose()


class RequestLog:
    """Counts the operator's API requests by kind while keeping kmock's own log short.

    kmock 0.8 keeps every request and looks a new one up among all kept ones, so its answers slow
    down as the log grows; the benchmark would then measure the emulator. Old entries are counted
    here and dropped from its log; the newest stay, so a request being served is never dropped.
    """

    KINDS = ("requests", "status_writes", "pod_lists", "reconcile_reads")

    def __init__(self, emulator: Emulator) -> None:
        self.emulator = emulator
        self.dropped = dict.fromkeys(self.KINDS, 0)

    @staticmethod
    def _count(requests: list[Any]) -> dict[str, int]:
        return {"requests": len(requests),
                "status_writes": sum(1 for r in requests
                                     if r.method.value == "PATCH" and r.url.path.endswith("/status")),
                "pod_lists": sum(1 for r in requests if r.method.value == "GET" and r.url.path.endswith("/pods")),
                # Only a reconcile pass reads these kinds: the autoscaler never does.
                "reconcile_reads": sum(1 for r in requests if any(
                    f"/{plural}/" in r.url.path for plural in ("services", "secrets", "poddisruptionbudgets")))}

    def totals(self) -> dict[str, int]:
        current = self._count(list(self.emulator._requests))
        return {key: self.dropped[key] + current[key] for key in self.KINDS}

    async def trim(self) -> None:
        while True:
            log = self.emulator._requests
            if len(log) > 2 * KEEP_REQUESTS:
                old = log[:-KEEP_REQUESTS]
                del log[:-KEEP_REQUESTS]
                for key, value in self._count(old).items():
                    self.dropped[key] += value
            await asyncio.sleep(0.05)

    async def settle(self, kind: str, quiet_seconds: float = 5, timeout: float = 300) -> None:
        """Until no request of `kind` has reached the API for quiet_seconds."""
        deadline, last, since = time.monotonic() + timeout, -1, time.monotonic()
        while time.monotonic() < deadline:
            count = self.totals()[kind]
            if count != last:
                last, since = count, time.monotonic()
            elif time.monotonic() - since >= quiet_seconds:
                return
            await asyncio.sleep(0.2)
        raise TimeoutError(f"the operator never stopped sending {kind}")


class Engines:
    """Every engine pod's /metrics: one HTTP app, one listening socket per pod IP, one shared port."""

    def __init__(self) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.2", 0))
            self.port = probe.getsockname()[1]
        self.metrics: dict[str, EngineMetrics] = {}
        self.scrapes: dict[str, list[float]] = {}  # ip -> perf_counter() of each /metrics read
        app = web.Application()
        app.router.add_get("/metrics", self._serve)
        self.runner = web.AppRunner(app, access_log=None)

    async def start(self) -> None:
        await self.runner.setup()

    async def add(self, ip: str, queue: tuple[int, int]) -> None:
        self.metrics[ip] = EngineMetrics()
        self.set(ip, queue)
        await web.TCPSite(self.runner, ip, self.port).start()

    def set(self, ip: str, queue: tuple[int, int], kv_cache_usage: float = 0.5) -> None:
        self.metrics[ip].set_queue(*queue, kv_cache_usage)

    def num_scrapes(self) -> int:
        return sum(map(len, self.scrapes.values()))

    async def _serve(self, request: web.Request) -> web.Response:
        ip = request.transport.get_extra_info("sockname")[0]
        self.scrapes.setdefault(ip, []).append(time.perf_counter())
        return web.Response(body=self.metrics[ip].render(), content_type="text/plain")


def fleet(name: str, autoscaling: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": names.API_VERSION, "kind": names.KIND, "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"model": {"name": "m", "uri": "pvc://models/m"}, "engine": {"image": "e:1"},
                     "replicas": 2, "autoscaling": autoscaling}}


def pod(name: str, fleet_name: str, ip: str, port: int) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": {names.PARENT_LABEL: fleet_name}},
            "spec": {"containers": [{"name": "engine", "image": "e:1",
                                     "ports": [{"name": "http", "containerPort": port}]}]},
            "status": {"podIP": ip, "phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}


def scaling_reason(cluster: Cluster, name: str) -> str | None:
    body = cluster.get(names.API_VERSION, names.PLURAL, name) or {}
    conditions = body.get("status", {}).get("conditions", [])
    return next((c["reason"] for c in conditions if c["type"] == "ScalingReady"), None)


async def until(check: Callable[[], Any], timeout: float, what: str, every: float = 0.2) -> Any:
    # Reading the emulator's objects is not free (kmock filters its whole store): poll gently.
    deadline = time.monotonic() + timeout
    while not (result := check()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(every)
    return result


def summary(values: list[float]) -> dict[str, float]:
    """Median, p90 and extremes in seconds (p90 interpolated between the trials)."""
    return {"median": statistics.median(values), "p90": statistics.quantiles(values, n=10, method="inclusive")[-1],
            "min": min(values), "max": max(values)}


async def spikes(cluster: Cluster, engines: Engines, name: str, ip: str, interval: int, trials: int,
                 rng: random.Random) -> list[tuple[float, float, float]]:
    """(reaction, wait for the poll, poll work) in seconds for each of `trials` spikes on one fleet."""
    emulator: BenchEmulator = cluster.emulator
    await cluster.create(fleet(name, {"enabled": True, "minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 4,
                                      "pollIntervalSeconds": interval, "scaleDownStabilizationSeconds": 0,
                                      "maxScaleDownStep": 4}))
    await engines.add(ip, CALM)
    await cluster.create(pod(f"{name}-0", name, ip, engines.port))
    await until(lambda: scaling_reason(cluster, name) == "Stable", 120, f"{name} to settle")

    def write_after(since: float, wanted: Callable[[int], bool]) -> float | None:
        return next((t for t, n in emulator.replica_writes.get(name, []) if t > since and wanted(n)), None)

    results, calm_since = [], time.perf_counter()
    for _ in range(trials):
        await asyncio.sleep(rng.uniform(0, interval))  # a random moment of the poll cycle
        engines.set(ip, SPIKE, 0.9)
        spiked = time.perf_counter()
        scaled = await until(lambda: write_after(spiked, lambda n: n > 1), 2 * interval + 30, f"{name} to scale up",
                             every=0.02)
        if write_after(calm_since, lambda n: n > 1) != scaled:
            raise RuntimeError(f"{name} scaled up before its queue rose")
        seen = min(t for t in engines.scrapes[ip] if t >= spiked)
        results.append((scaled - spiked, seen - spiked, scaled - seen))
        engines.set(ip, CALM)
        calm_since = await until(lambda: write_after(scaled, lambda n: n == 1), 2 * interval + 30,
                                 f"{name} to scale down", every=0.02)
    await cluster.delete(names.API_VERSION, names.PLURAL, name)
    return results


async def reaction(cluster: Cluster, engines: Engines, interval: int, trials: int, subnet: int) -> dict[str, Any]:
    per_fleet = [trials // SPIKE_FLEETS + (i < trials % SPIKE_FLEETS) for i in range(SPIKE_FLEETS)]
    runs = await asyncio.gather(*(
        spikes(cluster, engines, f"spike-{interval}s-{i}", f"127.0.{subnet}.{i + 2}", interval, n, random.Random(i))
        for i, n in enumerate(per_fleet) if n))
    results = [r for run in runs for r in run]
    total, wait, work = ([r[k] for r in results] for k in range(3))
    return {"trials": len(results), "reaction_s": summary(total), "wait_for_poll_s": summary(wait),
            "poll_work_s": summary(work)}


class Sampler:
    """CPU seconds of the operator, of this process and of the whole machine, between two readings."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def read(self) -> dict[str, float]:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        ticks = [int(x) for x in cpu[:8]]  # user nice system idle iowait irq softirq steal
        own = os.times()
        return {"wall": time.perf_counter(), "operator": (int(fields[11]) + int(fields[12])) / CLOCK_TICKS,
                "benchmark": own.user + own.system,
                "machine": (sum(ticks) - ticks[3] - ticks[4]) / CLOCK_TICKS}

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")


async def measure(log: RequestLog, engines: Engines, sampler: Sampler, seconds: float, ips: list[str],
                  attempts: int = 3) -> dict[str, Any]:
    """Rates over a window of `seconds` in which no reconcile pass ran (measured again if one did)."""
    for _ in range(attempts):
        requests, scrapes, cpu = log.totals(), engines.num_scrapes(), sampler.read()
        await asyncio.sleep(seconds)
        requests_after, scrapes_after, cpu_after = log.totals(), engines.num_scrapes(), sampler.read()
        if requests_after["reconcile_reads"] == requests["reconcile_reads"]:
            break
        print("  (a reconcile pass ran in the window: measuring again)", flush=True)
        await log.settle("reconcile_reads")
    wall = cpu_after["wall"] - cpu["wall"]
    used = {key: (cpu_after[key] - cpu[key]) / wall for key in ("operator", "benchmark", "machine")}
    # Gaps between two reads of one pod inside the window: how late the polls came.
    gaps = [b - a for ip in ips for a, b in zip(engines.scrapes.get(ip, []), engines.scrapes.get(ip, [])[1:])
            if cpu["wall"] <= a and b <= cpu_after["wall"]]
    return {"window_s": round(wall, 1),
            "operator_cpu_cores": used["operator"],
            "benchmark_cpu_cores": used["benchmark"],
            "other_cpu_cores": max(0.0, used["machine"] - used["operator"] - used["benchmark"]),
            "machine_busy_cores": used["machine"],
            **{f"{key}_per_s": (requests_after[key] - requests[key]) / wall for key in RequestLog.KINDS},
            "metrics_reads_per_s": (scrapes_after - scrapes) / wall,
            "poll_period_s": summary(gaps) if len(gaps) > 1 else None,
            "operator_rss_mib": sampler.rss_mib()}


async def wander(engines: Engines, ips: list[str]) -> None:
    """Every second each pod's queue moves a little, within the tolerance band (30 to 34 over two
    replicas at a target of 16 each): every poll sees a new queue depth and writes it."""
    rng = random.Random(0)
    while True:
        for ip in ips:
            engines.set(ip, (rng.randint(0, 1), rng.randint(15, 16)), rng.random())
        await asyncio.sleep(1)


async def cost(args: argparse.Namespace, cluster: Cluster, log: RequestLog, engines: Engines,
               sampler: Sampler) -> dict[str, Any]:
    ips: list[str] = []
    for i in range(args.fleets):
        name = f"cost-{i}"
        await cluster.create(fleet(name, {"enabled": False, "maxReplicas": 4}))
        for j in range(2):
            ip = f"127.1.{i // 100}.{(i % 100) * 2 + j + 2}"
            await engines.add(ip, (0, 16))
            await cluster.create(pod(f"{name}-{j}", name, ip, engines.port))
            ips.append(ip)
    deployments = [f"cost-{i}" for i in range(args.fleets)]
    await until(lambda: all(cluster.get("apps/v1", "deployments", d) for d in deployments), 600,
                "the fleets' children", every=2)
    await log.settle("requests")  # every creation pass is over: the operator only watches
    print(f"{args.fleets} fleets created; measuring {args.seconds:g} s with autoscaling off", flush=True)
    windows = {"off": await measure(log, engines, sampler, args.seconds, ips)}

    for name in deployments:
        await cluster.patch(names.API_VERSION, names.PLURAL, name, {"spec": {"autoscaling": {
            "enabled": True, "minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 16}}})
    await until(lambda: all(scaling_reason(cluster, d) for d in deployments), 600, "every fleet's first poll",
                every=2)
    await log.settle("reconcile_reads")  # the passes for the spec change are over: only polls remain
    await log.settle("status_writes")  # every first poll's status is written: the queues hold still
    print(f"autoscaling on at 5 s, queues holding still: measuring {args.seconds:g} s", flush=True)
    windows["steady"] = await measure(log, engines, sampler, args.seconds, ips)

    wandering = asyncio.create_task(wander(engines, ips))
    try:
        await asyncio.sleep(10)  # every fleet has polled a moving queue at least once
        print(f"autoscaling on at 5 s, queues moving: measuring {args.seconds:g} s", flush=True)
        windows["moving"] = await measure(log, engines, sampler, args.seconds, ips)
    finally:
        wandering.cancel()
    idle = windows["off"]["operator_cpu_cores"]
    for key in ("steady", "moving"):
        window = windows[key]
        polls = window["pod_lists_per_s"]  # one label-selected pod list per poll
        window["polls_due_per_s"] = args.fleets / 5
        window["cpu_ms_per_poll"] = (window["operator_cpu_cores"] - idle) / polls * 1000 if polls else None
    return {"fleets": args.fleets, "poll_interval_s": 5, "replicas_per_fleet": 2, "windows": windows}


def rounded(value: Any) -> Any:
    """Floats to four decimals (0.1 ms, 0.01 % of a core): the noise is far above that."""
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {key: rounded(item) for key, item in value.items()}
    return value


def machine() -> dict[str, Any]:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"cpus": os.cpu_count(), "cpu_model": model, "python": platform.python_version(),
            **{package: metadata.version(package) for package in ("kopf", "kmock", "kubernetes", "aiohttp")}}


def operator_executable() -> str:
    # The console script installed beside this interpreter, else the first on PATH.
    beside = Path(sys.executable).with_name("deepseek-operator")
    found = str(beside) if beside.exists() else shutil.which("deepseek-operator")
    if found is None:
        raise SystemExit("deepseek-operator is not installed: pip install -e '.[operator,dev]'")
    return found


async def run(args: argparse.Namespace, cluster: Cluster, log: RequestLog, engines: Engines,
              pid: int) -> dict[str, Any]:
    options = "".join(f" --{key} {getattr(args, key):g}" for key in DEFAULTS if getattr(args, key) != DEFAULTS[key])
    result: dict[str, Any] = {"command": COMMAND + options, "date": datetime.date.today().isoformat(),
                              "machine": machine(), "reaction": {}}
    print(f"operator pid {pid}; {os.cpu_count()} CPUs; {args.trials} spikes per poll interval", flush=True)
    reactions = await asyncio.gather(*(reaction(cluster, engines, interval, args.trials, subnet)
                                       for subnet, interval in enumerate(INTERVALS, start=1)))
    for interval, figures in zip(INTERVALS, reactions):
        result["reaction"][f"poll_{interval}s"] = figures
        r, w = figures["reaction_s"], figures["poll_work_s"]
        print(f"queue spike -> new replica count at pollIntervalSeconds {interval}: median {r['median']:.2f} s, "
              f"p90 {r['p90']:.2f} s, max {r['max']:.2f} s over {figures['trials']} spikes; "
              f"the poll's own work: median {w['median'] * 1000:.0f} ms, p90 {w['p90'] * 1000:.0f} ms", flush=True)
    result["cost"] = await cost(args, cluster, log, engines, Sampler(pid))
    for key, window in result["cost"]["windows"].items():
        print(describe(key, window), flush=True)
    return result


def describe(key: str, w: dict[str, Any]) -> str:
    line = (f"{key}: operator {w['operator_cpu_cores'] * 100:.1f}% of a core, RSS {w['operator_rss_mib']:.0f} MiB, "
            f"{w['requests_per_s']:.1f} API requests/s; machine busy {w['machine_busy_cores']:.2f} cores "
            f"(benchmark {w['benchmark_cpu_cores']:.2f}, others {w['other_cpu_cores']:.2f})")
    if "cpu_ms_per_poll" in w:
        line += (f"; {w['pod_lists_per_s']:.1f} polls/s of {w['polls_due_per_s']:g} due "
                 f"(p90 period {(w['poll_period_s'] or {}).get('p90', float('nan')):.2f} s), "
                 f"{w['status_writes_per_s']:.1f} status writes/s, "
                 + ("no poll in the window" if w["cpu_ms_per_poll"] is None
                    else f"{w['cpu_ms_per_poll']:.2f} ms of CPU per poll"))
    return line


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fleets", type=int, default=DEFAULTS["fleets"], help="fleets polled in the cost measurement")
    p.add_argument("--seconds", type=float, default=DEFAULTS["seconds"], help="length of each cost window")
    p.add_argument("--trials", type=int, default=DEFAULTS["trials"], help="queue spikes per poll interval")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the figures go (JSON)")
    p.add_argument("--operator-log", default=os.devnull, help="where the operator's log goes")
    args = p.parse_args()
    if args.fleets < 1 or args.fleets > 25_000 or args.trials < 2 or args.seconds <= 0:
        p.error("--fleets must be 1..25000 (loopback addresses), --trials at least 2, --seconds positive")
    return args


async def main() -> None:
    args = parse_args()
    executable = operator_executable()
    async with BenchEmulator() as emulator, kmock.Server(emulator) as server:
        declare_resources(emulator)
        cluster = Cluster(emulator, server)
        engines = Engines()
        await engines.start()
        with tempfile.TemporaryDirectory() as tmp, open(args.operator_log, "wb") as operator_log:
            env = {**os.environ, "KUBECONFIG": str(write_kubeconfig(Path(tmp) / "kubeconfig", str(server.url))),
                   "DEEPSEEK_OPERATOR_NAMESPACES": NAMESPACE}
            operator = await asyncio.create_subprocess_exec(
                executable, "--liveness", "off", env=env, stdout=operator_log, stderr=operator_log)
            log = RequestLog(emulator)
            trimming = asyncio.create_task(log.trim())
            try:
                result = await run(args, cluster, log, engines, operator.pid)
            finally:
                trimming.cancel()
                operator.terminate()
                try:
                    await asyncio.wait_for(operator.wait(), 30)
                except asyncio.TimeoutError:
                    operator.kill()
                    await operator.wait()
        await engines.runner.cleanup()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rounded(result), indent=2) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    asyncio.run(main())
