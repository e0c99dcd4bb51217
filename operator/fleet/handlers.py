"""Kopf handlers (importing this module registers them): thin wrappers around Runtime."""

from __future__ import annotations

import os
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from fleet import names
from fleet.kube import WATCHED_KINDS, Stopped
from fleet.runtime import Runtime, warn_about_fleet
from fleet.settings import OperatorSettings

RETRY_DELAY_SECONDS = 10


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    """Keep Kopf's bookkeeping in our annotations and build the shared runtime."""
    # Structural schemas prune unknown status fields, so Kopf's progress lives in annotations.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=names.GROUP, key="last-handled-configuration"
    )
    settings.posting.reporting_component = names.MANAGER
    settings.watching.server_timeout = 300  # re-establish watches every few minutes
    # `deepseek-operator` hands its parsed settings over; otherwise (kopf run) the environment decides.
    operator_settings = getattr(memo, "settings", None) or OperatorSettings.load([], os.environ)
    # Kopf resolves namespace patterns by listing and watching namespaces (scanning); exact names
    # need none of it, nor the cluster-wide RBAC it takes.
    settings.scanning.disabled = not operator_settings.namespace_globs
    if getattr(memo, "runtime", None) is None:
        memo.runtime = Runtime.from_environment(operator_settings)
        if operator_settings.metrics_port:
            try:
                memo.runtime.metrics.serve(operator_settings.metrics_port)
            except OSError as exc:  # the fleets matter more than the operator's own metrics
                logger.error(f"Cannot serve metrics on port {operator_settings.metrics_port}: {exc}")
    memo.runtime.handler_executor = settings.execution.executor


@kopf.on.resume(names.GROUP, names.VERSION, names.PLURAL)
@kopf.on.create(names.GROUP, names.VERSION, names.PLURAL)
@kopf.on.update(names.GROUP, names.VERSION, names.PLURAL)
async def reconcile_fleet(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    """A fleet appeared, changed or was found at startup: bring everything in line.

    Async around a pass in a thread, not a sync handler: Kopf cancels its handlers when it stops,
    and only a coroutine hears that and can end the pass before its next API call."""
    try:
        outcome = await memo.runtime.reconcile_in_thread(namespace, name, wait=True,
                                                         executor=memo.runtime.handler_executor)
    except Stopped as exc:
        raise kopf.TemporaryError("The operator is stopping; its next start resumes.",
                                  delay=RETRY_DELAY_SECONDS) from exc
    except ApiException as exc:
        raise kopf.TemporaryError(f"API error {exc.status}: {exc.reason}", delay=RETRY_DELAY_SECONDS) from exc
    if outcome is not None and outcome.invalid is not None:
        # Reported in the status and an Event already; retrying cannot fix a spec.
        raise kopf.PermanentError(str(outcome.invalid))


@kopf.on.event(names.GROUP, names.VERSION, names.PLURAL, id="autoscaler")
async def track_autoscaling(event: kopf.RawEvent, body: kopf.Body, namespace: str, name: str, memo: kopf.Memo,
                            **_: Any) -> None:
    """Start a fleet's autoscaler when it asks for one, wake it on a spec change, stop it on deletion."""
    if event.get("type") == "DELETED":
        await memo.runtime.autoscalers.forget(namespace, name)
    else:
        memo.runtime.autoscalers.observe(body)


@kopf.on.event(names.GROUP, names.VERSION, names.PLURAL, id="resync")
async def track_fleets(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Keep the resync's list of fleets current, and start its loop with the first fleet.

    Started from a handler (like the autoscalers), its task inherits the context in which
    Kopf's event posting works; a startup handler's would not.
    """
    memo.runtime.resync.observe(body, deleted=event.get("type") == "DELETED")
    memo.runtime.metrics.fleets.set(len(memo.runtime.resync.fleets()))
    memo.runtime.resync.start()


@kopf.on.cleanup()
async def stop_autoscalers(memo: kopf.Memo, **_: Any) -> None:
    """The operator is stopping: no more API calls, end the resync and every autoscaler loop, and close
    their connections."""
    if getattr(memo, "runtime", None) is not None:
        memo.runtime.stopping.set()
        await memo.runtime.resync.stop()
        await memo.runtime.autoscalers.close()


def _owner(body: kopf.Body) -> dict[str, Any] | None:
    for ref in body.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("kind") == names.KIND and ref.get("apiVersion", "").startswith(f"{names.GROUP}/"):
            return ref
    return None


async def child_changed(body: kopf.Body, namespace: str, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    """A child changed or vanished: repair drift and refresh the parent's status."""
    owner = _owner(body)
    if owner is None:
        return
    try:
        await memo.runtime.reconcile_in_thread(namespace, owner["name"], wait=False,
                                               executor=memo.runtime.handler_executor)
    except Stopped:
        return  # the operator is stopping; the next one's resume and resync come back to it
    except ApiException as exc:
        # No retry loop here: the next event, or the parent's own handlers, will come back to it.
        message = (f"Reconciling after a change to {body.get('kind')} {body.metadata.name} failed: "
                   f"{exc.status} {exc.reason}; the periodic resync retries it.")
        logger.warning(message)
        warn_about_fleet(namespace, owner["name"], owner.get("uid"), message)


def _watch_children() -> None:
    # Kopf filters these labels client-side; only our children reach child_changed.
    for kind in WATCHED_KINDS:
        kopf.on.event(
            kind.group, kind.api_version.rpartition("/")[2], kind.plural,
            labels={"app.kubernetes.io/managed-by": names.MANAGER},
            id=f"child-{kind.plural}",
        )(child_changed)


_watch_children()
