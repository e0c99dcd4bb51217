"""What the handlers share for the operator's lifetime (kept on Kopf's memo, not in globals)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import kopf
from kubernetes import client, config

from fleet import names
from fleet.autoscaler.registry import Autoscalers
from fleet.kube import Kube, Stopped
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
    """The reconciler, the per-fleet turns, the autoscalers and the periodic resync.

    `stopping` is set once the operator stops: from then on no pass starts and every API call
    (of a pass, of an autoscaler) raises Stopped before it is sent.
    """

    reconciler: Reconciler
    autoscalers: Autoscalers
    turns: Turns = field(default_factory=Turns)
    resync_seconds: float = 0.0
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    stopping: threading.Event = field(default_factory=threading.Event)
    # Kopf's pool for sync handlers, where the handlers' passes run (the resync's and the autoscalers'
    # work runs in the event loop's default pool, so neither crowds out the other).
    handler_executor: concurrent.futures.Executor | None = None
    resync: Resync = field(init=False)

    def __post_init__(self) -> None:
        self.resync = Resync(lambda ns, name: self.reconcile_in_thread(ns, name, wait=False), warn_about_fleet,
                             interval=self.resync_seconds)
        self.autoscalers.on_decision = self.metrics.observe_decision

    @classmethod
    def from_environment(cls, settings: OperatorSettings) -> Runtime:
        """Credentials in the order Kopf's login uses: in-cluster, then $KUBECONFIG or ~/.kube/config."""
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
        stopping = threading.Event()
        kube = Kube(client.ApiClient(), stop=stopping.is_set)
        reconciler = Reconciler(kube, post_kopf_event, options=settings.build_options())
        return cls(reconciler, Autoscalers(kube, post_kopf_event), resync_seconds=settings.resync_seconds,
                   stopping=stopping)

    def reconcile(self, namespace: str, name: str, *, wait: bool,
                  cancelled: threading.Event | None = None) -> Outcome | None:
        """Reconcile one fleet in its turn; wait=False folds into a pass already running.

        Blocking. Once the operator is stopping, or `cancelled` is set, no pass starts and a pass
        in progress ends before its next API call (Stopped)."""
        key = (namespace, name)

        def stop() -> bool:
            return self.stopping.is_set() or (cancelled is not None and cancelled.is_set())

        started = time.monotonic()
        try:
            outcome = self.turns.run(key, lambda: self.reconciler.reconcile(namespace, name, stop=stop),
                                     wait=wait, stop=stop)
        except Stopped:
            raise  # abandoned, not failed: not counted
        except Exception:
            self.metrics.observe_pass(None, time.monotonic() - started, failed=True)
            raise
        self.metrics.observe_pass(outcome, time.monotonic() - started)
        if outcome is not None and outcome.gone:
            self.turns.forget(key)
        return outcome

    async def reconcile_in_thread(self, namespace: str, name: str, *, wait: bool,
                                  executor: concurrent.futures.Executor | None = None) -> Outcome | None:
        """reconcile() in a thread of executor (None: the event loop's default pool), for the event loop.

        Cancelled (Kopf cancels its handlers when it stops; the resync is cancelled too), the pass
        is told to end before its next API call and is waited for: no pass outlives its caller.
        """
        cancelled = threading.Event()
        call = functools.partial(self.reconcile, namespace, name, wait=wait, cancelled=cancelled)
        # The context goes along, as Kopf's own sync handlers get it: kopf.event() posts through it.
        work = asyncio.get_running_loop().run_in_executor(executor, contextvars.copy_context().run, call)
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            cancelled.set()
            while not work.done():
                try:
                    await asyncio.wait([work])
                except asyncio.CancelledError:
                    pass  # cancelled again: still no orphan thread
            if not work.cancelled():
                work.exception()  # retrieved: Stopped, typically
            raise
