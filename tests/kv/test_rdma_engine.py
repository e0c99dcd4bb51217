"""Cross-replica KV reuse between real engines over the RDMA transport, on Mooncake's TCP protocol (no
RDMA hardware here): a real redis-server, real engines, the connector offering its cache for reads."""

import functools

import pytest

pytest.importorskip("mooncake.engine", reason="Mooncake's transfer engine (the rdma extra) cannot be loaded here",
                    exc_type=ImportError)

from engine.kv import connector  # noqa: E402
from engine.kv.rdma import RdmaTransport  # noqa: E402
from engine.kv.transport import select_transport  # noqa: E402
from engine.tools.make_random_checkpoint import make_random_checkpoint  # noqa: E402
from tests.engine.test_kv_reuse import PROMPT, make_engine, run, wait_published  # noqa: E402, F401


@pytest.fixture(scope="module")
def random_checkpoint(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("random-ckpt"), seed=0)


@pytest.fixture(autouse=True)
def over_mooncake_tcp(monkeypatch):
    monkeypatch.setattr(connector, "select_transport",
                        functools.partial(select_transport, devices=["mlx5_0"], protocol="tcp"))


def test_second_turn_pulls_over_rdma(make_engine, redis_server):
    a, b = make_engine("a", kv_transport="rdma"), make_engine("b", kv_transport="rdma")
    assert isinstance(a.kv.transport, RdmaTransport)
    first = run(a, "t1", PROMPT)
    wait_published(a, redis_server, 16)
    second = run(b, "t2", PROMPT)
    recompute = run(make_engine("c", kv_pull_policy="never", kv_transport="tcp"), "t3", PROMPT)
    assert second.token_ids == first.token_ids == recompute.token_ids
    assert second.num_cached_tokens == second.num_remote_cached_tokens == 64
    assert b.kv.stats.pulls == 1 and b.kv.stats.fallbacks == {}
    assert a.kv.stats.served_blocks == 16
    third = run(b, "t4", PROMPT + [5, 6, 7, 8, 9])
    assert third.num_cached_tokens == 68 and third.num_remote_cached_tokens == 0


# (holder, puller, the puller's fallbacks when they are asserted): an RDMA replica serves TCP pullers
# through its lessor; pulling from a TCP-only peer, an RDMA replica switches to TCP and counts it
@pytest.mark.parametrize("holder, puller, fallbacks", [("rdma", "tcp", None),
                                                        ("tcp", "rdma", {"rdma_peer_unavailable": 1})])
def test_mixed_fleets_pull_both_ways(make_engine, redis_server, holder, puller, fallbacks):
    a, b = make_engine("a", kv_transport=holder), make_engine("b", kv_transport=puller)
    first = run(a, "t1", PROMPT)
    wait_published(a, redis_server, 16)
    second = run(b, "t2", PROMPT)
    assert second.token_ids == first.token_ids and second.num_remote_cached_tokens == 64
    assert fallbacks is None or b.kv.stats.fallbacks == fallbacks


def test_dead_rdma_peer_means_recompute(make_engine, redis_server):
    a, b = make_engine("a", kv_transport="rdma"), make_engine("b", kv_transport="rdma")
    first = run(a, "t1", PROMPT)
    wait_published(a, redis_server, 16)
    a.kv.transport.close()
    second = run(b, "t2", PROMPT)
    assert second.token_ids == first.token_ids and second.num_cached_tokens == 0
    assert b.kv.stats.fallbacks.get("transfer_failed") == 1
