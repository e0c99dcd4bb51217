"""Scale-down picks its pods: the idlest ready ones get the lowest pod-deletion-cost."""

from __future__ import annotations

from fleet.autoscaler.decision import PodLoad
from fleet.autoscaler.deletion_cost import deletion_costs
from fleet.autoscaler.pods import EnginePod


def pod(name: str, *, ready: bool = True, cost: str | None = None) -> EnginePod:
    return EnginePod(name=name, ready=ready, ip="10.0.0.1" if ready else None, port=8000, deletion_cost=cost)


LOADS = {
    "busy": PodLoad(waiting=0, running=9, kv_cache_usage=0.9),
    "idle-cold": PodLoad(waiting=0, running=0, kv_cache_usage=0.1),
    "idle-warm": PodLoad(waiting=0, running=0, kv_cache_usage=0.7),
    "light": PodLoad(waiting=0, running=1, kv_cache_usage=0.0),
}


def test_fewest_running_then_least_cache_go_first() -> None:
    pods = [pod(name) for name in LOADS]
    assert deletion_costs(pods, LOADS, replicas=3) == {"idle-cold": "-1"}
    assert deletion_costs(pods, LOADS, replicas=1) == {"idle-cold": "-3", "idle-warm": "-2", "light": "-1"}


def test_not_ready_pods_go_first_anyway_so_fewer_are_marked() -> None:
    pods = [pod(name) for name in LOADS] + [pod("loading", ready=False)]
    # Five pods down to three: the ReplicaSet takes the unready one first, one idle pod follows.
    assert deletion_costs(pods, LOADS, replicas=3) == {"idle-cold": "-1"}
    assert deletion_costs(pods, LOADS, replicas=4) == {}


def test_a_silent_pod_is_never_chosen() -> None:
    loads = {**LOADS, "idle-cold": None}
    pods = [pod(name) for name in LOADS]
    assert deletion_costs(pods, loads, replicas=3) == {"idle-warm": "-1"}


def test_old_marks_are_cleared_and_unchanged_ones_not_rewritten() -> None:
    pods = [pod("busy", cost="-1"), pod("idle-cold", cost="-1"), pod("idle-warm"), pod("light")]
    assert deletion_costs(pods, LOADS, replicas=3) == {"busy": None}
    assert deletion_costs(pods, LOADS, replicas=4) == {"busy": None, "idle-cold": None}
