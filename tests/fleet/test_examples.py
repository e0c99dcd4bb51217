"""Every example is admitted by the CRD, accepted by the operator and builds valid children."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from admission import admit

from fleet.manifests import build_children
from fleet.validation import validate

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
SECRET = "generated-kv-transfer-secret"  # the reconcile passes the one it generated or read


def test_the_required_examples_exist() -> None:
    assert {p.name for p in EXAMPLES} >= {
        "two-replicas-managed-redis.yaml", "eight-gpus-rdma.yaml", "external-redis.yaml",
    }


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example(path: Path) -> None:
    (doc,) = yaml.safe_load_all(path.read_text())
    assert admit(doc) == []
    parent = validate({**doc, "metadata": {**doc["metadata"], "namespace": "ns"}})
    for child in build_children(parent, kv_password="pw", transfer_secret=SECRET, replicas=parent.spec.replicas):
        kubernetes_validate.validate(child, "1.33.0", strict=True)
