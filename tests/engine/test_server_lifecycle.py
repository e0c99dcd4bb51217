"""Start, drain and failure: SIGTERM while streaming, the drain limit, loading, and a broken engine."""

import asyncio
import json
import multiprocessing
import os
import signal
import subprocess
import time

import httpx
import openai
import pytest

from engine.config import EngineConfig
from engine.metrics import EngineMetrics
from engine.server.app import create_app
from engine.server.async_engine import AsyncEngine
from engine.server.engine_process import build_llm_engine
from engine.server.settings import ServerSettings
from engine.tokenizer import Tokenizer
from tests.engine.conftest_server import (  # noqa: F401
    MODEL_NAME,
    SERVE,
    ServerProcess,
    free_port,
    module_servers,
    selected_items,
    tiny_checkpoint,
    tiny_checkpoint_in,
    wait_for,
)

SPAWN = multiprocessing.get_context("spawn")  # the engine process is spawned; its events must be too
# The servers of this module's tests, by the test that uses each: all started at once, ahead of the module
# (start_servers), so their start-ups overlap one another and the tests before theirs; each serves its own
# test alone.
SERVERS = {
    "test_sigterm_drains_streams_then_exits_0[off]": ("--drain-timeout", "120", "--async-scheduling", "off"),
    "test_sigterm_drains_streams_then_exits_0[on]": ("--drain-timeout", "120", "--async-scheduling", "on"),
    "test_drain_timeout_ends_streams_with_an_error_and_exits_0": ("--drain-timeout", "0.5"),
    "test_a_stopped_engine_process_turns_health_unhealthy": ("--engine-heartbeat-timeout", "2"),
}


def start_servers(session, tmp_path_factory) -> dict[str, ServerProcess]:
    """The servers of the tests this run selected."""
    chosen = {item.name for item in selected_items(session, __name__)}
    logs = tmp_path_factory.mktemp("servers")
    return {name: ServerProcess(tiny_checkpoint_in(tmp_path_factory), logs / f"{i}.log", *args)
            for i, (name, args) in enumerate(SERVERS.items()) if name in chosen}


@pytest.fixture
def server(request) -> ServerProcess:
    """This test's own server, ready (SIGKILLed at the end, if still up)."""
    proc = module_servers(request).pop(request.node.name)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop(signal.SIGKILL)


def stream_body(max_tokens: int) -> dict:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def open_streams(http: httpx.AsyncClient, num: int, max_tokens: int):
    """Starts `num` streams; returns (tasks collecting each stream's events, event set once all generate)."""
    generating = [asyncio.Event() for _ in range(num)]

    async def collect(i: int) -> list[str]:
        events = []
        async with http.stream("POST", "/v1/chat/completions", json=stream_body(max_tokens)) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    if len(events) == 2:
                        generating[i].set()
        return events

    tasks = [asyncio.create_task(collect(i)) for i in range(num)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in generating)), 120)
    return tasks


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
async def test_sigterm_drains_streams_then_exits_0(server, async_scheduling):
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            streams = await open_streams(http, 4, 250)
            server.proc.send_signal(signal.SIGTERM)
            for _ in range(100):  # the signal is handled on the server's next event-loop turn
                ready = await http.get("/ready")
                if ready.status_code == 503:
                    break
                await asyncio.sleep(0.02)
            assert ready.status_code == 503 and ready.json() == {"status": "draining"}
            refused = await http.post("/v1/chat/completions", json={**stream_body(4), "stream": False})
            assert refused.status_code == 503
            assert refused.json()["error"]["type"] == "service_unavailable"
            assert (await http.get("/health")).status_code == 200
            assert not all(t.done() for t in streams), "the streams should still be running"
            for events in await asyncio.gather(*streams):
                assert events[-1] == "[DONE]"
                chunks = [json.loads(e) for e in events[:-1]]
                assert chunks[-2]["choices"][0]["finish_reason"] == "length"
                assert chunks[-1]["usage"]["completion_tokens"] == 250
        assert server.proc.wait(60) == 0
        assert "draining 4 request(s)" in server.log()
    finally:
        server.stop()


async def test_drain_timeout_ends_streams_with_an_error_and_exits_0(server):
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            streams = await open_streams(http, 2, 1800)
            server.proc.send_signal(signal.SIGTERM)
            for events in await asyncio.wait_for(asyncio.gather(*streams), 30):
                error = json.loads(events[-1])["error"]
                assert error["code"] == "service_unavailable" and "shut down" in error["message"]
        assert server.proc.wait(30) == 0
    finally:
        server.stop()


def test_serve_with_no_arguments_serves_the_embedded_model(tmp_path):
    # No flags at all: the address comes from the environment, as the operator's pods may set it.
    port = free_port()
    env = {**os.environ, "DEEPSEEK_ENGINE_HOST": "127.0.0.1", "DEEPSEEK_ENGINE_PORT": str(port)}
    with open(tmp_path / "server.log", "w") as log:
        proc = subprocess.Popen(SERVE, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        assert wait_for(lambda: _ready(url), timeout=120), (tmp_path / "server.log").read_text()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["deepseek-tiny"]
        reply = client.chat.completions.create(
            model="deepseek-tiny", messages=[{"role": "user", "content": "Hello!"}], max_tokens=16, temperature=0
        )
        assert reply.choices[0].message.content and reply.usage.completion_tokens <= 16
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_model_that_does_not_exist_is_a_clear_error_at_once(tmp_path):
    done = subprocess.run([*SERVE, "--model", str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "neither a directory nor an embedded model" in done.stderr


def test_an_engine_that_fails_to_build_exits_1(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    server = ServerProcess(tmp_path, tmp_path / "server.log")
    assert server.proc.wait(120) == 1
    assert "building the engine failed" in server.log()


def build_when_set(checkpoint: str, gate) -> object:
    """Engine builder for the engine process that "loads" until `gate` is set."""
    gate.wait()
    return build_llm_engine(EngineConfig(model=checkpoint, dtype="float32", show_progress=False))


def build_crashing_when_set(checkpoint: str, crash) -> object:
    """Engine builder whose engine fails its next step once `crash` is set (a lost device, say)."""
    engine = build_llm_engine(EngineConfig(model=checkpoint, dtype="float32", show_progress=False))
    step = engine.step

    def step_until_crash():
        if crash.is_set():
            raise RuntimeError("device lost")
        return step()

    engine.step = step_until_crash
    return engine


def in_process_app(build, *args) -> tuple[AsyncEngine, object]:
    engine = AsyncEngine(build, args, EngineMetrics(), load_tokenizer=Tokenizer)
    return engine, create_app(ServerSettings(served_model_name=MODEL_NAME), engine)


async def test_not_ready_while_loading_then_ready(tiny_checkpoint):
    gate = SPAWN.Event()
    engine, app = in_process_app(build_when_set, str(tiny_checkpoint), gate)
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2}
    engine.start()  # what the app's lifespan does under uvicorn
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            assert (await http.get("/health")).status_code == 200
            assert (await http.get("/ready")).json() == {"status": "loading"}
            refused = await http.post("/v1/completions", json=body)
            assert refused.status_code == 503 and "not loaded" in refused.json()["error"]["message"]
            gate.set()
            await asyncio.wait_for(engine.wait_ready(), 120)
            assert (await http.get("/ready")).status_code == 200
            assert (await http.post("/v1/completions", json=body)).json()["usage"]["completion_tokens"] == 2
    finally:
        gate.set()
        await engine.stop()


async def test_an_engine_failure_fails_requests_and_health(tiny_checkpoint):
    crash = SPAWN.Event()
    engine, app = in_process_app(build_crashing_when_set, str(tiny_checkpoint), crash)
    engine.start()
    try:
        await asyncio.wait_for(engine.wait_ready(), 120)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 1800, "ignore_eos": True}
            pending = asyncio.create_task(http.post("/v1/completions", json=body))
            await asyncio.sleep(0.5)
            crash.set()
            failed = await asyncio.wait_for(pending, 60)
            assert failed.status_code == 500
            message = failed.json()["error"]["message"]  # that it failed, not the internals (in the log)
            assert "engine failed" in message and "device lost" not in message
            assert engine.failed.is_set() and "device lost" in engine.error
            health = await http.get("/health")
            assert health.status_code == 503 and health.json() == {"status": "failed"}
            assert (await http.post("/v1/completions", json=body)).status_code == 503
    finally:
        await engine.stop()


async def test_an_engine_process_that_dies_fails_requests(tiny_checkpoint):
    engine, app = in_process_app(build_llm_engine, EngineConfig(model=str(tiny_checkpoint), dtype="float32"))
    engine.start()
    try:
        await asyncio.wait_for(engine.wait_ready(), 120)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 1800, "ignore_eos": True}
            pending = asyncio.create_task(http.post("/v1/completions", json=body))
            await asyncio.sleep(0.5)
            engine._process.kill()  # what the kernel's OOM killer would do
            failed = await asyncio.wait_for(pending, 60)
            assert failed.status_code == 500 and "engine failed" in failed.json()["error"]["message"]
            assert "exited unexpectedly" in engine.error
            assert (await http.get("/health")).status_code == 503
    finally:
        await engine.stop()


def test_a_stopped_engine_process_turns_health_unhealthy(server):
    """The engine reports at least every second, idle or not: one that stops (SIGSTOP, a wedged driver)
    fails /health within the heartbeat timeout, so the kubelet restarts the pod, and recovers with it."""
    from tests.engine.test_parallel_server import descendants

    try:
        time.sleep(2.5)  # idle longer than the timeout: the heartbeat keeps it healthy
        assert httpx.get(f"{server.url}/health").status_code == 200
        (engine_pid,) = [pid for pid, cmd in descendants(server.proc.pid) if "spawn_main" in cmd]
        os.kill(engine_pid, signal.SIGSTOP)
        stopped = time.monotonic()
        while httpx.get(f"{server.url}/health").status_code == 200:
            assert time.monotonic() - stopped < 6, "/health still 200 with the engine stopped"
            time.sleep(0.2)
        assert httpx.get(f"{server.url}/health").json()["status"] == "unresponsive"
        os.kill(engine_pid, signal.SIGCONT)
        assert wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 200, timeout=5)
    finally:
        server.stop(signal.SIGKILL)
