"""The replica count a fleet should have, from its queue depth: HPA's algorithm, shaped for queues.

    queue depth  = sum over ready replicas of (waiting + running)
    raw          = current                  if |queue depth / (target * current) - 1| <= tolerance
                   ceil(queue depth / target)  otherwise
    recommended  = raw within [min, max], remembered with its time
    up           = lowest recommendation of the last scaleUpStabilizationSeconds
    down         = highest recommendation of the last scaleDownStabilizationSeconds
    desired      = up, at most current + maxScaleUpStep          if up > current
                   down, at least current - maxScaleDownStep     if down < current
                   current                                       otherwise
                   then within [min, max] (the bounds win over the steps)

A replica that does not answer is unknown, never idle: it is assumed to carry the average of
those that answered, and while any is silent the recommendation never goes below the current
count (no scale-down on partial sight). When most ready replicas are silent there is no
decision at all, only the bounds are enforced.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from fleet.autoscaler.policy import Policy


@dataclass(frozen=True)
class PodLoad:
    """What one engine reported on /metrics."""

    waiting: float
    running: float
    kv_cache_usage: float | None = None

    @property
    def queue_depth(self) -> float:
        return self.waiting + self.running


@dataclass(frozen=True)
class Observation:
    """One poll: every ready engine pod, with its load or None when it did not answer."""

    loads: Mapping[str, PodLoad | None]

    @property
    def num_ready(self) -> int:
        return len(self.loads)

    @property
    def silent(self) -> list[str]:
        return sorted(name for name, load in self.loads.items() if load is None)

    @property
    def num_answered(self) -> int:
        return self.num_ready - len(self.silent)

    def queue_depth(self) -> float | None:
        """Summed queue depth, silent pods counted at the average of the others; None if none answered."""
        answered = [load.queue_depth for load in self.loads.values() if load is not None]
        if not answered:
            return 0.0 if not self.loads else None
        return sum(answered) * self.num_ready / len(answered)


@dataclass(frozen=True)
class Decision:
    """What one poll concluded: the replica count to set, and why (ScalingReady's reason and message)."""

    current: int
    replicas: int
    queue_depth: float | None
    ok: bool
    reason: str
    message: str

    @property
    def scaled(self) -> bool:
        return self.replicas != self.current

    @property
    def event_reason(self) -> str:
        return "ScaledUp" if self.replicas > self.current else "ScaledDown"


class Decider:
    """Decisions for one fleet; remembers its recommendations as long as the longest window."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._history: deque[tuple[float, int]] = deque()  # (time, recommended replicas), oldest first

    def remember(self, now: float, replicas: int) -> None:
        """Record a recommendation; seeding with the current count makes a restart wait a full window."""
        self._history.append((now, self.policy.bounded(replicas)))
        horizon = now - self.policy.longest_window
        while self._history and self._history[0][0] < horizon:
            self._history.popleft()

    def decide(self, now: float, current: int, observation: Observation) -> Decision:
        """The decision for this poll (now: monotonic seconds; current: the workload's replica count)."""
        p = self.policy
        ready, answered = observation.num_ready, observation.num_answered
        if ready == 0 and current > 0:
            return self._blind(current, "NoReadyReplicas",
                               f"None of the {current} replicas is ready yet, so there is no queue to read.")
        if answered * 2 < ready:
            return self._blind(current, "MetricsUnavailable", (
                f"{ready - answered} of {ready} ready replicas did not answer on /metrics "
                f"({', '.join(observation.silent)}); no scaling decision until most of them do."))
        queue = observation.queue_depth()
        assert queue is not None  # most pods answered
        recommended = p.bounded(self._raw(queue, current))
        if observation.silent:
            recommended = p.bounded(max(recommended, current))
        self.remember(now, recommended)
        up = min(r for t, r in self._history if t >= now - p.scale_up_window)
        down = max(r for t, r in self._history if t >= now - p.scale_down_window)
        if up > current:
            desired = min(up, current + p.max_scale_up_step)
        elif down < current:
            desired = max(down, current - p.max_scale_down_step)
        else:
            desired = current
        desired = p.bounded(desired)

        basis = (f"queue depth {queue:g} over {ready} ready replica{'s' * (ready != 1)} "
                 f"(target {p.target_queue_depth:g} each) recommends {recommended}")
        if observation.silent:
            basis += (f"; {', '.join(observation.silent)} did not answer and count at the average, "
                      "and no scale-down is made until every ready replica answers")
        if desired != current:
            reason = "ScaledUp" if desired > current else "ScaledDown"
            wanted = up if desired > current else down
            step = p.max_scale_up_step if desired > current else p.max_scale_down_step
            if wanted != desired and abs(desired - current) == step:
                basis += f"; at most {step} replica{'s' * (step != 1)} per step"
            return Decision(current, desired, queue, True, reason, f"Scaled from {current} to {desired}: {basis}.")
        if recommended > current:
            message = f"{basis}; scaling up once that has held for {p.scale_up_window:g}s."
            return Decision(current, current, queue, True, "ScaleUpStabilizing", message)
        if recommended < current:
            message = (f"{basis}; scaling down once no higher recommendation was seen for "
                       f"{p.scale_down_window:g}s (the highest now is {down}).")
            return Decision(current, current, queue, True, "ScaleDownStabilizing", message)
        return Decision(current, current, queue, True, "Stable", f"{basis}; {current} is right.")

    def _raw(self, queue: float, current: int) -> int:
        target, tolerance = self.policy.target_queue_depth, self.policy.tolerance
        if current > 0 and abs(queue / (target * current) - 1) <= tolerance:
            return current
        return math.ceil(round(queue / target, 9))  # round: 12.000000001 must not become 13

    def _blind(self, current: int, reason: str, message: str) -> Decision:
        # Without a queue to read, only the bounds are enforced (a user may have just moved them).
        bounded = self.policy.bounded(current)
        if bounded != current:
            message += f" Moved from {current} to {bounded} to stay within [{self.policy.min_replicas}, {self.policy.max_replicas}]."
        return Decision(current, bounded, None, False, reason, message)
