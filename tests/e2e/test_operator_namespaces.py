"""Namespace patterns (`-n 'fleet-*'`) with a real Kopf operator against the emulated API server:
fleets in matching namespaces are reconciled, including a namespace created after the start,
and fleets elsewhere are left alone."""

from __future__ import annotations

import asyncio

import pytest
from operator_harness import Cluster, RunningOperator, eventually, fleet_manifest, quiet

from fleet.settings import OperatorSettings

pytestmark = pytest.mark.timeout(60)


def in_namespace(name: str, namespace: str) -> dict:
    manifest = fleet_manifest(name)
    manifest["metadata"]["namespace"] = namespace
    return manifest


async def test_a_namespace_pattern_watches_the_namespaces_it_matches(cluster: Cluster) -> None:
    for namespace in ("fleet-a", "other"):
        await cluster.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    operator = RunningOperator(OperatorSettings(namespaces=("fleet-*",)))
    await operator.start()
    try:
        await cluster.create(in_namespace("v3", "fleet-a"))
        await cluster.create(in_namespace("v4", "other"))
        await eventually(lambda: cluster.get("apps/v1", "deployments", "v3", namespace="fleet-a"), what="fleet-a")

        await cluster.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "fleet-b"}})
        await asyncio.sleep(0.5)  # the operator starts watching fleet-b once it sees the namespace
        await cluster.create(in_namespace("v5", "fleet-b"))
        await eventually(lambda: cluster.get("apps/v1", "deployments", "v5", namespace="fleet-b"), what="fleet-b")
        await quiet(cluster)
        assert cluster.get("apps/v1", "deployments", "v4", namespace="other") is None
    finally:
        await operator.stop()
