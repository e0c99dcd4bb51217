"""One reconcile pass at a time, driven directly (no Kopf), against the emulated API server."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kmock
import pytest
from kubernetes import config
from operator_harness import NAMESPACE, Cluster, Emulator, condition_of, declare_resources, write_kubeconfig

from fleet import names
from fleet.kube import Kube
from fleet.manifests import kv_transfer
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
    assert len(first.actions) == 9 and first.status_written
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


def transfer_secret(cluster: Cluster) -> str | None:
    return kv_transfer.read_secret(cluster.get("v1", "secrets", "v3-kv-transfer"))


def engine_template(cluster: Cluster) -> dict[str, Any]:
    return cluster.get("apps/v1", "deployments", "v3")["spec"]["template"]


async def test_the_kv_transfer_secret_is_generated_once_and_kept(setup: Any) -> None:
    cluster, reconciler, _ = setup
    await create_fleet(cluster)
    await run(reconciler)
    secret = transfer_secret(cluster)
    assert secret is not None and len(secret) >= 32
    digest = engine_template(cluster)["metadata"]["annotations"][names.SECRETS_HASH]
    await run(reconciler)  # the next pass (an event's, the resync's)
    # A restarted operator: nothing in memory, only what it reads back.
    restarted = Reconciler(reconciler.kube, lambda *_: None)
    before = cluster.request_count()
    assert (await run(restarted)).actions == [] and cluster.writes(before) == []
    assert transfer_secret(cluster) == secret
    assert engine_template(cluster)["metadata"]["annotations"][names.SECRETS_HASH] == digest

    # Rotation: a deleted Secret comes back with a new secret, and the engines roll to it.
    await cluster.delete("v1", "secrets", "v3-kv-transfer")
    outcome = await run(reconciler)
    assert "Created Secret v3-kv-transfer" in outcome.actions
    assert transfer_secret(cluster) not in (None, secret)
    assert engine_template(cluster)["metadata"]["annotations"][names.SECRETS_HASH] != digest


async def test_a_secret_of_ones_own_replaces_and_prunes_the_generated_one(setup: Any) -> None:
    cluster, reconciler, _ = setup
    await create_fleet(cluster)
    await run(reconciler)
    assert transfer_secret(cluster) is not None
    own = {"name": "fleet-kv", "key": "shared"}
    await cluster.patch(names.API_VERSION, names.PLURAL, "v3", {"spec": {"kvCache": {"transferSecretRef": own}}})
    outcome = await run(reconciler)
    assert "Deleted Secret v3-kv-transfer, which the spec no longer asks for" in outcome.actions
    assert cluster.get("v1", "secrets", "v3-kv-transfer") is None
    volumes = {v["name"]: v for v in engine_template(cluster)["spec"]["volumes"]}
    assert volumes["kv-secret"]["secret"]["secretName"] == "fleet-kv"
    kv = condition_of(cluster.get(names.API_VERSION, names.PLURAL, "v3"), "KVDirectoryReady")
    assert (kv["status"], kv["reason"]) == ("False", "TransferSecretInvalid") and "does not exist" in kv["message"]

    await cluster.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "fleet-kv", "namespace": NAMESPACE},
                          "data": {"shared": base64.b64encode(b"too short").decode()}})
    await run(reconciler)
    kv = condition_of(cluster.get(names.API_VERSION, names.PLURAL, "v3"), "KVDirectoryReady")
    assert kv["reason"] == "TransferSecretInvalid" and "shorter than 16 bytes" in kv["message"]
    digest = engine_template(cluster)["metadata"]["annotations"][names.SECRETS_HASH]
    await cluster.patch("v1", "secrets", "fleet-kv", {"data": {"shared": base64.b64encode(b"s" * 32).decode()}})
    await run(reconciler)
    kv = condition_of(cluster.get(names.API_VERSION, names.PLURAL, "v3"), "KVDirectoryReady")
    assert kv["reason"] == "RedisNotReady"  # the secret is fine; no Redis pod is ready here
    assert engine_template(cluster)["metadata"]["annotations"][names.SECRETS_HASH] != digest  # a rotation rolls
    assert cluster.get("v1", "secrets", "fleet-kv") is not None  # a Secret of the user's is never pruned


async def test_the_generated_secret_named_as_the_fleets_own_stays(setup: Any) -> None:
    cluster, reconciler, _ = setup
    await create_fleet(cluster)
    await run(reconciler)
    secret = transfer_secret(cluster)
    own = {"name": "v3-kv-transfer", "key": kv_transfer.SECRET_KEY}
    await cluster.patch(names.API_VERSION, names.PLURAL, "v3", {"spec": {"kvCache": {"transferSecretRef": own}}})
    outcome = await run(reconciler)
    assert not [a for a in outcome.actions if a.startswith("Deleted")]
    assert transfer_secret(cluster) == secret
