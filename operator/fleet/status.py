"""`DeepSeekDeployment.status`: what the operator (and later the autoscaler) observed."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from fleet.schema import ApiModel

SCALING_HISTORY_LIMIT = 20


class Condition(ApiModel):
    """One aspect of the fleet's state, as Kubernetes API conventions describe conditions."""

    type: str
    """Ready, Progressing, Degraded, KVDirectoryReady, RDMAReady or ScalingReady."""
    status: Literal["True", "False", "Unknown"]
    """Whether the condition holds."""
    reason: str
    """CamelCase cause of the status."""
    message: str = ""
    """What happened and what to do about it."""
    last_transition_time: str = Field(json_schema_extra={"format": "date-time"})
    """When status last changed (not reason or message)."""
    observed_generation: int | None = None
    """metadata.generation the condition was computed for."""


class ScalingEvent(ApiModel):
    """One replica-count change made by the autoscaler."""

    time: str = Field(json_schema_extra={"format": "date-time"})
    """When the change was made."""
    from_replicas: int
    """Replica count before."""
    to_replicas: int
    """Replica count after."""
    queue_depth: float | None = None
    """Queue depth (waiting plus running requests) that led to it."""
    reason: str = ""
    """Why the autoscaler changed the count."""


class DeepSeekDeploymentStatus(ApiModel):
    """Observed state of the fleet."""

    # Written by two controllers and read by tools: unknown keys are ignored, never refused.
    model_config = ConfigDict(extra="ignore")

    observed_generation: int | None = None
    """metadata.generation the status was computed for."""
    replicas: int | None = None
    """Engine pods that exist (the scale subresource reads it)."""
    ready_replicas: int | None = None
    """Engine pods that are ready to serve."""
    updated_replicas: int | None = None
    """Engine pods that run the current pod template."""
    selector: str | None = None
    """Label selector of the engine pods (the scale subresource reads it)."""
    endpoint: str | None = None
    """OpenAI-compatible base URL of the fleet inside the cluster."""
    engine_image: str | None = None
    """Engine image of the current pod template (spec.engine.image, else the operator's default)."""
    conditions: list[Condition] = Field(
        default_factory=list, json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}
    )
    """Current conditions, one per type."""
    desired_replicas: int | None = None
    """Replica count the autoscaler last decided on."""
    queue_depth: float | None = None
    """Requests waiting or running, summed over the ready replicas at the last autoscaler poll."""
    last_scale_time: str | None = Field(default=None, json_schema_extra={"format": "date-time"})
    """When the autoscaler last changed the replica count."""
    scaling_history: list[ScalingEvent] = Field(default_factory=list, max_length=SCALING_HISTORY_LIMIT)
    """The latest replica-count changes, newest last."""


def merge_conditions(
    current: list[dict], fresh: list[dict], *, now: str, generation: int
) -> list[dict]:
    """Conditions after an update: fresh ones replace theirs by type, the rest stay as they are.

    lastTransitionTime moves only when a condition's status flips; conditions of types we did not
    compute (another controller's, like ScalingReady) are kept untouched.
    """
    by_type = {c["type"]: c for c in current}
    merged = []
    for cond in fresh:
        old = by_type.get(cond["type"])
        flipped = old is None or old.get("status") != cond["status"]
        stamp = now if flipped else old.get("lastTransitionTime", now)
        merged.append({**cond, "lastTransitionTime": stamp, "observedGeneration": generation})
    fresh_types = {c["type"] for c in fresh}
    return merged + [c for c in current if c["type"] not in fresh_types]


def condition(type_: str, ok: bool, reason: str, message: str) -> dict:
    """A condition without its timestamps (merge_conditions adds them)."""
    return {"type": type_, "status": "True" if ok else "False", "reason": reason, "message": message}
