"""What the operator's settings add to the children of every fleet (the builders' only other input)."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass


def _version() -> str:
    try:
        return importlib.metadata.version("deepseek-fleet")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "0.1.0"


# The engine image released with this operator (the chart's `engineImage` default names the same).
DEFAULT_ENGINE_IMAGE = f"deepseek-fleet/engine:{_version()}"


@dataclass(frozen=True)
class BuildOptions:
    """Operator-wide choices the builders apply to every fleet."""

    engine_image: str = DEFAULT_ENGINE_IMAGE
    """Engine image of fleets whose spec.engine.image is unset."""
    pod_monitors: bool = False
    """Give every fleet a PodMonitor (needs the Prometheus Operator's CRDs)."""
    inference_pools: bool = False
    """Give every fleet an InferencePool (needs the Gateway API Inference Extension's CRDs)."""
