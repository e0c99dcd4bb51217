"""The engine Deployment: GPU pods running `deepseek-engine serve`."""

from __future__ import annotations

import copy
import math
from typing import Any

from kubernetes.utils import parse_quantity

from fleet import names
from fleet.manifests import kv_transfer, rdma, security
from fleet.manifests.kv_directory import directory_env
from fleet.manifests.model_source import MODEL_DIR, VOLUME, model_source
from fleet.parent import Parent

API_KEY_DIR = "/etc/deepseek/api-key"
PRESTOP_SECONDS = 10  # lets Services drop the endpoint before SIGTERM starts the drain
STARTUP_PERIOD_SECONDS = 10
CPU_PER_GPU = 4  # tokenization, detokenization, the HTTP server and one process per GPU
MEMORY_PER_GPU_GI = 16  # host memory per GPU process: CUDA context, pinned buffers, weight loading
# Flags the operator owns; extraArgs may not repeat them.
MANAGED_FLAGS = (
    "--model", "--served-model-name", "--port", "--tensor-parallel-size", "--max-model-len", "--replica-id",
    "--advertise-host", "--kv-directory", "--kv-transport", "--kv-transfer-port", "--kv-secret-file",
    "--api-key-file", "--nnodes", "--node-rank", "--dist-init-addr",
)


def gpus_per_pod(parent: Parent) -> int:
    """GPUs of one engine pod: a node's share when a replica spans several nodes."""
    return parent.spec.gpus_per_node or parent.spec.gpus_per_replica


def nodes_per_replica(parent: Parent) -> int:
    """Pods (one per node) that make up one replica."""
    return parent.spec.gpus_per_replica // gpus_per_pod(parent)


def tensor_parallel_size(parent: Parent) -> int:
    """Tensor-parallel degree: as set, else all of the pod's GPUs."""
    return parent.spec.engine.tensor_parallel_size or parent.spec.gpus_per_replica


def engine_args(parent: Parent, model_path: str, *, multinode: bool = False) -> list[str]:
    """`deepseek-engine` arguments; $(VAR) references are expanded by the kubelet from the env.

    multinode: a pod of a replica over several nodes; the LeaderWorkerSet controller puts
    LWS_WORKER_INDEX (0 on the leader) and LWS_LEADER_ADDRESS in every container's env."""
    spec = parent.spec
    args = [
        "serve",
        "--model", model_path,
        "--served-model-name", spec.model.name,
        "--port", str(names.HTTP_PORT),
        "--tensor-parallel-size", str(tensor_parallel_size(parent)),
    ]
    if spec.engine.max_model_len is not None:
        args += ["--max-model-len", str(spec.engine.max_model_len)]
    if multinode:
        args += [
            "--nnodes", str(nodes_per_replica(parent)),
            "--node-rank", "$(LWS_WORKER_INDEX)",
            "--dist-init-addr", f"$(LWS_LEADER_ADDRESS):{names.DIST_INIT_PORT}",
        ]
    args += [
        "--replica-id", "$(POD_NAME)",
        "--advertise-host", "$(POD_IP)",
        "--kv-transport", rdma.kv_transport(spec),
        "--kv-transfer-port", str(names.KV_TRANSFER_PORT),
        "--kv-secret-file", kv_transfer.SECRET_FILE,
    ]
    if spec.engine.api_key_secret_ref is not None:
        args += ["--api-key-file", f"{API_KEY_DIR}/api-key"]
    return args + list(spec.engine.extra_args)


def _env(parent: Parent) -> list[dict[str, Any]]:
    downward = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    user = [e.model_dump(by_alias=True, exclude_none=True) for e in parent.spec.engine.env]
    return downward + directory_env(parent) + rdma.env(parent.spec.network.rdma) + user


def default_requests(parent: Parent) -> dict[str, str]:
    """CPU and memory requests the template does not set: CPU_PER_GPU cores and MEMORY_PER_GPU_GI GiB
    per GPU, plus the memory-backed /dev/shm (which the pod's memory pays for).

    A resource the template limits but does not request is left alone: Kubernetes then requests
    the limit. So a pod is Burstable at least, never BestEffort (first to go under node pressure).
    """
    spec, resources = parent.spec, parent.spec.template.resources
    gpus = gpus_per_pod(parent)
    shm_bytes = int(parse_quantity(spec.template.shared_memory_size))
    wanted = {"cpu": str(CPU_PER_GPU * gpus), "memory": _bytes_text(shm_bytes + MEMORY_PER_GPU_GI * gpus * 2**30)}
    return {k: v for k, v in wanted.items() if k not in resources.requests and k not in resources.limits}


def _bytes_text(size: int) -> str:
    mebibytes = -(-size // 2**20)  # rounded up to whole MiB
    return f"{mebibytes // 1024}Gi" if mebibytes % 1024 == 0 else f"{mebibytes}Mi"


def _resources(parent: Parent) -> dict[str, Any]:
    spec = parent.spec
    devices = {spec.gpu_resource_name: gpus_per_pod(parent), **rdma.device_resources(spec.network.rdma)}
    devices_text = {name: str(count) for name, count in devices.items()}
    return {
        "requests": {**default_requests(parent), **spec.template.resources.requests, **devices_text},
        "limits": {**spec.template.resources.limits, **devices_text},
    }


def _affinity(parent: Parent) -> dict[str, Any]:
    affinity = copy.deepcopy(parent.spec.template.affinity or {})
    spread = {
        "weight": 100,
        "podAffinityTerm": {
            "labelSelector": {"matchLabels": names.engine_selector(parent.name)},
            "topologyKey": "kubernetes.io/hostname",
        },
    }
    anti = affinity.setdefault("podAntiAffinity", {})
    anti.setdefault("preferredDuringSchedulingIgnoredDuringExecution", []).append(spread)
    return affinity


def _probes(parent: Parent) -> dict[str, Any]:
    startup_budget = parent.spec.engine.startup_timeout_seconds
    return {
        # Gates the others until the weights are loaded, which can take many minutes.
        "startupProbe": {
            "httpGet": {"path": "/ready", "port": "http"},
            "periodSeconds": STARTUP_PERIOD_SECONDS,
            "timeoutSeconds": 5,
            "failureThreshold": math.ceil(startup_budget / STARTUP_PERIOD_SECONDS),
        },
        # /ready turns 503 while draining, taking the replica out of the Service quickly.
        "readinessProbe": {
            "httpGet": {"path": "/ready", "port": "http"},
            "periodSeconds": 5,
            "timeoutSeconds": 5,
            "failureThreshold": 2,
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
    }


def _container(parent: Parent, model_path: str, role: str | None = None) -> dict[str, Any]:
    spec = parent.spec
    mounts = [
        {"name": VOLUME, "mountPath": MODEL_DIR, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
        kv_transfer.volume_mount(),
    ]
    if spec.engine.api_key_secret_ref is not None:
        mounts.append({"name": "api-key", "mountPath": API_KEY_DIR, "readOnly": True})
    mounts += [dict(m) for m in spec.template.volume_mounts]
    container: dict[str, Any] = {
        "name": "engine",
        "image": parent.engine_image,
        "command": ["deepseek-engine"],
        "args": engine_args(parent, model_path, multinode=role is not None),
        "env": _env(parent),
        "ports": [
            {"name": "http", "containerPort": names.HTTP_PORT, "protocol": "TCP"},
            {"name": "kv-transfer", "containerPort": names.KV_TRANSFER_PORT, "protocol": "TCP"},
            *([{"name": "dist-init", "containerPort": names.DIST_INIT_PORT, "protocol": "TCP"}] if role else []),
        ],
        "resources": _resources(parent),
        "volumeMounts": mounts,
        # A worker's engine ranks serve no HTTP: no probes (the group restarts with its leader).
        **({} if role == "worker" else _probes(parent)),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SECONDS}}},
    }
    if spec.engine.image_pull_policy:
        container["imagePullPolicy"] = spec.engine.image_pull_policy
    container["securityContext"] = security.container_security_context(spec)
    return container


def _volumes(parent: Parent, model_volume: dict[str, Any]) -> list[dict[str, Any]]:
    spec = parent.spec
    volumes = [
        model_volume,
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.template.shared_memory_size}},
        kv_transfer.volume(parent),
    ]
    ref = spec.engine.api_key_secret_ref
    if ref is not None:
        # 0444, as the KV transfer secret's: the engine runs as a non-root user outside the file's group
        # (root, unless the template sets an fsGroup), so 0440 would leave the key unreadable to it.
        volumes.append(
            {"name": "api-key", "secret": {"secretName": ref.name, "items": [{"key": ref.key, "path": "api-key"}],
                                           "defaultMode": 0o444}}
        )
    return volumes + [dict(v) for v in spec.template.volumes]


def engine_pod_template(parent: Parent, *, kv_auth_hash: str | None, secrets_hash: str | None,
                        role: str | None = None) -> dict[str, Any]:
    """The engine pod template. role: None for a one-pod replica; "leader" or "worker" for the pods
    of a replica spread over several nodes (multinode.py), whose workers stay outside the engine
    selector (they serve no HTTP: Services, the PodDisruptionBudget and the autoscaler see leaders)."""
    spec = parent.spec
    source = model_source(spec.model, spec.engine, parent.engine_image)
    template = spec.template
    labels = names.common_labels(parent.name, "engine", "deepseek-engine")
    if role == "worker":
        labels = {k: v for k, v in labels.items() if k != names.PARENT_LABEL} | names.worker_selector(parent.name)
    annotations = {
        **template.annotations,
        **rdma.pod_annotations(spec.network.rdma),
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(names.HTTP_PORT),
        "prometheus.io/path": "/metrics",
    }
    if kv_auth_hash is not None:
        annotations[names.KV_AUTH_HASH] = kv_auth_hash
    if secrets_hash is not None:
        annotations[names.SECRETS_HASH] = secrets_hash
    pod_spec: dict[str, Any] = {
        # Service links would inject e.g. DEEPSEEK_ENGINE_PORT for a Service named deepseek-engine,
        # which the engine reads as its --port flag.
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": PRESTOP_SECONDS + spec.engine.drain_seconds + 5,
        "securityContext": security.pod_security_context(spec),
        "affinity": _affinity(parent),
        "containers": [_container(parent, source.path, role), *(dict(c) for c in template.sidecars)],
        "volumes": _volumes(parent, source.volume),
    }
    if source.init_containers:
        pod_spec["initContainers"] = [
            {**c, "securityContext": security.container_security_context(spec, engine=False)}
            for c in source.init_containers
        ]
    if template.node_selector:
        pod_spec["nodeSelector"] = dict(template.node_selector)
    if template.tolerations:
        pod_spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in template.tolerations]
    if template.priority_class_name:
        pod_spec["priorityClassName"] = template.priority_class_name
    if template.service_account_name:
        pod_spec["serviceAccountName"] = template.service_account_name
    if template.runtime_class_name:
        pod_spec["runtimeClassName"] = template.runtime_class_name
    if template.scheduler_name:
        pod_spec["schedulerName"] = template.scheduler_name
    if template.topology_spread_constraints:
        pod_spec["topologySpreadConstraints"] = [dict(c) for c in template.topology_spread_constraints]
    if spec.engine.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in spec.engine.image_pull_secrets]
    return {"metadata": {"labels": {**template.labels, **labels}, "annotations": annotations}, "spec": pod_spec}


def build_engine_deployment(parent: Parent, *, replicas: int | None, kv_auth_hash: str | None,
                            secrets_hash: str | None = None) -> dict[str, Any]:
    """The engine Deployment; replicas=None leaves the count to whoever owns it (the autoscaler)."""
    spec = parent.spec
    labels = names.common_labels(parent.name, "engine", "deepseek-engine")
    deployment_spec: dict[str, Any] = {
        "selector": {"matchLabels": names.engine_selector(parent.name)},
        "strategy": {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": spec.rollout.max_surge, "maxUnavailable": spec.rollout.max_unavailable},
        },
        # Loading hundreds of GB must not read as a stuck rollout.
        "progressDeadlineSeconds": spec.engine.startup_timeout_seconds + 600,
        "template": engine_pod_template(parent, kv_auth_hash=kv_auth_hash, secrets_hash=secrets_hash),
    }
    if replicas is not None:
        deployment_spec = {"replicas": replicas, **deployment_spec}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": names.engine_name(parent.name), "namespace": parent.namespace, "labels": labels},
        "spec": deployment_spec,
    }
