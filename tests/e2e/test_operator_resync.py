"""The periodic resync, with a real Kopf operator against the emulated API server: it retries a
pass that failed, and it rolls the engine pods when a Secret they read changes (Secrets are read
by name on each pass, never watched)."""

from __future__ import annotations

import asyncio
import base64

import pytest
from operator_harness import NAMESPACE, Cluster, RunningOperator, eventually, fleet_manifest, quiet

from fleet import names
from fleet.settings import OperatorSettings

pytestmark = pytest.mark.timeout(90)


async def running(resync_seconds: float) -> RunningOperator:
    operator = RunningOperator(OperatorSettings(resync_seconds=resync_seconds))
    await operator.start()
    return operator


@pytest.mark.parametrize("resync_seconds", [1.0, 0.0], ids=["resync", "no-resync"])
async def test_a_failed_pass_is_retried_by_the_resync(cluster: Cluster, resync_seconds: float) -> None:
    operator = await running(resync_seconds)
    try:
        await cluster.create(fleet_manifest())
        await eventually(lambda: cluster.get("v1", "services", "v3-peers"), what="the peers Service")
        await quiet(cluster)
        # The pass after this deletion (a child event's: no retry of its own) fails to recreate it.
        cluster.emulator.fail_next("POST", "services")
        await cluster.delete("v1", "services", "v3-peers")
        await eventually(lambda: cluster.emulator.failures_left("POST", "services") == 0, what="the failed pass")
        if resync_seconds:
            await eventually(lambda: cluster.get("v1", "services", "v3-peers"), timeout=5, what="the resync's repair")
            failed = [e for e in cluster.events() if e.get("reason") == "ReconcileFailed"]
            assert failed and "the periodic resync retries it" in failed[0]["message"]
        else:
            await asyncio.sleep(3)  # the control: nothing else would ever come back to it
            assert cluster.get("v1", "services", "v3-peers") is None
    finally:
        await operator.stop()


def secret(value: str) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "api-key", "namespace": NAMESPACE},
            "data": {"key": base64.b64encode(value.encode()).decode(), "unused": ""}}


def secrets_hash(cluster: Cluster) -> str | None:
    engine = cluster.get("apps/v1", "deployments", "v3") or {}
    return (engine.get("spec", {}).get("template", {}).get("metadata", {}).get("annotations") or {}).get(
        names.SECRETS_HASH)


async def test_a_changed_secret_rolls_the_engine_pods(cluster: Cluster) -> None:
    await cluster.create(secret("first"))
    operator = await running(1.0)
    try:
        await cluster.create(fleet_manifest(engine={"apiKeySecretRef": {"name": "api-key", "key": "key"}}))
        first = await eventually(lambda: secrets_hash(cluster), what="the Secret's digest on the pod template")
        generation = cluster.get("apps/v1", "deployments", "v3")["metadata"]["generation"]

        await cluster.patch("v1", "secrets", "api-key", {"data": {"unused": "eA=="}})  # a key the pods do not read
        await asyncio.sleep(2.5)
        assert secrets_hash(cluster) == first

        await cluster.patch("v1", "secrets", "api-key", {"data": secret("rotated")["data"]})
        await eventually(lambda: secrets_hash(cluster) not in (None, first), timeout=5, what="a new digest")
        assert cluster.get("apps/v1", "deployments", "v3")["metadata"]["generation"] > generation  # a rollout
    finally:
        await operator.stop()
