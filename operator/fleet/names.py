"""Names, labels and selectors shared by the CRD, the builders and the reconcile."""

from __future__ import annotations

GROUP = "deepseek-fleet.io"
VERSION = "v1alpha1"
KIND = "DeepSeekDeployment"
PLURAL = "deepseekdeployments"
SINGULAR = "deepseekdeployment"
SHORT_NAME = "dsd"
API_VERSION = f"{GROUP}/{VERSION}"
CRD_NAME = f"{PLURAL}.{GROUP}"

MANAGER = "deepseek-operator"
PARENT_LABEL = f"{GROUP}/deployment"  # on every child object and on engine pods
KV_DIRECTORY_LABEL = f"{GROUP}/kv-directory"  # on Redis pods (kept off the engine selector)
LAST_APPLIED = f"{GROUP}/last-applied"  # what we last wrote, to find fields we must remove
KV_AUTH_HASH = f"{GROUP}/kv-auth-hash"  # pod-template annotation: a password change rolls pods
SECRETS_HASH = f"{GROUP}/secrets-hash"  # pod-template annotation: a change to a referenced Secret rolls pods

HTTP_PORT = 8000
KV_TRANSFER_PORT = 8100
DIST_INIT_PORT = 29500  # the leader's torch.distributed rendezvous, for replicas over several nodes
WORKER_LABEL = f"{GROUP}/worker-of"  # on the non-leader pods of a multi-node replica
REDIS_PORT = 6379


def engine_name(parent: str) -> str:
    """Deployment, ClusterIP Service and PodDisruptionBudget of the engines."""
    return parent


def peers_name(parent: str) -> str:
    """Headless Service through which replicas reach each other's KV transfer port."""
    return f"{parent}-peers"


def kv_name(parent: str) -> str:
    """Redis Deployment, Service and NetworkPolicy of a managed KV directory."""
    return f"{parent}-kv"


def kv_secret_name(parent: str) -> str:
    """Secret with the managed Redis password."""
    return f"{parent}-kv-auth"


def kv_transfer_secret_name(parent: str) -> str:
    """Secret with the fleet's generated KV transfer secret (`--kv-secret-file`)."""
    return f"{parent}-kv-transfer"


def secret_names(parent: str) -> list[str]:
    """Every Secret the operator may create for a fleet (Secrets are pruned by name, never listed)."""
    return [kv_secret_name(parent), kv_transfer_secret_name(parent)]


def children_selector(parent: str) -> dict[str, str]:
    """Labels on every child object of one fleet."""
    return {"app.kubernetes.io/managed-by": MANAGER, PARENT_LABEL: parent}


def engine_selector(parent: str) -> dict[str, str]:
    """Labels that select exactly the engine pods of one fleet (Deployment selectors are immutable)."""
    return {PARENT_LABEL: parent}


def worker_selector(parent: str) -> dict[str, str]:
    """Labels of the worker pods of a fleet's multi-node replicas (kept off the engine selector)."""
    return {WORKER_LABEL: parent}


def kv_selector(parent: str) -> dict[str, str]:
    """Labels that select exactly the Redis pods of one fleet."""
    return {KV_DIRECTORY_LABEL: parent}


def selector_string(labels: dict[str, str]) -> str:
    """A label selector in the string form that status.selector and `kubectl -l` take."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def common_labels(parent: str, component: str, app: str) -> dict[str, str]:
    """Recommended app.kubernetes.io labels plus the parent label used to route child events."""
    return {
        "app.kubernetes.io/name": app,
        "app.kubernetes.io/instance": parent,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": "deepseek-fleet",
        "app.kubernetes.io/managed-by": MANAGER,
        PARENT_LABEL: parent,
    }


def endpoint(parent: str, namespace: str) -> str:
    """OpenAI-compatible base URL of a fleet inside the cluster."""
    return f"http://{engine_name(parent)}.{namespace}.svc:{HTTP_PORT}/v1"
