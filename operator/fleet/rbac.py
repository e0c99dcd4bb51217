"""The least-privilege RBAC rules the operator needs (`python -m fleet.rbac` prints them as YAML)."""

from __future__ import annotations

import sys
from typing import Any

import yaml

from fleet import names
from fleet.kube import CHILD_KINDS, POD_VERBS


def rules(*, namespace_globs: bool = False, leader_election: bool = False) -> list[dict[str, Any]]:
    """PolicyRules for a ClusterRole (cluster-wide) or a Role per watched namespace.

    namespace_globs: the operator watches namespace patterns (`-n 'llm-*'`), which Kopf resolves by
    listing and watching namespaces; those rules only work in a ClusterRole.
    leader_election: replicas elect a leader with a Lease (`--leader-election NS/NAME`).
    """
    out: list[dict[str, Any]] = [
        # Kopf watches fleets and keeps its bookkeeping in their annotations; no delete: the
        # operator never deletes a fleet (it deletes only children the spec no longer asks for).
        {"apiGroups": [names.GROUP], "resources": [names.PLURAL], "verbs": ["get", "list", "watch", "patch"]},
        {"apiGroups": [names.GROUP], "resources": [f"{names.PLURAL}/status"], "verbs": ["get", "patch"]},
        # Owner references with blockOwnerDeletion need this where OwnerReferencesPermissionEnforcement is on.
        {"apiGroups": [names.GROUP], "resources": [f"{names.PLURAL}/finalizers"], "verbs": ["update"]},
    ]
    for kind in CHILD_KINDS:
        out.append({"apiGroups": [kind.group], "resources": [kind.plural], "verbs": list(kind.verbs)})
    out += [
        # RDMAReady reads Multus' network-status annotation from the engine pods; the autoscaler
        # finds the ready ones and marks the idlest with a deletion cost before a scale-down.
        {"apiGroups": [""], "resources": ["pods"], "verbs": list(POD_VERBS)},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    ]
    if namespace_globs:
        out.append({"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]})
    if leader_election:
        out.append({"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "patch"]})
    return out


def cluster_role(name: str = names.MANAGER, *, namespace_globs: bool = False,
                 leader_election: bool = False) -> dict[str, Any]:
    """A ClusterRole holding the rules."""
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": name},
            "rules": rules(namespace_globs=namespace_globs, leader_election=leader_election)}


if __name__ == "__main__":
    # `--namespace-globs`: the ClusterRole for an operator started with namespace patterns.
    # `--leader-election`: with the Lease rules for several replicas.
    role = cluster_role(namespace_globs="--namespace-globs" in sys.argv, leader_election="--leader-election" in sys.argv)
    print(yaml.safe_dump(role, sort_keys=False), end="")
