"""What the autoscaler writes on its fleet: status fields, the ScalingReady condition and its history."""

from __future__ import annotations

from typing import Any

from fleet.autoscaler.decision import Decision
from fleet.status import SCALING_HISTORY_LIMIT, condition, merge_conditions

CONDITION = "ScalingReady"
DISABLED = "AutoscalingDisabled"
DISABLED_MESSAGE = (
    "Autoscaling is off: spec.replicas sets the replica count, directly or through the scale "
    "subresource (kubectl scale, a HorizontalPodAutoscaler or KEDA)."
)


def status_patch(status: dict[str, Any], decision: Decision, *, now: str, generation: int) -> dict[str, Any] | None:
    """The status fields to merge-patch after a poll, or None when none of them would change."""
    fields: dict[str, Any] = {"desiredReplicas": decision.replicas, "queueDepth": _rounded(decision.queue_depth)}
    if decision.scaled:
        entry = {"time": now, "fromReplicas": decision.current, "toReplicas": decision.replicas,
                 "reason": decision.message}
        if decision.queue_depth is not None:
            entry["queueDepth"] = _rounded(decision.queue_depth)
        fields["lastScaleTime"] = now
        fields["scalingHistory"] = [*(status.get("scalingHistory") or []), entry][-SCALING_HISTORY_LIMIT:]
    fresh = condition(CONDITION, decision.ok, decision.reason, decision.message)
    return _changes(status, fields, fresh, now=now, generation=generation)


def disabled_patch(status: dict[str, Any], *, now: str, generation: int) -> dict[str, Any] | None:
    """The status once autoscaling is off: no live queue figures, ScalingReady False; history is kept."""
    fresh = condition(CONDITION, False, DISABLED, DISABLED_MESSAGE)
    return _changes(status, {"desiredReplicas": None, "queueDepth": None}, fresh, now=now, generation=generation)


def holds_autoscaler_state(status: dict[str, Any]) -> bool:
    """Whether a status still shows an autoscaler at work (left over if it was turned off meanwhile)."""
    scaling = scaling_condition(status)
    return (status.get("queueDepth") is not None or status.get("desiredReplicas") is not None
            or bool(scaling) and scaling.get("reason") != DISABLED)


def scaling_condition(status: dict[str, Any]) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c.get("type") == CONDITION), {})


def _changes(status: dict[str, Any], fields: dict[str, Any], fresh: dict[str, Any], *, now: str,
             generation: int) -> dict[str, Any] | None:
    current = status.get("conditions") or []
    (stamped, *_) = merge_conditions(current, [fresh], now=now, generation=generation)
    # Replaced where it stands: the reconcile keeps the list's order too, so neither writer
    # sees a reordered list as a change and the two never take turns rewriting it.
    conditions = [stamped if c.get("type") == CONDITION else c for c in current]
    if not any(c.get("type") == CONDITION for c in current):
        conditions.append(stamped)
    wanted = {**fields, "conditions": conditions}
    if all(status.get(key) == value for key, value in wanted.items()):
        return None
    return wanted


def _rounded(queue_depth: float | None) -> float | None:
    return None if queue_depth is None else round(queue_depth, 2)
