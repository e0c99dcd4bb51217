"""One level-based pass: read the parent and its children, write only what differs, report status."""

from __future__ import annotations

import copy
import datetime
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from fleet import drift, names
from fleet.kube import PRUNED_KINDS, CRDMissing, Kube
from fleet.manifests import build_children, kv_transfer
from fleet.manifests.kv_directory import new_password, read_password
from fleet.manifests.multinode import engine_workload
from fleet.options import BuildOptions
from fleet.parent import Parent
from fleet.readiness import Observed, status_fields
from fleet.status import condition, merge_conditions
from fleet.validation import InvalidSpec, validate

# (parent body, event type, reason, message)
EventSink = Callable[[dict[str, Any], str, str, str], None]
CONFLICT_RETRIES = 3
UNSERVED_RECHECK_SECONDS = 300.0
INSTALL_HINTS = {
    "LeaderWorkerSet": "multi-node replicas need the LeaderWorkerSet controller (docs/install.md)",
    "PodMonitor": "install the Prometheus Operator's CRDs, or turn off --pod-monitors",
    "InferencePool": "install the Gateway API Inference Extension's CRDs, or turn off --inference-pools",
}
URL_SAFE = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")


def utc_now() -> str:
    """RFC 3339 time, second precision, as Kubernetes writes it."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Outcome:
    """What a pass did: for events, for retries and for tests."""

    actions: list[str] = field(default_factory=list)
    invalid: InvalidSpec | None = None
    gone: bool = False
    status_written: bool = False


class Reconciler:
    """Makes a fleet's children match its spec and its status match its children."""

    def __init__(self, kube: Kube, post_event: EventSink, now: Callable[[], str] = utc_now,
                 options: BuildOptions = BuildOptions()) -> None:
        self.kube = kube
        self.post_event = post_event
        self.now = now
        self.options = options
        self.unserved: dict[str, float] = {}  # optional kind -> when its CRD was last found missing

    def reconcile(self, namespace: str, name: str, *, stop: Callable[[], bool] | None = None) -> Outcome:
        """One pass over the named DeepSeekDeployment, from a fresh read of it.

        A status write that loses a race with another writer (409) starts the pass over from a
        fresh read; children already fixed are then found unchanged. Once stop() is true the pass
        ends before its next API call (Stopped): what it wrote so far is level state, which the
        next pass, of this operator or of the next one, continues from.
        """
        kube = self.kube if stop is None else self.kube.until(stop)
        for attempt in range(CONFLICT_RETRIES):
            try:
                return self._reconcile_once(kube, namespace, name)
            except ApiException as exc:
                if exc.status != 409 or attempt == CONFLICT_RETRIES - 1:
                    raise
        raise AssertionError("unreachable")

    def _reconcile_once(self, kube: Kube, namespace: str, name: str) -> Outcome:
        body = kube.get_parent(namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return Outcome(gone=True)  # the garbage collector removes the children through ownerReferences
        try:
            parent = validate(body, self.options)
        except InvalidSpec as exc:
            return self._report_invalid(kube, body, exc)
        return _Pass(self, kube, body, parent).run()

    def _report_invalid(self, kube: Kube, body: dict[str, Any], exc: InvalidSpec) -> Outcome:
        message = f"Spec rejected, nothing was created or changed: {exc}"
        generation = body["metadata"].get("generation", 0)
        fresh = [
            condition("Ready", False, "InvalidSpec", message),
            condition("Progressing", False, "InvalidSpec", "Waiting for a valid spec."),
        ]
        old_ready = _find(body.get("status", {}).get("conditions", []), "Ready")
        if old_ready.get("reason") != "InvalidSpec" or old_ready.get("message") != message:
            self.post_event(body, "Warning", "InvalidSpec", str(exc))
        written = self._write_status(kube, body, {"observedGeneration": generation}, fresh, generation)
        return Outcome(invalid=exc, status_written=written)

    def _write_status(self, kube: Kube, body: dict[str, Any], counts: dict[str, Any], fresh: list[dict],
                      generation: int) -> bool:
        current = body.get("status") or {}
        conditions = merge_conditions(current.get("conditions", []), fresh, now=self.now(), generation=generation)
        wanted = {**counts, "conditions": conditions}
        if all(current.get(k) == v for k, v in wanted.items()):
            return False  # no churn: an unchanged fleet gets no write
        meta = body["metadata"]
        # resourceVersion makes the write fail (409) rather than overwrite another writer's conditions.
        patch = {"metadata": {"resourceVersion": meta.get("resourceVersion")}, "status": wanted}
        kube.patch_parent_status(meta["namespace"], meta["name"], patch)
        old_ready, new_ready = _find(current.get("conditions", []), "Ready"), _find(conditions, "Ready")
        if old_ready.get("status") != new_ready.get("status") and new_ready.get("reason") != "InvalidSpec":
            kind = "Normal" if new_ready["status"] == "True" else "Warning"
            self.post_event(body, kind, new_ready["reason"], new_ready["message"])
        return True


class _Pass:
    """State of one reconcile pass over one valid fleet."""

    def __init__(self, owner: Reconciler, kube: Kube, body: dict[str, Any], parent: Parent) -> None:
        self.kube = kube
        self.owner = owner
        self.body = body
        self.parent = parent
        self.outcome = Outcome()
        self.blocked: list[str] = []
        self.missing_crds: list[str] = []
        self.live: dict[tuple[str, str], dict[str, Any] | None] = {}

    def _get(self, api_version: str, kind: str, name: str) -> dict[str, Any] | None:
        key = (kind, name)
        if key not in self.live:
            self.live[key] = self.kube.get(api_version, kind, self.parent.namespace, name)
        return self.live[key]

    def run(self) -> Outcome:
        parent = self.parent
        workload = engine_workload(parent)
        engine = self._get(*workload, names.engine_name(parent.name))
        password, kv_problem = self._kv_password()
        transfer_secret, transfer_problem = self._transfer_secret()
        children = build_children(parent, kv_password=password, transfer_secret=transfer_secret,
                                  replicas=self._replicas(engine), secrets_hash=self._secrets_hash(transfer_secret))
        applied = {(c["kind"], c["metadata"]["name"]): self._apply(c) for c in children}
        self._prune(set(applied))
        observed = Observed(
            engine=applied.get((workload[1], names.engine_name(parent.name))),
            redis=applied.get(("Deployment", names.kv_name(parent.name))),
            pods=self._pods() if parent.spec.network.rdma.enabled else [],
            kv_problem=kv_problem,
            transfer_problem=transfer_problem,
            blocked=self.blocked,
            missing_crds=self.missing_crds,
        )
        old_degraded = _find(self.body.get("status", {}).get("conditions", []), "Degraded")
        counts, fresh = status_fields(parent, observed)
        new_degraded = _find(fresh, "Degraded")
        if new_degraded["status"] == "True" and new_degraded["message"] != old_degraded.get("message"):
            self.owner.post_event(self.body, "Warning", new_degraded["reason"], new_degraded["message"])
        self.outcome.status_written = self.owner._write_status(self.kube, self.body, counts, fresh,
                                                               parent.generation)
        return self.outcome

    def _replicas(self, engine: dict[str, Any] | None) -> int | None:
        scaling = self.parent.spec.autoscaling
        if not scaling.enabled:
            return self.parent.spec.replicas
        if engine is not None:
            return None  # the autoscaler owns the count now
        # A (re)created Deployment starts where the autoscaler last wanted it, within bounds.
        wanted = (self.body.get("status") or {}).get("desiredReplicas", scaling.min_replicas)
        return max(scaling.min_replicas, min(wanted, scaling.max_replicas or wanted))

    def _kv_password(self) -> tuple[str | None, str | None]:
        directory = self.parent.spec.kv_cache.directory
        if directory.managed:
            secret = self._get("v1", "Secret", names.kv_secret_name(self.parent.name))
            existing = read_password(secret) if secret else None
            return existing or new_password(), None
        ref = directory.password_secret_ref
        if ref is None:
            return None, None
        secret = self._get("v1", "Secret", ref.name)
        if secret is None:
            return None, f"Secret {ref.name} with the Redis password does not exist; create it with key {ref.key}."
        password = read_password({"data": {"password": (secret.get("data") or {}).get(ref.key)}})
        if password is None:
            return None, f"Secret {ref.name} has no key {ref.key}; put the Redis password there."
        if not set(password) <= URL_SAFE:
            return None, (
                f"The password in Secret {ref.name} has characters that are not URL-safe; "
                "it is spliced into the redis:// URL, so use letters, digits and -._~ only."
            )
        return None, None

    def _transfer_secret(self) -> tuple[str | None, str | None]:
        """The fleet's generated KV transfer secret (None when the spec names its own), and what is
        wrong with the one the spec names. Generated once: a value in the Secret is kept for good,
        so neither a resync nor a restarted operator changes the secret of a running fleet."""
        ref = self.parent.spec.kv_cache.transfer_secret_ref
        if ref is None:
            secret = self._get("v1", "Secret", names.kv_transfer_secret_name(self.parent.name))
            return kv_transfer.read_secret(secret) or kv_transfer.new_secret(), None
        secret = self._get("v1", "Secret", ref.name)
        if secret is None:
            return None, (f"Secret {ref.name} with the fleet's KV transfer secret does not exist; create it "
                          f"with key {ref.key} (at least {kv_transfer.MIN_BYTES} random bytes).")
        if not (secret.get("data") or {}).get(ref.key):
            return None, f"Secret {ref.name} has no key {ref.key}; put the fleet's KV transfer secret there."
        if kv_transfer.read_secret(secret, ref.key) is None:
            return None, (f"The KV transfer secret in Secret {ref.name} is shorter than {kv_transfer.MIN_BYTES} "
                          "bytes, which the engines refuse; use 32 random bytes, say.")
        return None, None

    def _referenced_secrets(self) -> list[tuple[str, str]]:
        """(name, key) of every Secret key the spec names."""
        spec = self.parent.spec
        refs = [spec.engine.api_key_secret_ref, spec.kv_cache.directory.password_secret_ref,
                spec.model.token_secret_ref, spec.kv_cache.transfer_secret_ref]
        return sorted({(r.name, r.key) for r in refs if r is not None})

    def _secrets_hash(self, transfer_secret: str | None) -> str | None:
        """A digest of the Secret keys the engine pods read, None if they read none.

        Secrets are read by name on every pass (no list or watch on Secrets): a rotated API key,
        password or KV transfer secret changes the digest on the pod template at the next pass,
        which rolls the pods (the engines read their secrets at start).
        """
        values = {f"{name}/{key}": ((self._get("v1", "Secret", name) or {}).get("data") or {}).get(key)
                  for name, key in self._referenced_secrets()}
        if transfer_secret is not None:
            values[f"{names.kv_transfer_secret_name(self.parent.name)}/{kv_transfer.SECRET_KEY}"] = transfer_secret
        if not values:
            return None
        digest = hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()
        return digest[:16]

    def _pods(self) -> list[dict[str, Any]]:
        selector = names.selector_string(names.engine_selector(self.parent.name))
        return self.kube.list_pods(self.parent.namespace, selector)

    def _apply(self, manifest: dict[str, Any]) -> dict[str, Any] | None:
        api_version, kind, name = manifest["apiVersion"], manifest["kind"], manifest["metadata"]["name"]
        desired = drift.with_record(manifest)
        live = self._get(api_version, kind, name)
        try:
            if live is None:
                created = copy.deepcopy(desired)
                # Only the owner reference, not kopf.adopt(): adopt also copies the parent's labels,
                # which would leak GitOps tracking labels onto the children.
                kopf.append_owner_reference(created, owner=self.body)
                result = self.kube.create(created)
                self._did(f"Created {kind} {name}")
                return result
            controller = _controller(live)
            uid = self.body["metadata"].get("uid")
            if controller is not None and controller.get("uid") != uid:
                self.blocked.append(
                    f"{kind} {name} already exists and belongs to {controller.get('kind')} "
                    f"{controller.get('name')}; delete or rename it"
                )
                return live
            patch = drift.merge_patch(desired, live)
            if controller is None:
                adopted = copy.deepcopy(live)
                kopf.append_owner_reference(adopted, owner=self.body)
                patch = patch or {}
                patch.setdefault("metadata", {})["ownerReferences"] = adopted["metadata"]["ownerReferences"]
            if patch is None:
                return live
            result = self.kube.patch(api_version, kind, self.parent.namespace, name, patch)
            self._did(f"{'Adopted' if controller is None else 'Updated'} {kind} {name}")
            return result
        except CRDMissing as exc:
            self.missing_crds.append(f"{kind} {name} cannot be created: {exc}; {INSTALL_HINTS.get(kind, '')}")
            return live
        except ApiException as exc:
            if exc.status not in (400, 403, 422):
                raise  # transient: the caller retries
            self.blocked.append(f"{kind} {name} was rejected by the API server: {_reason(exc)}")
            return live

    def _prune(self, wanted: set[tuple[str, str]]) -> None:
        """Delete the children of this fleet that the spec no longer asks for (say, a managed Redis
        after a switch to an external one). Only objects that carry this fleet's labels and name
        its uid as controller go: an object of the same name owned by anyone else is never touched."""
        uid = self.body["metadata"].get("uid")
        labels = names.children_selector(self.parent.name)
        for kind in PRUNED_KINDS:
            if self.owner.unserved.get(kind.kind, -UNSERVED_RECHECK_SECONDS) > time.monotonic() - UNSERVED_RECHECK_SECONDS:
                continue  # its CRD was missing a moment ago: nothing of that kind to prune
            if "list" in kind.verbs:
                try:
                    candidates = self.kube.list(kind.api_version, kind.kind, self.parent.namespace,
                                                names.selector_string(labels))
                except CRDMissing:
                    self.owner.unserved[kind.kind] = time.monotonic()
                    continue
            else:
                # One the spec now names (say, a generated Secret taken over as transferSecretRef) stays.
                referenced = {name for name, _ in self._referenced_secrets()}
                found = (self._get(kind.api_version, kind.kind, n) for n in names.secret_names(self.parent.name)
                         if n not in referenced)
                candidates = [c for c in found if c is not None]
            for live in candidates:
                meta = live.get("metadata", {})
                if (kind.kind, meta.get("name")) in wanted or not uid:
                    continue
                owned = (_controller(live) or {}).get("uid") == uid
                if not owned or not labels.items() <= (meta.get("labels") or {}).items():
                    continue
                try:
                    deleted = self.kube.delete(kind.api_version, kind.kind, self.parent.namespace, meta["name"],
                                               uid=meta["uid"])
                except ApiException as exc:
                    if exc.status not in (403, 422):
                        raise
                    self.blocked.append(f"{kind.kind} {meta['name']} is no longer wanted but could not be deleted: "
                                        f"{_reason(exc)}")
                    continue
                if deleted:
                    self._did(f"Deleted {kind.kind} {meta['name']}, which the spec no longer asks for")

    def _did(self, action: str) -> None:
        self.outcome.actions.append(action)
        verb = action.split(" ", 1)[0]
        self.owner.post_event(self.body, "Normal", verb, action)


def _find(conditions: list[dict], type_: str) -> dict:
    return next((c for c in conditions if c.get("type") == type_), {})


def _controller(obj: dict[str, Any]) -> dict[str, Any] | None:
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return next((r for r in refs if r.get("controller")), None)


def _reason(exc: ApiException) -> str:
    try:
        return json.loads(exc.body).get("message") or str(exc.reason)
    except (TypeError, ValueError):
        return str(exc.reason)
