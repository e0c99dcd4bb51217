"""The chart's RBAC covers every API call the running operator makes, and grants nothing it never uses.

The calls are not listed by hand: a real Kopf operator (the e2e harness: kmock's API emulation over
HTTP) is driven through every path that touches the API (creating and repairing each child kind, managed
and external directories, RDMA pod reads, an invalid spec, an autoscaler scale-down), and each
request it sent is turned into the (API group, resource, verb) that RBAC would check. Requests
made by the test itself carry no credentials and are left out. The operator watches one namespace
here; watching the whole cluster it makes the same calls without the namespace in the path, which
RBAC checks against the same (group, resource, verb), granted then by the ClusterRole.

Not covered: what RBAC checks outside API calls. `deepseekdeployments/finalizers: update` is such
a rule (the OwnerReferencesPermissionEnforcement admission plugin checks it when a child's owner
reference sets blockOwnerDeletion), so it is expected to be granted and never called.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kmock
import pytest
from aiohttp import web
from test_chart import render

from fleet import names
from fleet.settings import OperatorSettings
from tests.e2e.operator_harness import (
    NAMESPACE,
    OPTIONAL_RESOURCES,
    Cluster,
    RunningOperator,
    emulated_cluster,
    eventually,
    quiet,
)

pytestmark = pytest.mark.timeout(120)

# Granted without ever being an API call (see the module docstring).
ADMISSION_ONLY = {(names.GROUP, f"{names.PLURAL}/finalizers", "update")}
# Reading the status subresource shows nothing that `get` on the resource itself does not: granted
# by fleet.rbac although no call uses it, and tolerated here because it widens nothing.
NO_WIDER_THAN_GET = {(names.GROUP, f"{names.PLURAL}/status", "get")}
# Pruned only once the operator runs with the setting that made them turned off (a restart).
DELETED_AFTER_A_SETTING_CHANGE = {("monitoring.coreos.com", "podmonitors", "delete"),
                                  ("inference.networking.k8s.io", "inferencepools", "delete")}
# Paths every authenticated client may read (the system:discovery ClusterRole): not RBAC rules of ours.
DISCOVERY_PREFIXES = ("/api", "/apis", "/version", "/openapi")
VERB_OF_METHOD = {"GET": "get", "POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}


def fleet(name: str, **spec: Any) -> dict[str, Any]:
    base = {"model": {"name": "m", "uri": "pvc://models/m"}, "engine": {"image": "e:1"}, "gpusPerReplica": 8}
    return {"apiVersion": names.API_VERSION, "kind": names.KIND,
            "metadata": {"name": name, "namespace": NAMESPACE}, "spec": {**base, **spec}}


def secret(name: str, **data: str) -> dict[str, Any]:
    encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": NAMESPACE}, "data": encoded}


def rbac_attributes(request: kmock.Request) -> tuple[str, str, str] | str:
    """(group, resource[/subresource], verb) as the API server's authorizer sees the request, or the
    path of a non-resource request."""
    if request.resource is None or request.resource.plural is None:  # discovery
        return request.url.path
    resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
    verb = VERB_OF_METHOD[request.method.value]
    if verb == "get" and request.name is None:
        verb = "watch" if request.params.get("watch") in ("true", "1") else "list"
    return request.resource.group or "", resource, verb


def granted(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


@pytest.fixture
async def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Cluster]:
    async with emulated_cluster(tmp_path, monkeypatch, optional=tuple(OPTIONAL_RESOURCES)) as cluster:
        yield cluster


def labelled(cluster: Cluster, api_version: str, plural: str, name: str) -> bool:
    obj = cluster.get(api_version, plural, name) or {}
    return (obj.get("metadata", {}).get("labels") or {}).get("app.kubernetes.io/part-of") == "deepseek-fleet"


def engine_pod(name: str, fleet_name: str, port: int, networks: str = "[]") -> dict[str, Any]:
    """A ready engine pod as the Deployment controller, the kubelet and Multus leave it."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": name, "namespace": NAMESPACE, "labels": {names.PARENT_LABEL: fleet_name},
        "annotations": {"k8s.v1.cni.cncf.io/network-status": networks}},
        "spec": {"containers": [{"name": "engine", "image": "e:1", "ports": [{"name": "http", "containerPort": port}]}]},
        "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}


@pytest.fixture
async def metrics_port() -> AsyncIterator[int]:
    """Idle engines' /metrics (the two queue gauges the autoscaler reads), on a loopback port."""
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text="deepseek_engine_requests_waiting 0\ndeepseek_engine_requests_running 0\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1]
    finally:
        await runner.cleanup()


async def drive_every_path(cluster: Cluster, metrics_port: int) -> None:
    """Make the operator create, read, repair and report everything it can."""
    await cluster.create(secret("api-key", key="k"))
    await cluster.create(secret("hf-token", token="t"))
    await cluster.create(secret("kv-redis", password="p"))
    rdma = {"rdma": {"enabled": True, "resourceName": "rdma/rdma_shared_device_a", "networks": ["rdma-net"]}}
    await cluster.create(fleet(
        "a", replicas=1, network=rdma,
        model={"name": "m", "uri": "hf://org/repo@main", "tokenSecretRef": {"name": "hf-token", "key": "token"}},
        engine={"image": "e:1", "apiKeySecretRef": {"name": "api-key", "key": "key"}},
    ))
    external = {"url": "redis://kv.platform.svc:6379/0", "passwordSecretRef": {"name": "kv-redis", "key": "password"}}
    await cluster.create(fleet("b", kvCache={"directory": external}))
    await cluster.create(fleet("c", gpusPerReplica=3))  # invalid: a status and a Warning Event only
    await cluster.create(fleet("d", autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 3,
                                                 "pollIntervalSeconds": 1, "scaleDownStabilizationSeconds": 0}))
    children = [("apps/v1", "deployments", "a"), ("v1", "services", "a"), ("v1", "services", "a-peers"),
                ("policy/v1", "poddisruptionbudgets", "a"), ("apps/v1", "deployments", "a-kv"),
                ("v1", "services", "a-kv"), ("networking.k8s.io/v1", "networkpolicies", "a-kv"),
                ("v1", "secrets", "a-kv-auth")]
    unwatched = [children[-1], ("monitoring.coreos.com/v1", "podmonitors", "a"),  # repaired by the next pass
                 ("inference.networking.k8s.io/v1", "inferencepools", "a")]
    for api_version, plural, name in children + unwatched:
        await eventually(lambda: cluster.get(api_version, plural, name), what=f"{plural}/{name}")

    # An engine pod as the Deployment controller and Multus leave it: RDMAReady reads the pods.
    await cluster.create(engine_pod("a-0", "a", metrics_port, networks='[{"name":"fleet/rdma-net"}]'))
    await cluster.patch("apps/v1", "deployments", "a", {"status": {
        "observedGeneration": 1, "replicas": 1, "readyReplicas": 1, "updatedReplicas": 1, "availableReplicas": 1,
    }}, subresource="status")

    # The autoscaler finds three idle engines of "d" (their /metrics on this machine) and scales
    # down, marking the idlest pods with a deletion cost first.
    await eventually(lambda: cluster.get("apps/v1", "deployments", "d"), what="deployments/d")
    await cluster.patch("apps/v1", "deployments", "d", {"spec": {"replicas": 3}})
    for i in range(3):
        await cluster.create(engine_pod(f"d-{i}", "d", metrics_port))
    await cluster.patch("apps/v1", "deployments", "d", {"status": {
        "observedGeneration": 2, "replicas": 3, "readyReplicas": 3, "updatedReplicas": 3, "availableReplicas": 3,
    }}, subresource="status")
    await eventually(lambda: cluster.get("apps/v1", "deployments", "d")["spec"]["replicas"] < 3, what="a scale-down")

    # Drift on every child kind: the Secret first (Secrets are not watched, so the edits after it
    # bring the pass that repairs it), then one edit per watched kind.
    for api_version, plural, name in [*unwatched, *children[:-1]]:
        await cluster.patch(api_version, plural, name, {"metadata": {"labels": {"app.kubernetes.io/part-of": None}}})
    for api_version, plural, name in children + unwatched:
        await eventually(lambda: labelled(cluster, api_version, plural, name), what=f"repaired {plural}/{name}")

    # A multi-node fleet runs as a LeaderWorkerSet (created, repaired); back on one node, it is pruned.
    await cluster.create(fleet("e", gpusPerReplica=16, gpusPerNode=8))
    await eventually(lambda: cluster.get("leaderworkerset.x-k8s.io/v1", "leaderworkersets", "e"), what="the LWS")
    await cluster.patch("leaderworkerset.x-k8s.io/v1", "leaderworkersets", "e",
                        {"metadata": {"labels": {"app.kubernetes.io/part-of": None}}})
    lws = ("leaderworkerset.x-k8s.io/v1", "leaderworkersets", "e")
    await eventually(lambda: labelled(cluster, *lws), what="the LWS repaired by the resync")
    await cluster.patch(names.API_VERSION, names.PLURAL, "e", {"spec": {"gpusPerReplica": 8, "gpusPerNode": None}})
    await eventually(lambda: cluster.get("leaderworkerset.x-k8s.io/v1", "leaderworkersets", "e") is None,
                     what="the LWS pruned")

    # A switch to an external directory prunes the managed Redis: a delete of each prunable kind.
    await cluster.patch(names.API_VERSION, names.PLURAL, "a", {"spec": {"kvCache": {"directory": {
        "managed": None, **external}}}})
    for api_version, plural, name in children[4:]:
        await eventually(lambda: cluster.get(api_version, plural, name) is None, what=f"pruned {plural}/{name}")
    await quiet(cluster)


async def test_rendered_rbac_covers_every_call_and_nothing_more(cluster: Cluster, metrics_port: int) -> None:
    operator = RunningOperator(OperatorSettings(metrics_port=0, pod_monitors=True, inference_pools=True,
                                                resync_seconds=1))
    await operator.start()
    try:
        await drive_every_path(cluster, metrics_port)
    finally:
        await operator.stop()

    calls = [r for r in cluster.emulator if r.headers.get("Authorization") == "Bearer test-token"]
    attributes = {rbac_attributes(r) for r in calls}
    non_resource = {a for a in attributes if isinstance(a, str)}
    used = attributes - non_resource
    assert non_resource and all(p.startswith(DISCOVERY_PREFIXES) for p in non_resource), non_resource

    (role,) = [d for d in render({"watchNamespaces": [NAMESPACE]}) if d["kind"] == "Role"]
    (cluster_role,) = [d for d in render({}) if d["kind"] == "ClusterRole"]
    for rules in (role["rules"], cluster_role["rules"]):
        allowed = granted(rules)
        assert used <= allowed, f"calls the chart does not allow: {sorted(used - allowed)}"
        unused = allowed - used - ADMISSION_ONLY - NO_WIDER_THAN_GET - DELETED_AFTER_A_SETTING_CHANGE
        assert not unused, f"granted but never used: {sorted(unused)}"
    assert (names.GROUP, names.PLURAL, "get") in used
