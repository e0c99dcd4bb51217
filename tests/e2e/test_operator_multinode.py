"""A multi-node fleet with a real Kopf operator against the emulated API server: a LeaderWorkerSet
with the engine ranks where its CRD is installed, a clear condition where it is not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from operator_harness import Cluster, RunningOperator, condition_of, emulated_cluster, eventually, fleet_manifest

from fleet import names

pytestmark = pytest.mark.timeout(60)
LWS = "leaderworkerset.x-k8s.io/v1"
MULTI = {"gpusPerReplica": 16, "gpusPerNode": 8}


@pytest.fixture
async def lws_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Cluster]:
    async with emulated_cluster(tmp_path, monkeypatch, optional=(f"{LWS}/leaderworkersets",)) as cluster:
        yield cluster


def fleet_status(cluster: Cluster) -> dict:
    return cluster.get(names.API_VERSION, names.PLURAL, "v3") or {}


async def test_a_multi_node_fleet_runs_as_a_leader_worker_set(lws_cluster: Cluster) -> None:
    cluster = lws_cluster
    operator = RunningOperator()
    await operator.start()
    try:
        await cluster.create(fleet_manifest(**MULTI))
        lws = await eventually(lambda: cluster.get(LWS, "leaderworkersets", "v3"), what="the LeaderWorkerSet")
        assert lws["metadata"]["ownerReferences"][0]["kind"] == names.KIND
        group = lws["spec"]["leaderWorkerTemplate"]
        assert (lws["spec"]["replicas"], group["size"]) == (2, 2)
        for role in ("leaderTemplate", "workerTemplate"):
            args = group[role]["spec"]["containers"][0]["args"]
            assert args[args.index("--node-rank") + 1] == "$(LWS_WORKER_INDEX)"
            assert args[args.index("--nnodes") + 1] == "2"
        assert cluster.get("apps/v1", "deployments", "v3") is None
        # The LWS controller's report: both groups ready.
        await cluster.patch(LWS, "leaderworkersets", "v3", {"status": {"replicas": 2, "readyReplicas": 2,
                                                                         "updatedReplicas": 2}}, subresource="status")
        await cluster.patch("apps/v1", "deployments", "v3-kv", {"status": {"replicas": 1, "readyReplicas": 1}},
                            subresource="status")
        await eventually(lambda: condition_of(fleet_status(cluster), "Ready").get("status") == "True", what="Ready")
        assert fleet_status(cluster)["status"]["readyReplicas"] == 2
    finally:
        await operator.stop()


async def test_without_the_crd_the_fleet_says_what_is_missing(cluster: Cluster) -> None:
    operator = RunningOperator()
    await operator.start()
    try:
        await cluster.create(fleet_manifest(**MULTI))
        degraded = await eventually(lambda: condition_of(fleet_status(cluster), "Degraded").get("status") == "True"
                                    and condition_of(fleet_status(cluster), "Degraded"), what="Degraded")
        assert degraded["reason"] == "CRDNotInstalled"
        assert "LeaderWorkerSet" in degraded["message"] and "not served" in degraded["message"]
        assert condition_of(fleet_status(cluster), "Ready")["reason"] == "CRDNotInstalled"
        assert cluster.get("v1", "services", "v3")  # the rest of the fleet is there
    finally:
        await operator.stop()
