"""Stopping the operator (SIGTERM, a lost Lease) while passes run and more are asked for: it ends
within a few seconds, and no pass of it is still calling the API server afterwards.

The API server answers slowly here, so that one pass over a fleet takes many seconds: a pass in
progress must be abandoned between two API calls, and neither the resync nor a child event may
start another one, or the operator outlives its termination grace period."""

from __future__ import annotations

import asyncio

import pytest
from operator_harness import Cluster, RunningOperator, eventually, fleet_manifest

from fleet import names
from fleet.settings import OperatorSettings

pytestmark = pytest.mark.timeout(120)

FLEETS = ("a", "b", "c")
LATENCY = 0.4  # seconds per request: a pass over one fleet (some 25 requests) takes about 10 s
# Kopf lets queued events run for up to 2 s (settings.queueing.exit_timeout) before it cancels the
# handlers; then each pass ends after the request it is waiting for.
STOP_BUDGET = 2.0 + 4 * LATENCY + 2.0


def parent_reads(cluster: Cluster, since: int) -> set[str]:
    """Fleets whose pass started (read the fleet) after the `since`-th request."""
    prefix = f"/apis/{names.API_VERSION}/namespaces/fleet/{names.PLURAL}/"
    return {r.url.path.removeprefix(prefix) for r in list(cluster.emulator)[since:]
            if r.method.value == "GET" and r.url.path.startswith(prefix) and "/" not in r.url.path.removeprefix(prefix)}


async def test_the_operator_stops_promptly_with_passes_in_flight(cluster: Cluster) -> None:
    operator = RunningOperator(OperatorSettings(resync_seconds=1))
    await operator.start()
    try:
        for name in FLEETS:
            await cluster.create(fleet_manifest(name))
        for name in FLEETS:
            await eventually(lambda: cluster.get("apps/v1", "deployments", name), what=f"the engines of {name}")
        cluster.emulator.latency = LATENCY
        # An update handler's pass for each fleet, child events' passes and the resync's.
        before = cluster.request_count()
        for name in FLEETS:
            await cluster.patch(names.API_VERSION, names.PLURAL, name, {"spec": {"replicas": 3}})
            await cluster.patch("v1", "services", name, {"metadata": {"labels": {"app.kubernetes.io/part-of": None}}})
        await eventually(lambda: parent_reads(cluster, before) >= set(FLEETS), timeout=15, what="passes under way")
        await asyncio.sleep(2 * LATENCY)  # well inside them
    finally:
        started = asyncio.get_running_loop().time()
        await operator.stop()
        took = asyncio.get_running_loop().time() - started
    assert took < STOP_BUDGET, f"the operator took {took:.1f}s to stop"
    after = cluster.request_count()
    await asyncio.sleep(3 * LATENCY)
    late = [f"{r.method.value} {r.url.path}" for r in list(cluster.emulator)[after:]]
    assert late == [], f"requests after the operator stopped: {late}"
