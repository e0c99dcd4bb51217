"""Reading engine metrics: the real exposition parsed, every pod read at once, a silent pod unknown."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from engine.metrics import EngineMetrics
from fleet.autoscaler.decision import PodLoad
from fleet.autoscaler.metrics_client import MAX_BYTES, MetricsClient, parse_load
from fleet.autoscaler.pods import EnginePod

pytestmark = pytest.mark.timeout(60)


def exposition(waiting: int, running: int, kv: float) -> str:
    metrics = EngineMetrics()  # the engine's own registry and names: the contract itself
    metrics.set_queue(waiting, running, kv)
    return metrics.render().decode()


def test_parses_the_engine_exposition() -> None:
    assert parse_load(exposition(3, 5, 0.25)) == PodLoad(waiting=3, running=5, kv_cache_usage=0.25)


@pytest.mark.parametrize("text", [
    "", "<html>busy</html>\n", "deepseek_engine_requests_waiting 1\n",  # running missing
    "deepseek_engine_requests_waiting NaN\ndeepseek_engine_requests_running 1\n",
    "deepseek_engine_requests_waiting{ 1\n",
])
def test_malformed_or_partial_text_is_unknown_not_zero(text: str) -> None:
    assert parse_load(text) is None


def test_labelled_samples_are_summed_and_kv_usage_is_optional() -> None:
    text = ('deepseek_engine_requests_waiting{model="a"} 2\ndeepseek_engine_requests_waiting{model="b"} 3\n'
            "deepseek_engine_requests_running 1\n")
    assert parse_load(text) == PodLoad(waiting=5, running=1, kv_cache_usage=None)


def test_the_operator_package_does_not_import_the_engine() -> None:
    code = "import sys, fleet.handlers; bad = {'torch', 'engine'} & set(sys.modules); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest.fixture
async def pods() -> AsyncIterator[Callable[[dict[str, Handler]], Awaitable[list[EnginePod]]]]:
    """Real HTTP servers, each on its own loopback address and one shared port, as engine pods are."""
    runners: list[web.AppRunner] = []

    async def serve(handlers: dict[str, Handler]) -> list[EnginePod]:
        with socket.socket() as probe:
            probe.bind(("127.0.0.2", 0))
            port = probe.getsockname()[1]
        out = []
        for i, (name, handler) in enumerate(handlers.items()):
            ip = f"127.0.0.{i + 2}"
            app = web.Application()
            app.router.add_get("/metrics", handler)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, ip, port).start()
            runners.append(runner)
            out.append(EnginePod(name=name, ready=True, ip=ip, port=port, deletion_cost=None))
        return out

    yield serve
    for runner in runners:
        await runner.cleanup()


def text(body: str, status: int = 200) -> Handler:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(text=body, status=status)
    return handler


async def test_each_pod_is_read_and_every_failure_is_unknown(pods) -> None:  # noqa: ANN001
    release = asyncio.Event()

    async def hangs(request: web.Request) -> web.Response:
        await release.wait()  # until the client has given up on it
        return web.Response(text=exposition(0, 0, 0))

    async def huge(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(MAX_BYTES // 65536 + 2):
            await response.write(b"#" * 65535 + b"\n")
        return response

    served = await pods({
        "good": text(exposition(1, 2, 0.5)), "error": text("oops", 503), "garbage": text("<html>\n"),
        "hangs": hangs, "huge": huge,
    })
    closed = EnginePod(name="closed", ready=True, ip="127.0.0.9", port=served[0].port, deletion_cost=None)
    client = MetricsClient()
    try:
        loads = await client.read([*served, closed], timeout=0.5)
    finally:
        release.set()
        await client.close()
    assert loads == {"good": PodLoad(1, 2, 0.5), "error": None, "garbage": None, "hangs": None, "huge": None,
                     "closed": None}


async def test_pods_are_read_concurrently(pods) -> None:  # noqa: ANN001
    # Each server answers only once all of them have been asked: read one by one, all would time out.
    arrived = asyncio.Barrier(4)

    async def waits_for_the_others(request: web.Request) -> web.Response:
        await arrived.wait()
        return web.Response(text=exposition(0, 1, 0.1))

    served = await pods({f"p{i}": waits_for_the_others for i in range(4)})
    client = MetricsClient()
    try:
        loads = await client.read(served, timeout=5)
    finally:
        await client.close()
    assert loads == {f"p{i}": PodLoad(0, 1, 0.1) for i in range(4)}


def test_pod_view_follows_the_engine_port_and_readiness() -> None:
    pod = {"metadata": {"name": "a", "annotations": {"controller.kubernetes.io/pod-deletion-cost": "-1"}},
           "spec": {"containers": [{"name": "engine", "ports": [{"name": "kv-transfer", "containerPort": 8100},
                                                                {"name": "http", "containerPort": 9000}]}]},
           "status": {"podIP": "10.0.0.7", "conditions": [{"type": "Ready", "status": "True"}]}}
    view = EnginePod.from_pod(pod)
    assert (view.ready, view.metrics_url, view.deletion_cost) == (True, "http://10.0.0.7:9000/metrics", "-1")
    starting = EnginePod.from_pod({"metadata": {"name": "b"}, "status": {"podIP": "fd00::5"}})
    assert (starting.ready, starting.metrics_url) == (False, "http://[fd00::5]:8000/metrics")
