"""What RDMA adds to an engine pod: Multus networks, the device resource, IPC_LOCK and NCCL/UCX env."""

from __future__ import annotations

from typing import Any

from fleet.spec import DeepSeekDeploymentSpec, RDMASpec

MULTUS_ANNOTATION = "k8s.v1.cni.cncf.io/networks"
MULTUS_STATUS_ANNOTATION = "k8s.v1.cni.cncf.io/network-status"  # written by Multus on the pod


def kv_transport(spec: DeepSeekDeploymentSpec) -> str:
    """`--kv-transport`: auto resolves here, where we know whether the pod has an RDMA device."""
    if spec.kv_cache.transport != "auto":
        return spec.kv_cache.transport
    return "rdma" if spec.network.rdma.enabled else "tcp"


def pod_annotations(rdma: RDMASpec) -> dict[str, str]:
    """Multus annotation attaching the secondary networks."""
    if not rdma.enabled or not rdma.networks:
        return {}
    return {MULTUS_ANNOTATION: ",".join(rdma.networks)}


def device_resources(rdma: RDMASpec) -> dict[str, int]:
    """RDMA device count per pod, requested and limited alike (extended resources need both equal)."""
    if not rdma.enabled or rdma.resource_name is None:
        return {}
    return {rdma.resource_name: rdma.count or 1}


def capabilities(rdma: RDMASpec) -> list[str]:
    """IPC_LOCK lets the engine pin the memory it registers with the NIC."""
    return ["IPC_LOCK"] if rdma.enabled else []


def env(rdma: RDMASpec) -> list[dict[str, Any]]:
    """NCCL and UCX settings; anything autodetectable is left to the libraries."""
    if not rdma.enabled:
        return []
    out: list[dict[str, Any]] = [{"name": "NCCL_IB_DISABLE", "value": "0"}]
    if rdma.hcas:
        out.append({"name": "NCCL_IB_HCA", "value": ",".join(rdma.hcas)})
        out.append({"name": "UCX_NET_DEVICES", "value": ",".join(f"{hca}:1" for hca in rdma.hcas)})
    if rdma.gid_index is not None:
        out.append({"name": "NCCL_IB_GID_INDEX", "value": str(rdma.gid_index)})
    return out
