"""Bounded input: what one client can make the server hold or do, each limit a clear 4xx."""

import threading
import time

import httpx
import pytest

from tests.engine.conftest_server import MODEL_NAME, ServerProcess, module_servers, tiny_checkpoint_in


def start_servers(session, tmp_path_factory) -> dict[str, ServerProcess]:
    return {"server": ServerProcess(tiny_checkpoint_in(tmp_path_factory), tmp_path_factory.mktemp("log") / "server.log",
                                    "--max-waiting-requests", "4", "--max-request-body-size", "6MiB")}


@pytest.fixture(scope="module")
def server(request):
    proc = module_servers(request).pop("server")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def chat(content: str, **extra) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}


def test_a_body_over_the_limit_is_413_before_it_is_read(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat("x" * (7 << 20)), timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted while it arrives
        for _ in range(8):
            yield b"x" * (1 << 20)

    r = httpx.post(f"{server.url}/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 413
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_too_many_choices_are_refused_before_tokenizing(server):
    r = httpx.post(f"{server.url}/v1/completions",
                   json={"model": MODEL_NAME, "prompt": ["hello"] * 20000, "max_tokens": 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "at most 256" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat("hi", n=300), timeout=60)
    assert r.status_code == 400


def test_a_burst_on_an_idle_server_is_not_refused(server):
    """Eight requests at once, four may wait: the engine runs 64 at a time, so none of them waits."""
    codes = []

    def one():
        codes.append(httpx.post(f"{server.url}/v1/chat/completions", json=chat("hello"), timeout=120).status_code)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert codes == [200] * 8


def test_a_long_prompt_is_tokenized_off_the_event_loop(server):
    """A 5 MB prompt (templated and tokenized in a thread) leaves /health answering meanwhile."""
    done = threading.Event()
    result = {}

    def big():
        start = time.monotonic()
        try:
            result["r"] = httpx.post(f"{server.url}/v1/chat/completions", json=chat("word " * (1 << 20)), timeout=120)
        finally:  # a request that fails still ends the polling below
            result["seconds"] = time.monotonic() - start
            done.set()

    threading.Thread(target=big).start()
    slowest = 0.0
    while not done.is_set():
        t0 = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        slowest = max(slowest, time.monotonic() - t0)
        time.sleep(0.05)
    assert result["r"].status_code == 400 and result["r"].json()["error"]["code"] == "context_length_exceeded"
    # a loop blocked by the tokenization would answer /health once, after most of the request's time
    # (~8 s on a quiet 2-core machine, /health then 0.4 s at most); a share of it, not a fixed second, so
    # that a loaded machine, where both stretch, does not fail it
    assert slowest < 0.25 * result["seconds"], (f"/health took {slowest:.2f} s while the prompt was tokenized "
                                                f"({result['seconds']:.2f} s)")
