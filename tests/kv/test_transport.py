"""Choosing the KV transport: TCP unless the pod has an RDMA device, a KV cache to serve and a working
Mooncake transfer engine; every fallback is logged and counted."""

import logging
import sys

import pytest
import torch

from engine.kv.connector import KVStats
from engine.kv.rdma import RdmaTransport, ServedCache
from engine.kv.transfer import TcpTransport
from engine.kv.transport import select_transport

try:
    import mooncake.engine  # noqa: F401

    HAS_MOONCAKE = True
except ImportError:
    HAS_MOONCAKE = False
needs_mooncake = pytest.mark.skipif(not HAS_MOONCAKE, reason="Mooncake (the rdma extra) cannot be loaded here")


def served(caches: list[torch.Tensor] | None = None) -> ServedCache:
    caches = caches if caches is not None else [torch.zeros(8, 4, 16) for _ in range(2)]
    return ServedCache(caches, lambda hashes: [], lambda held: len(held), "127.0.0.1", 1)


def select(requested: str, **kw):
    stats = KVStats()
    transport, name = select_transport(requested, "model-key", 2.0, stats, **kw)
    return transport, name, stats


def test_an_unknown_transport_is_refused():
    with pytest.raises(ValueError, match="auto, tcp or rdma"):
        select("udp")


def test_tcp_is_taken_as_asked_without_a_fallback(caplog):
    transport, name, stats = select("tcp", served=served(), devices=["mlx5_0"])
    assert isinstance(transport, TcpTransport) and name == "tcp"
    assert stats.fallbacks == {} and not caplog.records


def test_tcp_takes_the_configured_stream_count_on_either_path():
    assert select("tcp", streams=3)[0].num_stripes == 3
    assert select("auto", devices=[], streams=2)[0].num_stripes == 2  # the fallback too
    assert select("tcp")[0].num_stripes >= 1  # default: from the usable cores


@pytest.mark.parametrize("requested, level", [("auto", logging.INFO), ("rdma", logging.WARNING)])
def test_no_rdma_device_falls_back_to_tcp(requested, level, caplog):
    caplog.set_level(logging.INFO, "engine.kv.transport")
    transport, name, stats = select(requested, served=served(), devices=[])
    assert isinstance(transport, TcpTransport) and name == "tcp"
    assert stats.fallbacks == {"rdma_unavailable": 1}
    [record] = caplog.records
    assert record.levelno == level and "no RDMA device in this pod" in record.getMessage()


def test_rdma_needs_the_kv_cache_to_serve(caplog):
    caplog.set_level(logging.INFO, "engine.kv.transport")
    transport, name, stats = select("rdma", devices=["mlx5_0"])
    assert name == "tcp" and stats.fallbacks == {"rdma_unavailable": 1}
    assert "not offered for RDMA reads" in caplog.text


def test_rdma_without_mooncake_falls_back_to_tcp(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # an import of it fails, as when not installed
    caplog.set_level(logging.INFO, "engine.kv.transport")
    transport, name, stats = select("rdma", served=served(), devices=["mlx5_0"])
    assert isinstance(transport, TcpTransport) and name == "tcp"
    assert stats.fallbacks == {"rdma_unavailable": 1}
    assert "mooncake transfer engine cannot be loaded" in caplog.text


def test_a_cache_rdma_cannot_register_falls_back_to_tcp(caplog):
    caplog.set_level(logging.INFO, "engine.kv.transport")
    strided = [torch.zeros(8, 16, 4).transpose(1, 2) for _ in range(2)]
    _, name, stats = select("auto", served=served(strided), devices=["mlx5_0"])
    assert name == "tcp" and stats.fallbacks == {"rdma_unavailable": 1}
    assert "not one contiguous tensor per layer" in caplog.text


@needs_mooncake
def test_rdma_devices_mooncake_cannot_open_fall_back_to_tcp(caplog):
    # Mooncake would quietly move the data over its own TCP transport; the selection says so instead
    caplog.set_level(logging.INFO, "engine.kv.transport")
    transport, name, stats = select("auto", served=served(), devices=["no_such_hca0"])
    assert isinstance(transport, TcpTransport) and name == "tcp"
    assert stats.fallbacks == {"rdma_unavailable": 1}
    assert "opened none of the RDMA devices ['no_such_hca0']" in caplog.text


@needs_mooncake
def test_auto_takes_rdma_when_the_engine_starts(caplog):
    caplog.set_level(logging.INFO, "engine.kv.transport")
    transport, name, stats = select("auto", served=served(), devices=["mlx5_0"], protocol="tcp")
    try:
        assert isinstance(transport, RdmaTransport) and name == transport.name == "rdma"
        assert transport.addr.startswith("127.0.0.1:") and transport.addr != transport.session
        assert stats.fallbacks == {} and "KV transfer over RDMA on mlx5_0" in caplog.text
    finally:
        transport.close()
