"""The managed Redis KV directory (Secret, Deployment, Service, NetworkPolicy) and how engines reach it."""

from __future__ import annotations

import base64
import hashlib
import secrets
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from kubernetes.utils import parse_quantity

from fleet import names
from fleet.parent import Parent

PASSWORD_KEY = "password"
PASSWORD_ENV = "DEEPSEEK_KV_DIRECTORY_PASSWORD"  # outside DEEPSEEK_ENGINE_*: not a flag of its own
MAXMEMORY_PERCENT = 75  # headroom for fragmentation and client buffers under the container limit


def new_password() -> str:
    """A URL-safe random password (it is spliced into a redis:// URL)."""
    return secrets.token_urlsafe(32)


def password_hash(password: str) -> str:
    """Short digest put on pod templates so that a new password rolls Redis and the engines."""
    return hashlib.sha256(password.encode()).hexdigest()[:16]


def read_password(secret: dict[str, Any]) -> str | None:
    """The password stored in a managed Secret, if it holds one."""
    data = (secret.get("data") or {}).get(PASSWORD_KEY)
    return base64.b64decode(data).decode() if data else None


def _labels(parent: Parent) -> dict[str, str]:
    return names.common_labels(parent.name, "kv-directory", "redis")


def _pod_labels(parent: Parent) -> dict[str, str]:
    # Redis pods must stay outside the engine selector (the parent label), or the engine
    # Service, PodDisruptionBudget and scale selector would count them.
    labels = {k: v for k, v in _labels(parent).items() if k != names.PARENT_LABEL}
    return {**labels, **names.kv_selector(parent.name)}


def build_kv_secret(parent: Parent, password: str) -> dict[str, Any]:
    """Secret with the managed Redis password (generated once, then kept)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": names.kv_secret_name(parent.name), "namespace": parent.namespace, "labels": _labels(parent)},
        "type": "Opaque",
        "data": {PASSWORD_KEY: base64.b64encode(password.encode()).decode()},
    }


def build_kv_deployment(parent: Parent, *, auth_hash: str) -> dict[str, Any]:
    """One memory-only Redis: bounded by maxmemory with LRU eviction, no RDB or AOF (soft state)."""
    redis = parent.spec.kv_cache.redis
    maxmemory = int(parse_quantity(redis.memory)) * MAXMEMORY_PERCENT // 100
    container = {
        "name": "redis",
        "image": redis.image,
        "command": ["redis-server"],
        "args": [
            "--port", str(names.REDIS_PORT),
            "--maxmemory", str(maxmemory),
            "--maxmemory-policy", "allkeys-lru",
            "--save", "",
            "--appendonly", "no",
            "--requirepass", "$(REDIS_PASSWORD)",
        ],
        "env": [
            {
                "name": "REDIS_PASSWORD",
                "valueFrom": {"secretKeyRef": {"name": names.kv_secret_name(parent.name), "key": PASSWORD_KEY}},
            }
        ],
        "ports": [{"name": "redis", "containerPort": names.REDIS_PORT, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "100m", "memory": redis.memory}, "limits": {"memory": redis.memory}},
        "readinessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 10, "failureThreshold": 6},
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 999,
            "runAsGroup": 999,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": names.kv_name(parent.name), "namespace": parent.namespace, "labels": _labels(parent)},
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},  # two directories at once would split the index
            "selector": {"matchLabels": names.kv_selector(parent.name)},
            "template": {
                "metadata": {"labels": _pod_labels(parent), "annotations": {names.KV_AUTH_HASH: auth_hash}},
                "spec": {
                    "enableServiceLinks": False,
                    "automountServiceAccountToken": False,
                    "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [container],
                    "volumes": [{"name": "data", "emptyDir": {}}],
                },
            },
        },
    }


def build_kv_service(parent: Parent) -> dict[str, Any]:
    """ClusterIP Service of the managed Redis."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": names.kv_name(parent.name), "namespace": parent.namespace, "labels": _labels(parent)},
        "spec": {
            "type": "ClusterIP",
            "selector": names.kv_selector(parent.name),
            "ports": [{"name": "redis", "port": names.REDIS_PORT, "targetPort": "redis", "protocol": "TCP"}],
        },
    }


def build_kv_network_policy(parent: Parent) -> dict[str, Any]:
    """Only this fleet's engine pods may reach its Redis."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": names.kv_name(parent.name), "namespace": parent.namespace, "labels": _labels(parent)},
        "spec": {
            "podSelector": {"matchLabels": names.kv_selector(parent.name)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": names.engine_selector(parent.name)}}],
                    "ports": [{"protocol": "TCP", "port": names.REDIS_PORT}],
                }
            ],
        },
    }


def directory_env(parent: Parent) -> list[dict[str, Any]]:
    """Engine env that points `--kv-directory` at the Redis, the password coming from a Secret.

    The URL goes through DEEPSEEK_ENGINE_KV_DIRECTORY, never through args, and references the
    password variable, which the kubelet expands: the password is in neither manifest nor argv.
    """
    directory = parent.spec.kv_cache.directory
    if directory.managed:
        url = f"redis://:$({PASSWORD_ENV})@{names.kv_name(parent.name)}.{parent.namespace}.svc:{names.REDIS_PORT}/0"
        ref = {"name": names.kv_secret_name(parent.name), "key": PASSWORD_KEY}
    elif directory.password_secret_ref is not None:
        url = _with_password(directory.url or "", f"$({PASSWORD_ENV})")
        ref = {"name": directory.password_secret_ref.name, "key": directory.password_secret_ref.key}
    else:
        return [{"name": "DEEPSEEK_ENGINE_KV_DIRECTORY", "value": directory.url}]
    return [
        {"name": PASSWORD_ENV, "valueFrom": {"secretKeyRef": ref}},
        {"name": "DEEPSEEK_ENGINE_KV_DIRECTORY", "value": url},
    ]


def _with_password(url: str, password: str) -> str:
    parts = urlsplit(url)
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f"{user}:{password}@{host}"))
