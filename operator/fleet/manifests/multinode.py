"""Replicas over several nodes: a LeaderWorkerSet (leaderworkerset.x-k8s.io/v1), one group per replica.

Each group is gpusPerReplica / gpusPerNode pods: the leader (rank 0, the replica's HTTP endpoint,
inside the engine selector) and workers (ranks 1.., outside it). Every pod runs the same engine
command with `--nnodes`, `--node-rank $(LWS_WORKER_INDEX)` and `--dist-init-addr
$(LWS_LEADER_ADDRESS):29500`, which the LeaderWorkerSet controller's env makes concrete.
"""

from __future__ import annotations

from typing import Any

from fleet import names
from fleet.manifests.engine import engine_pod_template, nodes_per_replica
from fleet.parent import Parent

API_VERSION = "leaderworkerset.x-k8s.io/v1"


def is_multinode(parent: Parent) -> bool:
    """Whether a replica needs more than one pod."""
    return nodes_per_replica(parent) > 1


def engine_workload(parent: Parent) -> tuple[str, str]:
    """(apiVersion, kind) of the object that runs a fleet's engines; both are named after the fleet."""
    return (API_VERSION, "LeaderWorkerSet") if is_multinode(parent) else ("apps/v1", "Deployment")


def build_leader_worker_set(parent: Parent, *, replicas: int | None, kv_auth_hash: str | None,
                            secrets_hash: str | None = None) -> dict[str, Any]:
    """The engines of a multi-node fleet; replicas=None leaves the group count to the autoscaler."""
    spec = parent.spec
    hashes = {"kv_auth_hash": kv_auth_hash, "secrets_hash": secrets_hash}
    lws_spec: dict[str, Any] = {
        # Workers start once their leader exists: its address is what they rendezvous with.
        "startupPolicy": "LeaderCreated",
        "rolloutStrategy": {
            "type": "RollingUpdate",
            "rollingUpdateConfiguration": {"maxSurge": spec.rollout.max_surge,
                                           "maxUnavailable": spec.rollout.max_unavailable},
        },
        "leaderWorkerTemplate": {
            "size": nodes_per_replica(parent),
            # One rank lost loses the replica's collectives: the whole group restarts together.
            "restartPolicy": "RecreateGroupOnPodRestart",
            "leaderTemplate": engine_pod_template(parent, role="leader", **hashes),
            "workerTemplate": engine_pod_template(parent, role="worker", **hashes),
        },
    }
    if replicas is not None:
        lws_spec = {"replicas": replicas, **lws_spec}
    return {
        "apiVersion": API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": {"name": names.engine_name(parent.name), "namespace": parent.namespace,
                     "labels": names.common_labels(parent.name, "engine", "deepseek-engine")},
        "spec": lws_spec,
    }
