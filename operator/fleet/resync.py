"""The periodic level-based pass: every fleet the operator has seen is reconciled again each interval.

Kopf reacts to events; an event whose pass failed (a child event's pass has no retry loop) or an
input that sends no event (a Secret's new value: Secrets are read by name, never watched) would
otherwise wait for the next unrelated change. A plain asyncio task, not a Kopf timer: a timer
would put a finalizer on every fleet, and fleets stay finalizer-free.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from kubernetes.client.exceptions import ApiException

from fleet import names
from fleet.kube import Stopped

LOGGER = logging.getLogger("fleet.resync")
Key = tuple[str, str]
# (namespace, name, uid, message): a Warning Event about a pass that failed
FailureSink = Callable[[str, str, str | None, str], None]


class Resync:
    """Knows the fleets from Kopf's events and reconciles each of them every `interval` seconds."""

    def __init__(self, reconcile: Callable[[str, str], Awaitable[Any]], report_failure: FailureSink, *,
                 interval: float) -> None:
        self.reconcile, self.report_failure, self.interval = reconcile, report_failure, interval
        self._fleets: dict[Key, str | None] = {}  # key -> uid
        self._task: asyncio.Task[None] | None = None

    def observe(self, body: Mapping[str, Any], *, deleted: bool) -> None:
        """A fleet event: remember the fleet, or forget it once it is deleted."""
        meta = body.get("metadata", {})
        key = (meta["namespace"], meta["name"])
        if deleted:
            self._fleets.pop(key, None)
        else:
            self._fleets[key] = meta.get("uid")

    def fleets(self) -> list[Key]:
        return sorted(self._fleets)

    def start(self) -> None:
        """Start the loop in the running event loop (interval 0 turns it off)."""
        if self.interval > 0 and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="resync")

    async def stop(self) -> None:
        """End the loop; a pass in progress ends before its next API call and is waited for."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while await self.run_once(delay=self.interval):
            pass

    async def run_once(self, *, delay: float = 0.0) -> bool:
        """One pass over every known fleet, one at a time (they share the API server with the events).

        False once the operator is stopping (Stopped, or its thread pool no longer takes work)."""
        await asyncio.sleep(delay)
        for key in self.fleets():
            try:
                await self.reconcile(*key)
            except Stopped:
                return False
            except RuntimeError as exc:
                if "shutdown" in str(exc):
                    return False
                LOGGER.exception(f"Resync of {key[0]}/{key[1]} failed")
                self._failed(key, type(exc).__name__)
            except ApiException as exc:
                self._failed(key, f"{exc.status} {exc.reason}")
            except Exception as exc:  # the loop must outlive any one bad pass
                LOGGER.exception(f"Resync of {key[0]}/{key[1]} failed")
                self._failed(key, type(exc).__name__)
        return True

    def _failed(self, key: Key, why: str) -> None:
        message = f"The periodic resync of {names.KIND} {key[1]} failed: {why}; it is retried in {self.interval:g}s."
        LOGGER.warning(message)
        self.report_failure(key[0], key[1], self._fleets.get(key), message)
