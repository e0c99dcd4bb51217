"""A real Kopf operator reconciling DeepSeekDeployments against the emulated API server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from operator_harness import NAMESPACE, Cluster, RunningOperator, eventually, quiet

from fleet import names

pytestmark = pytest.mark.timeout(120)


def fleet_manifest(name: str = "v3", **spec: Any) -> dict[str, Any]:
    base = {
        "model": {"name": "deepseek-v3", "uri": "pvc://models/DeepSeek-V3"},
        "engine": {"image": "registry.example/deepseek-engine:1.0"},
        "gpusPerReplica": 8,
        "replicas": 2,
    }
    return {"apiVersion": names.API_VERSION, "kind": names.KIND,
            "metadata": {"name": name, "namespace": NAMESPACE}, "spec": {**base, **spec}}


@pytest.fixture
async def operator(cluster: Cluster) -> AsyncIterator[RunningOperator]:
    running = RunningOperator()
    await running.start()
    try:
        yield running
    finally:
        await running.stop()


def parent(cluster: Cluster, name: str = "v3") -> dict[str, Any] | None:
    return cluster.get(names.API_VERSION, names.PLURAL, name)


def parent_if(cluster: Cluster, type_: str, status: str) -> dict[str, Any] | None:
    """The parent once its condition type_ has the given status."""
    body = parent(cluster)
    return body if condition(body, type_).get("status") == status else None


def condition(body: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for cond in (body or {}).get("status", {}).get("conditions", []):
        if cond["type"] == type_:
            return cond
    return {}


async def test_create_makes_every_child_owned_and_wired(cluster: Cluster, operator: RunningOperator) -> None:
    await cluster.create(fleet_manifest())
    engine = await eventually(lambda: cluster.get("apps/v1", "deployments", "v3"), what="engine Deployment")
    await eventually(lambda: condition(parent(cluster), "Ready"), what="status")
    uid = parent(cluster)["metadata"]["uid"]
    for api_version, plural, name in [
        ("apps/v1", "deployments", "v3"), ("v1", "services", "v3"), ("v1", "services", "v3-peers"),
        ("policy/v1", "poddisruptionbudgets", "v3"), ("apps/v1", "deployments", "v3-kv"),
        ("v1", "services", "v3-kv"), ("v1", "secrets", "v3-kv-auth"), ("networking.k8s.io/v1", "networkpolicies", "v3-kv"),
        ("v1", "secrets", "v3-kv-transfer"),
    ]:
        child = await eventually(lambda: cluster.get(api_version, plural, name), what=f"{plural}/{name}")
        (ref,) = child["metadata"]["ownerReferences"]
        assert ref["uid"] == uid and ref["controller"] is True and ref["kind"] == names.KIND
    pod = engine["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}} in pod["volumes"]
    assert container["startupProbe"]["httpGet"]["path"] == "/ready"
    assert engine["spec"]["replicas"] == 2
    env = {e["name"]: e for e in container["env"]}
    assert env["DEEPSEEK_ENGINE_KV_DIRECTORY"]["value"].endswith(f"@v3-kv.{NAMESPACE}.svc:6379/0")
    status = parent(cluster)["status"]
    assert status["endpoint"] == f"http://v3.{NAMESPACE}.svc:8000/v1"
    assert status["selector"] == f"{names.PARENT_LABEL}=v3"
    assert condition(parent(cluster), "Ready")["status"] == "False"


CHILDREN = [
    ("apps/v1", "deployments", "v3"), ("v1", "services", "v3"), ("v1", "services", "v3-peers"),
    ("policy/v1", "poddisruptionbudgets", "v3"), ("apps/v1", "deployments", "v3-kv"),
    ("v1", "services", "v3-kv"), ("v1", "secrets", "v3-kv-auth"), ("networking.k8s.io/v1", "networkpolicies", "v3-kv"),
    ("v1", "secrets", "v3-kv-transfer"),
]


async def converged(cluster: Cluster, name: str = "v3") -> dict[str, Any]:
    """Wait for every child and a status for the current generation, then for the operator to go quiet."""
    for api_version, plural, child in CHILDREN:
        child = child.replace("v3", name, 1)
        await eventually(lambda: cluster.get(api_version, plural, child), what=f"{plural}/{child}")
    await eventually(
        lambda: (p := parent(cluster, name)) and p.get("status", {}).get("observedGeneration") == p["metadata"]["generation"],
        what="status of the current generation",
    )
    await quiet(cluster)
    return parent(cluster, name)


def engine_container(cluster: Cluster) -> dict[str, Any]:
    return cluster.get("apps/v1", "deployments", "v3")["spec"]["template"]["spec"]["containers"][0]


async def make_ready(cluster: Cluster, replicas: int) -> None:
    """Act as kube-controller-manager: the engine and Redis Deployments report ready pods."""
    engine = cluster.get("apps/v1", "deployments", "v3")
    status = {"observedGeneration": engine["metadata"]["generation"], "replicas": replicas,
              "readyReplicas": replicas, "updatedReplicas": replicas, "availableReplicas": replicas}
    await cluster.patch("apps/v1", "deployments", "v3", {"status": status}, subresource="status")
    await cluster.patch("apps/v1", "deployments", "v3-kv", {"status": {"replicas": 1, "readyReplicas": 1}},
                        subresource="status")


async def test_unchanged_fleet_gets_no_writes_even_across_a_restart(cluster: Cluster, operator: RunningOperator) -> None:
    await cluster.create(fleet_manifest())
    await converged(cluster)
    await make_ready(cluster, 2)
    await eventually(lambda: condition(parent(cluster), "Ready").get("status") == "True", what="Ready=True")
    await quiet(cluster)
    before = cluster.request_count()
    await operator.stop()
    restarted = RunningOperator()
    await restarted.start()
    try:
        # The resume handler reconciles every fleet; wait until it has read the last child.
        await eventually(
            lambda: any("deployments/v3" in r.url.path and r.method.value == "GET" for r in list(cluster.emulator)[before:]),
            what="the resumed reconcile",
        )
        await quiet(cluster)
        assert cluster.writes(before) == []
    finally:
        await restarted.stop()


async def test_status_follows_the_children_without_a_spec_change(cluster: Cluster, operator: RunningOperator) -> None:
    await cluster.create(fleet_manifest())
    body = await converged(cluster)
    ready = condition(body, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ReplicasNotReady")
    await make_ready(cluster, 2)
    body = await eventually(lambda: parent_if(cluster, "Ready", "True"), what="Ready=True")
    assert body["status"]["readyReplicas"] == 2 and body["metadata"]["generation"] == 1
    assert condition(body, "KVDirectoryReady")["reason"] == "RedisReady"
    assert condition(body, "Progressing")["status"] == "False"
    # lastTransitionTime moved for Ready (it flipped) and is an RFC 3339 timestamp.
    assert condition(body, "Ready")["lastTransitionTime"].endswith("Z")
    await eventually(lambda: {"Created", "FleetReady"} <= {e.get("reason") for e in cluster.events()}, what="events")


async def test_spec_updates_patch_children_in_place(cluster: Cluster, operator: RunningOperator) -> None:
    await cluster.create(fleet_manifest())
    await converged(cluster)
    uids = {(plural, name): cluster.get(av, plural, name)["metadata"]["uid"] for av, plural, name in CHILDREN}
    start = cluster.request_count()

    await cluster.patch(names.API_VERSION, names.PLURAL, "v3", {"spec": {
        "engine": {"image": "registry.example/deepseek-engine:2.0"}, "replicas": 3,
        "network": {"rdma": {"enabled": True, "resourceName": "rdma/rdma_shared_device_a", "networks": ["rdma-net"]}},
    }})
    await eventually(lambda: engine_container(cluster)["image"].endswith(":2.0"), what="new image")
    await converged(cluster)
    engine = cluster.get("apps/v1", "deployments", "v3")
    container = engine_container(cluster)
    assert engine["spec"]["replicas"] == 3
    assert container["resources"]["limits"]["rdma/rdma_shared_device_a"] == "1"
    assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    assert "rdma" == container["args"][container["args"].index("--kv-transport") + 1]
    annotations = engine["spec"]["template"]["metadata"]["annotations"]
    assert annotations["k8s.v1.cni.cncf.io/networks"] == "rdma-net"

    await cluster.patch(names.API_VERSION, names.PLURAL, "v3", {"spec": {"network": {"rdma": None}}})
    await eventually(lambda: "add" not in engine_container(cluster)["securityContext"]["capabilities"],
                     what="RDMA removed")
    await converged(cluster)
    container = engine_container(cluster)
    assert "rdma/rdma_shared_device_a" not in container["resources"]["limits"]
    assert "k8s.v1.cni.cncf.io/networks" not in cluster.get("apps/v1", "deployments", "v3")["spec"]["template"]["metadata"]["annotations"]
    assert container["args"][container["args"].index("--kv-transport") + 1] == "tcp"

    assert {k: cluster.get(av, k[0], k[1])["metadata"]["uid"] for (av, *_), k in zip(CHILDREN, uids)} == uids
    assert not [w for w in cluster.writes(start) if w.startswith(("DELETE", "POST"))]


async def test_deleted_or_edited_children_are_repaired(cluster: Cluster, operator: RunningOperator) -> None:
    await cluster.create(fleet_manifest())
    await converged(cluster)
    old = cluster.get("v1", "services", "v3-peers")
    await cluster.delete("v1", "services", "v3-peers")
    again = await eventually(lambda: cluster.get("v1", "services", "v3-peers"), what="recreated Service")
    assert again["metadata"]["uid"] != old["metadata"]["uid"]
    assert again["metadata"]["ownerReferences"][0]["uid"] == parent(cluster)["metadata"]["uid"]

    await cluster.patch("apps/v1", "deployments", "v3", {"spec": {"template": {"spec": {"containers": [
        {"name": "engine", "image": "someone/else:latest"}]}}}})
    await eventually(lambda: engine_container(cluster).get("command") == ["deepseek-engine"], what="repaired engine")
    assert engine_container(cluster)["image"] == "registry.example/deepseek-engine:1.0"


async def test_invalid_spec_reports_and_creates_nothing(cluster: Cluster, operator: RunningOperator) -> None:
    await cluster.create(fleet_manifest(engine={"image": "e:1", "tensorParallelSize": 3}))
    body = await eventually(lambda: parent_if(cluster, "Ready", "False"), what="a Ready condition")
    ready = condition(body, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert "engine.tensorParallelSize must divide gpusPerReplica" in ready["message"]
    await quiet(cluster)
    assert not [o for o in cluster.all_objects() if o.get("metadata", {}).get("ownerReferences")]
    await eventually(lambda: [e for e in cluster.events() if e.get("reason") == "InvalidSpec"], what="an Event")
    # No retry storm: nothing more is written while the spec stays invalid.
    before = cluster.request_count()
    await quiet(cluster, settle=1.5)
    assert cluster.writes(before) == []

    await cluster.patch(names.API_VERSION, names.PLURAL, "v3", {"spec": {"engine": {"tensorParallelSize": 4}}})
    body = await converged(cluster)
    assert condition(body, "Ready")["reason"] == "ReplicasNotReady"


async def test_restart_midway_converges_to_the_same_state(cluster: Cluster, operator: RunningOperator) -> None:
    await cluster.create(fleet_manifest())
    await converged(cluster)
    reference = {(p, n): cluster.get(av, p, n) for av, p, n in CHILDREN}
    await operator.stop()
    # While the operator is down: a child vanishes, another drifts, one is half-made.
    await cluster.delete("apps/v1", "deployments", "v3-kv")
    await cluster.delete("v1", "services", "v3")
    await cluster.patch("policy/v1", "poddisruptionbudgets", "v3", {"spec": {"maxUnavailable": 5}})
    restarted = RunningOperator()
    await restarted.start()
    try:
        await converged(cluster)
        # Both Secrets too: the Redis password and the KV transfer secret survive the restart.
        for av, plural, name in CHILDREN:
            now = cluster.get(av, plural, name)
            assert now["spec" if "spec" in now else "data"] == reference[plural, name]["spec" if "spec" in now else "data"]
            assert now["metadata"]["labels"] == reference[plural, name]["metadata"]["labels"]
    finally:
        await restarted.stop()


async def test_delete_leaves_cleanup_to_owner_references(cluster: Cluster, operator: RunningOperator) -> None:
    await cluster.create(fleet_manifest())
    await converged(cluster)
    assert not parent(cluster)["metadata"].get("finalizers")  # deletion never waits for the operator
    await cluster.delete(names.API_VERSION, names.PLURAL, "v3")
    assert parent(cluster) is None
    collected = await cluster.collect_garbage()
    assert len(collected) == len(CHILDREN)
    await quiet(cluster)
    assert not [o for o in cluster.all_objects() if o.get("metadata", {}).get("ownerReferences")]


async def test_autoscaled_replicas_are_left_to_the_autoscaler(cluster: Cluster, operator: RunningOperator) -> None:
    await cluster.create(fleet_manifest(autoscaling={"enabled": True, "minReplicas": 2, "maxReplicas": 6}))
    await converged(cluster)
    assert cluster.get("apps/v1", "deployments", "v3")["spec"]["replicas"] == 2
    await cluster.patch("apps/v1", "deployments", "v3", {"spec": {"replicas": 5}})  # the autoscaler's decision
    await cluster.patch(names.API_VERSION, names.PLURAL, "v3", {"spec": {"engine": {"image": "e:2"}}})
    await eventually(lambda: engine_container(cluster)["image"] == "e:2", what="image update")
    await converged(cluster)
    assert cluster.get("apps/v1", "deployments", "v3")["spec"]["replicas"] == 5


async def test_foreign_objects_are_not_taken_over(cluster: Cluster, operator: RunningOperator) -> None:
    await cluster.create({"apiVersion": "v1", "kind": "Service", "metadata": {
        "name": "v3-peers", "namespace": NAMESPACE,
        "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "other", "uid": "u-1", "controller": True}],
    }, "spec": {"ports": [{"port": 1}]}})
    await cluster.create(fleet_manifest())
    body = await eventually(lambda: parent_if(cluster, "Degraded", "True"), what="Degraded=True")
    degraded = condition(body, "Degraded")
    assert degraded["reason"] == "ChildBlocked" and "StatefulSet other" in degraded["message"]
    assert condition(body, "Ready")["reason"] == "ChildBlocked"
    assert cluster.get("v1", "services", "v3-peers")["spec"]["ports"] == [{"port": 1}]
    await eventually(lambda: [e for e in cluster.events() if e.get("reason") == "ChildBlocked"], what="an Event")


async def test_external_directory_reports_a_missing_password_secret(cluster: Cluster, operator: RunningOperator) -> None:
    directory = {"url": "redis://kv.platform.svc:6379/0", "passwordSecretRef": {"name": "kv-redis", "key": "password"}}
    await cluster.create(fleet_manifest(kvCache={"directory": directory}))
    body = await eventually(lambda: parent_if(cluster, "KVDirectoryReady", "False"), what="KVDirectoryReady=False")
    assert "Secret kv-redis" in condition(body, "KVDirectoryReady")["message"]
    assert cluster.get("apps/v1", "deployments", "v3-kv") is None  # nothing managed for an external directory
    await cluster.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "kv-redis", "namespace": NAMESPACE},
                          "data": {"password": "c2VjcmV0"}})
    # Secrets are not watched (least privilege): the next event on the fleet picks the fix up.
    await cluster.patch(names.API_VERSION, names.PLURAL, "v3", {"metadata": {"labels": {"touch": "1"}}})
    await eventually(lambda: parent_if(cluster, "KVDirectoryReady", "True"), what="KVDirectoryReady=True")


async def test_rdma_readiness_follows_the_pods(cluster: Cluster, operator: RunningOperator) -> None:
    rdma = {"rdma": {"enabled": True, "resourceName": "rdma/rdma_shared_device_a", "networks": ["rdma-net"]}}
    await cluster.create(fleet_manifest(replicas=1, network=rdma))
    await converged(cluster)
    # Pods as the Deployment controller and Multus would leave them; only one is ours.
    for name, labels, networks in [("v3-abc", {names.PARENT_LABEL: "v3"}, '[{"name":"fleet/rdma-net"}]'),
                                   ("other", {"app": "x"}, "[]")]:
        await cluster.create({"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": name, "namespace": NAMESPACE, "labels": labels,
            "annotations": {"k8s.v1.cni.cncf.io/network-status": networks}},
            "spec": {"containers": [{"name": "c", "image": "i"}]},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    await make_ready(cluster, 1)
    body = await eventually(lambda: parent_if(cluster, "Ready", "True"), what="Ready=True")
    assert condition(body, "RDMAReady")["reason"] == "Attached"
