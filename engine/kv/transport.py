"""Choosing how KV blocks travel between replicas: RDMA where the pod has it, TCP otherwise."""

import logging
from pathlib import Path

from engine.kv.auth import PeerAuth
from engine.kv.rdma import RdmaTransport, RdmaUnavailable, ServedCache
from engine.kv.transfer import BlockLayout, TcpTransport

logger = logging.getLogger(__name__)


def rdma_devices() -> list[str]:
    """RDMA devices the kernel exposes to this pod (empty without a device plugin grant)."""
    root = Path("/sys/class/infiniband")
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def select_transport(requested: str, model_key: str, timeout: float, stats, served: ServedCache | None = None,
                     devices: list[str] | None = None,
                     protocol: str = "rdma", streams: int | None = None, auth: PeerAuth | None = None,
                     layout: BlockLayout | None = None) -> tuple[TcpTransport | RdmaTransport, str]:
    """-> (transport, name peers should see). RDMA needs a device (`devices`, default: this pod's), the
    KV cache to serve (`served`) and Mooncake's transfer engine (the `rdma` extra) starting on them;
    anything missing falls back to TCP with a log line and a counted `rdma_unavailable` fallback.
    An RdmaTransport advertises its own address (`.addr`) and must be closed. `protocol="tcp"` runs
    the RDMA path over Mooncake's TCP transport (tests and debugging without RDMA hardware). `streams`:
    TCP connections per large pull (None: TcpTransport's default). `auth`: the fleet's handshake (the RDMA
    path takes it from `served`); `layout`: this replica's blocks (a peer announcing others is refused)."""
    if requested not in ("auto", "tcp", "rdma"):
        raise ValueError(f"kv transport must be auto, tcp or rdma, got {requested!r}")
    if requested == "tcp":
        return TcpTransport(model_key, timeout, num_stripes=streams, auth=auth, layout=layout), "tcp"
    devices = rdma_devices() if devices is None else devices
    if not devices:
        reason = "no RDMA device in this pod"
    elif served is None:
        reason = "the KV cache is not offered for RDMA reads"
    else:
        try:
            transport = RdmaTransport.open(served, model_key, timeout, stats, devices, protocol)
        except RdmaUnavailable as e:
            reason = str(e)
        else:
            logger.info("KV transfer over RDMA on %s (Mooncake %s session %s)", ",".join(devices), protocol,
                        transport.session)
            return transport, "rdma"
    log = logger.warning if requested == "rdma" else logger.info
    log("KV transfer over TCP (requested %s: %s)", requested, reason)
    stats.fallback("rdma_unavailable")
    return TcpTransport(model_key, timeout, num_stripes=streams, auth=auth, layout=layout), "tcp"
