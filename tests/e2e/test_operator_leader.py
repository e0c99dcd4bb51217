"""Two `deepseek-operator` processes with leader election against the emulated API server: only the
Lease holder writes; once it stops, the other takes over: at its next try when the leader stopped
cleanly and handed the Lease back, not after the lease (15 s) expires."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from pathlib import Path

import pytest
import yaml
from operator_harness import NAMESPACE, Cluster, eventually, fleet_manifest, write_kubeconfig

pytestmark = pytest.mark.timeout(90)
LEASE = f"{NAMESPACE}/deepseek-operator"


def kubeconfig_for(tmp_path: Path, url: str, token: str) -> str:
    path = write_kubeconfig(tmp_path / f"kubeconfig-{token}", url)
    config = yaml.safe_load(path.read_text())
    config["users"][0]["user"]["token"] = token
    path.write_text(yaml.safe_dump(config))
    return str(path)


def writers(cluster: Cluster) -> set[str]:
    """Tokens of the clients that wrote anything but the Lease and Events."""
    return {r.headers.get("Authorization", "").removeprefix("Bearer ") for r in cluster.emulator
            if r.method.value in ("POST", "PATCH", "PUT", "DELETE")
            and "/leases" not in r.url.path and "/events" not in r.url.path and r.headers.get("Authorization")}


async def test_two_operators_never_both_write(cluster: Cluster, tmp_path: Path) -> None:
    executable = shutil.which("deepseek-operator") or pytest.fail("deepseek-operator is not installed")
    url = str(cluster.server.url)
    processes = {}
    for token in ("first", "second"):
        env = {**os.environ, "KUBECONFIG": kubeconfig_for(tmp_path, url, token), "POD_NAME": token,
               "DEEPSEEK_OPERATOR_NAMESPACES": NAMESPACE, "DEEPSEEK_OPERATOR_LEADER_ELECTION": LEASE,
               "DEEPSEEK_OPERATOR_METRICS_PORT": "0", "DEEPSEEK_OPERATOR_RESYNC_SECONDS": "1"}
        processes[token] = await asyncio.create_subprocess_exec(
            executable, "--liveness", "off", env=env, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL)
        await asyncio.sleep(1.0)  # "first" takes the Lease before "second" starts
    try:
        await cluster.create(fleet_manifest())
        await eventually(lambda: cluster.get("apps/v1", "deployments", "v3"), timeout=30, what="engine Deployment")
        await asyncio.sleep(3)  # resyncs of the leader, and time for a second writer to show up
        assert writers(cluster) == {"first"}
        lease = cluster.get("coordination.k8s.io/v1", "leases", "deepseek-operator")
        assert lease["spec"]["holderIdentity"] == "first"

        processes["first"].send_signal(signal.SIGTERM)
        await asyncio.wait_for(processes["first"].wait(), timeout=20)
        assert processes["first"].returncode == 0
        released = cluster.get("coordination.k8s.io/v1", "leases", "deepseek-operator")["spec"]
        assert released.get("holderIdentity") in (None, "second"), released
        await cluster.delete("v1", "services", "v3-peers")  # work only the new leader can do
        # the candidate retries every 2 s: well inside the 15 s the Lease would take to expire
        await eventually(lambda: cluster.get("v1", "services", "v3-peers"), timeout=10, what="a takeover")
        assert writers(cluster) == {"first", "second"}
        assert cluster.get("coordination.k8s.io/v1", "leases", "deepseek-operator")["spec"]["holderIdentity"] == "second"
    finally:
        for process in processes.values():
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
                await asyncio.wait_for(process.wait(), timeout=20)
