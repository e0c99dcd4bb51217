"""Leader election over a coordination.k8s.io/v1 Lease, so that of several operator replicas one writes.

The candidate that holds the Lease runs the operator; the others wait to take it over once it is
not renewed for `lease_seconds`. A leader that cannot renew in time stops (its process exits and
restarts as a candidate): no two replicas ever act at once, as in controller-runtime. A leader that
stops cleanly (SIGTERM: a rolling update, a drained node) hands the Lease back once its handlers have
stopped, as client-go's ReleaseOnCancel does, so the next candidate takes over at its next try
instead of after the lease expires.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

LOGGER = logging.getLogger("fleet.leader")


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _stamp(moment: datetime.datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse(text: str | None) -> datetime.datetime | None:
    if not text:
        return None
    return datetime.datetime.strptime(text.replace("Z", "+0000"), "%Y-%m-%dT%H:%M:%S.%f%z")


class LeaderElector:
    """One candidate for the Lease `namespace/name`."""

    def __init__(self, api: client.CoordinationV1Api, namespace: str, name: str, identity: str, *,
                 lease_seconds: int = 15, retry_seconds: float = 2.0) -> None:
        self.api, self.namespace, self.name, self.identity = api, namespace, name, identity
        self.lease_seconds, self.retry_seconds = lease_seconds, retry_seconds

    def try_acquire(self) -> bool:
        """Take or renew the Lease once; True while this candidate holds it."""
        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace, _preload_content=False)
        except ApiException as exc:
            if exc.status != 404:
                raise
            return self._create()
        current: dict[str, Any] = json.loads(lease.data)
        spec = current.get("spec") or {}
        holder, renewed = spec.get("holderIdentity"), _parse(spec.get("renewTime"))
        expired = renewed is None or (_now() - renewed).total_seconds() > spec.get("leaseDurationSeconds", 0)
        if holder not in (None, self.identity) and not expired:
            return False
        body = {"metadata": {"resourceVersion": current["metadata"].get("resourceVersion")},
                "spec": self._spec(transitions=spec.get("leaseTransitions", 0) + (holder != self.identity),
                                   acquired=spec.get("acquireTime") if holder == self.identity else None)}
        try:
            self.api.patch_namespaced_lease(self.name, self.namespace, body, _preload_content=False,
                                            _content_type="application/merge-patch+json")
        except ApiException as exc:
            if exc.status == 409:  # another candidate got there first
                return False
            raise
        return True

    def _spec(self, *, transitions: int, acquired: str | None) -> dict[str, Any]:
        now = _stamp(_now())
        return {"holderIdentity": self.identity, "leaseDurationSeconds": self.lease_seconds,
                "acquireTime": acquired or now, "renewTime": now, "leaseTransitions": transitions}

    def _create(self) -> bool:
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": self._spec(transitions=0, acquired=None)}
        try:
            self.api.create_namespaced_lease(self.namespace, body, _preload_content=False)
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True

    def release(self) -> bool:
        """Hand the Lease back (no holder, expired at once) if this candidate still holds it; call only
        once nothing of this replica acts any more. True if it was handed back."""
        try:
            lease = json.loads(self.api.read_namespaced_lease(self.name, self.namespace, _preload_content=False).data)
            if (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return False
            body = {"metadata": {"resourceVersion": lease["metadata"].get("resourceVersion")},
                    "spec": {"holderIdentity": None, "leaseDurationSeconds": 1, "renewTime": _stamp(_now())}}
            self.api.patch_namespaced_lease(self.name, self.namespace, body, _preload_content=False,
                                            _content_type="application/merge-patch+json")
        except ApiException as exc:  # the Lease then expires as it would have
            LOGGER.warning(f"Releasing Lease {self.namespace}/{self.name}: {exc.status} {exc.reason}")
            return False
        LOGGER.info(f"{self.identity} released Lease {self.namespace}/{self.name}")
        return True

    def wait_until_leader(self, stop: threading.Event) -> bool:
        """Block until this candidate holds the Lease (True) or stop is set (False)."""
        while not stop.is_set():
            try:
                if self.try_acquire():
                    LOGGER.info(f"{self.identity} leads (Lease {self.namespace}/{self.name})")
                    return True
            except ApiException as exc:
                LOGGER.warning(f"Lease {self.namespace}/{self.name}: {exc.status} {exc.reason}")
            stop.wait(self.retry_seconds)
        return False

    def keep_leading(self, stop: threading.Event, on_lost: Callable[[], None]) -> None:
        """Renew every third of the lease; call on_lost (and return) once a renewal cannot be made in time."""
        last = time.monotonic()
        while not stop.wait(self.lease_seconds / 3):
            try:
                if self.try_acquire():
                    last = time.monotonic()
                    continue
            except ApiException as exc:
                LOGGER.warning(f"Renewing Lease {self.namespace}/{self.name}: {exc.status} {exc.reason}")
            if time.monotonic() - last > self.lease_seconds * 2 / 3:
                LOGGER.error(f"{self.identity} lost Lease {self.namespace}/{self.name}; stopping")
                on_lost()
                return
