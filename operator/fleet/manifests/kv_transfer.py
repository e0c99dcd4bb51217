"""The fleet's KV transfer secret: replicas authenticate to each other and sign their directory
entries with it (`--kv-secret-file`; docs/kv-reuse.md, threat model).

Generated once per fleet into the Secret `<name>-kv-transfer`, which the fleet owns and the
operator keeps (never regenerated while it exists), or named by `kvCache.transferSecretRef`. Either
way it is mounted read-only into every engine pod, leaders and workers alike.
"""

from __future__ import annotations

import base64
import secrets
from typing import Any

from fleet import names
from fleet.parent import Parent

SECRET_KEY = "secret"
VOLUME = "kv-secret"
MOUNT_DIR = "/etc/deepseek/kv-secret"
SECRET_FILE = f"{MOUNT_DIR}/kv-secret"
MIN_BYTES = 16  # the engine refuses shorter secrets (surrounding whitespace aside)


def new_secret() -> str:
    """32 random bytes, URL-safe text (43 characters)."""
    return secrets.token_urlsafe(32)


def read_secret(secret: dict[str, Any] | None, key: str = SECRET_KEY) -> str | None:
    """The value under key in a Secret, if it holds one the engine accepts."""
    data = ((secret or {}).get("data") or {}).get(key)
    if not data:
        return None
    value = base64.b64decode(data).decode(errors="replace")
    return value if len(value.strip().encode()) >= MIN_BYTES else None


def secret_key_ref(parent: Parent) -> tuple[str, str]:
    """(Secret name, key) the engine pods read the secret from: the spec's, else the generated one."""
    ref = parent.spec.kv_cache.transfer_secret_ref
    if ref is not None:
        return ref.name, ref.key
    return names.kv_transfer_secret_name(parent.name), SECRET_KEY


def build_transfer_secret(parent: Parent, value: str) -> dict[str, Any]:
    """The generated Secret (only when the spec names none)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": names.kv_transfer_secret_name(parent.name), "namespace": parent.namespace,
                     "labels": names.common_labels(parent.name, "kv-transfer", "deepseek-engine")},
        "type": "Opaque",
        "data": {SECRET_KEY: base64.b64encode(value.encode()).decode()},
    }


def volume(parent: Parent) -> dict[str, Any]:
    """The Secret as a pod volume holding one file. World-readable inside the pod (0444): the engine
    runs as a non-root user, and without an fsGroup the kubelet leaves the file to root:root; only
    containers that mount the volume see it."""
    name, key = secret_key_ref(parent)
    return {"name": VOLUME, "secret": {"secretName": name, "items": [{"key": key, "path": "kv-secret"}],
                                       "defaultMode": 0o444}}


def volume_mount() -> dict[str, Any]:
    return {"name": VOLUME, "mountPath": MOUNT_DIR, "readOnly": True}
