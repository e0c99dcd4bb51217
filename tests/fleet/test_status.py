"""Conditions: derived from the children, stamped only on a flip, other writers' types kept."""

from __future__ import annotations

from typing import Any

from fleet.parent import Parent
from fleet.readiness import Observed, status_fields
from fleet.spec import DeepSeekDeploymentSpec
from fleet.status import condition, merge_conditions


def parent(**spec: Any) -> Parent:
    base = {"model": {"name": "m", "uri": "pvc://c/m"}, "engine": {"image": "e"}, "replicas": 2}
    return Parent("v3", "ns", DeepSeekDeploymentSpec.model_validate({**base, **spec}), generation=3)


def deployment(ready: int, *, replicas: int = 2, generation: int = 1, **status: Any) -> dict[str, Any]:
    return {"metadata": {"generation": generation}, "spec": {"replicas": replicas},
            "status": {"observedGeneration": generation, "replicas": replicas, "readyReplicas": ready,
                       "updatedReplicas": replicas, "availableReplicas": ready, **status}}


REDIS_READY = {"status": {"readyReplicas": 1}}


def conditions(p: Parent, observed: Observed) -> dict[str, dict[str, Any]]:
    _, fresh = status_fields(p, observed)
    return {c["type"]: c for c in fresh}


def test_ready_fleet() -> None:
    counts, fresh = status_fields(parent(), Observed(engine=deployment(2), redis=REDIS_READY))
    by_type = {c["type"]: c for c in fresh}
    assert counts["readyReplicas"] == 2 and counts["observedGeneration"] == 3
    assert counts["selector"] == "deepseek-fleet.io/deployment=v3"
    assert counts["endpoint"] == "http://v3.ns.svc:8000/v1"
    assert (by_type["Ready"]["status"], by_type["Ready"]["reason"]) == ("True", "FleetReady")
    assert by_type["Progressing"]["status"] == "False" and by_type["Degraded"]["status"] == "False"
    assert by_type["RDMAReady"]["reason"] == "RDMADisabled"


def test_reasons_say_what_is_missing() -> None:
    by_type = conditions(parent(), Observed(engine=deployment(1), redis=REDIS_READY))
    assert by_type["Ready"]["reason"] == "ReplicasNotReady" and "1 of 2" in by_type["Ready"]["message"]
    assert by_type["Progressing"]["reason"] == "RollingOut"
    by_type = conditions(parent(), Observed(engine=deployment(2), redis={}))
    assert by_type["Ready"]["reason"] == "KVDirectoryNotReady"
    by_type = conditions(parent(), Observed(engine=deployment(0, conditions=[
        {"type": "ReplicaFailure", "status": "True", "message": "exceeded quota: gpus"}]), redis=REDIS_READY))
    assert by_type["Degraded"]["reason"] == "ReplicaFailure" and "quota" in by_type["Ready"]["message"]
    by_type = conditions(parent(), Observed(engine=deployment(2), redis=REDIS_READY, blocked=["Service v3 ..."]))
    assert (by_type["Degraded"]["status"], by_type["Ready"]["reason"]) == ("True", "ChildBlocked")
    by_type = conditions(parent(replicas=0), Observed(engine=deployment(0, replicas=0), redis=REDIS_READY))
    assert by_type["Ready"]["reason"] == "ScaledToZero"


def test_external_directory_problems_surface() -> None:
    p = parent(kvCache={"directory": {"url": "redis://r", "passwordSecretRef": {"name": "s", "key": "k"}}})
    by_type = conditions(p, Observed(engine=deployment(2), kv_problem="Secret s ... does not exist"))
    assert (by_type["KVDirectoryReady"]["status"], by_type["KVDirectoryReady"]["reason"]) == ("False", "PasswordSecretInvalid")
    assert by_type["Ready"]["reason"] == "KVDirectoryNotReady"


def test_rdma_ready_reads_multus_network_status() -> None:
    p = parent(network={"rdma": {"enabled": True, "resourceName": "rdma/x", "networks": ["ns/rdma-net"]}})

    def pod(name: str, networks: list[str]) -> dict[str, Any]:
        status = '[{"name":"default/cbr0"}' + "".join(f',{{"name":"{n}"}}' for n in networks) + "]"
        return {"metadata": {"name": name, "annotations": {"k8s.v1.cni.cncf.io/network-status": status}},
                "status": {"conditions": [{"type": "Ready", "status": "True"}]}}

    ok = conditions(p, Observed(engine=deployment(2), redis=REDIS_READY, pods=[pod("a", ["ns/rdma-net"]), pod("b", ["ns/rdma-net"])]))
    assert ok["RDMAReady"]["status"] == "True" and ok["Ready"]["status"] == "True"
    bad = conditions(p, Observed(engine=deployment(2), redis=REDIS_READY, pods=[pod("a", ["ns/rdma-net"]), pod("b", [])]))
    assert bad["RDMAReady"]["reason"] == "NetworkNotAttached" and "b: ns/rdma-net" in bad["RDMAReady"]["message"]
    assert bad["Ready"]["reason"] == "RDMANotReady"


def test_autoscaled_fleet_counts_the_deployments_replicas() -> None:
    p = parent(autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 9})
    by_type = conditions(p, Observed(engine=deployment(5, replicas=5), redis=REDIS_READY))
    assert by_type["Ready"]["status"] == "True" and "5 of 5" in by_type["Ready"]["message"]


def test_transition_time_moves_only_on_a_flip() -> None:
    old = [
        {**condition("Ready", False, "ReplicasNotReady", "0 of 2"), "lastTransitionTime": "T0", "observedGeneration": 1},
        {"type": "ScalingReady", "status": "True", "reason": "Polling", "message": "", "lastTransitionTime": "T0"},
    ]
    same = merge_conditions(old, [condition("Ready", False, "ReplicasNotReady", "1 of 2")], now="T1", generation=2)
    assert same[0]["lastTransitionTime"] == "T0" and same[0]["message"] == "1 of 2" and same[0]["observedGeneration"] == 2
    flipped = merge_conditions(old, [condition("Ready", True, "FleetReady", "2 of 2")], now="T2", generation=2)
    assert flipped[0]["lastTransitionTime"] == "T2"
    assert flipped[1] == old[1]  # the autoscaler's condition is not ours to touch
