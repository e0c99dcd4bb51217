"""What the handlers share for the operator's lifetime (kept on Kopf's memo, not in globals)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import kopf
from kubernetes import client, config

from fleet import names
from fleet.autoscaler.registry import Autoscalers
from fleet.kube import Kube
from fleet.metrics import OperatorMetrics
from fleet.reconcile import Outcome, Reconciler
from fleet.resync import Resync
from fleet.settings import OperatorSettings
from fleet.turns import Turns


def post_kopf_event(body: dict[str, Any], type_: str, reason: str, message: str) -> None:
    """A Kubernetes Event about the parent, through Kopf's posting queue (safe from threads)."""
    kopf.event(body, type=type_, reason=reason, message=message[:1024])


def warn_about_fleet(namespace: str, name: str, uid: str | None, message: str) -> None:
    """A Warning Event about a fleet known only by its identity (a pass that failed outside Kopf's retries)."""
    fleet = {"apiVersion": names.API_VERSION, "kind": names.KIND,
             "metadata": {"name": name, "namespace": namespace, "uid": uid}}
    kopf.warn(fleet, reason="ReconcileFailed", message=message[:1024])


@dataclass
class Runtime:
    """The reconciler, the per-fleet turns, the autoscalers and the periodic resync."""

    reconciler: Reconciler
    autoscalers: Autoscalers
    turns: Turns = field(default_factory=Turns)
    resync_seconds: float = 0.0
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    resync: Resync = field(init=False)

    def __post_init__(self) -> None:
        self.resync = Resync(lambda ns, name: self.reconcile(ns, name, wait=False), warn_about_fleet,
                             interval=self.resync_seconds)
        self.autoscalers.on_decision = self.metrics.observe_decision

    @classmethod
    def from_environment(cls, settings: OperatorSettings) -> Runtime:
        """Credentials in the order Kopf's login uses: in-cluster, then $KUBECONFIG or ~/.kube/config."""
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
        kube = Kube(client.ApiClient())
        reconciler = Reconciler(kube, post_kopf_event, options=settings.build_options())
        return cls(reconciler, Autoscalers(kube, post_kopf_event), resync_seconds=settings.resync_seconds)

    def reconcile(self, namespace: str, name: str, *, wait: bool) -> Outcome | None:
        """Reconcile one fleet in its turn; wait=False folds into a pass already running."""
        key = (namespace, name)
        started = time.monotonic()
        try:
            outcome = self.turns.run(key, lambda: self.reconciler.reconcile(namespace, name), wait=wait)
        except Exception:
            self.metrics.observe_pass(None, time.monotonic() - started, failed=True)
            raise
        self.metrics.observe_pass(outcome, time.monotonic() - started)
        if outcome is not None and outcome.gone:
            self.turns.forget(key)
        return outcome
