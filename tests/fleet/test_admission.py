"""The CRD's CEL rules and the operator's own checks agree, sample by sample."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from admission import admit, cel_failures, defaulted
from pydantic import ValidationError

from fleet.spec import DeepSeekDeploymentSpec


def resource(name: str = "v3", **spec: Any) -> dict[str, Any]:
    base = {"model": {"name": "m", "uri": "pvc://models/m"}, "engine": {"image": "e:1"}}
    merged = copy.deepcopy(base)
    for key, value in spec.items():
        merged[key] = value
    return {"apiVersion": "deepseek-fleet.io/v1alpha1", "kind": "DeepSeekDeployment",
            "metadata": {"name": name}, "spec": merged}


SAMPLES = {
    "minimal": (resource(), []),
    "gpus-3": (resource(gpusPerReplica=3), ["gpusPerReplica must be 1, 2, 4 or 8"]),
    "min-over-max": (
        resource(autoscaling={"enabled": True, "minReplicas": 5, "maxReplicas": 2}),
        ["minReplicas must not exceed maxReplicas"],
    ),
    "autoscaling-no-max": (resource(autoscaling={"enabled": True}), ["maxReplicas is required when autoscaling is enabled"]),
    "both-directories": (
        resource(kvCache={"directory": {"managed": True, "url": "redis://r:6379"}}),
        ["set exactly one of managed: true or url"],
    ),
    "no-directory": (resource(kvCache={"directory": {"managed": False}}), ["set exactly one of managed: true or url"]),
    "password-for-managed": (
        resource(kvCache={"directory": {"managed": True, "passwordSecretRef": {"name": "s", "key": "k"}}}),
        ["passwordSecretRef only applies to an external directory (url)"],
    ),
    "external": (
        resource(kvCache={"directory": {"url": "redis://r:6379/0", "passwordSecretRef": {"name": "s", "key": "k"}}}),
        [],
    ),
    "rdma-fields-while-off": (
        resource(network={"rdma": {"enabled": False, "count": 2}}),
        ["RDMA fields are only allowed when enabled is true"],
    ),
    "rdma-without-resource": (resource(network={"rdma": {"enabled": True}}), ["resourceName is required when RDMA is enabled"]),
    "rdma-transport-without-rdma": (resource(kvCache={"transport": "rdma"}), ["kvCache.transport rdma needs network.rdma.enabled"]),
    "rdma-ok": (
        resource(kvCache={"transport": "rdma"}, network={"rdma": {"enabled": True, "resourceName": "rdma/x", "networks": ["n"]}}),
        [],
    ),
    "tp-3-of-4-gpus": (
        resource(gpusPerReplica=4, engine={"image": "e:1", "tensorParallelSize": 3}),
        ["engine.tensorParallelSize must divide gpusPerReplica"],
    ),
    "tp-2-of-4-gpus": (resource(gpusPerReplica=4, engine={"image": "e:1", "tensorParallelSize": 2}), []),
    "hf-fields-on-pvc": (
        resource(model={"name": "m", "uri": "pvc://c/p", "cacheSize": "10Gi"}),
        ["cacheSize, downloaderImage and tokenSecretRef only apply to hf:// models"],
    ),
}


@pytest.mark.parametrize("sample", SAMPLES)
def test_cel_rules_and_models_agree(sample: str) -> None:
    obj, expected = SAMPLES[sample]
    assert sorted(cel_failures(defaulted(obj))) == sorted(expected)
    if expected:
        with pytest.raises(ValidationError) as info:
            DeepSeekDeploymentSpec.model_validate(obj["spec"])
        assert all(message in str(info.value) for message in expected)
    else:
        DeepSeekDeploymentSpec.model_validate(obj["spec"])
        assert admit(obj) == []


@pytest.mark.parametrize("name, ok", [("v3", True), ("3v", False), ("a" * 57, True), ("a" * 58, False), ("V3", False)])
def test_name_rule(name: str, ok: bool) -> None:
    failures = cel_failures(defaulted(resource(name)))
    assert (failures == []) is ok


def test_schema_refuses_what_types_forbid() -> None:
    errors = admit(resource(replicas=-1, kvCache={"transport": "udp"}))
    assert any("replicas" in e for e in errors) and any("udp" in e for e in errors)


def test_defaults_match_the_models() -> None:
    # The API server's defaults (from the CRD) and pydantic's defaults give the same object.
    obj = resource()
    from_crd = defaulted(obj)["spec"]
    from_models = DeepSeekDeploymentSpec.model_validate(obj["spec"]).model_dump(by_alias=True, exclude_none=True)
    assert from_crd == from_models
