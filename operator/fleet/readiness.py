"""Conditions and counts of a fleet, derived from the children as they are now."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from fleet import names
from fleet.manifests.rdma import MULTUS_STATUS_ANNOTATION
from fleet.parent import Parent
from fleet.status import condition


@dataclass(frozen=True)
class Observed:
    """What one reconcile pass saw and did."""

    engine: dict[str, Any] | None
    redis: dict[str, Any] | None = None
    pods: list[dict[str, Any]] = field(default_factory=list)
    kv_problem: str | None = None  # why the directory cannot work, found while reading its Secret
    transfer_problem: str | None = None  # what is wrong with the KV transfer secret the spec names
    blocked: list[str] = field(default_factory=list)  # children we could not create or update
    missing_crds: list[str] = field(default_factory=list)  # children whose kind the cluster does not serve


def desired_replicas(parent: Parent, engine: dict[str, Any] | None) -> int:
    """The replica count the fleet should have right now."""
    if parent.spec.autoscaling.enabled and engine is not None:
        return engine.get("spec", {}).get("replicas", 1)
    return parent.spec.replicas


def status_fields(parent: Parent, observed: Observed) -> tuple[dict[str, Any], list[dict]]:
    """Status counts and fresh conditions (without timestamps)."""
    engine_status = (observed.engine or {}).get("status", {})
    counts = {
        "observedGeneration": parent.generation,
        "replicas": engine_status.get("replicas", 0),
        "readyReplicas": engine_status.get("readyReplicas", 0),
        "updatedReplicas": engine_status.get("updatedReplicas", 0),
        "selector": names.selector_string(names.engine_selector(parent.name)),
        "endpoint": names.endpoint(parent.name, parent.namespace),
        "engineImage": _engine_image(observed.engine) or parent.engine_image,
    }
    kv = _kv_condition(parent, observed)
    rdma = _rdma_condition(parent, observed, counts["readyReplicas"])
    progressing = _progressing(parent, observed)
    degraded = _degraded(observed)
    ready = _ready(parent, observed, counts, kv, rdma, degraded)
    return counts, [ready, progressing, degraded, kv, rdma]


def _engine_image(engine: dict[str, Any] | None) -> str | None:
    containers = (engine or {}).get("spec", {}).get("template", {}).get("spec", {}).get("containers") or []
    return next((c.get("image") for c in containers if c.get("name") == "engine"), None)


def _kv_condition(parent: Parent, observed: Observed) -> dict:
    directory = parent.spec.kv_cache.directory
    if observed.kv_problem:
        return condition("KVDirectoryReady", False, "PasswordSecretInvalid", observed.kv_problem)
    if observed.transfer_problem:
        return condition("KVDirectoryReady", False, "TransferSecretInvalid", observed.transfer_problem)
    if not directory.managed:
        return condition(
            "KVDirectoryReady", True, "ExternalDirectory",
            f"Engines use the external directory {directory.url}; its reachability shows in the engines' logs.",
        )
    ready = (observed.redis or {}).get("status", {}).get("readyReplicas", 0)
    if ready >= 1:
        return condition("KVDirectoryReady", True, "RedisReady", "The managed Redis directory is ready.")
    return condition(
        "KVDirectoryReady", False, "RedisNotReady",
        f"The managed Redis {names.kv_name(parent.name)} has no ready pod yet; "
        f"see kubectl describe pods -l {names.selector_string(names.kv_selector(parent.name))}.",
    )


def _rdma_condition(parent: Parent, observed: Observed, ready_replicas: int) -> dict:
    rdma = parent.spec.network.rdma
    if not rdma.enabled:
        return condition("RDMAReady", False, "RDMADisabled", "RDMA is off; replicas move KV blocks over TCP.")
    if ready_replicas == 0:
        return condition("RDMAReady", False, "WaitingForPods", "No engine pod is ready yet to report its RDMA networks.")
    missing = []
    for pod in observed.pods:
        if not _pod_ready(pod):
            continue
        attached = _attached_networks(pod)
        for network in rdma.networks or []:
            if network.rsplit("/", 1)[-1] not in attached:
                missing.append(f"{pod['metadata']['name']}: {network}")
    if missing:
        return condition(
            "RDMAReady", False, "NetworkNotAttached",
            "Multus reports no interface for " + ", ".join(missing)
            + "; check that the NetworkAttachmentDefinition exists in this namespace.",
        )
    return condition(
        "RDMAReady", True, "Attached",
        f"Ready engine pods have {rdma.resource_name} and their RDMA networks attached.",
    )


def _pod_ready(pod: dict[str, Any]) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in pod.get("status", {}).get("conditions", [])
    )


def _attached_networks(pod: dict[str, Any]) -> set[str]:
    raw = (pod.get("metadata", {}).get("annotations") or {}).get(MULTUS_STATUS_ANNOTATION)
    try:
        entries = json.loads(raw) if raw else []
    except json.JSONDecodeError:
        return set()
    return {str(e.get("name", "")).rsplit("/", 1)[-1] for e in entries if isinstance(e, dict)}


def _deployment_condition(deployment: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for cond in (deployment or {}).get("status", {}).get("conditions", []):
        if cond.get("type") == type_:
            return cond
    return {}


def _progressing(parent: Parent, observed: Observed) -> dict:
    engine = observed.engine
    if engine is None:
        return condition("Progressing", True, "Creating", "Creating the engines' workload.")
    want = desired_replicas(parent, engine)
    status = engine.get("status", {})
    if engine.get("kind") == "LeaderWorkerSet":
        # A LeaderWorkerSet reports groups, without observedGeneration or availableReplicas.
        stale, available = False, status.get("readyReplicas", 0)
    else:
        stale = status.get("observedGeneration", 0) < engine.get("metadata", {}).get("generation", 0)
        available = status.get("availableReplicas", 0)
    updated = status.get("updatedReplicas", 0)
    total = status.get("replicas", 0)
    if stale or updated < want or available < want or total > want:
        return condition(
            "Progressing", True, "RollingOut",
            f"{updated} of {want} replicas updated, {available} available; new replicas load the model first.",
        )
    return condition("Progressing", False, "RolloutComplete", f"All {want} replicas run the current spec.")


def _degraded(observed: Observed) -> dict:
    if observed.missing_crds:
        return condition("Degraded", True, "CRDNotInstalled", "; ".join(observed.missing_crds))
    if observed.blocked:
        return condition("Degraded", True, "ChildBlocked", "; ".join(observed.blocked))
    failure = _deployment_condition(observed.engine, "ReplicaFailure")
    if failure.get("status") == "True":
        return condition("Degraded", True, "ReplicaFailure", failure.get("message", "The engine pods cannot be created."))
    progress = _deployment_condition(observed.engine, "Progressing")
    if progress.get("reason") == "ProgressDeadlineExceeded":
        return condition(
            "Degraded", True, "RolloutStuck",
            "The engine rollout exceeded its deadline; check pod events for scheduling or image problems.",
        )
    return condition("Degraded", False, "AsExpected", "No problem detected.")


def _ready(parent: Parent, observed: Observed, counts: dict, kv: dict, rdma: dict, degraded: dict) -> dict:
    want = desired_replicas(parent, observed.engine)
    ready = counts["readyReplicas"]
    if degraded["status"] == "True":
        return condition("Ready", False, degraded["reason"], degraded["message"])
    if want == 0:
        return condition("Ready", False, "ScaledToZero", "The fleet has 0 replicas; raise spec.replicas to serve.")
    if ready < want:
        return condition(
            "Ready", False, "ReplicasNotReady",
            f"{ready} of {want} replicas ready; pods may be waiting for GPUs or loading the model "
            f"(kubectl get pods -l {counts['selector']}).",
        )
    if kv["status"] != "True":
        return condition("Ready", False, "KVDirectoryNotReady", kv["message"])
    if parent.spec.network.rdma.enabled and rdma["status"] != "True":
        return condition("Ready", False, "RDMANotReady", rdma["message"])
    return condition("Ready", True, "FleetReady", f"{ready} of {want} replicas ready at {counts['endpoint']}.")
