"""The autoscaler's decision: replica sequences for load traces, and the properties it promises."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from fleet.autoscaler.decision import Decider, Decision, Observation, PodLoad
from fleet.autoscaler.policy import Policy
from fleet.spec import AutoscalingSpec

INTERVAL = 5.0
POLICY = Policy(min_replicas=1, max_replicas=10, target_queue_depth=4, tolerance=0.1, poll_interval=INTERVAL,
                scale_up_window=0, scale_down_window=30, max_scale_up_step=2, max_scale_down_step=1)
SILENT = None  # a pod that did not answer


def observation(queue: float, ready: int, silent: int = 0) -> Observation:
    """`ready` ready pods sharing `queue` evenly among those that answer; `silent` of them do not answer."""
    answering = ready - silent
    loads: dict[str, PodLoad | None] = {f"p{i}": SILENT for i in range(silent)}
    for i in range(silent, ready):
        loads[f"p{i}"] = PodLoad(waiting=0, running=queue / answering)
    return Observation(loads)


def run(policy: Policy, queues: list[float | tuple[float, int]], start: int) -> list[Decision]:
    """One poll per entry, INTERVAL apart; every replica is ready by the next poll (as a fast rollout)."""
    decider = Decider(policy)
    decider.remember(0.0, start)  # as the loop seeds it on its first poll
    current, decisions = start, []
    for i, entry in enumerate(queues):
        queue, silent = entry if isinstance(entry, tuple) else (entry, 0)
        decision = decider.decide(i * INTERVAL, current, observation(queue, current, silent))
        decisions.append(decision)
        current = decision.replicas
    return decisions


TRACES = {
    # name: (queue depth at each poll, starting replicas, expected replicas after each poll)
    "ramp up": ([4, 8, 12, 16, 20, 24, 28], 1, [1, 2, 3, 4, 5, 6, 7]),
    "spike, steps of 2 up to max": ([0, 40, 40, 40, 40, 40, 40], 1, [1, 3, 5, 7, 9, 10, 10]),
    "flat, inside the tolerance band": ([12, 13, 11, 12, 12.5, 11.5, 12], 3, [3] * 7),
    "drain, after the 30s window one by one": ([20] + [0] * 11, 5, [5] * 7 + [4, 3, 2, 1, 1]),
    "flapping holds the highest": ([8, 24] * 6 + [8] * 10, 2,
                                   [2, 4, 4, 6] + [6] * 8 + [6] * 6 + [5, 4, 3, 2]),
    "most pods silent: no decision": ([16, (16, 3), (40, 3), (0, 4), 16], 4, [4, 4, 4, 4, 4]),
    "one pod silent: up on the others' average, never down": ([16, (30, 1), (0, 1), (0, 1)], 4, [4, 6, 6, 6]),
    "below min or above max: bounds first": ([0, 0], 0, [1, 1]),
}


@pytest.mark.parametrize("name", TRACES)
def test_trace(name: str) -> None:
    queues, start, expected = TRACES[name]
    assert [d.replicas for d in run(POLICY, queues, start)] == expected


def test_reasons_explain_each_poll() -> None:
    spike = run(POLICY, [0, 40, 0], 1)
    assert [d.reason for d in spike] == ["Stable", "ScaledUp", "ScaleDownStabilizing"]
    assert spike[1].message.startswith("Scaled from 1 to 3: queue depth 40 over 1 ready replica (target 4 each) "
                                       "recommends 10; at most 2 replicas per step")
    assert "the highest now is 10" in spike[2].message
    blind = run(POLICY, [(16, 3)], 4)[0]
    assert (blind.ok, blind.reason, blind.queue_depth) == (False, "MetricsUnavailable", None)
    assert "3 of 4 ready replicas did not answer" in blind.message and "p0, p1, p2" in blind.message
    partial = run(POLICY, [(30, 1)], 4)[0]
    assert partial.ok and partial.queue_depth == 40  # 3 pods of 10 each, the silent one counted at 10


def test_no_ready_replicas_is_no_decision_but_bounds_hold() -> None:
    decider = Decider(replace(POLICY, max_replicas=3))
    decision = decider.decide(0.0, 5, Observation({}))
    assert (decision.replicas, decision.ok, decision.reason) == (3, False, "NoReadyReplicas")
    assert "Moved from 5 to 3 to stay within [1, 3]" in decision.message
    assert decider.decide(5.0, 0, Observation({})).replicas == 1  # zero replicas: an empty queue, raise to min


def test_scale_up_window_waits_for_the_lowest_to_rise() -> None:
    policy = replace(POLICY, scale_up_window=10)
    assert [d.replicas for d in run(policy, [4, 40, 40, 40, 40], 1)] == [1, 1, 1, 3, 5]
    assert run(policy, [4, 40], 1)[1].reason == "ScaleUpStabilizing"


def test_a_restart_waits_a_full_window_before_scaling_down() -> None:
    decisions = run(POLICY, [0] * 8, 4)  # seeded with the 4 replicas found running
    assert [d.replicas for d in decisions] == [4] * 7 + [3]


def random_trace(rng: random.Random, length: int) -> list[float | tuple[float, int]]:
    trace: list[float | tuple[float, int]] = []
    level = rng.uniform(0, 30)
    for _ in range(length):
        kind = rng.random()
        if kind < 0.1:
            level = rng.uniform(0, 80)  # spike or drop
        elif kind < 0.6:
            level = max(0.0, level + rng.uniform(-6, 6))
        trace.append((level, 1) if rng.random() < 0.05 else level)
    return trace


POLICIES = [
    POLICY,
    replace(POLICY, min_replicas=2, max_replicas=6, scale_down_window=60, max_scale_down_step=3),
    replace(POLICY, min_replicas=0, max_scale_up_step=5, scale_up_window=5, tolerance=0),
    Policy.from_spec(AutoscalingSpec(enabled=True, max_replicas=8)),  # the CRD's defaults
]


@pytest.mark.parametrize("policy", POLICIES, ids=["test", "wide-window", "eager", "defaults"])
def test_properties_over_random_traces(policy: Policy) -> None:
    rng = random.Random(20261130)
    for _ in range(200):
        start = rng.randint(policy.min_replicas, policy.max_replicas)
        decisions = run(policy, random_trace(rng, 60), start)
        counts = [start] + [d.replicas for d in decisions]
        assert all(policy.min_replicas <= c <= policy.max_replicas for c in counts[1:])
        last_up = None
        for i, d in enumerate(decisions):
            t = i * INTERVAL
            step = d.replicas - d.current
            assert -policy.max_scale_down_step <= step <= policy.max_scale_up_step
            if step > 0:
                last_up = t
            if step < 0 and last_up is not None:
                # Never back down inside the scale-down window of a scale-up: no oscillation.
                assert t - last_up > policy.scale_down_window, (counts, i)


@pytest.mark.parametrize("policy", POLICIES, ids=["test", "wide-window", "eager", "defaults"])
def test_a_sustained_spike_is_answered_within_two_polls(policy: Policy) -> None:
    for start in range(max(policy.min_replicas, 1), policy.max_replicas):
        spike = policy.target_queue_depth * start * 3
        decisions = run(policy, [policy.target_queue_depth * start] * 3 + [spike] * 2, start)
        assert max(d.replicas for d in decisions[3:]) > start, start


def test_policy_from_the_spec() -> None:
    spec = AutoscalingSpec(enabled=True, min_replicas=2, max_replicas=9, target_queue_depth=16,
                           scale_up_stabilization_seconds=15, poll_interval_seconds=2)
    policy = Policy.from_spec(spec)
    assert (policy.min_replicas, policy.max_replicas, policy.target_queue_depth) == (2, 9, 16)
    assert (policy.poll_interval, policy.scale_up_window, policy.scale_down_window) == (2, 15, 300)
    assert (policy.tolerance, policy.max_scale_up_step, policy.max_scale_down_step) == (0.1, 2, 1)
    with pytest.raises(ValueError, match="maxReplicas is required"):
        Policy.from_spec(AutoscalingSpec())
    with pytest.raises(ValueError, match="not a range"):
        Policy(min_replicas=3, max_replicas=2, target_queue_depth=1)
