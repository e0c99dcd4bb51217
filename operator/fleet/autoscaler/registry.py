"""One autoscaler task per fleet that needs one, started, woken and stopped from Kopf's fleet events.

Why tasks and not Kopf timers or daemons: Kopf puts a finalizer on every resource that has a
timer or daemon, so that it can stop them before the resource goes. The operator deliberately
keeps fleets finalizer-free (deleting one never waits for the operator), so it runs plain
asyncio tasks in Kopf's event loop instead: an event handler (which needs no finalizer) starts
them, a spec change wakes them, a deletion cancels them, and a task also ends by itself once its
fleet no longer asks for autoscaling.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from fleet.autoscaler.decision import Decision
from fleet.autoscaler.fleet_scaler import FleetScaler
from fleet.autoscaler.metrics_client import MetricsClient
from fleet.autoscaler.report import holds_autoscaler_state
from fleet.kube import Kube
from fleet.reconcile import EventSink

LOGGER = logging.getLogger("fleet.autoscaler")
Key = tuple[str, str]


def needs_autoscaler(body: Mapping[str, Any]) -> bool:
    """Autoscaling is on, or the status still shows it (it was turned off while no one was looking)."""
    if body.get("metadata", {}).get("deletionTimestamp"):
        return False
    scaling = (body.get("spec") or {}).get("autoscaling")
    if isinstance(scaling, Mapping) and scaling.get("enabled") is True:
        return True
    return holds_autoscaler_state(body.get("status") or {})


class Autoscalers:
    """The running autoscalers, keyed by (namespace, name); use from the operator's event loop only."""

    def __init__(self, kube: Kube, post_event: EventSink, *, metrics: MetricsClient | None = None) -> None:
        self.kube, self.post_event = kube, post_event
        self.metrics = metrics or MetricsClient()
        self._scalers: dict[Key, tuple[FleetScaler, asyncio.Task[None]]] = {}
        self.on_decision: Callable[[Decision], None] | None = None  # metrics, if anyone counts
        self._generations: dict[Key, int | None] = {}

    def observe(self, body: Mapping[str, Any]) -> None:
        """A fleet was seen (listed, added, modified): start its autoscaler, or wake it on a new spec."""
        meta = body.get("metadata", {})
        key = (meta["namespace"], meta["name"])
        generation, seen = meta.get("generation"), self._generations.get(key)
        self._generations[key] = generation
        running = self._scalers.get(key)
        if running is not None and not running[1].done():
            if generation != seen:
                running[0].wake()
            return
        if needs_autoscaler(body):
            self._start(key)

    def running(self) -> list[Key]:
        """Fleets with an autoscaler task alive."""
        return sorted(key for key, (_, task) in self._scalers.items() if not task.done())

    async def forget(self, namespace: str, name: str) -> None:
        """The fleet is gone: stop its autoscaler."""
        key = (namespace, name)
        self._generations.pop(key, None)
        entry = self._scalers.pop(key, None)
        if entry is not None:
            await _cancel(entry[1])

    async def close(self) -> None:
        """Stop every autoscaler and the metrics connections (the operator is stopping)."""
        entries, self._scalers = list(self._scalers.values()), {}
        for _, task in entries:
            await _cancel(task)
        await self.metrics.close()

    def _start(self, key: Key) -> None:
        scaler = FleetScaler(*key, kube=self.kube, metrics=self.metrics, post_event=self.post_event, logger=LOGGER,
                             on_decision=self.on_decision)
        task = asyncio.get_running_loop().create_task(scaler.run(), name=f"autoscaler {key[0]}/{key[1]}")
        self._scalers[key] = (scaler, task)
        task.add_done_callback(lambda done: self._finished(key, done))

    def _finished(self, key: Key, task: asyncio.Task[None]) -> None:
        if self._scalers.get(key, (None, None))[1] is task:
            del self._scalers[key]
        if not task.cancelled() and task.exception() is not None:
            LOGGER.error(f"Autoscaler of {key[0]}/{key[1]} stopped", exc_info=task.exception())


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
