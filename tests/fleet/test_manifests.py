"""The builders: valid Kubernetes 1.33 objects carrying the wiring the engine and Redis need."""

from __future__ import annotations

import base64
from typing import Any

import kubernetes_validate
import pytest

from fleet import names
from fleet.manifests import build_children
from fleet.manifests.engine import build_engine_deployment
from fleet.manifests.kv_directory import build_kv_deployment, password_hash
from fleet.parent import Parent
from fleet.spec import DeepSeekDeploymentSpec

SECRET = "generated-kv-transfer-secret"  # the reconcile passes the one it generated or read


def parent(**spec: Any) -> Parent:
    base: dict[str, Any] = {"model": {"name": "m", "uri": "pvc://models/DeepSeek-V3"}, "engine": {"image": "e:1"}}
    return Parent("v3", "ns", DeepSeekDeploymentSpec.model_validate({**base, **spec}), generation=1)


RDMA = {"rdma": {"enabled": True, "resourceName": "rdma/rdma_shared_device_a", "count": 2,
                 "networks": ["rdma-net", "other/rdma-b"], "hcas": ["mlx5_0"], "gidIndex": 3}}
VARIANTS = {
    "managed": parent(),
    "rdma": parent(network=RDMA),
    "external": parent(kvCache={"directory": {"url": "rediss://user@r:6380/1", "passwordSecretRef": {"name": "s", "key": "k"}}}),
    "external-no-password": parent(kvCache={"directory": {"url": "redis://r:6379"}}),
    "hf": parent(model={"name": "m", "uri": "hf://deepseek-ai/DeepSeek-V3@abc123", "cacheSize": "800Gi",
                        "tokenSecretRef": {"name": "hf", "key": "token"}}),
    "hostpath": parent(model={"name": "m", "uri": "hostpath:///mnt/models/v3"}),
    "overrides": parent(
        engine={"image": "e:1", "imagePullPolicy": "Always", "imagePullSecrets": ["regcred"], "maxModelLen": 4096,
                "apiKeySecretRef": {"name": "key", "key": "api"}, "extraArgs": ["--max-num-seqs", "64"],
                "env": [{"name": "LOG_LEVEL", "value": "debug"},
                        {"name": "X", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "x"}}}]},
        template={"nodeSelector": {"pool": "h200"}, "tolerations": [{"key": "gpu", "operator": "Exists"}],
                  "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                      {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
                  "priorityClassName": "high", "serviceAccountName": "engine",
                  "resources": {"requests": {"cpu": "16", "memory": "256Gi"}, "limits": {"memory": "300Gi"}},
                  "labels": {"team": "ml"}, "annotations": {"note": "x"}},
        rollout={"maxSurge": "25%", "maxUnavailable": 0}, disruptionBudget={"maxUnavailable": "50%"},
    ),
    "pod-extras": parent(template={
        "runtimeClassName": "nvidia", "schedulerName": "volcano",
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                       "whenUnsatisfiable": "ScheduleAnyway",
                                       "labelSelector": {"matchLabels": {names.PARENT_LABEL: "v3"}}}],
        "volumes": [{"name": "cache", "emptyDir": {"sizeLimit": "10Gi"}}],
        "volumeMounts": [{"name": "cache", "mountPath": "/home/engine/.cache"}],
        "sidecars": [{"name": "logs", "image": "fluent/fluent-bit:3.0",
                      "volumeMounts": [{"name": "cache", "mountPath": "/cache", "readOnly": True}]}],
        "securityContext": {"fsGroup": 10001}, "containerSecurityContext": {"readOnlyRootFilesystem": True},
    }),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_child_validates_strictly_against_kubernetes_1_33(variant: str) -> None:
    children = build_children(VARIANTS[variant], kv_password="pw", transfer_secret=SECRET, replicas=2)
    assert children
    for child in children:
        kubernetes_validate.validate(child, "1.33.0", strict=True)


def engine(p: Parent, **kwargs: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    deployment = build_engine_deployment(p, replicas=kwargs.get("replicas", 2), kv_auth_hash=kwargs.get("auth"))
    pod = deployment["spec"]["template"]["spec"]
    return deployment, pod, pod["containers"][0]


def flag(container: dict[str, Any], name: str) -> str:
    args = container["args"]
    return args[args.index(name) + 1]


def test_engine_gpus_shm_flags_and_downward_api() -> None:
    _, pod, container = engine(parent(gpusPerReplica=4))
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "4"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}} in pod["volumes"]
    assert container["command"] == ["deepseek-engine"] and container["args"][0] == "serve"
    assert flag(container, "--model") == "/models/DeepSeek-V3"
    assert flag(container, "--served-model-name") == "m"
    assert flag(container, "--port") == "8000"
    assert flag(container, "--tensor-parallel-size") == "4"
    assert flag(container, "--replica-id") == "$(POD_NAME)"
    assert flag(container, "--advertise-host") == "$(POD_IP)"
    assert flag(container, "--kv-transport") == "tcp"
    assert flag(container, "--kv-transfer-port") == "8100"
    assert "--max-model-len" not in container["args"] and "--kv-directory" not in container["args"]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert pod["enableServiceLinks"] is False


def test_probes_drain_and_spreading() -> None:
    _, pod, container = engine(parent(engine={"image": "e", "startupTimeoutSeconds": 7200, "drainSeconds": 300}))
    assert container["startupProbe"]["httpGet"]["path"] == "/ready"
    budget = container["startupProbe"]["periodSeconds"] * container["startupProbe"]["failureThreshold"]
    assert budget >= 7200
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["lifecycle"]["preStop"]["sleep"]["seconds"] > 0
    assert pod["terminationGracePeriodSeconds"] > 300 + container["lifecycle"]["preStop"]["sleep"]["seconds"]
    (spread,) = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert spread["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert spread["podAffinityTerm"]["labelSelector"]["matchLabels"] == {names.PARENT_LABEL: "v3"}


def test_user_overrides_merge_without_losing_ours() -> None:
    deployment, pod, container = engine(VARIANTS["overrides"])
    assert pod["nodeSelector"] == {"pool": "h200"} and pod["priorityClassName"] == "high"
    assert pod["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    assert "nodeAffinity" in pod["affinity"] and "podAntiAffinity" in pod["affinity"]
    assert container["resources"]["limits"] == {"memory": "300Gi", "nvidia.com/gpu": "8"}
    assert container["resources"]["requests"]["cpu"] == "16"
    assert container["args"][-2:] == ["--max-num-seqs", "64"]
    assert flag(container, "--max-model-len") == "4096"
    assert flag(container, "--api-key-file") == "/etc/deepseek/api-key/api-key"
    (key_volume,) = [v for v in pod["volumes"] if v["name"] == "api-key"]
    assert key_volume["secret"]["defaultMode"] == 0o444  # readable by the non-root engine without an fsGroup
    assert [e["name"] for e in container["env"]][-2:] == ["LOG_LEVEL", "X"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels["team"] == "ml" and labels[names.PARENT_LABEL] == "v3"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}] and container["imagePullPolicy"] == "Always"
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": "25%", "maxUnavailable": 0}


def test_pod_extras_reach_the_pod() -> None:
    _, pod, container = engine(VARIANTS["pod-extras"])
    assert (pod["runtimeClassName"], pod["schedulerName"]) == ("nvidia", "volcano")
    assert pod["topologySpreadConstraints"][0]["topologyKey"] == "topology.kubernetes.io/zone"
    assert pod["volumes"][-1]["name"] == "cache" and container["volumeMounts"][-1]["name"] == "cache"
    assert [c["name"] for c in pod["containers"]] == ["engine", "logs"]
    assert pod["securityContext"]["fsGroup"] == 10001 and pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                                            "readOnlyRootFilesystem": True}


def test_rdma_wiring() -> None:
    deployment, _, container = engine(VARIANTS["rdma"])
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["k8s.v1.cni.cncf.io/networks"] == "rdma-net,other/rdma-b"
    assert container["resources"]["limits"]["rdma/rdma_shared_device_a"] == "2"
    assert container["resources"]["requests"]["rdma/rdma_shared_device_a"] == "2"
    assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    assert flag(container, "--kv-transport") == "rdma"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NCCL_IB_DISABLE"] == "0" and env["NCCL_IB_HCA"] == "mlx5_0"
    assert env["UCX_NET_DEVICES"] == "mlx5_0:1" and env["NCCL_IB_GID_INDEX"] == "3"
    _, _, plain = engine(parent())
    assert "add" not in plain["securityContext"]["capabilities"]
    assert not any(e["name"].startswith("NCCL") for e in plain["env"])


def test_model_sources() -> None:
    _, pod, container = engine(VARIANTS["hf"])
    (init,) = pod["initContainers"]
    assert init["command"] == ["hf", "download", "deepseek-ai/DeepSeek-V3", "--revision", "abc123", "--local-dir", "/models"]
    assert init["env"][0]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
    volume = next(v for v in pod["volumes"] if v["name"] == "model")
    assert volume == {"name": "model", "emptyDir": {"sizeLimit": "800Gi"}}
    assert flag(container, "--model") == "/models"
    _, pod, container = engine(VARIANTS["hostpath"])
    volume = next(v for v in pod["volumes"] if v["name"] == "model")
    assert volume["hostPath"] == {"path": "/mnt/models/v3", "type": "Directory"}
    _, pod, _ = engine(parent())
    volume = next(v for v in pod["volumes"] if v["name"] == "model")
    assert volume["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}


def test_kv_directory_password_never_in_args() -> None:
    children = build_children(parent(), kv_password="s3cret", transfer_secret=SECRET, replicas=2)
    by_name = {(c["kind"], c["metadata"]["name"]): c for c in children}
    secret = by_name["Secret", "v3-kv-auth"]
    assert base64.b64decode(secret["data"]["password"]).decode() == "s3cret"
    for child in children:
        if child["kind"] != "Secret":
            assert "s3cret" not in str(child)
    redis = by_name["Deployment", "v3-kv"]["spec"]["template"]
    args = redis["spec"]["containers"][0]["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "allkeys-lru"
    assert args[args.index("--maxmemory") + 1] == str(1024**3 * 75 // 100)
    assert args[args.index("--save") + 1] == "" and args[args.index("--appendonly") + 1] == "no"
    assert names.PARENT_LABEL not in redis["metadata"]["labels"]  # kept out of the engine selector
    engine_pod = by_name["Deployment", "v3"]["spec"]["template"]
    env = {e["name"]: e for e in engine_pod["spec"]["containers"][0]["env"]}
    assert env["DEEPSEEK_ENGINE_KV_DIRECTORY"]["value"] == (
        "redis://:$(DEEPSEEK_KV_DIRECTORY_PASSWORD)@v3-kv.ns.svc:6379/0"
    )
    assert env["DEEPSEEK_KV_DIRECTORY_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "v3-kv-auth", "key": "password"}
    assert engine_pod["metadata"]["annotations"][names.KV_AUTH_HASH] == password_hash("s3cret")
    policy = by_name["NetworkPolicy", "v3-kv"]["spec"]
    assert policy["ingress"][0]["from"] == [{"podSelector": {"matchLabels": {names.PARENT_LABEL: "v3"}}}]


def test_external_directory() -> None:
    children = build_children(VARIANTS["external"], kv_password=None, transfer_secret=SECRET, replicas=1)
    assert {c["kind"] for c in children} == {"Deployment", "Service", "PodDisruptionBudget", "Secret"}
    assert [c["metadata"]["name"] for c in children if c["kind"] == "Secret"] == ["v3-kv-transfer"]  # no Redis
    container = children[-1]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["DEEPSEEK_ENGINE_KV_DIRECTORY"]["value"] == "rediss://user:$(DEEPSEEK_KV_DIRECTORY_PASSWORD)@r:6380/1"
    assert env["DEEPSEEK_KV_DIRECTORY_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "s", "key": "k"}


def test_services_budget_and_labels() -> None:
    built = build_children(parent(), kv_password="p", transfer_secret=SECRET, replicas=2)
    children = {(c["kind"], c["metadata"]["name"]): c for c in built}
    service = children["Service", "v3"]["spec"]
    assert service["type"] == "ClusterIP" and service["ports"][0]["port"] == 8000
    peers = children["Service", "v3-peers"]["spec"]
    assert peers["clusterIP"] == "None" and peers["ports"][0]["port"] == 8100
    budget = children["PodDisruptionBudget", "v3"]["spec"]
    assert budget["maxUnavailable"] == 1 and budget["selector"]["matchLabels"] == {names.PARENT_LABEL: "v3"}
    for child in children.values():
        labels = child["metadata"]["labels"]
        assert labels[names.PARENT_LABEL] == "v3" and labels["app.kubernetes.io/managed-by"] == "deepseek-operator"
        assert labels["app.kubernetes.io/instance"] == "v3"


def test_replicas_left_out_when_someone_else_owns_them() -> None:
    deployment, _, _ = engine(parent(), replicas=None)
    assert "replicas" not in deployment["spec"]
    assert build_kv_deployment(parent(), auth_hash="x")["spec"]["replicas"] == 1


def test_pod_monitor_only_when_the_operator_is_set_to_make_them() -> None:
    from dataclasses import replace

    from fleet.options import BuildOptions

    assert not [c for c in build_children(parent(), kv_password="p", transfer_secret=SECRET, replicas=1)
                if c["kind"] == "PodMonitor"]
    asked = replace(parent(), options=BuildOptions(pod_monitors=True))
    (monitor,) = [c for c in build_children(asked, kv_password="p", transfer_secret=SECRET, replicas=1)
                  if c["kind"] == "PodMonitor"]
    (engine,) = [c for c in build_children(asked, kv_password="p", transfer_secret=SECRET, replicas=1)
                 if c["kind"] == "Deployment" and c["metadata"]["name"] == "v3"]
    pod = engine["spec"]["template"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in [p["name"] for p in pod["spec"]["containers"][0]["ports"]]
    assert endpoint["path"] == "/metrics" and monitor["metadata"]["labels"][names.PARENT_LABEL] == "v3"


def test_inference_pool_only_when_asked_beside_the_service() -> None:
    from dataclasses import replace

    from fleet.options import BuildOptions

    assert not [c for c in build_children(parent(), kv_password="p", transfer_secret=SECRET, replicas=1)
                if c["kind"] == "InferencePool"]
    children = build_children(replace(parent(), options=BuildOptions(inference_pools=True)), kv_password="p",
                              transfer_secret=SECRET, replicas=1)
    (pool,) = [c for c in children if c["kind"] == "InferencePool"]
    (service,) = [c for c in children if c["kind"] == "Service" and c["metadata"]["name"] == "v3"]
    assert pool["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]  # the same serving pods
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"]["name"] == "v3-epp"
