"""Cross-replica KV reuse between real `deepseek-engine serve` processes, a real redis-server and the
official openai client: a conversation's next turn lands on another replica."""

import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
from openai import OpenAI

from tests.engine.conftest_server import (  # noqa: F401
    MODEL_NAME,
    ServerProcess,
    tiny_checkpoint,
    tiny_checkpoint_in,
    wait_for,
)
from tests.engine.test_kv_reuse import CorruptingProxy
from tests.redis_server import RedisServer

HISTORY = [
    {"role": "system", "content": "You are a careful assistant that explains Kubernetes operators at length. " * 4},
    {"role": "user", "content": "How does an operator reconcile a custom resource into pods and services?"},
]
FOLLOW_UP = {"role": "user", "content": "And what happens when a pod is deleted?"}


def start_replicas(checkpoint: Path, redis: RedisServer, logs: Path, replicas, first: int = 0) -> list[ServerProcess]:
    """("a", ("b", *extra), ...) -> a server for each, not waited for (their start-ups overlap)."""
    started = []
    for replica in replicas:
        name, *extra = (replica,) if isinstance(replica, str) else replica
        started.append(ServerProcess(
            checkpoint, logs / f"{name}-{first + len(started)}.log", "--kv-directory", redis.url,
            "--replica-id", name, "--advertise-host", "127.0.0.1", "--kv-transfer-port", "0",
            "--kv-min-prefix-tokens", "16", *extra))
    return started


def first_fleet(*replicas: str | tuple[str, ...]):
    """A test's first replicas, ("a", ("b", *extra), ...): they and the test's redis-server are started while
    the test before it runs (`ahead`), and the test gets them ready as its `replicas`."""
    def mark(test):
        test.first_fleet = replicas
        return test

    return mark


@dataclass
class Fleet:
    """A test's redis-server and first replicas, started ahead of it."""

    redis: RedisServer
    servers: list[ServerProcess]

    def stop(self, sig: int = signal.SIGKILL) -> None:
        for server in self.servers:
            server.stop(sig)
        self.redis.stop()


def start_fleet(replicas, checkpoint: Path, where: Path) -> Fleet:
    redis = RedisServer(where).start()
    try:
        return Fleet(redis, start_replicas(checkpoint, redis, where, replicas))
    except BaseException:
        redis.stop()
        raise


@pytest.fixture(autouse=True)
def ahead(request, early_servers, tmp_path_factory):
    """This test's first fleet unless it was started ahead, then the next test's, to start while this one
    runs: three start-ups of a few seconds each a test, which used to wait for its own."""
    started = early_servers.setdefault(__name__, {})
    items = request.session.items
    at = items.index(request.node)
    for item in (request.node, *items[at + 1:at + 2]):
        fleet = getattr(getattr(item, "function", None), "first_fleet", None)
        if getattr(item, "module", None) is not request.module or fleet is None or item.name in started:
            continue
        try:
            started[item.name] = start_fleet(fleet, tiny_checkpoint_in(tmp_path_factory),
                                             tmp_path_factory.mktemp("fleet"))
        except Exception:  # noqa: BLE001 - the next test starts its own, and fails there
            if item is request.node:
                raise
    yield


@pytest.fixture
def redis_server(request, ahead, early_servers, tmp_path):
    """A real redis-server of the test's own: its first fleet's, else a new one on a unix socket."""
    fleet = early_servers.get(__name__, {}).get(request.node.name)
    server = fleet.redis if fleet is not None else RedisServer(tmp_path).start()
    yield server
    server.stop()


@pytest.fixture
def replicas(request, redis_server, early_servers) -> list[ServerProcess]:
    """The test's first replicas (`first_fleet`), ready."""
    fleet = early_servers[__name__].pop(request.node.name)
    try:
        yield [server.wait_ready() for server in fleet.servers]
    finally:
        for server in fleet.servers:
            server.stop(signal.SIGKILL)


@pytest.fixture
def fleet(tiny_checkpoint, redis_server, tmp_path):  # noqa: F811
    """`fleet("a", ("b", *extra), ...)`: more replicas, started at once (their start-ups overlap), each ready."""
    procs = []

    def start(*replicas: str | tuple[str, ...]) -> list[ServerProcess]:
        started = start_replicas(tiny_checkpoint, redis_server, tmp_path, replicas, len(procs))
        procs.extend(started)
        return [proc.wait_ready() for proc in started]

    yield start
    for p in procs:
        p.stop(signal.SIGKILL)


def chat(server: ServerProcess, messages):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0)


def two_turns(first: ServerProcess, second: ServerProcess, redis_server: RedisServer):
    turn1 = chat(first, HISTORY)
    assert wait_for(lambda: redis_server.client().keys("dsf:*:block:*"), timeout=10)
    convo = HISTORY + [{"role": "assistant", "content": turn1.choices[0].message.content}, FOLLOW_UP]
    return convo, chat(second, convo)


def remote_hits(server: ServerProcess) -> float:
    return server.metrics()['deepseek_engine_prefix_cache_hit_tokens_total{source="remote"}']


@first_fleet("a", "b", ("c", "--kv-pull-policy", "never"))
def test_next_turn_on_another_replica_pulls_the_prefix(replicas, redis_server):
    a, b, recomputing = replicas
    convo, turn2 = two_turns(a, b, redis_server)
    cached = turn2.usage.prompt_tokens_details.cached_tokens
    assert cached >= 32 and cached < turn2.usage.prompt_tokens
    assert remote_hits(b) == cached
    reference = chat(recomputing, convo)
    assert reference.usage.prompt_tokens_details.cached_tokens == 0
    assert turn2.choices[0].message.content == reference.choices[0].message.content
    metrics = b.metrics()
    assert metrics["deepseek_engine_kv_transfer_bytes_total"] > 0


@first_fleet(("a", "--tensor-parallel-size", "2"), ("b", "--tensor-parallel-size", "2"),
             ("c", "--kv-pull-policy", "never"))
def test_a_tensor_parallel_replica_pulls_into_every_rank(replicas, redis_server):
    """Rank 0 receives the pulled blocks; every rank holds MLA's latent cache whole, so the next step
    copies them to the others first (without it rank 1 would attend over blocks it never wrote)."""
    a, b, recomputing = replicas
    convo, turn2 = two_turns(a, b, redis_server)
    assert turn2.usage.prompt_tokens_details.cached_tokens >= 32 and remote_hits(b) > 0
    assert turn2.choices[0].message.content == chat(recomputing, convo).choices[0].message.content


@first_fleet("a", "b")
def test_killed_peer_means_recompute_not_error(replicas, redis_server):
    a, b = replicas
    chat(a, HISTORY)
    assert wait_for(lambda: redis_server.client().keys("dsf:*:block:*"), timeout=10)
    a.stop(signal.SIGKILL)  # its heartbeat key outlives it: b still finds its entries
    convo = HISTORY + [{"role": "assistant", "content": "ok"}, FOLLOW_UP]
    turn2 = chat(b, convo)
    assert turn2.choices[0].finish_reason in ("stop", "length")
    assert turn2.usage.prompt_tokens_details.cached_tokens == 0
    assert b.metrics()['deepseek_engine_kv_pull_fallbacks_total{reason="transfer_failed"}'] == 1


@first_fleet("a")
def test_restarted_replica_old_entries_are_not_trusted(replicas, fleet, redis_server):
    (a,) = replicas
    chat(a, HISTORY)
    assert wait_for(lambda: redis_server.client().keys("dsf:*:block:*"), timeout=10)
    a.stop(signal.SIGKILL)
    _, b = fleet("a", "b")  # "a": same name, new incarnation, empty cache
    turn2 = chat(b, HISTORY + [{"role": "assistant", "content": "ok"}, FOLLOW_UP])
    assert turn2.usage.prompt_tokens_details.cached_tokens == 0
    assert remote_hits(b) == 0
    assert b.metrics().get('deepseek_engine_kv_pull_fallbacks_total{reason="transfer_failed"}', 0) == 0


@first_fleet("a", "b")
def test_redis_stopped_both_keep_serving(replicas, redis_server):
    a, b = replicas
    redis_server.stop()
    for server in (a, b, a):
        assert chat(server, HISTORY).choices[0].finish_reason in ("stop", "length")
    assert b.metrics()["deepseek_engine_kv_directory_up"] == 0


@first_fleet("a", "b")
def test_corrupted_block_in_transit_is_recomputed(replicas, redis_server):
    a, b = replicas
    chat(a, HISTORY)
    assert wait_for(lambda: redis_server.client().keys("dsf:*:block:*"), timeout=10)
    r = redis_server.client()
    (key,) = r.keys("dsf:*:replica:a")
    port = int(r.hget(key, "addr").decode().rpartition(":")[2])
    proxy = CorruptingProxy(port)
    r.hset(key, "addr", f"127.0.0.1:{proxy.port}")
    turn2 = chat(b, HISTORY + [{"role": "assistant", "content": "ok"}, FOLLOW_UP])
    assert turn2.usage.prompt_tokens_details.cached_tokens == 0
    assert b.metrics()['deepseek_engine_kv_pull_fallbacks_total{reason="checksum"}'] == 1


def test_replicas_of_one_fleet_authenticate_and_strangers_recompute(fleet, redis_server, tmp_path):
    """With the fleet's secret (--kv-secret-file, mounted by the operator) peers pull from each other; a
    replica holding another secret can neither read the fleet's blocks nor be read from."""
    (tmp_path / "fleet").write_text("a-fleet-secret-of-32-characters!\n")
    (tmp_path / "other").write_text("another-secret-of-32-characters!\n")
    a, b, stranger = fleet(("a", "--kv-secret-file", str(tmp_path / "fleet")),
                           ("b", "--kv-secret-file", str(tmp_path / "fleet")),
                           ("s", "--kv-secret-file", str(tmp_path / "other")))
    convo, turn2 = two_turns(a, b, redis_server)
    assert turn2.usage.prompt_tokens_details.cached_tokens >= 32 and remote_hits(b) > 0
    other = chat(stranger, convo)
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # recomputed, not an error
    assert other.choices[0].message.content == turn2.choices[0].message.content
    assert stranger.metrics()['deepseek_engine_kv_pull_fallbacks_total{reason="unsigned_entry"}'] >= 1
    assert "(authenticated)" in a.log()


def test_the_directory_password_never_reaches_the_log(tmp_path, tiny_checkpoint):  # noqa: F811
    from tests.engine.conftest_server import free_port

    redis = RedisServer(tmp_path, port=free_port(), password="hunter2-hunter2").start()
    server = ServerProcess(tiny_checkpoint, tmp_path / "server.log", "--kv-directory",
                           f"redis://:hunter2-hunter2@127.0.0.1:{redis.port}/0", "--replica-id", "a",
                           "--kv-transfer-port", "0").wait_ready()
    try:
        assert chat(server, HISTORY).choices[0].finish_reason in ("stop", "length")
        log = server.log()
        assert "hunter2" not in log and ":***@127.0.0.1" in log
        assert wait_for(lambda: redis.client().keys("dsf:*:replica:a"), timeout=10)  # it did reach Redis
    finally:
        server.stop(signal.SIGKILL)
        redis.stop()


@first_fleet("a")
def test_an_idle_replica_reports_the_directory_down(replicas, redis_server):
    """No request needed: the directory's heartbeat fails, and the engine's own heartbeat carries it to
    /metrics within seconds."""
    (a,) = replicas
    assert a.metrics()["deepseek_engine_kv_directory_up"] == 1
    redis_server.stop()
    assert wait_for(lambda: a.metrics()["deepseek_engine_kv_directory_up"] == 0, timeout=15, interval=0.5)


@first_fleet("a", "b")
def test_redis_restarted_mid_conversation(replicas, redis_server):
    """The directory's content is soft state: after a restart the replicas register again, the next turn
    recomputes (no error), and later turns pull again."""
    a, b = replicas
    convo, turn2 = two_turns(a, b, redis_server)
    redis_server.stop()
    redis_server.start()
    turn3 = chat(b, convo + [{"role": "assistant", "content": turn2.choices[0].message.content}, FOLLOW_UP])
    assert turn3.choices[0].finish_reason in ("stop", "length")
    assert wait_for(lambda: len(redis_server.client().keys("dsf:*:replica:*")) == 2, timeout=15)
    fresh = [{"role": "user", "content": "Explain leader election in Kubernetes controllers in detail. " * 3}]
    chat(a, fresh)
    assert wait_for(lambda: redis_server.client().keys("dsf:*:block:*"), timeout=10)
    follow = chat(b, fresh + [{"role": "assistant", "content": "ok"}, FOLLOW_UP])
    assert follow.usage.prompt_tokens_details.cached_tokens >= 32


@first_fleet("a", "b")
def test_a_peer_serving_garbage_costs_a_recompute(replicas, redis_server):
    import socket
    import threading

    a, b = replicas
    chat(a, HISTORY)
    assert wait_for(lambda: redis_server.client().keys("dsf:*:block:*"), timeout=10)
    garbage = socket.create_server(("127.0.0.1", 0))

    def serve_garbage():
        while True:
            try:
                conn, _ = garbage.accept()
            except OSError:
                return
            with conn:
                conn.recv(1 << 16)
                conn.sendall(b"\xff\x00\x13" * 5000)

    threading.Thread(target=serve_garbage, daemon=True).start()
    (key,) = redis_server.client().keys("dsf:*:replica:a")
    redis_server.client().hset(key, "addr", f"127.0.0.1:{garbage.getsockname()[1]}")
    turn2 = chat(b, HISTORY + [{"role": "assistant", "content": "ok"}, FOLLOW_UP])
    assert turn2.choices[0].finish_reason in ("stop", "length")
    assert turn2.usage.prompt_tokens_details.cached_tokens == 0
    fallbacks = {k: v for k, v in b.metrics().items() if k.startswith("deepseek_engine_kv_pull_fallbacks_total")}
    assert sum(fallbacks.values()) >= 1, fallbacks
    garbage.close()


@first_fleet("a", "b")
def test_200_disconnects_during_pulls_leave_nothing_behind(replicas, redis_server):
    """Clients that leave while their prefix is being pulled: every request ends, the replica's blocks
    are all free again, and its engine process ends near the memory it started with."""
    import asyncio

    import httpx

    from tests.engine.test_parallel_server import descendants

    a, b = replicas
    chat(a, HISTORY)
    assert wait_for(lambda: redis_server.client().keys("dsf:*:block:*"), timeout=10)
    (engine_pid,) = [pid for pid, cmd in descendants(b.proc.pid) if "spawn_main" in cmd]

    def rss_mb() -> float:
        for line in open(f"/proc/{engine_pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    chat(b, HISTORY + [{"role": "assistant", "content": "warm"}, FOLLOW_UP])  # allocations of a first pull
    before = rss_mb()

    async def leave_early(http: httpx.AsyncClient, i: int) -> None:
        messages = HISTORY + [{"role": "assistant", "content": f"turn {i}"}, FOLLOW_UP]
        body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 64, "stream": True}
        try:
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    break  # gone after the first line
        except httpx.HTTPError:
            pass

    async def storm() -> None:
        async with httpx.AsyncClient(base_url=b.url, timeout=60) as http:
            for wave in range(4):
                await asyncio.gather(*(leave_early(http, wave * 50 + i) for i in range(50)))

    asyncio.run(storm())
    assert wait_for(lambda: b.metrics()["deepseek_engine_requests_running"] == 0, timeout=30)
    assert b.metrics()["deepseek_engine_requests_waiting"] == 0
    assert chat(b, HISTORY).choices[0].finish_reason in ("stop", "length")  # alive and serving
    assert rss_mb() < before + 200, (before, rss_mb())
