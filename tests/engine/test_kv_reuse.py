"""Cross-replica KV reuse between engines in one process: a real redis-server, real TCP transfers."""

import socket
import threading
import time

import pytest

from engine import SamplingParams
from engine.config import EngineConfig
from engine.kv.connector import should_pull
from engine.llm_engine import LLMEngine
from tests.redis_server import RedisServer

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPT = list(range(2, 70))  # 67 cached-able tokens: 16 full blocks of 4


@pytest.fixture
def make_engine(random_checkpoint, redis_server):
    engines = []

    def make(name: str, **kw) -> LLMEngine:
        args = dict(model=str(random_checkpoint), dtype="float32", block_size=4, kv_directory=redis_server.url,
                    replica_id=name, kv_transfer_port=0, kv_pull_policy="always", kv_min_prefix_tokens=8,
                    show_progress=False)
        engine = LLMEngine(EngineConfig(**{**args, **kw}))
        engines.append(engine)
        return engine

    yield make
    for e in engines:
        e.shutdown()


def run(engine: LLMEngine, rid: str, prompt: list[int]):
    engine.add_request(rid, prompt, GREEDY)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out
    raise AssertionError("request vanished")


def wait_published(engine: LLMEngine, redis_server: RedisServer, n: int) -> None:
    keys = lambda: len(redis_server.client().keys(f"dsf:{engine.model_key}:block:*"))
    deadline = time.monotonic() + 5
    while keys() < n:
        assert time.monotonic() < deadline, "blocks never reached the directory"
        time.sleep(0.02)


def test_second_turn_on_another_replica_pulls_the_prefix(make_engine, redis_server):
    a, b = make_engine("a"), make_engine("b")
    first = run(a, "t1", PROMPT)
    wait_published(a, redis_server, 16)
    second = run(b, "t2", PROMPT)
    recompute = run(make_engine("c", kv_pull_policy="never"), "t3", PROMPT)
    assert second.token_ids == first.token_ids == recompute.token_ids
    assert second.num_cached_tokens == second.num_remote_cached_tokens == 64
    assert recompute.num_cached_tokens == 0
    assert b.kv.stats.pulls == 1 and b.kv.stats.transfer_bytes > 0
    assert a.kv.stats.served_blocks == 16
    # the pulled blocks are b's own now: a third turn there is a local hit
    third = run(b, "t4", PROMPT + [5, 6, 7, 8, 9])
    assert third.num_cached_tokens == 68 and third.num_remote_cached_tokens == 0


def test_dead_peer_means_recompute(make_engine, redis_server):
    a, b = make_engine("a"), make_engine("b")
    first = run(a, "t1", PROMPT)
    wait_published(a, redis_server, 16)
    a.kv.server.stop()  # killed: the heartbeat key outlives it for a while
    second = run(b, "t2", PROMPT)
    assert second.token_ids == first.token_ids
    assert second.num_cached_tokens == 0
    assert b.kv.stats.fallbacks.get("transfer_failed") == 1


def test_restarted_replica_entries_are_not_trusted(make_engine, redis_server):
    a = make_engine("a")
    run(a, "t1", PROMPT)
    wait_published(a, redis_server, 16)
    old_incarnation = a.kv.incarnation
    a.shutdown()
    a2 = make_engine("a")  # same name, new incarnation, empty cache; the old entries are still in Redis
    assert a2.kv.incarnation != old_incarnation
    b = make_engine("b")
    assert b.kv.directory.lookup(b.block_manager.prefix_hashes(_seq(b, PROMPT))) is None
    out = run(b, "t2", PROMPT)
    assert out.num_cached_tokens == 0 and b.kv.stats.pulls == 0


def _seq(engine, prompt):
    from engine.sequence import Sequence

    return Sequence("probe", prompt, GREEDY)


def test_redis_down_keeps_serving(make_engine, redis_server):
    a, b = make_engine("a"), make_engine("b")
    redis_server.stop()
    first = run(a, "t1", PROMPT)
    second = run(b, "t2", PROMPT)
    assert first.token_ids == second.token_ids
    assert second.num_cached_tokens == 0
    assert not b.kv.directory.healthy
    assert run(a, "t3", PROMPT).num_cached_tokens == 64  # the local prefix cache still works


class CorruptingProxy:
    """Forwards one TCP connection to `target`, flipping one byte of the response body."""

    def __init__(self, target_port: int, flip_at: int = 2000):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.target_port, self.flip_at = target_port, flip_at
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        client, _ = self.sock.accept()
        upstream = socket.create_connection(("127.0.0.1", self.target_port))
        threading.Thread(target=self._pipe, args=(client, upstream, None), daemon=True).start()
        self._pipe(upstream, client, self.flip_at)

    @staticmethod
    def _pipe(src, dst, flip_at):
        seen = 0
        try:
            while data := src.recv(65536):
                if flip_at is not None and seen <= flip_at < seen + len(data):
                    data = bytearray(data)
                    data[flip_at - seen] ^= 0xFF
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass  # the puller hangs up as soon as a checksum fails: the other direction then breaks
        finally:
            dst.close()


def test_corrupted_block_in_transit_is_detected_and_recomputed(make_engine, redis_server):
    a = make_engine("a")
    first = run(a, "t1", PROMPT)
    wait_published(a, redis_server, 16)
    # route peers to `a` through a proxy that damages the payload
    proxy = CorruptingProxy(a.kv.server.port)
    r = redis_server.client()
    r.hset(f"dsf:{a.model_key}:replica:a", "addr", f"127.0.0.1:{proxy.port}")
    b = make_engine("b")
    second = run(b, "t2", PROMPT)
    assert second.token_ids == first.token_ids
    assert second.num_cached_tokens == 0
    assert b.kv.stats.fallbacks.get("checksum") == 1


def test_reused_blocks_are_not_exported(make_engine, redis_server):
    a = make_engine("a", num_kv_blocks=20)
    run(a, "t1", PROMPT)
    hashes = a.block_manager.prefix_hashes(_seq(a, PROMPT))
    held = a.block_manager.lookup_cached(hashes)
    assert len(held) == 16
    run(a, "t2", list(range(300, 360)))  # needs most of the 20 blocks: evicts the first prefix
    assert a.block_manager.still_valid(held) < 16


def test_pull_policy():
    # 1k tokens, 70 MB at 10 GB/s (7 ms) vs recompute at 50k tok/s (20 ms): pull
    assert should_pull(1024, 70_000_000, 10e9, 50e3, 256, "auto")
    # the same over a slow link (1 GB/s: 70 ms): recompute
    assert not should_pull(1024, 70_000_000, 1e9, 50e3, 256, "auto")
    assert not should_pull(128, 1, 10e9, 1, 256, "always")  # below the minimum prefix
    assert not should_pull(4096, 1, 10e9, 1, 256, "never")


def test_an_abort_during_a_pull_returns_its_staging_buffer(make_engine, redis_server):
    """The request goes while its blocks are on the wire: the transfer finishes, and its buffer goes back
    to the pool instead of staying held (each such abort would keep one)."""
    a, b = make_engine("a"), make_engine("b")
    run(a, "t1", PROMPT)
    wait_published(a, redis_server, 16)
    released, arrived = threading.Event(), threading.Event()
    pull = b.kv.transport.pull

    def slow_pull(addr, hashes):
        pulled = pull(addr, hashes)
        arrived.wait(5)  # the abort lands while the transfer is still "under way"
        release = pulled.release
        pulled.release = lambda: (release(), released.set())
        return pulled

    b.kv.transport.pull = slow_pull
    b.add_request("t2", PROMPT, GREEDY)
    assert b.pending_pulls
    b.abort_request("t2")
    arrived.set()
    assert released.wait(5) and not b.has_unfinished_requests()

