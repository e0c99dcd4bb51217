"""The PodMonitor (Prometheus Operator) that scrapes a fleet's engines, when the operator is set to make one."""

from __future__ import annotations

from typing import Any

from fleet import names
from fleet.manifests.services import engine_metadata
from fleet.parent import Parent

SCRAPE_INTERVAL = "15s"


def build_pod_monitor(parent: Parent) -> dict[str, Any]:
    """Scrapes every engine pod's /metrics on its `http` port (the engine selector: one pod per replica)."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": engine_metadata(parent),
        "spec": {
            "selector": {"matchLabels": names.engine_selector(parent.name)},
            "podMetricsEndpoints": [{"port": "http", "path": "/metrics", "interval": SCRAPE_INTERVAL}],
        },
    }
