"""The autoscaling examples: the built-in autoscaler, and HPA or KEDA driving the scale subresource.

Fleets go through CRD admission, the operator's validation and child validation; the HPA
through kubernetes-validate for 1.33. KEDA publishes no schema that works offline, so a
ScaledObject is checked for what ties it to its fleet and to the metrics contract only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from admission import admit, defaulted

from fleet import names
from fleet.autoscaler.policy import Policy
from fleet.crd import build_crd
from fleet.manifests import build_children
from fleet.validation import validate

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "examples" / "autoscaling"
EXAMPLES = sorted(FOLDER.glob("*.yaml"))
SECRET = "generated-kv-transfer-secret"  # the reconcile passes the one it generated or read


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def fleet_in(path: Path) -> dict[str, Any]:
    (fleet,) = [d for d in documents(path) if d["kind"] == names.KIND]
    return fleet


def test_the_three_ways_exist_and_say_when_to_use_them() -> None:
    assert {p.name for p in EXAMPLES} == {"queue-depth.yaml", "hpa.yaml", "keda.yaml"}
    for path in EXAMPLES:
        leading = " ".join(line for line in path.read_text().splitlines() if line.startswith("#")).lower()
        assert leading.startswith("# use this when"), path.name


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_fleets_are_admitted_accepted_and_build_valid_children(path: Path) -> None:
    fleet = fleet_in(path)
    assert admit(fleet) == []
    parent = validate({**defaulted(fleet), "metadata": {**fleet["metadata"], "namespace": "ns"}})
    replicas = None if parent.spec.autoscaling.enabled else parent.spec.replicas
    for child in build_children(parent, kv_password="pw", transfer_secret=SECRET, replicas=replicas):
        kubernetes_validate.validate(child, "1.33.0", strict=True)


def test_fleet_names_are_unique_across_all_examples() -> None:
    found = [d["metadata"]["name"] for p in sorted((ROOT / "examples").rglob("*.yaml")) for d in documents(p)
             if d.get("kind") == names.KIND]
    assert len(found) == len(set(found)), found


def test_built_in_autoscaler_example_owns_the_count() -> None:
    fleet = fleet_in(FOLDER / "queue-depth.yaml")
    parent = validate({**fleet, "metadata": {**fleet["metadata"], "namespace": "ns"}})
    policy = Policy.from_spec(parent.spec.autoscaling)
    assert (policy.min_replicas, policy.max_replicas, policy.target_queue_depth) == (2, 8, 32)
    assert "replicas" not in fleet["spec"]  # ignored while autoscaling is on; Git need not hold it
    engine = next(c for c in build_children(parent, kv_password="pw", transfer_secret=SECRET, replicas=None)
                  if c["kind"] == "Deployment" and c["metadata"]["name"] == parent.name)
    assert "replicas" not in engine["spec"]


@pytest.mark.parametrize("name", ["hpa.yaml", "keda.yaml"])
def test_external_scalers_drive_the_scale_subresource_of_a_fleet_without_the_built_in_one(name: str) -> None:
    path = FOLDER / name
    fleet, (scaler,) = fleet_in(path), [d for d in documents(path) if d["kind"] != names.KIND]
    assert scaler["spec"]["scaleTargetRef"] == {"apiVersion": names.API_VERSION, "kind": names.KIND,
                                                "name": fleet["metadata"]["name"]}
    assert not fleet["spec"].get("autoscaling", {}).get("enabled")  # two autoscalers would fight
    assert "replicas" not in fleet["spec"]  # the scaler owns it: GitOps must not hold it
    scale = build_crd()["spec"]["versions"][0]["subresources"]["scale"]
    assert scale["specReplicasPath"] == ".spec.replicas" and scale["labelSelectorPath"] == ".status.selector"


def test_hpa_is_a_valid_autoscaling_v2_object() -> None:
    (hpa,) = [d for d in documents(FOLDER / "hpa.yaml") if d["kind"] == "HorizontalPodAutoscaler"]
    kubernetes_validate.validate(hpa, "1.33.0", strict=True)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "32"}
    # The adapter rule in the file's comment serves the contract's two gauges under this name.
    text = (FOLDER / "hpa.yaml").read_text()
    assert metric["pods"]["metric"]["name"] == "deepseek_engine_queue_depth" and "as: \"deepseek_engine_queue_depth\"" in text
    assert "deepseek_engine_requests_waiting{<<.LabelMatchers>>} + deepseek_engine_requests_running" in text


def test_keda_scaled_object_reads_the_contract_metrics() -> None:
    (scaled,) = [d for d in documents(FOLDER / "keda.yaml") if d["kind"] == "ScaledObject"]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and float(trigger["metadata"]["threshold"]) == 32
    query = trigger["metadata"]["query"]
    assert "deepseek_engine_requests_waiting" in query and "deepseek_engine_requests_running" in query
    assert query.count("(") == query.count(")")
