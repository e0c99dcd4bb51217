"""The committed CRD is what the models render, and it is a valid structural schema."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

from fleet import names
from fleet.crd import CRD_PATH, build_crd, render_crd

ROOT = Path(__file__).resolve().parents[2]


def test_committed_crd_matches_the_models() -> None:
    committed = (ROOT / CRD_PATH).read_text()
    assert committed == render_crd(), "crds/ is stale: run `python -m fleet.crd` from the repository root"


def test_crd_is_valid_for_kubernetes_1_33() -> None:
    kubernetes_validate.validate(build_crd(), "1.33.0", strict=True)


def _walk(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path, schema)]
    for name, prop in schema.get("properties", {}).items():
        out += _walk(prop, f"{path}.{name}")
    if "items" in schema:
        out += _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        out += _walk(schema["additionalProperties"], f"{path}{{}}")
    return out


def _root() -> dict[str, Any]:
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_schema_is_structural_and_described() -> None:
    for path, node in _walk(_root()):
        where = path or "<root>"
        assert "$ref" not in node and "title" not in node, where
        if node.get("x-kubernetes-int-or-string"):
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], where
        else:
            assert "type" in node and "anyOf" not in node and "oneOf" not in node, where
        if path.startswith((".spec", ".status")) and path.count(".") > 1 and not path.endswith(("[]", "{}")):
            assert node.get("description"), f"{where} has no description"
        assert node.get("default", 0) is not None, where


def test_rules_subresources_and_columns() -> None:
    crd = build_crd()
    version = crd["spec"]["versions"][0]
    assert crd["spec"]["names"]["shortNames"] == [names.SHORT_NAME]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert [c["name"] for c in version["additionalPrinterColumns"]] == ["Ready", "Replicas", "Queue", "Endpoint", "Image", "Age"]
    rules = [rule["rule"] for _, node in _walk(_root()) for rule in node.get("x-kubernetes-validations", [])]
    assert "has(self.gpusPerNode) || self.gpusPerReplica in [1, 2, 4, 8]" in rules
    assert "!has(self.maxReplicas) || self.minReplicas <= self.maxReplicas" in rules
    assert "(has(self.managed) && self.managed) != has(self.url)" in rules
    spec = _root()["properties"]["spec"]["properties"]
    assert spec["kvCache"]["properties"]["transport"]["enum"] == ["auto", "tcp", "rdma"]
    assert spec["autoscaling"]["properties"]["pollIntervalSeconds"]["default"] == 5
    assert spec["autoscaling"]["properties"]["scaleDownStabilizationSeconds"]["default"] == 300
    status = _root()["properties"]["status"]["properties"]
    assert {"desiredReplicas", "queueDepth", "lastScaleTime", "scalingHistory", "conditions"} <= set(status)


def test_crd_file_is_one_yaml_document() -> None:
    docs = list(yaml.safe_load_all((ROOT / CRD_PATH).read_text()))
    assert len(docs) == 1 and docs[0]["metadata"]["name"] == names.CRD_NAME


def test_field_reference_in_docs_is_current() -> None:
    from fleet.crd import render_reference

    text = (ROOT / "docs" / "crd.md").read_text()
    block = text.split("<!-- fields:begin -->\n", 1)[1].split("<!-- fields:end -->", 1)[0]
    assert block == render_reference(), "docs/crd.md is stale: paste `python -m fleet.crd reference`"
