"""The PodDisruptionBudget of the engine pods."""

from __future__ import annotations

from typing import Any

from fleet import names
from fleet.manifests.services import engine_metadata
from fleet.parent import Parent


def build_disruption_budget(parent: Parent) -> dict[str, Any]:
    """Limits voluntary evictions (node drains) to a few engine pods at a time."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": engine_metadata(parent),
        "spec": {
            "maxUnavailable": parent.spec.disruption_budget.max_unavailable,
            "selector": {"matchLabels": names.engine_selector(parent.name)},
        },
    }
