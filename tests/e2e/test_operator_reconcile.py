"""One reconcile pass at a time, driven directly (no Kopf), against the emulated API server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kmock
import pytest
from kubernetes import config
from operator_harness import NAMESPACE, Cluster, Emulator, declare_resources, write_kubeconfig

from fleet import names
from fleet.kube import Kube
from fleet.manifests.kv_directory import read_password
from fleet.reconcile import Reconciler

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[tuple[Cluster, Reconciler, list[tuple[str, str]]]]:
    async with Emulator() as emulator, kmock.Server(emulator) as server:
        declare_resources(emulator)
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", str(server.url))
        events: list[tuple[str, str]] = []
        reconciler = Reconciler(
            Kube(config.new_client_from_config(config_file=str(kubeconfig))),
            lambda body, type_, reason, message: events.append((reason, message)),
        )
        yield Cluster(emulator, server), reconciler, events


async def run(reconciler: Reconciler) -> Any:
    return await asyncio.to_thread(reconciler.reconcile, NAMESPACE, "v3")


async def create_fleet(cluster: Cluster) -> None:
    await cluster.create({"apiVersion": names.API_VERSION, "kind": names.KIND,
                          "metadata": {"name": "v3", "namespace": NAMESPACE},
                          "spec": {"model": {"name": "m", "uri": "pvc://models/m"}, "engine": {"image": "e:1"}}})


async def test_second_pass_over_an_unchanged_fleet_writes_nothing(setup: Any) -> None:
    cluster, reconciler, events = setup
    await create_fleet(cluster)
    first = await run(reconciler)
    assert len(first.actions) == 8 and first.status_written
    assert ("Created", "Created Deployment v3") in events
    before = cluster.request_count()
    second = await run(reconciler)
    assert second.actions == [] and not second.status_written
    assert cluster.writes(before) == []


async def test_managed_password_is_kept_and_a_lost_secret_rolls_the_pods(setup: Any) -> None:
    cluster, reconciler, _ = setup
    await create_fleet(cluster)
    await run(reconciler)
    password = read_password(cluster.get("v1", "secrets", "v3-kv-auth"))
    auth_hash = cluster.get("apps/v1", "deployments", "v3")["spec"]["template"]["metadata"]["annotations"][names.KV_AUTH_HASH]
    await run(reconciler)
    assert read_password(cluster.get("v1", "secrets", "v3-kv-auth")) == password
    await cluster.delete("v1", "secrets", "v3-kv-auth")
    outcome = await run(reconciler)
    assert "Created Secret v3-kv-auth" in outcome.actions
    assert read_password(cluster.get("v1", "secrets", "v3-kv-auth")) != password
    for deployment in ("v3", "v3-kv"):
        annotations = cluster.get("apps/v1", "deployments", deployment)["spec"]["template"]["metadata"]["annotations"]
        assert annotations[names.KV_AUTH_HASH] != auth_hash


async def test_a_gone_fleet_is_left_alone(setup: Any) -> None:
    cluster, reconciler, _ = setup
    before = cluster.request_count()
    assert (await run(reconciler)).gone
    assert cluster.writes(before) == []
