"""The engine pods an autoscaler poll looks at, and where each one serves its metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleet import names

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


@dataclass(frozen=True)
class EnginePod:
    """One engine pod as the autoscaler sees it."""

    name: str
    ready: bool
    ip: str | None
    port: int
    deletion_cost: str | None  # the annotation as it is now

    @classmethod
    def from_pod(cls, pod: dict[str, Any]) -> EnginePod:
        meta, status = pod.get("metadata", {}), pod.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
        )
        return cls(
            name=meta["name"],
            ready=ready and bool(status.get("podIP")),
            ip=status.get("podIP"),
            port=_http_port(pod),
            deletion_cost=(meta.get("annotations") or {}).get(DELETION_COST),
        )

    @property
    def metrics_url(self) -> str:
        host = f"[{self.ip}]" if self.ip and ":" in self.ip else self.ip
        return f"http://{host}:{self.port}/metrics"


def active(pods: list[dict[str, Any]]) -> list[EnginePod]:
    """Pods that count towards the workload: the ones not already terminating (they are draining)."""
    return [EnginePod.from_pod(p) for p in pods if not p.get("metadata", {}).get("deletionTimestamp")]


def _http_port(pod: dict[str, Any]) -> int:
    # The engine container names its API port "http"; follow it rather than assume 8000.
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "http" and isinstance(port.get("containerPort"), int):
                return port["containerPort"]
    return names.HTTP_PORT
