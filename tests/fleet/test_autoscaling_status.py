"""What the autoscaler writes: status fields, ScalingReady in place, a bounded history, no churn."""

from __future__ import annotations

from fleet.autoscaler.decision import Decision
from fleet.autoscaler.registry import needs_autoscaler
from fleet.autoscaler.report import disabled_patch, status_patch
from fleet.status import SCALING_HISTORY_LIMIT, DeepSeekDeploymentStatus

RECONCILED = [
    {"type": "Ready", "status": "True", "reason": "FleetReady", "message": "", "lastTransitionTime": "T0"},
    {"type": "Progressing", "status": "False", "reason": "RolloutComplete", "message": "", "lastTransitionTime": "T0"},
]
UP = Decision(current=2, replicas=4, queue_depth=30.0, ok=True, reason="ScaledUp", message="Scaled from 2 to 4: ...")
STABLE = Decision(current=4, replicas=4, queue_depth=15.999, ok=True, reason="Stable", message="4 is right.")
BLIND = Decision(current=4, replicas=4, queue_depth=None, ok=False, reason="MetricsUnavailable", message="3 of 4 ...")


def test_a_scale_up_is_recorded_with_its_reason() -> None:
    patch = status_patch({"conditions": RECONCILED}, UP, now="T1", generation=7)
    assert patch["desiredReplicas"] == 4 and patch["queueDepth"] == 30 and patch["lastScaleTime"] == "T1"
    assert patch["scalingHistory"] == [{"time": "T1", "fromReplicas": 2, "toReplicas": 4, "queueDepth": 30,
                                        "reason": "Scaled from 2 to 4: ..."}]
    *kept, scaling = patch["conditions"]
    assert kept == RECONCILED  # the reconcile's conditions untouched, in their order
    assert scaling == {"type": "ScalingReady", "status": "True", "reason": "ScaledUp",
                       "message": "Scaled from 2 to 4: ...", "lastTransitionTime": "T1", "observedGeneration": 7}
    DeepSeekDeploymentStatus.model_validate(patch)  # what the CRD admits


def test_conditions_keep_their_order_and_stamps() -> None:
    first = status_patch({"conditions": RECONCILED}, UP, now="T1", generation=7)
    reordered = [first["conditions"][2], *RECONCILED]  # ScalingReady first, as another writer may leave it
    second = status_patch({**first, "conditions": reordered}, STABLE, now="T2", generation=7)
    assert [c["type"] for c in second["conditions"]] == ["ScalingReady", "Ready", "Progressing"]
    assert second["conditions"][0]["lastTransitionTime"] == "T1"  # still True: no flip, no new stamp
    assert "scalingHistory" not in second and second["queueDepth"] == 16.0


def test_an_unchanged_poll_writes_nothing() -> None:
    status = status_patch({"conditions": RECONCILED}, STABLE, now="T1", generation=7)
    assert status_patch(status, STABLE, now="T2", generation=7) is None


def test_history_is_bounded_newest_last() -> None:
    status: dict = {}
    for i in range(SCALING_HISTORY_LIMIT + 5):
        step = Decision(current=i, replicas=i + 1, queue_depth=1.0, ok=True, reason="ScaledUp", message=f"#{i}")
        status = {**status, **status_patch(status, step, now=f"T{i}", generation=1)}
    history = status["scalingHistory"]
    assert len(history) == SCALING_HISTORY_LIMIT and history[-1]["reason"] == f"#{SCALING_HISTORY_LIMIT + 4}"
    DeepSeekDeploymentStatus.model_validate(status)


def test_unknown_metrics_clear_the_queue_figure() -> None:
    status = status_patch({}, STABLE, now="T1", generation=1)
    patch = status_patch(status, BLIND, now="T2", generation=1)
    assert patch["queueDepth"] is None  # removed by the merge patch: a stale figure would mislead
    assert patch["conditions"][0]["status"] == "False" and patch["conditions"][0]["lastTransitionTime"] == "T2"


def test_turning_autoscaling_off_keeps_history_and_drops_live_figures() -> None:
    status = status_patch({"conditions": RECONCILED}, UP, now="T1", generation=7)
    patch = disabled_patch(status, now="T2", generation=8)
    assert patch["desiredReplicas"] is None and patch["queueDepth"] is None and "scalingHistory" not in patch
    assert patch["conditions"][-1]["reason"] == "AutoscalingDisabled"
    after = {**status, **{k: v for k, v in patch.items() if v is not None}}
    after.pop("desiredReplicas"), after.pop("queueDepth")
    assert disabled_patch(after, now="T3", generation=8) is None


def test_which_fleets_need_an_autoscaler() -> None:
    on = {"metadata": {"name": "a"}, "spec": {"autoscaling": {"enabled": True}}}
    assert needs_autoscaler(on)
    assert not needs_autoscaler({**on, "metadata": {"name": "a", "deletionTimestamp": "T"}})
    assert not needs_autoscaler({"metadata": {"name": "a"}, "spec": {"replicas": 2}})
    assert not needs_autoscaler({"metadata": {"name": "a"}, "spec": {"autoscaling": "yes"}})
    left_over = {"metadata": {"name": "a"}, "spec": {}, "status": {"queueDepth": 3}}
    assert needs_autoscaler(left_over)  # turned off while the operator was down: its figures must go
    settled = status_patch({}, STABLE, now="T1", generation=1)
    settled = {k: v for k, v in {**settled, **disabled_patch(settled, now="T2", generation=1)}.items() if v is not None}
    assert not needs_autoscaler({"metadata": {"name": "a"}, "spec": {}, "status": settled})
