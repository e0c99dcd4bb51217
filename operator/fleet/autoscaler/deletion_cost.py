"""Which engine pods a scale-down removes: the idlest, marked with the ReplicaSet's pod-deletion-cost."""

from __future__ import annotations

from collections.abc import Mapping

from fleet.autoscaler.decision import PodLoad
from fleet.autoscaler.pods import EnginePod


def deletion_costs(pods: list[EnginePod], loads: Mapping[str, PodLoad | None], replicas: int) -> dict[str, str | None]:
    """Annotation changes to make before scaling the active pods down to `replicas`: pod -> cost (None clears it).

    The ReplicaSet controller removes pods that are not ready first, then those with the lowest
    deletion cost. So only as many ready pods as remain to be removed are marked: the idlest
    (fewest running requests, then least KV cache in use) get -k .. -1, the idlest lowest. A mark
    left by an earlier scale-down on a pod not chosen now is cleared, and a pod whose load is
    unknown is never chosen (it may be the busiest). Only changes are returned.
    """
    not_ready = sum(1 for pod in pods if not pod.ready)
    count = max(0, len(pods) - replicas - not_ready)
    candidates = sorted(
        (pod for pod in pods if pod.ready and loads.get(pod.name) is not None),
        key=lambda pod: _idleness(pod, loads[pod.name]),
    )
    victims = candidates[:count]
    wanted = {pod.name: str(rank - len(victims)) for rank, pod in enumerate(victims)}
    return {pod.name: wanted.get(pod.name) for pod in pods if pod.deletion_cost != wanted.get(pod.name)}


def _idleness(pod: EnginePod, load: PodLoad | None) -> tuple[float, float, float, str]:
    assert load is not None
    kv = 1.0 if load.kv_cache_usage is None else load.kv_cache_usage  # unknown cache: assume it is full
    return (load.running, kv, load.waiting, pod.name)
