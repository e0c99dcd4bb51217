"""`deepseek-operator`, the console script, runs the operator against a cluster from KUBECONFIG."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from pathlib import Path

import kmock
import pytest
from operator_harness import NAMESPACE, Cluster, Emulator, declare_resources, eventually, write_kubeconfig

from fleet import names

pytestmark = pytest.mark.timeout(60)


async def test_console_script_reconciles_a_fleet_and_stops_on_sigterm(tmp_path: Path) -> None:
    executable = shutil.which("deepseek-operator") or pytest.fail("deepseek-operator is not installed")
    async with Emulator() as emulator, kmock.Server(emulator) as server:
        declare_resources(emulator)
        cluster = Cluster(emulator, server)
        env = {**os.environ, "KUBECONFIG": str(write_kubeconfig(tmp_path / "kubeconfig", str(server.url))),
               "DEEPSEEK_OPERATOR_NAMESPACES": NAMESPACE}
        process = await asyncio.create_subprocess_exec(
            executable, "--liveness", "off", env=env,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )
        try:
            await cluster.create({
                "apiVersion": names.API_VERSION, "kind": names.KIND,
                "metadata": {"name": "v3", "namespace": NAMESPACE},
                "spec": {"model": {"name": "m", "uri": "pvc://models/m"}, "engine": {"image": "e:1"}},
            })
            await eventually(lambda: cluster.get("apps/v1", "deployments", "v3"), timeout=30, what="engine Deployment")
        finally:
            process.send_signal(signal.SIGTERM)
            _, stderr = await asyncio.wait_for(process.communicate(), timeout=20)
        assert process.returncode == 0, stderr.decode(errors="replace")[-2000:]
