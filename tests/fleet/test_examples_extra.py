"""Every document of every file in examples/ is checked by what applies to its kind, every file says
when to use it, and the docs list them all.

DeepSeekDeployments: CRD admission (schema, defaults, CEL), the operator's own validation, and
valid children. Built-in kinds (an HPA driving the scale subresource): kubernetes-validate for
1.33. KEDA ScaledObjects: no schema is available offline, so only what ties them to a fleet is
checked. Any other kind fails until a check for it is added here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from admission import admit

from fleet import names
from fleet.manifests import build_children
from fleet.validation import validate

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").rglob("*.y*ml"))
SCALERS = {("autoscaling/v2", "HorizontalPodAutoscaler"), ("keda.sh/v1alpha1", "ScaledObject")}
SECRET = "generated-kv-transfer-secret"  # the reconcile passes the one it generated or read


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def all_fleets() -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for p in EXAMPLES for d in documents(p) if d.get("kind") == names.KIND}


def test_the_issue_s_examples_exist() -> None:
    assert {p.name for p in EXAMPLES} >= {
        "two-replicas-managed-redis.yaml", "eight-gpus-rdma.yaml", "gb300-four-gpus.yaml", "external-redis.yaml",
    }


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.relative_to(ROOT / "examples").as_posix())
def test_example_says_when_to_use_it(path: Path) -> None:
    lines = path.read_text().splitlines()
    leading = []
    for line in lines:
        if not line.startswith("#"):
            break
        leading.append(line.lstrip("# ").lower())
    assert len(leading) >= 2, f"{path.name}: start with a comment saying what it sets up and when to use it"
    assert "use" in " ".join(leading), f"{path.name}: its leading comment should say when to use it"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.relative_to(ROOT / "examples").as_posix())
def test_every_document_passes_the_checks_of_its_kind(path: Path) -> None:
    docs = documents(path)
    assert docs, f"{path.name} is empty"
    for doc in docs:
        kind = (doc.get("apiVersion"), doc.get("kind"))
        if doc.get("kind") == names.KIND:
            assert doc["apiVersion"] == names.API_VERSION
            assert admit(doc) == [], path.name
            parent = validate({**doc, "metadata": {**doc["metadata"], "namespace": "ns"}})
            for child in build_children(parent, kv_password="pw", transfer_secret=SECRET,
                                        replicas=parent.spec.replicas):
                kubernetes_validate.validate(child, "1.33.0", strict=True)
        elif kind == ("keda.sh/v1alpha1", "ScaledObject"):
            spec = doc["spec"]
            assert spec["triggers"], f"{path.name}: a ScaledObject needs triggers"
            assert spec.get("minReplicaCount", 0) <= spec.get("maxReplicaCount", 100)
        elif doc.get("apiVersion", "").split("/")[0] in ("v1", "apps", "autoscaling", "policy", "networking.k8s.io",
                                                          "rbac.authorization.k8s.io", "batch"):
            kubernetes_validate.validate(doc, "1.33.0", strict=True)
        else:
            pytest.fail(f"{path.name}: no check for {kind}; add one to {Path(__file__).name}")
        if kind in SCALERS:
            check_scaler_targets_a_fleet(path, doc)


def check_scaler_targets_a_fleet(path: Path, scaler: dict[str, Any]) -> None:
    """An HPA or KEDA example drives a DeepSeekDeployment's scale subresource, and that fleet has the
    built-in autoscaler off (two autoscalers would fight over the replica count)."""
    target = scaler["spec"]["scaleTargetRef"]
    assert (target.get("apiVersion"), target.get("kind")) == (names.API_VERSION, names.KIND), path.name
    fleets = all_fleets()
    assert target["name"] in fleets, f"{path.name}: scaleTargetRef names {target['name']}, which no example defines"
    autoscaling = fleets[target["name"]]["spec"].get("autoscaling", {})
    assert not autoscaling.get("enabled"), f"{path.name}: {target['name']} also enables the built-in autoscaler"


def test_fleet_names_are_unique_across_examples() -> None:
    found = [d["metadata"]["name"] for p in EXAMPLES for d in documents(p) if d.get("kind") == names.KIND]
    assert len(found) == len(set(found)), found


def test_install_guide_lists_every_example() -> None:
    guide = (ROOT / "docs" / "install.md").read_text()
    missing = [p.relative_to(ROOT).as_posix() for p in EXAMPLES if p.relative_to(ROOT).as_posix() not in guide]
    assert not missing, f"docs/install.md does not list {missing}"


def test_gb300_example_fits_one_tray() -> None:
    (fleet,) = documents(ROOT / "examples" / "gb300-four-gpus.yaml")
    parent = validate({**fleet, "metadata": {**fleet["metadata"], "namespace": "ns"}})
    assert parent.spec.gpus_per_replica == 4
    assert parent.spec.template.node_selector["kubernetes.io/arch"] == "arm64"  # Grace CPUs
    engine = next(c for c in build_children(parent, kv_password="pw", transfer_secret=SECRET, replicas=1)
                  if (c["kind"], c["metadata"]["name"]) == ("Deployment", parent.name))
    (container,) = engine["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert container["args"][container["args"].index("--tensor-parallel-size") + 1] == "4"
