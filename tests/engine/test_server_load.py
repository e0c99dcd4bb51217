"""Many clients at once: concurrent streams, clients that leave midway, a client that stops reading."""

import asyncio
import socket

import httpx
import openai
import pytest

from tests.engine.conftest_server import (
    MODEL_NAME,
    ServerProcess,
    module_servers,
    selected_params,
    tiny_checkpoint_in,
    wait_for,
)


def start_servers(session, tmp_path_factory) -> dict[str, ServerProcess]:
    # with async scheduling (a GPU's default) aborts and ends also meet steps still in flight
    return {mode: ServerProcess(tiny_checkpoint_in(tmp_path_factory), tmp_path_factory.mktemp("log") / "server.log",
                                "--async-scheduling", mode)
            for mode in selected_params(session, __name__, "server")}


@pytest.fixture(scope="module", params=["off", "on"], ids=["sync", "async"])
def server(request):
    proc = module_servers(request).pop(request.param)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def chat_body(i: int, max_tokens: int, **extra) -> dict:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": f"Hello number {i}, tell me a story."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }


def is_idle(server: ServerProcess) -> bool:
    m = server.metrics()
    return (
        m["deepseek_engine_requests_running"] == 0
        and m["deepseek_engine_requests_waiting"] == 0
        and m["deepseek_engine_kv_cache_usage"] == 0
    )


async def test_64_concurrent_streams_complete(server):
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)

    async def one(i: int) -> tuple[str | None, int, int]:
        body = chat_body(i, 16)
        stream = await client.chat.completions.create(
            model=body.pop("model"), messages=body.pop("messages"), max_tokens=body.pop("max_tokens"),
            stream=True, stream_options={"include_usage": True}, extra_body=body,
        )  # fmt: skip
        finish, num_chunks, usage = None, 0, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                num_chunks += 1
                finish = choice.finish_reason or finish
        return finish, num_chunks, usage.completion_tokens

    results = await asyncio.gather(*(one(i) for i in range(64)))
    assert all(finish == "length" and tokens == 16 and chunks >= 2 for finish, chunks, tokens in results)
    await client.close()
    assert wait_for(lambda: is_idle(server), timeout=10)


async def test_200_clients_leaving_midstream_leave_nothing_behind(server):
    aborted_before = server.metrics()['deepseek_engine_requests_total{finish_reason="abort"}']
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as http:

        async def leave_after_first_token(i: int) -> bool:
            body = chat_body(i, 1500, stream=True)
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                num_events = 0
                async for line in r.aiter_lines():
                    num_events += line.startswith("data: ")
                    if num_events == 2:  # the role chunk, then generated text: leave mid-stream
                        return True
            return False

        assert all(await asyncio.gather(*(leave_after_first_token(i) for i in range(200))))
    # Every abort frees its KV blocks: nothing runs, nothing waits, no block is held.
    assert wait_for(lambda: is_idle(server), timeout=20), server.metrics()
    aborted = server.metrics()['deepseek_engine_requests_total{finish_reason="abort"}'] - aborted_before
    assert aborted == 200


def test_non_streaming_client_leaving_aborts_its_request(server):
    assert wait_for(lambda: is_idle(server), timeout=30)
    aborted_before = server.metrics()['deepseek_engine_requests_total{finish_reason="abort"}']
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/v1/chat/completions", json=chat_body(0, 1800), timeout=1.0)
    assert wait_for(lambda: is_idle(server), timeout=30), server.metrics()
    assert server.metrics()['deepseek_engine_requests_total{finish_reason="abort"}'] == aborted_before + 1


async def test_a_client_that_stops_reading_stalls_nobody(server):
    assert wait_for(lambda: is_idle(server), timeout=30)
    before = server.metrics()
    # A tiny receive window and large chunks (20 logprobs a token, ~1.3 kB): the unread stream fills
    # the socket buffers within a few dozen tokens, after which the server's writes to it block.
    tiny_window = httpx.AsyncHTTPTransport(socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)])
    body = chat_body(0, 120, stream=True, logprobs=True, top_logprobs=20)
    async with httpx.AsyncClient(base_url=server.url, timeout=300, transport=tiny_window) as slow:
        async with slow.stream("POST", "/v1/chat/completions", json=body) as stalled:
            assert stalled.status_code == 200
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
                others = await asyncio.gather(
                    *(http.post("/v1/chat/completions", json=chat_body(i, 8)) for i in range(1, 6))
                )
            assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8 for r in others)
            # The engine finishes the stalled request too, without waiting for its reader.
            finished = 'deepseek_engine_requests_total{finish_reason="length"}'
            assert wait_for(lambda: server.metrics()[finished] == before[finished] + 6, timeout=60)
    after = server.metrics()
    generated = "deepseek_engine_generation_tokens_total"
    assert after[generated] - before[generated] == 120 + 5 * 8
    assert after['deepseek_engine_requests_total{finish_reason="abort"}'] == before[
        'deepseek_engine_requests_total{finish_reason="abort"}'
    ]
