"""A real Kopf operator against kmock's Kubernetes API emulation, with the gaps of kmock 0.8 filled.

kmock 0.8 (pinned in pyproject) serves a stateful API over HTTP but never stamps uid,
resourceVersion, generation or creationTimestamp, answers a failed JSON-patch `test` with 500,
and can lose events between a watch's snapshot and its subscription. `Emulator` fixes those, and
also filters lists by label selector, honours resourceVersion preconditions (409), names
generateName objects and keeps spec and status apart for resources with a status subresource.
It also parses `/api/v1/namespaces` (kmock 0.8 cannot), so Kopf can resolve namespace patterns,
answers 404 for kinds it was not told about (kmock stores them), as a cluster without their CRD
does, can fail chosen requests with a 500 (`fail_next`) and can answer slowly (`latency`). It also
finds the reaction to a request in constant time (kmock 0.8 takes time linear in the requests
served so far, see `_contains`).

Still not emulated (covered by unit tests of the logic behind them instead): garbage collection
(`collect_garbage()` below is an explicit, test-driven stand-in), admission (schema validation,
defaulting, CEL), server-side apply, and every controller (no Deployment ever gets pods on its
own: tests write Deployment status the way kube-controller-manager would).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import json
import sys
import threading
import traceback
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import attrs
import jsonpatch
import kmock
import kopf
import yaml
from kmock._internal import dsl as kmock_dsl
from kmock._internal import parsing as kmock_parsing
from kubernetes.config import kube_config

from fleet import names
from fleet.settings import OperatorSettings

NAMESPACE = "fleet"
RESOURCES = {
    f"{names.API_VERSION}/{names.PLURAL}": dict(kind=names.KIND, subresources={"status", "scale"}),
    "apps/v1/deployments": dict(kind="Deployment", subresources={"status", "scale"}),
    "v1/services": dict(kind="Service", subresources={"status"}),
    "v1/secrets": dict(kind="Secret"),
    "v1/pods": dict(kind="Pod", subresources={"status"}),
    "v1/events": dict(kind="Event"),
    "coordination.k8s.io/v1/leases": dict(kind="Lease"),
    "networking.k8s.io/v1/networkpolicies": dict(kind="NetworkPolicy"),
    "policy/v1/poddisruptionbudgets": dict(kind="PodDisruptionBudget", subresources={"status"}),
}
# Kinds that other projects' CRDs add: declared only by tests that install those CRDs.
OPTIONAL_RESOURCES = {
    "monitoring.coreos.com/v1/podmonitors": dict(kind="PodMonitor"),
    "inference.networking.k8s.io/v1/inferencepools": dict(kind="InferencePool"),
    "leaderworkerset.x-k8s.io/v1/leaderworkersets": dict(kind="LeaderWorkerSet", subresources={"status", "scale"}),
}
CLUSTER_RESOURCES = {  # present on every real cluster; Kopf waits for them in discovery
    "apiextensions.k8s.io/v1/customresourcedefinitions": dict(kind="CustomResourceDefinition"),
    "v1/namespaces": dict(kind="Namespace"),
}
VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}


def _parse_path(path: str, _parse: Callable[[str], Any] = kmock_parsing.parse_path) -> Any:
    """kmock 0.8 reads `/api/v1/namespaces` (the Namespace collection) as the start of a namespaced
    path and fails; that collection is what Kopf lists and watches to resolve namespace patterns."""
    if path.rstrip("/") == "/api/v1/namespaces":
        return kmock_parsing.ParsedPath(group="", version="v1", plural="namespaces")
    return _parse(path)


kmock_parsing.parse_path = _parse_path


def _contains(view: Any, item: Any, _slow: Callable[[Any, Any], bool] = kmock_dsl.View.__contains__) -> bool:
    """kmock 0.8 finds the reaction to a request by asking each reaction's view whether it holds the
    request, and answers that by filtering every request served so far: quadratic, about 0.1 s of
    CPU a request in this process after a few hundred, which starved the operator tests' later steps.
    For the views the emulator's reactions sit on (filters and priorities over the root) the request
    is in the view exactly when every filter accepts it; any other view is asked the slow way."""
    if isinstance(item, kmock.Request):
        node = view
        while type(node) in (kmock_dsl.Filter, kmock_dsl.Priority):
            if type(node) is kmock_dsl.Filter and not node.criteria(item):
                return False
            node = node._source
        if isinstance(node, kmock_dsl.Root):
            recorded = node._requests
            if 0 <= item.id < len(recorded) and recorded[item.id] is item:
                return True
    return _slow(view, item)


kmock_dsl.View.__contains__ = _contains


def _merge(base: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(base) if isinstance(base, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge(out.get(key), value)
    return out


def _matches_selector(obj: dict[str, Any], selector: str | None) -> bool:
    """Equality-based label selectors: `k=v`, `k==v`, `k!=v`, `k`, `!k`, comma-separated."""
    labels = obj.get("metadata", {}).get("labels") or {}
    for term in filter(None, (selector or "").split(",")):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


@attrs.define(kw_only=True)
class Emulator(kmock.KubernetesEmulator):
    """kmock's emulator plus the object bookkeeping a real API server does."""

    _revision: int = attrs.field(default=0, init=False)
    _failures: dict[tuple[str, str], int] = attrs.field(factory=dict, init=False)
    latency: float = attrs.field(default=0.0, init=False)  # seconds before each API request is answered

    def fail_next(self, method: str, plural: str, times: int = 1) -> None:
        """Answer the next `times` requests of this method on this resource with a 500, as an
        overloaded or restarting API server would."""
        self._failures[(method, plural)] = times

    def failures_left(self, method: str, plural: str) -> int:
        return self._failures.get((method, plural), 0)

    def _next_revision(self) -> str:
        self._revision += 1
        return str(self._revision)

    def _current(self, request: kmock.Request) -> dict[str, Any] | None:
        key = (request.resource, request.namespace, request.name)
        if key not in self._objects or self._objects[key].deleted:
            return None
        return self._objects[key].raw

    def _has_status_subresource(self, resource: Any) -> bool:
        for declared, info in self._resources.items():
            if declared == resource:
                return "status" in info.subresources
        return False

    async def _handle(self, request: kmock.Request) -> Any:
        if self.latency and request.resource is not None:
            await asyncio.sleep(self.latency)  # a slow or distant API server; requests still overlap
        key = (request.method.value, getattr(request.resource, "plural", None))
        if self._failures.get(key):
            self._failures[key] -= 1
            raise kmock.KubernetesError(status=500, reason="InternalError", message="injected by the test")
        resource = request.resource
        if resource is not None and resource.plural and not any(d == resource for d in self._get_resources()):
            raise kmock.KubernetesResourceNotFoundError()  # a kind no CRD added: 404, as a real server answers
        if request.resource is not None and isinstance(request.data, dict) and request.action == kmock.action.CREATE:
            self._stamp_new(request.data)
        elif request.resource is not None and request.action == kmock.action.UPDATE and request.name is not None:
            async with self._lock:
                self._stamp_patch(request)
        return await super()._handle(request)

    def _stamp_new(self, obj: dict[str, Any]) -> None:
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
        meta["resourceVersion"] = self._next_revision()
        meta["generation"] = 1

    def _stamp_patch(self, request: kmock.Request) -> None:
        current = self._current(request)
        if current is None:
            return  # kmock answers 404 itself
        data = request.data
        if isinstance(data, list):  # JSON patch: a failed `test` is 422, as on a real server
            try:
                patched = jsonpatch.apply_patch(current, data)
            except jsonpatch.JsonPatchTestFailed as exc:
                raise kmock.KubernetesError(status=422, reason="Invalid", message=str(exc)) from None
            data = _diff_as_merge(current, patched)
        wanted = (data.get("metadata") or {}).get("resourceVersion")
        if wanted and wanted != current["metadata"].get("resourceVersion"):
            raise kmock.KubernetesError(
                status=409, reason="Conflict",
                message="the object has been modified; please apply your changes to the latest version",
            )
        if self._has_status_subresource(request.resource):
            if request.subresource == "status":
                data = {"status": data.get("status")} if "status" in data else {}
            else:
                data = {k: v for k, v in data.items() if k != "status"}
        patched = _merge(current, data)
        meta_patch = {"resourceVersion": self._next_revision()}
        if patched.get("spec") != current.get("spec"):
            meta_patch["generation"] = current["metadata"].get("generation", 1) + 1
        for frozen in ("uid", "creationTimestamp"):
            meta_patch[frozen] = current["metadata"].get(frozen)
        final = _merge(current, {**data, "metadata": {**(data.get("metadata") or {}), **meta_patch}})
        # Hand kmock a patch of the same type that produces exactly `final`.
        if isinstance(request.data, list):
            request.data[:] = jsonpatch.make_patch(current, final).patch
        else:
            request.data.clear()
            request.data.update(_diff_as_merge(current, final))

    async def _serve_list(self, request: kmock.Request) -> dict[str, Any]:
        if not any(declared == request.resource for declared in self._get_resources()):
            raise kmock.KubernetesResourceNotFoundError()
        async with self._lock:
            items = self._snapshot(request)
        return {"metadata": {"resourceVersion": str(self._revision)}, "items": items}

    def _snapshot(self, request: kmock.Request) -> list[dict[str, Any]]:
        return [
            copy.deepcopy(obj.raw)
            for (resource, namespace, name), obj in self._objects.items()
            if resource == request.resource and not obj.deleted
            and (request.namespace is None or namespace == request.namespace)
            and (request.name is None or name == request.name)
            and _matches_selector(obj.raw, request.params.get("labelSelector"))
        ]

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        yield b""
        bus = self._buses[request.resource]
        # Subscribe and snapshot under the lock every mutation takes: nothing slips in between.
        async with self._lock:
            marker = await bus.mark()
            items = self._snapshot(request)
        try:
            for item in items:
                yield {"type": "ADDED", "object": item}
            async for event in bus.stream(since=marker):
                obj = event.get("object", {})
                meta = obj.get("metadata", {})
                if request.namespace is not None and meta.get("namespace") != request.namespace:
                    continue
                if request.name is not None and meta.get("name") != request.name:
                    continue
                if _matches_selector(obj, request.params.get("labelSelector")):
                    yield event
        finally:
            await bus.unmark(marker)


def _diff_as_merge(old: Any, new: Any) -> Any:
    """A merge patch that turns old into new."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return copy.deepcopy(new)
    out: dict[str, Any] = {k: None for k in old if k not in new}
    for key, value in new.items():
        if key not in old:
            out[key] = copy.deepcopy(value)
        elif old[key] != value:
            out[key] = _diff_as_merge(old[key], value)
    return out


def path_of(api_version: str, plural: str, name: str | None = None, namespace: str = NAMESPACE) -> str:
    """REST path of a namespaced collection or object."""
    root = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    return f"{root}/namespaces/{namespace}/{plural}" + (f"/{name}" if name else "")


@attrs.define
class Cluster:
    """The emulated API server plus the helpers a test needs to act as users and controllers."""

    emulator: Emulator
    server: kmock.Server

    async def _call(self, method: str, path: str, payload: Any = None, content_type: str | None = None) -> Any:
        headers = {"Content-Type": content_type} if content_type else {}
        data = json.dumps(payload) if payload is not None else None
        async with self.server.client.request(method, path, data=data, headers=headers) as response:
            body = await response.json()
            if response.status >= 400:
                raise AssertionError(f"{method} {path} -> {response.status}: {body.get('message')}")
            return body

    async def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        plural = manifest["kind"].lower() + "s"
        if manifest["kind"] == names.KIND:
            plural = names.PLURAL
        if manifest["kind"] == "Namespace":
            return await self._call("POST", "/api/v1/namespaces", manifest, "application/json")
        namespace = manifest["metadata"].get("namespace", NAMESPACE)
        path = path_of(manifest["apiVersion"], plural, namespace=namespace)
        return await self._call("POST", path, manifest, "application/json")

    async def patch(self, api_version: str, plural: str, name: str, patch: Any, *, subresource: str = "") -> Any:
        path = path_of(api_version, plural, name) + (f"/{subresource}" if subresource else "")
        kind = "application/json-patch+json" if isinstance(patch, list) else "application/merge-patch+json"
        return await self._call("PATCH", path, patch, kind)

    async def delete(self, api_version: str, plural: str, name: str) -> Any:
        return await self._call("DELETE", path_of(api_version, plural, name))

    def get(self, api_version: str, plural: str, name: str, namespace: str = NAMESPACE) -> dict[str, Any] | None:
        try:
            obj = self.emulator.objects[f"{api_version}/{plural}", namespace, name]
        except KeyError:
            return None
        return None if obj.deleted else copy.deepcopy(obj.raw)

    def all_objects(self) -> list[dict[str, Any]]:
        return [copy.deepcopy(o.raw) for _, o in self.emulator.objects.items() if not o.deleted]

    def writes(self, since: int = 0) -> list[str]:
        """Mutating requests after the `since`-th request, except Events (which are reports, not state)."""
        return [
            f"{r.method.value} {r.url.path}"
            for r in list(self.emulator)[since:]
            if r.method.value in ("POST", "PUT", "PATCH", "DELETE") and "/events" not in r.url.path
        ]

    def request_count(self) -> int:
        return len(list(self.emulator))

    def events(self) -> list[dict[str, Any]]:
        return [o for o in self.all_objects() if o.get("kind") == "Event" or "involvedObject" in o]

    async def collect_garbage(self) -> list[str]:
        """Delete what the garbage collector would: objects whose controller owner no longer exists."""
        alive = {o["metadata"].get("uid") for o in self.all_objects()}
        collected = []
        for (resource, namespace, name), obj in list(self.emulator.objects.items()):
            if obj.deleted:
                continue
            refs = obj.raw.get("metadata", {}).get("ownerReferences") or []
            if any(r.get("controller") for r in refs) and not any(r.get("uid") in alive for r in refs):
                api_version = f"{resource.group}/{resource.version}" if resource.group else resource.version
                await self.delete(api_version, resource.plural, name)
                collected.append(f"{resource.plural}/{name}")
        return collected


@contextlib.asynccontextmanager
async def emulated_cluster(tmp_path: Path, monkeypatch: Any, *, optional: tuple[str, ...] = ()) -> AsyncIterator[Cluster]:
    """An emulated API server that every Kubernetes client of this process (Kopf's too) talks to."""
    async with Emulator() as emulator, kmock.Server(emulator) as server:
        declare_resources(emulator, optional=optional)
        kubeconfig = str(write_kubeconfig(tmp_path / "kubeconfig", str(server.url)))
        monkeypatch.setenv("KUBECONFIG", kubeconfig)
        # The client library reads $KUBECONFIG once, at import; Kopf's login goes through it.
        monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", kubeconfig)
        yield Cluster(emulator, server)


def fleet_manifest(name: str = "v3", **spec: Any) -> dict[str, Any]:
    """A DeepSeekDeployment in the test namespace: the spec's top-level fields replace the base's."""
    base = {"model": {"name": "deepseek-v3", "uri": "pvc://models/DeepSeek-V3"}, "gpusPerReplica": 8, "replicas": 2}
    return {"apiVersion": names.API_VERSION, "kind": names.KIND,
            "metadata": {"name": name, "namespace": NAMESPACE}, "spec": {**base, **spec}}


def condition_of(body: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    """The condition of that type in a fleet's status ({} if absent)."""
    return next((c for c in (body or {}).get("status", {}).get("conditions", []) if c["type"] == type_), {})


def write_kubeconfig(path: Path, url: str) -> Path:
    """A kubeconfig that points every Kubernetes client (Kopf's and ours) at the emulator."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emulated", "cluster": {"server": url}}],
        "users": [{"name": "tester", "user": {"token": "test-token"}}],
        "contexts": [{"name": "emulated", "context": {"cluster": "emulated", "user": "tester", "namespace": NAMESPACE}}],
        "current-context": "emulated",
    }
    path.write_text(yaml.safe_dump(config))
    return path


def declare_resources(emulator: Emulator, *, optional: tuple[str, ...] = ()) -> None:
    """Declare the built-in kinds, and those of OPTIONAL_RESOURCES named in optional (their CRDs)."""
    for key in optional:
        emulator.resources[key] = kmock.ResourceInfo(namespaced=True, verbs=VERBS, **OPTIONAL_RESOURCES[key])
    for key, info in RESOURCES.items():
        emulator.resources[key] = kmock.ResourceInfo(namespaced=True, verbs=VERBS, **info)
    for key, info in CLUSTER_RESOURCES.items():
        emulator.resources[key] = kmock.ResourceInfo(namespaced=False, verbs=VERBS, **info)


class RunningOperator:
    """`deepseek-operator`'s Kopf operator, in a thread with its own event loop.

    Kopf treats every task created in its loop after its start as its own and cancels it when
    stopping, which would include the test's teardown; a thread keeps the two apart. The API
    calls still cross a real socket to the emulator in the test's loop.
    """

    def __init__(self, settings: OperatorSettings | None = None) -> None:
        # No metrics port unless a test asks: several operators start and stop in one test run.
        settings = settings or OperatorSettings()
        if "metrics_port" not in settings.model_fields_set:
            settings = settings.model_copy(update={"metrics_port": 0})
        self.settings = settings
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def _run(self) -> None:
        import fleet.handlers  # noqa: F401  (registers the handlers, as the CLI does)

        try:
            namespaces = list(self.settings.namespaces) if self.settings and self.settings.namespaces else [NAMESPACE]
            asyncio.run(kopf.operator(
                namespaces=namespaces, standalone=True, stop_flag=self._stop, ready_flag=self._ready,
                memo=kopf.Memo(settings=self.settings),
            ))
        except BaseException as exc:  # surfaced by stop()
            self.error = exc

    async def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kopf-operator", daemon=True)
        self._thread.start()
        await eventually(self._ready.is_set, timeout=15, what="the operator to start")

    async def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 40)  # a hung request times out after 30 s
            if self._thread.is_alive():
                frames = sys._current_frames()
                stacks = "".join("".join(traceback.format_stack(frames[t.ident])) for t in threading.enumerate()
                                 if t.ident in frames and t is not threading.current_thread())
                raise AssertionError(f"the operator did not stop; its threads:\n{stacks[-6000:]}")
        if self.error is not None:
            raise self.error


async def eventually(check: Callable[[], Any], *, timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll until check() returns something truthy (no fixed sleeps), else fail with what."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = check()
        if result:
            return result
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def quiet(cluster: Cluster, *, settle: float = 0.6, timeout: float = 10.0) -> None:
    """Wait until no mutating request has arrived for `settle` seconds (counted from the last one seen, looked
    for every 50 ms: from `settle` to `settle` + 50 ms after it, where polling every `settle` took up to twice)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    seen, since = len(cluster.writes()), loop.time()
    while loop.time() < deadline:
        await asyncio.sleep(0.05)
        count = len(cluster.writes())
        if count != seen:
            seen, since = count, loop.time()
        elif loop.time() - since >= settle:
            return
    raise AssertionError("the operator never settled")
