"""Pure builders: a validated DeepSeekDeployment in, Kubernetes manifests (plain dicts) out."""

from __future__ import annotations

from typing import Any

from fleet.manifests.budget import build_disruption_budget
from fleet.manifests.engine import build_engine_deployment
from fleet.manifests.kv_directory import (
    build_kv_deployment,
    build_kv_network_policy,
    build_kv_secret,
    build_kv_service,
    password_hash,
)
from fleet.manifests.kv_transfer import build_transfer_secret
from fleet.manifests.monitoring import build_pod_monitor
from fleet.manifests.multinode import build_leader_worker_set, is_multinode
from fleet.manifests.routing import build_inference_pool
from fleet.manifests.services import build_engine_service, build_peers_service
from fleet.parent import Parent


def build_children(parent: Parent, *, kv_password: str | None, replicas: int | None,
                   transfer_secret: str | None = None, secrets_hash: str | None = None) -> list[dict[str, Any]]:
    """Every child of a fleet, in creation order (what others depend on first).

    kv_password is the managed Redis password (None for an external directory); transfer_secret
    the generated KV transfer secret (None when kvCache.transferSecretRef names one); replicas is
    None when the autoscaler owns the engine Deployment's replica count; secrets_hash digests the
    Secrets the engines read (API key, external Redis password, Hugging Face token, KV transfer secret).
    """
    children: list[dict[str, Any]] = []
    if parent.spec.kv_cache.transfer_secret_ref is None:
        assert transfer_secret is not None, "a fleet without transferSecretRef needs its generated secret"
        children.append(build_transfer_secret(parent, transfer_secret))
    auth_hash = None
    if parent.spec.kv_cache.directory.managed:
        assert kv_password is not None, "a managed directory needs its password"
        auth_hash = password_hash(kv_password)
        children += [
            build_kv_secret(parent, kv_password),
            build_kv_deployment(parent, auth_hash=auth_hash),
            build_kv_service(parent),
            build_kv_network_policy(parent),
        ]
    children += [
        build_engine_service(parent),
        build_peers_service(parent),
        build_disruption_budget(parent),
        (build_leader_worker_set if is_multinode(parent) else build_engine_deployment)(
            parent, replicas=replicas, kv_auth_hash=auth_hash, secrets_hash=secrets_hash),
    ]
    if parent.options.pod_monitors:
        children.append(build_pod_monitor(parent))
    if parent.options.inference_pools:
        children.append(build_inference_pool(parent))
    return children
