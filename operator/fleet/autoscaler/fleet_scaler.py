"""One fleet's autoscaler: every poll interval, read the engines' queues, decide, scale and report."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from kubernetes.client.exceptions import ApiException

from fleet import names
from fleet.autoscaler.decision import Decider, Decision, Observation, PodLoad
from fleet.autoscaler.deletion_cost import deletion_costs
from fleet.autoscaler.metrics_client import MetricsClient
from fleet.autoscaler.pods import DELETION_COST, EnginePod, active
from fleet.autoscaler.policy import Policy
from fleet.autoscaler.report import disabled_patch, scaling_condition, status_patch
from fleet.kube import Kube, Stopped
from fleet.manifests.multinode import engine_workload
from fleet.reconcile import EventSink, utc_now
from fleet.validation import InvalidSpec, validate

SCRAPE_TIMEOUT_SECONDS = 2.0  # at most; never more than most of a poll interval
CONFLICT_RETRIES = 3
FALLBACK_INTERVAL_SECONDS = 5.0  # after a failed poll, before the fleet's own interval is known


class FleetScaler:
    """Polls one fleet until its autoscaling is turned off, its spec turns invalid or it is deleted.

    The Kubernetes client blocks, so its calls run in threads; the metrics are read in the event
    loop, all pods at once. Spec changes wake the loop early (`wake`), status changes do not.
    """

    def __init__(self, namespace: str, name: str, *, kube: Kube, metrics: MetricsClient, post_event: EventSink,
                 logger: logging.Logger, clock: Callable[[], float] = time.monotonic,
                 now: Callable[[], str] = utc_now, on_decision: Callable[[Decision], None] | None = None) -> None:
        self.namespace, self.name = namespace, name
        self.kube, self.metrics, self.post_event, self.logger = kube, metrics, post_event, logger
        self.clock, self.now, self.on_decision = clock, now, on_decision
        self.decider: Decider | None = None
        self._interval = FALLBACK_INTERVAL_SECONDS
        self._workload = ("apps/v1", "Deployment")  # or a LeaderWorkerSet, once the spec is read
        self._wake = asyncio.Event()

    def wake(self) -> None:
        """Poll now rather than at the next tick (the spec changed)."""
        self._wake.set()

    async def run(self) -> None:
        """Poll at the fleet's interval until the fleet needs no autoscaler."""
        while True:
            started = self.clock()
            try:
                interval = await self.poll()
            except Stopped:
                return  # the operator is stopping
            except ApiException as exc:
                self.logger.warning(f"Autoscaler poll of {self.namespace}/{self.name} failed: {exc.status} {exc.reason}")
                interval = self._interval
            except Exception:  # the loop must outlive any one bad poll
                self.logger.exception(f"Autoscaler poll of {self.namespace}/{self.name} failed")
                interval = self._interval
            if interval is None:
                if not self._wake.is_set():
                    return
                self._wake.clear()  # the spec changed while this poll decided to stop: look again
                continue
            self._interval = interval
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=max(0.0, started + interval - self.clock()))
            self._wake.clear()

    async def poll(self) -> float | None:
        """One poll; the seconds until the next one, or None when this fleet needs no autoscaler."""
        body = await asyncio.to_thread(self.kube.get_parent, self.namespace, self.name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return None
        try:
            parent = validate(body)
        except InvalidSpec:
            return None  # the reconcile reports it; a valid spec starts a new autoscaler
        scaling = parent.spec.autoscaling
        if not scaling.enabled:
            await asyncio.to_thread(self._report_disabled, body)
            return None
        policy = Policy.from_spec(scaling)
        self._workload = engine_workload(parent)
        engine, pods = await asyncio.to_thread(self._read_engine)
        if engine is None:
            return policy.poll_interval  # the reconcile creates it
        current = engine.get("spec", {}).get("replicas", 1)
        if self.decider is None:
            self.decider = Decider(policy)
            self.decider.remember(self.clock(), current)
        self.decider.policy = policy
        ready = [pod for pod in pods if pod.ready]
        loads = await self.metrics.read(ready, timeout=min(SCRAPE_TIMEOUT_SECONDS, 0.8 * policy.poll_interval))
        decision = self.decider.decide(self.clock(), current, Observation(loads))
        if self.on_decision is not None:
            self.on_decision(decision)
        if decision.scaled:
            decision = await asyncio.to_thread(self._scale, body, pods, loads, decision)
        await asyncio.to_thread(self._report, body, decision)
        return policy.poll_interval

    def _read_engine(self) -> tuple[dict[str, Any] | None, list[EnginePod]]:
        engine = self.kube.get(*self._workload, self.namespace, names.engine_name(self.name))
        if engine is None:
            return None, []
        selector = names.selector_string(names.engine_selector(self.name))
        return engine, active(self.kube.list_pods(self.namespace, selector))

    def _scale(self, body: dict[str, Any], pods: list[EnginePod], loads: dict[str, PodLoad | None],
               decision: Decision) -> Decision:
        if decision.replicas < decision.current:
            self._mark_idlest(pods, loads, decision.replicas)
        try:
            self.kube.patch(*self._workload, self.namespace, names.engine_name(self.name),
                            {"spec": {"replicas": decision.replicas}})
        except ApiException as exc:
            message = (f"Could not set the engine Deployment to {decision.replicas} replicas: "
                       f"{exc.status} {_reason(exc)}; retrying at the next poll.")
            return Decision(decision.current, decision.current, decision.queue_depth, False, "ScaleFailed", message)
        self.post_event(body, "Normal", decision.event_reason, decision.message)
        return decision

    def _mark_idlest(self, pods: list[EnginePod], loads: dict[str, PodLoad | None], replicas: int) -> None:
        for pod, cost in deletion_costs(pods, loads, replicas).items():
            try:
                self.kube.patch_pod(self.namespace, pod, {"metadata": {"annotations": {DELETION_COST: cost}}})
            except ApiException as exc:
                # Not worth holding the scale-down for: the engine's drain still finishes every
                # request of whichever pod the ReplicaSet picks; only the choice is worse.
                self.logger.warning(f"Could not mark pod {pod} with a deletion cost: {exc.status} {exc.reason}")

    def _report(self, body: dict[str, Any], decision: Decision) -> None:
        self._write_status(body, lambda status, generation: status_patch(
            status, decision, now=self.now(), generation=generation))

    def _report_disabled(self, body: dict[str, Any]) -> None:
        self._write_status(body, lambda status, generation: disabled_patch(
            status, now=self.now(), generation=generation))

    def _write_status(self, body: dict[str, Any], patch_for: Callable[[dict[str, Any], int], dict[str, Any] | None]) -> None:
        """Merge-patch the status, guarded by resourceVersion; on a conflict, recompute from a fresh read."""
        for attempt in range(CONFLICT_RETRIES):
            status = body.get("status") or {}
            meta = body["metadata"]
            patch = patch_for(status, meta.get("generation", 0))
            if patch is None:
                return
            try:
                self.kube.patch_parent_status(self.namespace, self.name, {
                    "metadata": {"resourceVersion": meta.get("resourceVersion")}, "status": patch})
            except ApiException as exc:
                if exc.status != 409 or attempt == CONFLICT_RETRIES - 1:
                    raise
                fresh = self.kube.get_parent(self.namespace, self.name)
                if fresh is None:
                    return
                body = fresh
                continue
            self._warn_on_failure(body, scaling_condition(status), scaling_condition({"conditions": patch["conditions"]}))
            return

    def _warn_on_failure(self, body: dict[str, Any], old: dict[str, Any], new: dict[str, Any]) -> None:
        # One Warning per new failure reason, not one per poll.
        if new.get("status") == "False" and new.get("reason") != "AutoscalingDisabled" and (
            old.get("status") != "False" or old.get("reason") != new.get("reason")
        ):
            self.post_event(body, "Warning", new["reason"], new["message"])


def _reason(exc: ApiException) -> str:
    try:
        return json.loads(exc.body).get("message") or str(exc.reason)
    except (TypeError, ValueError):
        return str(exc.reason)
