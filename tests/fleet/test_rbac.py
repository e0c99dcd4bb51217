"""The written-down RBAC rules are current and cover every call the operator makes."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import yaml

from fleet import names
from fleet.kube import CHILD_KINDS
from fleet.rbac import cluster_role, rules

ROOT = Path(__file__).resolve().parents[2]


def allowed(group: str, resource: str, verb: str) -> bool:
    return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in rules())


def test_rules_cover_the_operator_and_kopf() -> None:
    for kind in CHILD_KINDS:
        for verb in ("get", "create", "patch"):
            assert allowed(kind.group, kind.plural, verb), (kind.plural, verb)
    for verb in ("get", "list", "watch", "patch"):
        assert allowed(names.GROUP, names.PLURAL, verb)
    assert allowed(names.GROUP, f"{names.PLURAL}/status", "patch")
    assert allowed("", "events", "create") and allowed("", "pods", "list")
    assert allowed("", "pods", "patch")  # the autoscaler's pod-deletion-cost before a scale-down
    assert not allowed("", "pods", "watch")  # pods are listed by label; a watch would stream every pod


def test_least_privilege() -> None:
    assert not any("*" in r["verbs"] or "*" in r["resources"] for r in rules())
    # delete only where a spec change can leave a child unwanted (the reconcile prunes it)
    deletable = {(g, res) for r in rules() if "delete" in r["verbs"] for g in r["apiGroups"] for res in r["resources"]}
    assert deletable == {("apps", "deployments"), ("", "services"), ("", "secrets"), ("networking.k8s.io", "networkpolicies"),
                         ("monitoring.coreos.com", "podmonitors"), ("leaderworkerset.x-k8s.io", "leaderworkersets"),
                         ("inference.networking.k8s.io", "inferencepools")}
    assert not allowed("", "secrets", "list") and not allowed("", "secrets", "watch")


def test_role_is_valid_and_documented() -> None:
    kubernetes_validate.validate(cluster_role(), "1.33.0", strict=True)
    text = (ROOT / "docs" / "operator.md").read_text()
    block = text.split("<!-- rbac:begin -->\n```yaml\n", 1)[1].split("```\n<!-- rbac:end -->", 1)[0]
    assert yaml.safe_load(block) == cluster_role(), "docs/operator.md is stale: paste `python -m fleet.rbac`"
