"""Every pod the operator renders for every example meets the Pod Security level the docs promise:
`restricted`, except that RDMA engines add IPC_LOCK (outside `baseline` too) and nothing else."""

from __future__ import annotations

from typing import Any

import pytest
from pod_security import level_of, violations
from test_examples_extra import all_fleets
from test_manifests import RDMA, parent

from fleet.manifests import build_children
from fleet.manifests.engine import build_engine_deployment, default_requests
from fleet.validation import validate

FLEETS = all_fleets()
SECRET = "generated-kv-transfer-secret"  # the reconcile passes the one it generated or read
IPC_LOCK_BASELINE = ["Capabilities: containers[engine] adds IPC_LOCK"]
IPC_LOCK = IPC_LOCK_BASELINE + ["Capabilities: containers[engine] may add only NET_BIND_SERVICE, adds IPC_LOCK"]


def pod_templates(fleet: dict[str, Any]) -> dict[str, dict[str, Any]]:
    body = {**fleet, "metadata": {**fleet["metadata"], "namespace": "ns"}}
    children = build_children(validate(body), kv_password="pw", transfer_secret=SECRET, replicas=1)
    return {c["metadata"]["name"]: c["spec"]["template"] for c in children if "template" in c.get("spec", {})}


@pytest.mark.parametrize("name", FLEETS)
def test_every_pod_of_every_example_meets_its_level(name: str) -> None:
    fleet = FLEETS[name]
    rdma = (fleet["spec"].get("network") or {}).get("rdma", {}).get("enabled", False)
    templates = pod_templates(fleet)
    assert name in templates
    for child, template in templates.items():
        if rdma and child == name:
            # IPC_LOCK (pinning memory for the NIC) is the one thing the engine adds; no level allows it.
            assert violations(template, "restricted") == IPC_LOCK
            assert violations(template, "baseline") == IPC_LOCK_BASELINE
            assert level_of(template) == "privileged"
        else:
            assert violations(template, "restricted") == [], child


def test_every_example_engine_is_burstable_at_least() -> None:
    for name, fleet in FLEETS.items():
        (engine, *_) = pod_templates(fleet)[name]["spec"]["containers"]
        assert {"cpu", "memory"} <= set(engine["resources"]["requests"]), name


def test_default_requests_follow_the_gpus_and_shared_memory() -> None:
    assert default_requests(parent()) == {"cpu": "32", "memory": "192Gi"}  # 8 GPUs, 64Gi of /dev/shm
    small = parent(gpusPerReplica=1, template={"sharedMemorySize": "1536Mi"})
    assert default_requests(small) == {"cpu": "4", "memory": "17920Mi"}
    own = parent(template={"resources": {"requests": {"cpu": "10"}, "limits": {"memory": "300Gi"}}})
    assert default_requests(own) == {}  # a memory limit alone: Kubernetes requests the limit


def test_hostpath_models_and_overrides_change_the_level() -> None:
    hostpath = build_engine_deployment(parent(model={"name": "m", "uri": "hostpath:///models/v3"}),
                                       replicas=1, kv_auth_hash=None)["spec"]["template"]
    assert violations(hostpath, "baseline") == ["HostPath Volumes: volume model is a hostPath"]
    relaxed = parent(template={"containerSecurityContext": {"allowPrivilegeEscalation": True},
                               "securityContext": {"runAsUser": 2000}})
    template = build_engine_deployment(relaxed, replicas=1, kv_auth_hash=None)["spec"]["template"]
    assert template["spec"]["securityContext"] == {"runAsNonRoot": True, "runAsUser": 2000,
                                                   "seccompProfile": {"type": "RuntimeDefault"}}
    assert violations(template, "restricted") == [
        "Privilege Escalation: containers[engine] must set allowPrivilegeEscalation: false"]
    rdma = build_engine_deployment(parent(network=RDMA), replicas=1, kv_auth_hash=None)["spec"]["template"]
    assert violations(rdma, "restricted") == IPC_LOCK


BAD_PODS = {
    "host-network": ({"hostNetwork": True}, "baseline", "Host Namespaces"),
    "privileged": ({"containers": [{"name": "c", "securityContext": {"privileged": True}}]}, "baseline", "Privileged"),
    "sys-admin": ({"containers": [{"name": "c", "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}]},
                  "baseline", "adds SYS_ADMIN"),
    "host-port": ({"containers": [{"name": "c", "ports": [{"containerPort": 80, "hostPort": 80}]}]}, "baseline",
                  "Host Ports"),
    "unsafe-sysctl": ({"securityContext": {"sysctls": [{"name": "kernel.msgmax", "value": "1"}]}}, "baseline",
                      "Sysctls"),
    "unconfined-seccomp": ({"securityContext": {"seccompProfile": {"type": "Unconfined"}}}, "baseline", "Seccomp"),
    "selinux-user": ({"securityContext": {"seLinuxOptions": {"user": "root"}}}, "baseline", "SELinux"),
    "nfs-volume": ({"volumes": [{"name": "v", "nfs": {"server": "s", "path": "/"}}]}, "restricted", "Volume Types"),
    "escalation": ({"containers": [{"name": "c"}]}, "restricted", "Privilege Escalation"),
    "root": ({"securityContext": {"runAsUser": 0}}, "restricted", "runs as user 0"),
    "no-seccomp": ({"containers": [{"name": "c"}]}, "restricted", "Seccomp: containers[c]"),
    "caps-kept": ({"containers": [{"name": "c"}]}, "restricted", "must drop ALL"),
    "init-container": ({"initContainers": [{"name": "i"}]}, "restricted", "initContainers[i]"),
}


@pytest.mark.parametrize("case", BAD_PODS)
def test_each_control_catches_its_violation(case: str) -> None:
    spec, level, expected = BAD_PODS[case]
    found = violations({"spec": {"containers": [], **spec}}, level)
    assert any(expected in v for v in found), found
