"""Security contexts of the pods the operator creates: Pod Security `restricted` unless RDMA needs more."""

from __future__ import annotations

import copy
from typing import Any

from fleet.manifests import rdma
from fleet.spec import DeepSeekDeploymentSpec


def merged(base: dict[str, Any], override: dict[str, Any] | None) -> dict[str, Any]:
    """base with override's fields laid over it, recursively (override wins)."""
    out = copy.deepcopy(base)
    for key, value in (override or {}).items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def pod_security_context(spec: DeepSeekDeploymentSpec) -> dict[str, Any]:
    """Non-root (the images run as a numeric user) with the runtime's default seccomp profile."""
    defaults = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    return merged(defaults, spec.template.security_context)


def container_security_context(spec: DeepSeekDeploymentSpec, *, engine: bool = True) -> dict[str, Any]:
    """No privilege escalation and no capabilities, except IPC_LOCK on an RDMA engine (outside `baseline`)."""
    capabilities: dict[str, Any] = {"drop": ["ALL"]}
    added = rdma.capabilities(spec.network.rdma) if engine else []
    if added:
        capabilities["add"] = added
    defaults = {"allowPrivilegeEscalation": False, "capabilities": capabilities}
    return merged(defaults, spec.template.container_security_context) if engine else defaults
