"""The PodDisruptionBudget of the engine pods."""

from __future__ import annotations

from typing import Any

from fleet import names
from fleet.parent import Parent


def build_disruption_budget(parent: Parent) -> dict[str, Any]:
    """Limits voluntary evictions (node drains) to a few engine pods at a time."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {
            "name": names.engine_name(parent.name),
            "namespace": parent.namespace,
            "labels": names.common_labels(parent.name, "engine", "deepseek-engine"),
        },
        "spec": {
            "maxUnavailable": parent.spec.disruption_budget.max_unavailable,
            "selector": {"matchLabels": names.engine_selector(parent.name)},
        },
    }
