"""A fleet's autoscaling settings, in the units the decision works in."""

from __future__ import annotations

from dataclasses import dataclass

from fleet.spec import AutoscalingSpec


@dataclass(frozen=True)
class Policy:
    """Bounds, target, tolerance, windows (seconds) and step sizes of one fleet's autoscaler."""

    min_replicas: int
    max_replicas: int
    target_queue_depth: float
    tolerance: float = 0.1
    poll_interval: float = 5.0
    scale_up_window: float = 0.0
    scale_down_window: float = 300.0
    max_scale_up_step: int = 2
    max_scale_down_step: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"replica bounds [{self.min_replicas}, {self.max_replicas}] are not a range")
        if self.target_queue_depth <= 0 or self.max_scale_up_step < 1 or self.max_scale_down_step < 1:
            raise ValueError("target and steps must be positive")

    @classmethod
    def from_spec(cls, spec: AutoscalingSpec) -> Policy:
        """The policy of an enabled, validated spec (maxReplicas is then required)."""
        if spec.max_replicas is None:
            raise ValueError("maxReplicas is required when autoscaling is enabled")
        return cls(
            min_replicas=spec.min_replicas,
            max_replicas=spec.max_replicas,
            target_queue_depth=spec.target_queue_depth,
            tolerance=spec.tolerance,
            poll_interval=float(spec.poll_interval_seconds),
            scale_up_window=float(spec.scale_up_stabilization_seconds),
            scale_down_window=float(spec.scale_down_stabilization_seconds),
            max_scale_up_step=spec.max_scale_up_step,
            max_scale_down_step=spec.max_scale_down_step,
        )

    def bounded(self, replicas: int) -> int:
        """replicas moved into [min_replicas, max_replicas]."""
        return max(self.min_replicas, min(self.max_replicas, replicas))

    @property
    def longest_window(self) -> float:
        return max(self.scale_up_window, self.scale_down_window)
