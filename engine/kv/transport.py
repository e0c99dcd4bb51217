"""Choosing how KV blocks travel between replicas: RDMA where the pod has it, TCP otherwise."""

import importlib.util
import logging
from pathlib import Path

from engine.kv.transfer import TcpTransport

logger = logging.getLogger(__name__)


def rdma_devices() -> list[str]:
    """RDMA devices the kernel exposes to this pod (empty without a device plugin grant)."""
    root = Path("/sys/class/infiniband")
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def select_transport(requested: str, model_key: str, timeout: float, stats) -> tuple[TcpTransport, str]:
    """-> (transport, name peers should see). RDMA needs a device and Mooncake's transfer engine
    (the `rdma` extra); anything missing falls back to TCP with a log line and a counted fallback."""
    if requested not in ("auto", "tcp", "rdma"):
        raise ValueError(f"kv transport must be auto, tcp or rdma, got {requested!r}")
    if requested == "tcp":
        return TcpTransport(model_key, timeout), "tcp"
    devices = rdma_devices()
    has_lib = importlib.util.find_spec("mooncake") is not None
    if devices and has_lib:
        # Mooncake's RDMA transfer engine plugs in here; until it is wired and validated on RDMA
        # hardware, pods with RDMA still move KV over TCP (on the RDMA network's IPoIB/RoCE address).
        reason = "the RDMA transfer path is not enabled in this build"
    elif not devices:
        reason = "no RDMA device in this pod"
    else:
        reason = "the mooncake transfer engine is not installed"
    log = logger.warning if requested == "rdma" else logger.info
    log("KV transfer over TCP (requested %s: %s)", requested, reason)
    stats.fallback("rdma_unavailable")
    return TcpTransport(model_key, timeout), "tcp"
