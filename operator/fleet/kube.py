"""The Kubernetes API as the reconcile needs it: plain-dict get/create/patch/list per kind."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from fleet import names

MERGE_PATCH = "application/merge-patch+json"
REQUEST_TIMEOUT_SECONDS = 30.0


@dataclass(frozen=True)
class Kind:
    """One child kind and the typed client methods that serve it."""

    api_version: str
    kind: str
    plural: str
    api: str  # class in kubernetes.client; CUSTOM for kinds a CRD adds
    method_suffix: str  # e.g. "deployment" in read_namespaced_deployment
    verbs: tuple[str, ...]  # what the operator does with it (RBAC is derived from this)

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    @property
    def version(self) -> str:
        return self.api_version.rpartition("/")[2]

    @property
    def custom(self) -> bool:
        return self.api == CUSTOM


CUSTOM = "CustomObjectsApi"
CUSTOM_VERBS = ("get", "list", "create", "patch", "delete")


# "delete" marks the kinds a spec change can make unwanted (the reconcile prunes them).
CHILD_KINDS = (
    Kind("apps/v1", "Deployment", "deployments", "AppsV1Api", "deployment",
         ("get", "list", "watch", "create", "patch", "delete")),
    Kind("v1", "Service", "services", "CoreV1Api", "service", ("get", "list", "watch", "create", "patch", "delete")),
    # Secrets are neither watched nor listed: that would read every Secret in the namespace. The
    # ones to prune are found by the names the operator gives them.
    Kind("v1", "Secret", "secrets", "CoreV1Api", "secret", ("get", "create", "patch", "delete")),
    Kind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies", "NetworkingV1Api", "network_policy",
         ("get", "list", "watch", "create", "patch", "delete")),
    Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets", "PolicyV1Api", "pod_disruption_budget",
         ("get", "list", "watch", "create", "patch")),
)
# Kinds that CRDs of other projects add: used only where a fleet or a setting asks for them, never
# watched (Kopf would wait for a CRD that may not be installed); the resync repairs their drift.
OPTIONAL_KINDS = (
    Kind("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "leaderworkersets", CUSTOM, "", CUSTOM_VERBS),
    Kind("monitoring.coreos.com/v1", "PodMonitor", "podmonitors", CUSTOM, "", CUSTOM_VERBS),
    Kind("inference.networking.k8s.io/v1", "InferencePool", "inferencepools", CUSTOM, "", CUSTOM_VERBS),
)
CHILD_KINDS = CHILD_KINDS + OPTIONAL_KINDS
KINDS = {(k.api_version, k.kind): k for k in CHILD_KINDS}
WATCHED_KINDS = tuple(k for k in CHILD_KINDS if "watch" in k.verbs)
PRUNED_KINDS = tuple(k for k in CHILD_KINDS if "delete" in k.verbs)
# Engine pods: listed by label selector (RDMA readiness, the autoscaler's polls; a watch would
# stream every pod of the cluster into the operator) and annotated with a deletion cost.
POD_VERBS = ("list", "patch")


class CRDMissing(Exception):
    """The API server does not serve this kind: the CRD that adds it is not installed."""

    def __init__(self, kind: Kind) -> None:
        super().__init__(f"the {kind.api_version} {kind.kind} API is not served (is its CRD installed?)")
        self.kind = kind


class Stopped(Exception):
    """The operator is stopping, or the pass was cancelled: no further API call is made."""


class Kube:
    """Blocking API access (passes and the autoscalers' reads run in worker threads).

    `stop` is asked before every call: once it is true each call raises Stopped instead, so a pass
    in a thread ends at its next call, not after all of them (the timeout bounds each one alone).
    """

    def __init__(self, api_client: client.ApiClient, *, timeout: float = REQUEST_TIMEOUT_SECONDS,
                 stop: Callable[[], bool] = lambda: False) -> None:
        # Raw JSON, and no call may hang a reconcile (or the operator's shutdown) for ever.
        self._raw: dict[str, Any] = {"_preload_content": False, "_request_timeout": timeout}
        self._client = api_client
        self._custom = client.CustomObjectsApi(api_client)
        self._core = client.CoreV1Api(api_client)
        self._stop = stop

    def until(self, stop: Callable[[], bool]) -> Kube:
        """The same client whose calls also stop once stop() is true (one pass's cancellation)."""
        view = copy.copy(self)
        view._stop = lambda: self._stop() or stop()
        return view

    def _check(self) -> None:
        if self._stop():
            raise Stopped("the operator is stopping, or this pass was cancelled")

    def _method(self, api_version: str, kind: str, verb: str):  # noqa: ANN202
        self._check()
        spec = KINDS[(api_version, kind)]
        if spec.custom:
            return _CustomMethod(self._custom, spec, verb)
        api = getattr(client, spec.api)(self._client)
        return getattr(api, f"{verb}_namespaced_{spec.method_suffix}")

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None if it does not exist."""
        try:
            response = self._method(api_version, kind, "read")(name, namespace, **self._raw)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return json.loads(response.data)

    def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Create a namespaced object from its manifest (CRDMissing if its kind is not served)."""
        meta = manifest["metadata"]
        create = self._method(manifest["apiVersion"], manifest["kind"], "create")
        try:
            return json.loads(create(meta["namespace"], manifest, **self._raw).data)
        except ApiException as exc:
            self._raise_if_unserved(exc, manifest["apiVersion"], manifest["kind"])
            raise

    def patch(self, api_version: str, kind: str, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """Apply a JSON merge patch."""
        method = self._method(api_version, kind, "patch")
        return json.loads(method(name, namespace, patch, _content_type=MERGE_PATCH, **self._raw).data)

    def list(self, api_version: str, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        """Objects of a kind matching a label selector (CRDMissing if the kind is not served)."""
        try:
            response = self._method(api_version, kind, "list")(namespace, label_selector=selector,
                                                               **self._raw)
        except ApiException as exc:
            self._raise_if_unserved(exc, api_version, kind)
            raise
        return json.loads(response.data).get("items", [])

    @staticmethod
    def _raise_if_unserved(exc: ApiException, api_version: str, kind: str) -> None:
        # A collection answers 404 only when its kind is not served at all.
        spec = KINDS[(api_version, kind)]
        if exc.status == 404 and spec.custom:
            raise CRDMissing(spec) from exc

    def delete(self, api_version: str, kind: str, namespace: str, name: str, uid: str) -> bool:
        """Delete exactly this object (uid precondition), its dependents in the background; False if gone."""
        options = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid),
                                          propagation_policy="Background")
        try:
            self._method(api_version, kind, "delete")(name, namespace, body=options, **self._raw)
        except ApiException as exc:
            if exc.status in (404, 409):  # gone, or replaced by an object of the same name
                return False
            raise
        return True

    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        """Pods matching a label selector."""
        self._check()
        response = self._core.list_namespaced_pod(namespace, label_selector=selector, **self._raw)
        return json.loads(response.data).get("items", [])

    def patch_pod(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any] | None:
        """Merge-patch a pod; None if it is already gone."""
        self._check()
        try:
            response = self._core.patch_namespaced_pod(
                name, namespace, patch, _content_type=MERGE_PATCH, **self._raw
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return json.loads(response.data)

    def get_parent(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A DeepSeekDeployment, or None if it is gone."""
        self._check()
        try:
            response = self._custom.get_namespaced_custom_object(
                names.GROUP, names.VERSION, namespace, names.PLURAL, name, **self._raw
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return json.loads(response.data)

    def patch_parent_status(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """Merge-patch a DeepSeekDeployment's status subresource."""
        self._check()
        response = self._custom.patch_namespaced_custom_object_status(
            names.GROUP, names.VERSION, namespace, names.PLURAL, name, patch,
            _content_type=MERGE_PATCH, **self._raw,
        )
        return json.loads(response.data)


class _CustomMethod:
    """A typed-client-like `verb_namespaced_x(...)` for a kind served through CustomObjectsApi.

    Positional arguments follow the typed client's order: (name, namespace[, body]) for an
    object, (namespace[, body]) for a collection.
    """

    def __init__(self, api: client.CustomObjectsApi, kind: Kind, verb: str) -> None:
        self.api, self.kind, self.verb = api, kind, verb

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        k = self.kind
        where = (k.group, k.version)
        if self.verb == "read":
            name, namespace = args
            return self.api.get_namespaced_custom_object(*where, namespace, k.plural, name, **kwargs)
        if self.verb == "create":
            namespace, body = args
            return self.api.create_namespaced_custom_object(*where, namespace, k.plural, body, **kwargs)
        if self.verb == "patch":
            name, namespace, body = args
            return self.api.patch_namespaced_custom_object(*where, namespace, k.plural, name, body, **kwargs)
        if self.verb == "list":
            (namespace,) = args
            return self.api.list_namespaced_custom_object(*where, namespace, k.plural, **kwargs)
        if self.verb == "delete":
            name, namespace = args
            return self.api.delete_namespaced_custom_object(*where, namespace, k.plural, name, **kwargs)
        raise ValueError(self.verb)
