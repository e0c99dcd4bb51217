"""The Services in front of the engines."""

from __future__ import annotations

from typing import Any

from fleet import names
from fleet.parent import Parent


def engine_metadata(parent: Parent) -> dict[str, Any]:
    """Metadata of the children named after the fleet that front its engines (Service, budget, monitors)."""
    return {
        "name": names.engine_name(parent.name),
        "namespace": parent.namespace,
        "labels": names.common_labels(parent.name, "engine", "deepseek-engine"),
    }


def build_engine_service(parent: Parent) -> dict[str, Any]:
    """ClusterIP Service: the fleet's OpenAI-compatible endpoint."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": engine_metadata(parent),
        "spec": {
            "type": "ClusterIP",
            "selector": names.engine_selector(parent.name),
            "ports": [{"name": "http", "port": names.HTTP_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def build_peers_service(parent: Parent) -> dict[str, Any]:
    """Headless Service: per-pod DNS for KV transfers between replicas."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": names.peers_name(parent.name),
            "namespace": parent.namespace,
            "labels": names.common_labels(parent.name, "engine", "deepseek-engine"),
        },
        "spec": {
            "clusterIP": "None",
            # A draining replica still holds KV blocks its peers may pull.
            "publishNotReadyAddresses": True,
            "selector": names.engine_selector(parent.name),
            "ports": [
                {"name": "kv-transfer", "port": names.KV_TRANSFER_PORT, "targetPort": "kv-transfer", "protocol": "TCP"}
            ],
        },
    }
