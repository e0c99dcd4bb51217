"""A fleet without spec.engine.image runs the operator's engine image, and says so in its status."""

from __future__ import annotations

from typing import Any

import pytest
from operator_harness import Cluster, RunningOperator, eventually, fleet_manifest

from fleet import names
from fleet.settings import OperatorSettings

pytestmark = pytest.mark.timeout(60)
OPERATOR_DEFAULT = "registry.example/deepseek-engine:7.0"


def pod_spec(cluster: Cluster) -> dict[str, Any]:
    return (cluster.get("apps/v1", "deployments", "v3") or {}).get("spec", {}).get("template", {}).get("spec", {})


def status_image(cluster: Cluster) -> str | None:
    return (cluster.get(names.API_VERSION, names.PLURAL, "v3") or {}).get("status", {}).get("engineImage")


async def test_the_default_engine_image_and_a_fleet_of_its_own(cluster: Cluster) -> None:
    operator = RunningOperator(OperatorSettings(engine_image=OPERATOR_DEFAULT))
    await operator.start()
    try:
        hf = {"name": "deepseek-v2-lite", "uri": "hf://deepseek-ai/DeepSeek-V2-Lite@main"}
        await cluster.create(fleet_manifest(model=hf))  # no spec.engine at all
        pod = await eventually(lambda: pod_spec(cluster), what="engine Deployment")
        assert pod["containers"][0]["image"] == OPERATOR_DEFAULT
        assert pod["initContainers"][0]["image"] == OPERATOR_DEFAULT  # the hf:// downloader follows it
        await eventually(lambda: status_image(cluster) == OPERATOR_DEFAULT, what="status.engineImage")

        await cluster.patch(names.API_VERSION, names.PLURAL, "v3", {"spec": {"engine": {"image": "team/engine:1"}}})
        await eventually(lambda: pod_spec(cluster)["containers"][0]["image"] == "team/engine:1", what="own image")
        await eventually(lambda: status_image(cluster) == "team/engine:1", what="status of the own image")
    finally:
        await operator.stop()
