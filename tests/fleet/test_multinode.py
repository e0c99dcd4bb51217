"""Replicas over several nodes: a LeaderWorkerSet valid against the LWS v1 API (a schema vendored
from its Go types, tests/fleet/data), pod templates valid for Kubernetes 1.33, and the engine ranks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
from admission import admit
from pod_security import violations
from test_manifests import parent

from fleet import names
from fleet.manifests import build_children
from fleet.validation import validate

SCHEMA = json.loads((Path(__file__).parent / "data" / "leaderworkerset-v1.schema.json").read_text())
MULTI = {"gpusPerReplica": 16, "gpusPerNode": 8, "engine": {"tensorParallelSize": 16}}
SECRET = "generated-kv-transfer-secret"  # the reconcile passes the one it generated or read


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def lws_of(p: Any, replicas: int | None = 2) -> dict[str, Any]:
    (lws,) = [c for c in build_children(p, kv_password="pw", transfer_secret=SECRET, replicas=replicas)
              if c["kind"] == "LeaderWorkerSet"]
    return lws


def test_a_multi_node_fleet_renders_a_valid_leader_worker_set() -> None:
    p = parent(**MULTI)
    children = build_children(p, kv_password="pw", transfer_secret=SECRET, replicas=2)
    assert not [c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"] == "v3"]
    lws = lws_of(p)
    jsonschema.Draft7Validator(SCHEMA).validate(lws)
    group = lws["spec"]["leaderWorkerTemplate"]
    assert lws["spec"]["replicas"] == 2 and group["size"] == 2
    for role in ("leaderTemplate", "workerTemplate"):
        template = group[role]
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role.lower()},
                                      "template": template}, "1.33.0", strict=True)
        assert violations(template, "restricted") == []
        engine = template["spec"]["containers"][0]
        args = engine["args"]
        assert flag(args, "--nnodes") == "2" and flag(args, "--node-rank") == "$(LWS_WORKER_INDEX)"
        assert flag(args, "--dist-init-addr") == f"$(LWS_LEADER_ADDRESS):{names.DIST_INIT_PORT}"
        assert flag(args, "--tensor-parallel-size") == "16"
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == "8"  # a node's share, not the replica's
        assert engine["resources"]["requests"]["cpu"] == "32"
    leader, worker = group["leaderTemplate"], group["workerTemplate"]
    # Services, the budget and the autoscaler select leaders (one per replica); workers stay out.
    assert leader["metadata"]["labels"][names.PARENT_LABEL] == "v3"
    assert names.PARENT_LABEL not in worker["metadata"]["labels"]
    assert worker["metadata"]["labels"][names.WORKER_LABEL] == "v3"
    assert "readinessProbe" in leader["spec"]["containers"][0]
    assert "readinessProbe" not in worker["spec"]["containers"][0]


def test_the_autoscaler_owns_the_group_count() -> None:
    lws = lws_of(parent(**MULTI, autoscaling={"enabled": True, "maxReplicas": 3}), replicas=None)
    assert "replicas" not in lws["spec"]
    jsonschema.Draft7Validator(SCHEMA).validate(lws)


@pytest.mark.parametrize(("spec", "problem"), [
    ({"gpusPerReplica": 16}, "gpusPerReplica must be 1, 2, 4 or 8"),
    ({"gpusPerReplica": 16, "gpusPerNode": 3}, "gpusPerNode must be 1, 2, 4 or 8 and divide gpusPerReplica"),
    ({"gpusPerReplica": 12, "gpusPerNode": 8}, "gpusPerNode must be 1, 2, 4 or 8 and divide gpusPerReplica"),
])
def test_admission_and_the_operator_refuse_impossible_splits(spec: dict[str, Any], problem: str) -> None:
    body = {"apiVersion": names.API_VERSION, "kind": names.KIND, "metadata": {"name": "v3", "namespace": "ns"},
            "spec": {"model": {"name": "m", "uri": "pvc://models/m"}, **spec}}
    assert problem in admit(body)
    with pytest.raises(Exception, match=problem.split(" ")[0]):
        validate(body)


def test_one_node_fleets_are_unchanged() -> None:
    (engine,) = [c for c in build_children(parent(gpusPerNode=8), kv_password="pw", transfer_secret=SECRET, replicas=1)
                 if c["metadata"]["name"] == "v3" and c["kind"] in ("Deployment", "LeaderWorkerSet")]
    assert engine["kind"] == "Deployment"
    assert "--nnodes" not in engine["spec"]["template"]["spec"]["containers"][0]["args"]
