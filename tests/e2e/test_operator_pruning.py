"""Children the spec no longer asks for are deleted, and nothing else: a real Kopf operator
against the emulated API server switches a fleet from a managed to an external Redis."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from operator_harness import NAMESPACE, Cluster, RunningOperator, eventually, fleet_manifest, quiet

from fleet import names

pytestmark = pytest.mark.timeout(90)
MANAGED_REDIS = [("apps/v1", "deployments", "v3-kv"), ("v1", "services", "v3-kv"),
                 ("networking.k8s.io/v1", "networkpolicies", "v3-kv"), ("v1", "secrets", "v3-kv-auth")]


def lookalike(kind: str, name: str, owner: dict[str, Any] | None) -> dict[str, Any]:
    """An object carrying the fleet's labels, owned by someone else (or no one)."""
    labels = {**names.children_selector("v3"), "app.kubernetes.io/part-of": "deepseek-fleet"}
    meta: dict[str, Any] = {"name": name, "namespace": NAMESPACE, "labels": labels}
    if owner is not None:
        meta["ownerReferences"] = [owner]
    if kind == "Service":
        return {"apiVersion": "v1", "kind": kind, "metadata": meta, "spec": {"ports": [{"port": 80}]}}
    return {"apiVersion": "apps/v1", "kind": kind, "metadata": meta,
            "spec": {"selector": {"matchLabels": {"a": "b"}}, "template": {"metadata": {"labels": {"a": "b"}},
                                                                          "spec": {"containers": []}}}}


def uids(cluster: Cluster) -> dict[tuple[str, str], str]:
    return {(o["kind"], o["metadata"]["name"]): o["metadata"]["uid"] for o in cluster.all_objects()
            if o.get("kind") not in ("Event", names.KIND) and "involvedObject" not in o}


async def test_managed_to_external_redis_deletes_the_managed_children_and_nothing_else(cluster: Cluster) -> None:
    password = base64.b64encode(b"p").decode()
    await cluster.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "kv-redis", "namespace": NAMESPACE},
                          "data": {"password": password}})
    operator = RunningOperator()
    await operator.start()
    try:
        await cluster.create(fleet_manifest("v3"))
        await cluster.create(fleet_manifest("v4"))  # a neighbour with a managed Redis of its own
        for fleet in ("v3", "v4"):
            for api_version, plural, name in MANAGED_REDIS:
                child = name.replace("v3", fleet, 1)
                await eventually(lambda: cluster.get(api_version, plural, child), what=f"{plural}/{child}")
        # Same labels, but another controller or none: never the fleet's to delete.
        other = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "someone", "uid": "0000", "controller": True}
        await cluster.create(lookalike("Deployment", "v3-kv-copy", other))
        await cluster.create(lookalike("Service", "v3-unowned", None))
        await quiet(cluster)
        before = uids(cluster)

        external = {"managed": None, "url": "redis://kv.platform.svc:6379/0",
                    "passwordSecretRef": {"name": "kv-redis", "key": "password"}}
        await cluster.patch(names.API_VERSION, names.PLURAL, "v3", {"spec": {"kvCache": {"directory": external}}})
        for api_version, plural, name in MANAGED_REDIS:
            await eventually(lambda: cluster.get(api_version, plural, name) is None, what=f"{plural}/{name} deleted")
        await quiet(cluster)

        gone = {("Deployment", "v3-kv"), ("Service", "v3-kv"), ("NetworkPolicy", "v3-kv"), ("Secret", "v3-kv-auth")}
        assert uids(cluster) == {k: v for k, v in before.items() if k not in gone}
        deleted = sorted(e["message"] for e in cluster.events() if e.get("reason") == "Deleted")
        assert len(deleted) == 4 and all("the spec no longer asks for" in m for m in deleted), deleted
        engine = cluster.get("apps/v1", "deployments", "v3")["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e for e in engine["env"]}
        assert env["DEEPSEEK_ENGINE_KV_DIRECTORY"]["value"].endswith("@kv.platform.svc:6379/0")
    finally:
        await operator.stop()
