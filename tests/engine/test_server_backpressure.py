"""A full waiting queue answers 429 with Retry-After; the queue frees as requests leave."""

import asyncio

import httpx
import openai
import pytest

from tests.engine.conftest_server import MODEL_NAME, ServerProcess, module_servers, tiny_checkpoint_in, wait_for


def start_servers(session, tmp_path_factory) -> dict[str, ServerProcess]:
    # One request runs at a time and one may wait: the third concurrent request is refused.
    return {"server": ServerProcess(
        tiny_checkpoint_in(tmp_path_factory), tmp_path_factory.mktemp("log") / "server.log",
        "--max-num-seqs", "1", "--max-waiting-requests", "1",
    )}  # fmt: skip


@pytest.fixture(scope="module")
def server(request):
    proc = module_servers(request).pop("server")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def body(max_tokens: int, **extra) -> dict:
    messages = [{"role": "user", "content": "Hello"}]
    return {"model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True, **extra}


async def keep_reading(http: httpx.AsyncClient, generating: asyncio.Event) -> None:
    """A streaming client that reads everything; `generating` is set at its first generated text."""
    async with http.stream("POST", "/v1/chat/completions", json=body(1800, stream=True)) as r:
        async for line in r.aiter_lines():
            if '"content"' in line and '"role"' not in line:
                generating.set()


async def test_full_queue_is_429_with_retry_after(server):
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
        generating = asyncio.Event()
        running = asyncio.create_task(keep_reading(http, generating))
        await asyncio.wait_for(generating.wait(), 60)  # it holds the only running slot
        # Response headers arrive once the engine has admitted the request: then it waits.
        async with http.stream("POST", "/v1/chat/completions", json=body(1800, stream=True)) as waiting:
            assert waiting.status_code == 200
            assert server.metrics()["deepseek_engine_requests_waiting"] == 1
            refused = await http.post("/v1/chat/completions", json=body(4))
            assert refused.status_code == 429
            assert int(refused.headers["retry-after"]) >= 1
            error = refused.json()["error"]
            assert error["code"] == "rate_limit_exceeded" and "waiting queue is full" in error["message"]
            client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.RateLimitError):
                await client.chat.completions.create(model=MODEL_NAME, messages=body(4)["messages"])
            await client.close()
        running.cancel()
    # Both clients left: their requests are aborted and the queue is free again.
    assert wait_for(lambda: server.metrics()["deepseek_engine_requests_running"] == 0, timeout=10)
    assert server.metrics()["deepseek_engine_requests_waiting"] == 0
    ok = httpx.post(f"{server.url}/v1/chat/completions", json=body(4), timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


def test_n_choices_count_against_what_the_engine_holds(server):
    # An idle server runs one and queues one: 2 choices are admitted (one runs at once, one waits) ...
    ok = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "n": 2, "max_tokens": 2},
                    timeout=60)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
    # ... 3 never fit: a 400 that says so (not a 429 to retry forever), nothing half-made
    never = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "n": 3}, timeout=60)
    assert never.status_code == 400 and never.json()["error"]["param"] == "n"
    assert "ever holds" in never.json()["error"]["message"]
    assert server.metrics()["deepseek_engine_requests_waiting"] == 0
