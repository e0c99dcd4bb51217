"""The fleet's KV transfer secret in the built children: its Secret, its read-only mount and
`--kv-secret-file` in every engine pod (one-node and multi-node), a Secret of the user's in its
place, and nothing a user sets can take the flag, its variable or its volume over."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from fleet import names
from fleet.manifests import build_children
from fleet.manifests.kv_transfer import MOUNT_DIR, SECRET_FILE
from fleet.validation import InvalidSpec, validate

SECRET = "generated-kv-transfer-secret-0123456789abcdef"
OWN = {"name": "fleet-kv", "key": "shared"}


def fleet(**spec: Any) -> dict[str, Any]:
    base = {"model": {"name": "m", "uri": "pvc://models/m"}, "engine": {"image": "e:1"}}
    return {"metadata": {"name": "v3", "namespace": "ns"}, "spec": {**base, **spec}}


def children(**spec: Any) -> dict[tuple[str, str], dict[str, Any]]:
    built = build_children(validate(fleet(**spec)), kv_password="pw", transfer_secret=SECRET, replicas=2)
    return {(c["kind"], c["metadata"]["name"]): c for c in built}


def pod_templates(workload: dict[str, Any]) -> list[dict[str, Any]]:
    if workload["kind"] == "LeaderWorkerSet":
        group = workload["spec"]["leaderWorkerTemplate"]
        return [group["leaderTemplate"], group["workerTemplate"]]
    return [workload["spec"]["template"]]


def assert_mounted(template: dict[str, Any], secret_name: str, key: str) -> None:
    pod = template["spec"]
    (engine,) = [c for c in pod["containers"] if c["name"] == "engine"]
    args = engine["args"]
    assert args.count("--kv-secret-file") == 1 and args[args.index("--kv-secret-file") + 1] == SECRET_FILE
    (mount,) = [m for m in engine["volumeMounts"] if m["name"] == "kv-secret"]
    assert mount == {"name": "kv-secret", "mountPath": MOUNT_DIR, "readOnly": True}
    assert SECRET_FILE.startswith(MOUNT_DIR + "/")
    (volume,) = [v for v in pod["volumes"] if v["name"] == "kv-secret"]
    assert volume["secret"]["secretName"] == secret_name
    assert volume["secret"]["items"] == [{"key": key, "path": SECRET_FILE.rsplit("/", 1)[1]}]
    assert volume["secret"]["defaultMode"] == 0o444  # a non-root engine without fsGroup must read it


def test_a_generated_secret_is_a_child_and_is_mounted_and_flagged() -> None:
    built = children()
    secret = built["Secret", "v3-kv-transfer"]
    assert base64.b64decode(secret["data"]["secret"]).decode() == SECRET
    assert names.children_selector("v3").items() <= secret["metadata"]["labels"].items()  # prunable
    order = list(built)
    assert order.index(("Secret", "v3-kv-transfer")) < order.index(("Deployment", "v3"))  # before the pods
    (template,) = pod_templates(built["Deployment", "v3"])
    assert_mounted(template, "v3-kv-transfer", "secret")
    for key, child in built.items():
        if key != ("Secret", "v3-kv-transfer"):
            assert SECRET not in str(child) and base64.b64encode(SECRET.encode()).decode() not in str(child)


def test_every_pod_of_a_multi_node_replica_mounts_it() -> None:
    built = children(gpusPerReplica=16, gpusPerNode=8)
    templates = pod_templates(built["LeaderWorkerSet", "v3"])
    assert len(templates) == 2  # the leader and the workers
    for template in templates:
        assert_mounted(template, "v3-kv-transfer", "secret")
    assert ("Secret", "v3-kv-transfer") in built


def test_a_secret_of_the_users_replaces_the_generated_one() -> None:
    parent = validate(fleet(kvCache={"directory": {"managed": True}, "transferSecretRef": OWN}))
    built = build_children(parent, kv_password="pw", replicas=1)  # nothing generated to pass
    assert not [c for c in built if c["metadata"]["name"] == "v3-kv-transfer"]
    (deployment,) = [c for c in built if c["kind"] == "Deployment" and c["metadata"]["name"] == "v3"]
    assert_mounted(deployment["spec"]["template"], "fleet-kv", "shared")


def test_without_a_secret_of_its_own_a_fleet_needs_the_generated_one() -> None:
    with pytest.raises(AssertionError, match="generated secret"):
        build_children(validate(fleet()), kv_password="pw", replicas=1)


@pytest.mark.parametrize("engine", [
    {"extraArgs": ["--kv-secret-file", "/tmp/mine"]},
    {"extraArgs": ["--kv-secret-file=/tmp/mine"]},
    {"env": [{"name": "DEEPSEEK_ENGINE_KV_SECRET_FILE", "value": "/tmp/mine"}]},
], ids=["arg", "arg=value", "env"])
def test_a_user_cannot_set_the_secret_file(engine: dict[str, Any]) -> None:
    with pytest.raises(InvalidSpec, match="KV_SECRET_FILE|--kv-secret-file"):
        validate(fleet(engine={"image": "e:1", **engine}))


def test_a_user_volume_cannot_take_the_secrets_name() -> None:
    with pytest.raises(InvalidSpec, match="kv-secret"):
        validate(fleet(template={"volumes": [{"name": "kv-secret", "emptyDir": {}}]}))
