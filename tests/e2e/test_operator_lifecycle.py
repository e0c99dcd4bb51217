"""A real Kopf operator reconciling DeepSeekDeployments against the emulated API server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from operator_harness import (
    NAMESPACE,
    Cluster,
    Emulator,
    RunningOperator,
    declare_resources,
    eventually,
    quiet,
    write_kubeconfig,
)

import kmock
from kubernetes.config import kube_config
from fleet import names

pytestmark = pytest.mark.timeout(120)


def fleet_manifest(name: str = "v3", **spec: Any) -> dict[str, Any]:
    base = {
        "model": {"name": "deepseek-v3", "uri": "pvc://models/DeepSeek-V3"},
        "engine": {"image": "registry.example/deepseek-engine:1.0"},
        "gpusPerReplica": 8,
        "replicas": 2,
    }
    return {"apiVersion": names.API_VERSION, "kind": names.KIND,
            "metadata": {"name": name, "namespace": NAMESPACE}, "spec": {**base, **spec}}


@pytest.fixture
async def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Cluster]:
    async with Emulator() as emulator, kmock.Server(emulator) as server:
        declare_resources(emulator)
        kubeconfig = str(write_kubeconfig(tmp_path / "kubeconfig", str(server.url)))
        monkeypatch.setenv("KUBECONFIG", kubeconfig)
        # The client library reads $KUBECONFIG once, at import; Kopf's login goes through it.
        monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", kubeconfig)
        yield Cluster(emulator, server)


@pytest.fixture
async def operator(cluster: Cluster) -> AsyncIterator[RunningOperator]:
    running = RunningOperator()
    await running.start()
    try:
        yield running
    finally:
        await running.stop()


def parent(cluster: Cluster, name: str = "v3") -> dict[str, Any] | None:
    return cluster.get(names.API_VERSION, names.PLURAL, name)


def condition(body: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for cond in (body or {}).get("status", {}).get("conditions", []):
        if cond["type"] == type_:
            return cond
    return {}


async def test_create_makes_every_child_owned_and_wired(cluster: Cluster, operator: RunningOperator) -> None:
    await cluster.create(fleet_manifest())
    engine = await eventually(lambda: cluster.get("apps/v1", "deployments", "v3"), what="engine Deployment")
    await eventually(lambda: condition(parent(cluster), "Ready"), what="status")
    uid = parent(cluster)["metadata"]["uid"]
    for api_version, plural, name in [
        ("apps/v1", "deployments", "v3"), ("v1", "services", "v3"), ("v1", "services", "v3-peers"),
        ("policy/v1", "poddisruptionbudgets", "v3"), ("apps/v1", "deployments", "v3-kv"),
        ("v1", "services", "v3-kv"), ("v1", "secrets", "v3-kv-auth"), ("networking.k8s.io/v1", "networkpolicies", "v3-kv"),
    ]:
        child = await eventually(lambda: cluster.get(api_version, plural, name), what=f"{plural}/{name}")
        (ref,) = child["metadata"]["ownerReferences"]
        assert ref["uid"] == uid and ref["controller"] is True and ref["kind"] == names.KIND
    pod = engine["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}} in pod["volumes"]
    assert container["startupProbe"]["httpGet"]["path"] == "/ready"
    assert engine["spec"]["replicas"] == 2
    env = {e["name"]: e for e in container["env"]}
    assert env["DEEPSEEK_ENGINE_KV_DIRECTORY"]["value"].endswith(f"@v3-kv.{NAMESPACE}.svc:6379/0")
    status = parent(cluster)["status"]
    assert status["endpoint"] == f"http://v3.{NAMESPACE}.svc:8000/v1"
    assert status["selector"] == f"{names.PARENT_LABEL}=v3"
    assert condition(parent(cluster), "Ready")["status"] == "False"
