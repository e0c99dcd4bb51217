"""The operator's autoscaler end to end: a real Kopf operator against the emulated API server,
engine pods whose IPs are loopback addresses where real HTTP servers serve the engine's own
metrics text, and a stand-in for the ReplicaSet controller that removes pods the way it ranks them.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from operator_harness import NAMESPACE, Cluster, RunningOperator, eventually

from engine.metrics import EngineMetrics
from fleet import names

pytestmark = pytest.mark.timeout(120)
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
AUTOSCALING = {"enabled": True, "minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 4, "pollIntervalSeconds": 1,
               "scaleDownStabilizationSeconds": 3, "maxScaleUpStep": 2, "maxScaleDownStep": 1}


@pytest.fixture
async def operator(cluster: Cluster) -> AsyncIterator[RunningOperator]:
    running = RunningOperator()
    await running.start()
    try:
        yield running
    finally:
        await running.stop()


@dataclass
class Engine:
    """One engine pod's /metrics: a real HTTP server on the pod's own loopback IP."""

    ip: str
    port: int
    metrics: EngineMetrics = field(default_factory=EngineMetrics)
    runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._serve)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, self.ip, self.port).start()

    async def stop(self) -> None:  # connection refused from now on: the pod does not answer
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def _serve(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain")


class ReplicaSetStandIn:
    """Plays kube-controller-manager for the engine Deployment: pods follow spec.replicas.

    A scale-down removes pods the way the ReplicaSet controller ranks them: not ready first, then
    the lowest controller.kubernetes.io/pod-deletion-cost, then the newest. New pods are ready at
    once, at the next free loopback address, with `new_load` as their queue.
    """

    def __init__(self, cluster: Cluster, port: int) -> None:
        self.cluster, self.port = cluster, port
        self.engines: dict[str, Engine] = {}
        self.created = 0
        self.replica_counts: list[int] = []  # every spec.replicas seen, in order
        self.removed: list[tuple[str, str | None]] = []  # (pod, its deletion cost when removed)
        self.new_load = (0, 4, 0.5)

    @property
    def replicas(self) -> int | None:
        """The Deployment's spec.replicas as last seen."""
        return self.replica_counts[-1] if self.replica_counts else None

    def set_load(self, pod: str, waiting: int, running: int, kv: float) -> None:
        self.engines[pod].metrics.set_queue(waiting, running, kv)

    async def run(self) -> None:
        while True:
            deployment = self.cluster.get("apps/v1", "deployments", "v3")
            if deployment is not None:
                await self._follow(deployment["spec"].get("replicas", 1))
            await asyncio.sleep(0.05)

    async def _follow(self, wanted: int) -> None:
        if not self.replica_counts or self.replica_counts[-1] != wanted:
            self.replica_counts.append(wanted)
        while len(self.engines) < wanted:
            await self._create()
        while len(self.engines) > wanted:
            await self._remove()
        count = len(self.engines)
        status = {"replicas": count, "readyReplicas": count, "availableReplicas": count, "updatedReplicas": count}
        if self.cluster.get("apps/v1", "deployments", "v3").get("status", {}) != {
                "observedGeneration": 1, **status}:
            await self.cluster.patch("apps/v1", "deployments", "v3", {"status": {"observedGeneration": 1, **status}},
                                     subresource="status")

    async def _create(self) -> None:
        name, ip = f"v3-e{self.created}", f"127.0.0.{self.created + 2}"
        self.created += 1
        engine = Engine(ip, self.port)
        engine.metrics.set_queue(*self.new_load)
        await engine.start()
        self.engines[name] = engine
        await self.cluster.create({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": {names.PARENT_LABEL: "v3"}},
            "spec": {"containers": [{"name": "engine", "image": "e:1",
                                     "ports": [{"name": "http", "containerPort": self.port}]}]},
            "status": {"podIP": ip, "phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
        })

    async def _remove(self) -> None:
        def rank(name: str) -> tuple[int, int]:
            pod = self.cluster.get("v1", "pods", name) or {}
            cost = (pod.get("metadata", {}).get("annotations") or {}).get(DELETION_COST, "0")
            return int(cost), -int(name.rsplit("e", 1)[1])  # lowest cost, then the newest

        victim = min(self.engines, key=rank)
        pod = self.cluster.get("v1", "pods", victim)
        self.removed.append((victim, (pod["metadata"].get("annotations") or {}).get(DELETION_COST)))
        await self.cluster.delete("v1", "pods", victim)
        await self.engines.pop(victim).stop()

    async def close(self) -> None:
        for engine in self.engines.values():
            await engine.stop()


@pytest.fixture
async def replicaset(cluster: Cluster) -> AsyncIterator[ReplicaSetStandIn]:
    with socket.socket() as probe:  # one port, free on the first address; every pod uses it, as in a cluster
        probe.bind(("127.0.0.2", 0))
        port = probe.getsockname()[1]
    standin = ReplicaSetStandIn(cluster, port)
    task = asyncio.create_task(standin.run())
    try:
        yield standin
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await standin.close()


def fleet(**autoscaling: Any) -> dict[str, Any]:
    return {"apiVersion": names.API_VERSION, "kind": names.KIND, "metadata": {"name": "v3", "namespace": NAMESPACE},
            "spec": {"model": {"name": "deepseek-v3", "uri": "pvc://models/DeepSeek-V3"},
                     "engine": {"image": "registry.example/deepseek-engine:1.0"}, "replicas": 1,
                     "autoscaling": {**AUTOSCALING, **autoscaling}}}


def status(cluster: Cluster) -> dict[str, Any]:
    return (cluster.get(names.API_VERSION, names.PLURAL, "v3") or {}).get("status", {})


def scaling(cluster: Cluster) -> dict[str, Any]:
    return next((c for c in status(cluster).get("conditions", []) if c["type"] == "ScalingReady"), {})


def events(cluster: Cluster, reason: str) -> list[dict[str, Any]]:
    return [e for e in cluster.events() if e.get("reason") == reason]


async def test_replicas_status_and_events_follow_a_load_trace(
    cluster: Cluster, operator: RunningOperator, replicaset: ReplicaSetStandIn
) -> None:
    await cluster.create(fleet())
    await eventually(lambda: scaling(cluster).get("reason") == "Stable", timeout=15, what="a first decision")
    assert replicaset.replica_counts == [1] and status(cluster)["desiredReplicas"] == 1
    assert status(cluster)["queueDepth"] == 4  # the first pod's 4 running requests

    # Spike: 16 requests on the one replica recommend 4; steps of at most 2 make that 1 -> 3 -> 4.
    replicaset.set_load("v3-e0", waiting=12, running=4, kv=0.9)
    await eventually(lambda: replicaset.replicas == 4, timeout=10, what="scale-up to 4")
    await eventually(lambda: len(status(cluster).get("scalingHistory", [])) == 2, what="history")
    assert replicaset.replica_counts == [1, 3, 4]
    history = status(cluster)["scalingHistory"]
    assert [(h["fromReplicas"], h["toReplicas"]) for h in history] == [(1, 3), (3, 4)]
    assert history[0]["queueDepth"] == 16 and "recommends 4" in history[0]["reason"]
    assert status(cluster)["lastScaleTime"] == history[-1]["time"]
    await eventually(lambda: status(cluster).get("queueDepth") == 28, what="the queue over four replicas")
    assert status(cluster)["desiredReplicas"] == 4
    await eventually(lambda: len(events(cluster, "ScaledUp")) == 2, what="an Event per scale-up")

    # Most replicas stop answering: no decision, the queue figure goes, the reason is reported once.
    for pod in ("v3-e1", "v3-e2", "v3-e3"):
        await replicaset.engines[pod].stop()
    await eventually(lambda: scaling(cluster).get("reason") == "MetricsUnavailable", what="MetricsUnavailable")
    assert scaling(cluster)["status"] == "False" and "3 of 4 ready replicas did not answer" in scaling(cluster)["message"]
    assert "queueDepth" not in status(cluster)
    await eventually(lambda: events(cluster, "MetricsUnavailable"), what="a Warning Event")
    for pod in ("v3-e1", "v3-e2", "v3-e3"):
        await replicaset.engines[pod].start()

    # Drain: the window holds 4 for 3 s, then one replica per poll goes, the idlest first.
    loads = {"v3-e0": (0, 2, 0.6), "v3-e1": (0, 0, 0.1), "v3-e2": (0, 0, 0.5), "v3-e3": (0, 1, 0.0)}
    for pod, load in loads.items():
        replicaset.set_load(pod, *load)
    await eventually(lambda: scaling(cluster).get("reason") == "ScaleDownStabilizing", what="the window holding")
    assert replicaset.replicas == 4
    await eventually(lambda: replicaset.replicas == 1, timeout=20, what="scale-down to 1")
    assert replicaset.replica_counts == [1, 3, 4, 3, 2, 1]
    # Each pod removed was marked before its scale-down: no running request, least KV cache first.
    assert replicaset.removed == [("v3-e1", "-1"), ("v3-e2", "-1"), ("v3-e3", "-1")]
    await eventually(lambda: len(events(cluster, "ScaledDown")) == 3, what="an Event per scale-down")
    # the Event and the status patch of the last step are separate writes: wait for the status too
    await eventually(lambda: [(h["fromReplicas"], h["toReplicas"]) for h in status(cluster)["scalingHistory"]][-1:]
                     == [(2, 1)], what="the last step in the history")
    body = cluster.get(names.API_VERSION, names.PLURAL, "v3")
    assert body["metadata"]["generation"] == 1 and body["spec"]["replicas"] == 1  # spec never written
    assert [(h["fromReplicas"], h["toReplicas"]) for h in body["status"]["scalingHistory"]][-3:] == [
        (4, 3), (3, 2), (2, 1)]


async def test_turned_off_the_spec_and_the_scale_subresource_rule(
    cluster: Cluster, operator: RunningOperator, replicaset: ReplicaSetStandIn
) -> None:
    replicaset.new_load = (8, 4, 0.5)  # 12 per replica: the autoscaler wants more
    await cluster.create(fleet(minReplicas=2))
    await eventually(lambda: replicaset.replicas == 4, timeout=15, what="scale-up to max")
    await cluster.patch(names.API_VERSION, names.PLURAL, "v3", {"spec": {"replicas": 2, "autoscaling": {"enabled": False}}})
    await eventually(lambda: scaling(cluster).get("reason") == "AutoscalingDisabled", what="AutoscalingDisabled")
    await eventually(lambda: replicaset.replicas == 2, what="spec.replicas rules again")
    assert "queueDepth" not in status(cluster) and "desiredReplicas" not in status(cluster)
    assert status(cluster)["scalingHistory"]  # history stays
    # HPA and KEDA write spec.replicas through the scale subresource; the operator follows.
    await cluster.patch(names.API_VERSION, names.PLURAL, "v3", {"spec": {"replicas": 3}}, subresource="scale")
    await eventually(lambda: replicaset.replicas == 3, what="the scale subresource's count")
    await asyncio.sleep(2.5)  # two autoscaler poll intervals: nothing may scale any more
    assert replicaset.replicas == 3 and scaling(cluster)["reason"] == "AutoscalingDisabled"
