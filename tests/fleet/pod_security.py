"""The Pod Security Standards (Kubernetes 1.33, policy version `latest`), as rules over a pod spec.

Each check follows one control of https://kubernetes.io/docs/concepts/security/pod-security-standards/
and the pod-security-admission library's checks of the same name. `violations(pod, "baseline")`
runs the baseline controls, `"restricted"` adds the restricted ones; each violation names its
control and the container or field that breaks it.
"""

from __future__ import annotations

from typing import Any

BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}
LEVELS = ("privileged", "baseline", "restricted")


def _containers(pod: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for key in ("initContainers", "containers", "ephemeralContainers"):
        out += [(f"{key}[{c.get('name')}]", c) for c in pod.get(key) or []]
    return out


def _sc(container: dict[str, Any]) -> dict[str, Any]:
    return container.get("securityContext") or {}


def baseline(pod: dict[str, Any], annotations: dict[str, str]) -> list[str]:
    """The baseline controls: no known privilege escalation."""
    found, pod_sc = [], pod.get("securityContext") or {}
    if (pod_sc.get("windowsOptions") or {}).get("hostProcess") or any(
            (_sc(c).get("windowsOptions") or {}).get("hostProcess") for _, c in _containers(pod)):
        found.append("HostProcess: windowsOptions.hostProcess must not be true")
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            found.append(f"Host Namespaces: {key} must not be true")
    for where, c in _containers(pod):
        sc = _sc(c)
        if sc.get("privileged"):
            found.append(f"Privileged Containers: {where} is privileged")
        extra = set((sc.get("capabilities") or {}).get("add") or []) - BASELINE_CAPABILITIES
        if extra:
            found.append(f"Capabilities: {where} adds {', '.join(sorted(extra))}")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            found.append(f"Host Ports: {where} uses a hostPort")
        if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined":
            found.append(f"AppArmor: {where} is Unconfined")
        if sc.get("procMount", "Default") != "Default":
            found.append(f"/proc Mount Type: {where} sets procMount {sc['procMount']}")
        found += _selinux(sc.get("seLinuxOptions"), where)
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            found.append(f"Seccomp: {where} is Unconfined")
    for volume in pod.get("volumes") or []:
        if "hostPath" in volume:
            found.append(f"HostPath Volumes: volume {volume.get('name')} is a hostPath")
    if (pod_sc.get("appArmorProfile") or {}).get("type") == "Unconfined" or any(
            k.startswith("container.apparmor.security.beta.kubernetes.io/") and v == "unconfined"
            for k, v in annotations.items()):
        found.append("AppArmor: the pod is unconfined")
    found += _selinux(pod_sc.get("seLinuxOptions"), "pod")
    if (pod_sc.get("seccompProfile") or {}).get("type") == "Unconfined":
        found.append("Seccomp: the pod is Unconfined")
    for sysctl in pod_sc.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            found.append(f"Sysctls: {sysctl.get('name')} is not a safe sysctl")
    return found


def _selinux(options: dict[str, Any] | None, where: str) -> list[str]:
    options = options or {}
    found = []
    if options.get("type", "") not in SELINUX_TYPES:
        found.append(f"SELinux: {where} sets type {options['type']}")
    if options.get("user") or options.get("role"):
        found.append(f"SELinux: {where} sets a user or role")
    return found


def restricted(pod: dict[str, Any]) -> list[str]:
    """The restricted controls on top of baseline: current pod-hardening practice."""
    found, pod_sc = [], pod.get("securityContext") or {}
    for volume in pod.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            found.append(f"Volume Types: volume {volume.get('name')} is {', '.join(sorted(kinds))}")
    for where, c in _containers(pod):
        sc = _sc(c)
        if sc.get("allowPrivilegeEscalation") is not False:
            found.append(f"Privilege Escalation: {where} must set allowPrivilegeEscalation: false")
        non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
        if non_root is not True:
            found.append(f"Running as Non-root: {where} must run with runAsNonRoot: true")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            found.append(f"Running as Non-root user: {where} runs as user 0")
        seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"Seccomp: {where} must use the RuntimeDefault or a Localhost profile")
        capabilities = sc.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            found.append(f"Capabilities: {where} must drop ALL")
        extra = set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}
        if extra:
            found.append(f"Capabilities: {where} may add only NET_BIND_SERVICE, adds {', '.join(sorted(extra))}")
    if pod_sc.get("runAsUser") == 0:
        found.append("Running as Non-root user: the pod runs as user 0")
    return found


def violations(template: dict[str, Any], level: str) -> list[str]:
    """What stops a pod template (metadata + spec) from meeting level."""
    pod, annotations = template["spec"], (template.get("metadata") or {}).get("annotations") or {}
    if level == "privileged":
        return []
    found = baseline(pod, annotations)
    return found + restricted(pod) if level == "restricted" else found


def level_of(template: dict[str, Any]) -> str:
    """The strictest Pod Security level the pod template meets."""
    return next(level for level in reversed(LEVELS) if not violations(template, level))
