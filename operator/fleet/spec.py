"""`DeepSeekDeployment.spec`: the desired fleet, as users write it."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from fleet.schema import ApiModel, CelRule, FreeForm, IntOrString, Quantity

DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
MODEL_URI = r"^(pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/.*)?|hostpath:///.*|hf://[^/@\s]+/[^/@\s]+(@[^\s]+)?)$"
# A qualified resource name such as nvidia.com/gpu or rdma/rdma_shared_device_a.
RESOURCE_NAME = r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"


class SecretKeyRef(ApiModel):
    """A key inside a Secret of the DeepSeekDeployment's namespace."""

    name: str = Field(pattern=DNS_SUBDOMAIN, max_length=253)
    """Name of the Secret."""
    key: str = Field(min_length=1)
    """Key inside the Secret's data."""


class ModelSpec(ApiModel):
    """Which checkpoint to serve and under which name."""

    name: str = Field(min_length=1)
    """Model name clients send in requests (`--served-model-name`)."""
    uri: str = Field(pattern=MODEL_URI)
    """Where the checkpoint lives: `pvc://claim/path`, `hostpath:///path` or `hf://org/repo@revision`
    (downloaded by an init container into the pod's volume)."""
    cache_size: Quantity | None = None
    """Size limit of the pod volume that an `hf://` checkpoint is downloaded into (unbounded if unset)."""
    downloader_image: str | None = None
    """Image of the `hf://` download init container; it must provide the `hf` command (default: the engine image)."""
    token_secret_ref: SecretKeyRef | None = None
    """Secret key holding a Hugging Face token, for gated `hf://` repositories."""

    CEL_RULES: ClassVar = (
        CelRule(
            cel="self.uri.startsWith('hf://') || !(has(self.cacheSize) || has(self.downloaderImage) || has(self.tokenSecretRef))",
            message="cacheSize, downloaderImage and tokenSecretRef only apply to hf:// models",
            check=lambda m: m.uri.startswith("hf://")
            or not (m.cache_size or m.downloader_image or m.token_secret_ref),
        ),
    )


class EnvVar(ApiModel):
    """An environment variable for the engine container."""

    name: str = Field(min_length=1)
    """Variable name."""
    value: str | None = None
    """Literal value."""
    value_from: FreeForm | None = None
    """Kubernetes EnvVarSource (secretKeyRef, configMapKeyRef, fieldRef, ...)."""


class EngineSpec(ApiModel):
    """The inference engine container."""

    image: str | None = Field(default=None, min_length=1)
    """Engine image (it must provide the `deepseek-engine` command); default: the operator's engine image
    (the chart's `engineImage`)."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    """Image pull policy of the engine and downloader containers (Kubernetes default if unset)."""
    image_pull_secrets: list[str] = []
    """Names of Secrets used to pull the images."""
    tensor_parallel_size: int | None = Field(default=None, ge=1)
    """Tensor-parallel degree (`--tensor-parallel-size`); must divide gpusPerReplica (default: gpusPerReplica)."""
    max_model_len: int | None = Field(default=None, ge=1)
    """Longest context in tokens (`--max-model-len`); the engine's default if unset."""
    api_key_secret_ref: SecretKeyRef | None = None
    """Secret key holding the API key clients must send (`--api-key-file`); no auth if unset."""
    extra_args: list[str] = []
    """Extra engine flags, appended after the ones the operator sets (which they may not repeat)."""
    env: list[EnvVar] = []
    """Extra environment variables for the engine container."""
    startup_timeout_seconds: int = Field(default=3600, ge=60)
    """How long a replica may take to load its model before Kubernetes restarts it."""
    drain_seconds: int = Field(default=120, ge=0)
    """How long a stopping replica may keep finishing in-flight requests."""


class AutoscalingSpec(ApiModel):
    """Queue-depth autoscaling; when enabled, the autoscaler owns the replica count, not spec.replicas."""

    enabled: bool = False
    """Scale on queue depth instead of following spec.replicas."""
    min_replicas: int = Field(default=1, ge=0)
    """Fewest replicas the autoscaler keeps."""
    max_replicas: int | None = Field(default=None, ge=1)
    """Most replicas the autoscaler may run (required when enabled)."""
    target_queue_depth: float = Field(default=32.0, gt=0)
    """Requests (waiting plus running) per ready replica to aim for; about half the engine's --max-num-seqs."""
    tolerance: float = Field(default=0.1, ge=0, lt=1)
    """Relative distance from the target within which the replica count is left alone (0.1: 10%)."""
    poll_interval_seconds: int = Field(default=5, ge=1)
    """How often the autoscaler reads the engines' metrics."""
    scale_up_stabilization_seconds: int = Field(default=0, ge=0)
    """How long a higher recommendation must hold before scaling up (it scales to the lowest seen in this window)."""
    scale_down_stabilization_seconds: int = Field(default=300, ge=0)
    """How long a lower recommendation must hold before scaling down (it scales to the highest seen in this window)."""
    max_scale_up_step: int = Field(default=2, ge=1)
    """Most replicas added in one scaling decision."""
    max_scale_down_step: int = Field(default=1, ge=1)
    """Most replicas removed in one scaling decision."""

    CEL_RULES: ClassVar = (
        CelRule(
            cel="!self.enabled || has(self.maxReplicas)",
            message="maxReplicas is required when autoscaling is enabled",
            check=lambda a: not a.enabled or a.max_replicas is not None,
        ),
        CelRule(
            cel="!has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
            message="minReplicas must not exceed maxReplicas",
            check=lambda a: a.max_replicas is None or a.min_replicas <= a.max_replicas,
        ),
    )


class KVDirectorySpec(ApiModel):
    """The Redis directory mapping prompt-prefix KV blocks to the replicas that hold them."""

    managed: bool | None = None
    """Let the operator run a Redis for this fleet (memory-only, LRU, password in a generated Secret)."""
    url: str | None = Field(default=None, pattern=r"^rediss?://[^\s]+$")
    """URL of an external Redis (`redis://host:6379/0` or `rediss://...`); put no password in it."""
    password_secret_ref: SecretKeyRef | None = None
    """Secret key holding the external Redis password (URL-safe characters only)."""

    CEL_RULES: ClassVar = (
        CelRule(
            cel="(has(self.managed) && self.managed) != has(self.url)",
            message="set exactly one of managed: true or url",
            check=lambda d: bool(d.managed) != (d.url is not None),
        ),
        CelRule(
            cel="!has(self.passwordSecretRef) || has(self.url)",
            message="passwordSecretRef only applies to an external directory (url)",
            check=lambda d: d.password_secret_ref is None or d.url is not None,
        ),
    )


class ManagedRedisSpec(ApiModel):
    """Settings of the operator-managed Redis (ignored for an external directory)."""

    image: str = "redis:7.2-alpine"
    """Redis image."""
    memory: Quantity = "1Gi"
    """Memory limit of the Redis container; Redis evicts least-recently-used entries at 75% of it."""


class KVCacheSpec(ApiModel):
    """Cross-replica KV cache sharing."""

    directory: KVDirectorySpec = KVDirectorySpec(managed=True)
    """Where replicas publish and look up cached prefixes."""
    transport: Literal["auto", "tcp", "rdma"] = "auto"
    """How replicas move KV blocks between each other (`--kv-transport`); auto picks RDMA when enabled."""
    redis: ManagedRedisSpec = ManagedRedisSpec()
    """Managed Redis settings."""
    transfer_secret_ref: SecretKeyRef | None = None
    """Secret key holding the KV transfer secret (`--kv-secret-file`, 16 bytes or more) that replicas authenticate
    and sign directory entries with; unset: the operator generates one into the Secret `<name>-kv-transfer`."""


class RDMASpec(ApiModel):
    """RDMA networking for the engine pods (Multus secondary networks plus an RDMA device plugin)."""

    enabled: bool = False
    """Attach RDMA devices and networks to every engine pod."""
    resource_name: str | None = Field(default=None, pattern=RESOURCE_NAME)
    """Device-plugin resource of the RDMA device, e.g. `rdma/rdma_shared_device_a` or `nvidia.com/hostdev`."""
    count: int | None = Field(default=None, ge=1)
    """How many RDMA devices each pod requests (default 1)."""
    networks: list[str] | None = None
    """Multus NetworkAttachmentDefinitions (`name` or `namespace/name`) to attach."""
    hcas: list[str] | None = None
    """HCA device names for NCCL and UCX (e.g. `mlx5_0`); autodetected if unset."""
    gid_index: int | None = Field(default=None, ge=0)
    """RoCE GID index (`NCCL_IB_GID_INDEX`); InfiniBand needs none."""

    CEL_RULES: ClassVar = (
        CelRule(
            cel="!self.enabled || has(self.resourceName)",
            message="resourceName is required when RDMA is enabled",
            check=lambda r: not r.enabled or r.resource_name is not None,
        ),
        CelRule(
            cel="self.enabled || !(has(self.resourceName) || has(self.count) || has(self.networks)"
            " || has(self.hcas) || has(self.gidIndex))",
            message="RDMA fields are only allowed when enabled is true",
            check=lambda r: r.enabled
            or all(v is None for v in (r.resource_name, r.count, r.networks, r.hcas, r.gid_index)),
        ),
    )


class NetworkSpec(ApiModel):
    """Pod networking."""

    rdma: RDMASpec = RDMASpec()
    """RDMA for KV transfers and collective communication."""


class Toleration(ApiModel):
    """A Kubernetes toleration."""

    key: str | None = None
    """Taint key (all keys when empty and operator is Exists)."""
    operator: Literal["Exists", "Equal"] | None = None
    """How key and value are compared (Equal if unset)."""
    value: str | None = None
    """Taint value to match."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to match (all effects if unset)."""
    toleration_seconds: int | None = None
    """How long a NoExecute taint is tolerated."""


class Resources(ApiModel):
    """Extra resources of the engine container; GPUs and RDMA devices come from their own fields."""

    requests: dict[str, Quantity] = {}
    """Resource requests, e.g. cpu and memory."""
    limits: dict[str, Quantity] = {}
    """Resource limits, e.g. memory."""


class PodTemplate(ApiModel):
    """Scheduling and pod-level overrides for the engine pods."""

    node_selector: dict[str, str] = {}
    """Node labels the engine pods require."""
    tolerations: list[Toleration] = []
    """Taints the engine pods tolerate (GPU nodes are often tainted)."""
    affinity: FreeForm | None = None
    """Kubernetes Affinity; the operator adds a preferred anti-affinity that spreads replicas over nodes."""
    priority_class_name: str | None = None
    """PriorityClass of the engine pods."""
    service_account_name: str | None = None
    """ServiceAccount of the engine pods."""
    resources: Resources = Resources()
    """CPU, memory and other resources of the engine container; cpu and memory requests left unset are
    4 cores and 16Gi per GPU, plus sharedMemorySize of memory."""
    shared_memory_size: Quantity = "64Gi"
    """Size of the memory-backed /dev/shm (it counts against the pod's memory)."""
    labels: dict[str, str] = {}
    """Extra pod labels (the operator's own labels win)."""
    annotations: dict[str, str] = {}
    """Extra pod annotations."""
    runtime_class_name: str | None = None
    """RuntimeClass of the engine pods (e.g. `nvidia` where the NVIDIA runtime is not the default)."""
    scheduler_name: str | None = None
    """Scheduler of the engine pods (a gang or topology-aware scheduler); the default scheduler if unset."""
    topology_spread_constraints: list[FreeForm] = []
    """Kubernetes TopologySpreadConstraints of the engine pods."""
    volumes: list[FreeForm] = []
    """Extra pod volumes (Kubernetes Volume objects); model, dshm, api-key and kv-secret are the operator's names."""
    volume_mounts: list[FreeForm] = []
    """Extra mounts of the engine container (Kubernetes VolumeMount objects)."""
    sidecars: list[FreeForm] = []
    """Extra containers next to the engine (Kubernetes Container objects), e.g. a log shipper."""
    security_context: FreeForm | None = None
    """Pod SecurityContext fields, merged over the operator's restricted defaults."""
    container_security_context: FreeForm | None = None
    """Engine container SecurityContext fields, merged over the operator's restricted defaults."""


class RolloutSpec(ApiModel):
    """How an engine update replaces pods."""

    max_surge: IntOrString = 0
    """Extra pods during a rollout; 0 needs no spare GPUs."""
    max_unavailable: IntOrString = 1
    """Pods that may be down during a rollout."""


class DisruptionBudgetSpec(ApiModel):
    """The PodDisruptionBudget guarding engine pods against voluntary evictions (node drains)."""

    max_unavailable: IntOrString = 1
    """Engine pods that may be evicted at once."""


class DeepSeekDeploymentSpec(ApiModel):
    """A fleet of DeepSeek inference replicas behind one OpenAI-compatible endpoint."""

    model: ModelSpec
    """The checkpoint to serve."""
    engine: EngineSpec = EngineSpec()
    """The engine container."""
    gpus_per_replica: int = Field(default=8, ge=1, le=512)
    """GPUs of each replica (tensor/expert parallel over them); one pod unless gpusPerNode is smaller."""
    gpus_per_node: int | None = Field(default=None, ge=1)
    """GPUs of each pod when a replica needs more than a node has: the replica becomes
    gpusPerReplica / gpusPerNode pods on as many nodes (a LeaderWorkerSet group)."""
    gpu_resource_name: str = Field(default="nvidia.com/gpu", pattern=RESOURCE_NAME)
    """Device-plugin resource name of the GPUs."""
    replicas: int = Field(default=1, ge=0)
    """Replica count while autoscaling is off (the scale subresource points here)."""
    autoscaling: AutoscalingSpec = AutoscalingSpec()
    """Queue-depth autoscaling."""
    kv_cache: KVCacheSpec = KVCacheSpec()
    """Cross-replica KV cache sharing."""
    network: NetworkSpec = NetworkSpec()
    """Pod networking."""
    template: PodTemplate = PodTemplate()
    """Engine pod overrides."""
    rollout: RolloutSpec = RolloutSpec()
    """Rolling update settings."""
    disruption_budget: DisruptionBudgetSpec = DisruptionBudgetSpec()
    """PodDisruptionBudget settings."""

    CEL_RULES: ClassVar = (
        CelRule(
            cel="has(self.gpusPerNode) || self.gpusPerReplica in [1, 2, 4, 8]",
            message="gpusPerReplica must be 1, 2, 4 or 8",
            check=lambda s: s.gpus_per_node is not None or s.gpus_per_replica in (1, 2, 4, 8),
        ),
        CelRule(
            cel="!has(self.gpusPerNode) || (self.gpusPerNode in [1, 2, 4, 8]"
            " && self.gpusPerReplica % self.gpusPerNode == 0)",
            message="gpusPerNode must be 1, 2, 4 or 8 and divide gpusPerReplica",
            check=lambda s: s.gpus_per_node is None
            or (s.gpus_per_node in (1, 2, 4, 8) and s.gpus_per_replica % s.gpus_per_node == 0),
        ),
        CelRule(
            cel="!has(self.engine.tensorParallelSize) || self.gpusPerReplica % self.engine.tensorParallelSize == 0",
            message="engine.tensorParallelSize must divide gpusPerReplica",
            check=lambda s: s.engine.tensor_parallel_size is None
            or s.gpus_per_replica % s.engine.tensor_parallel_size == 0,
        ),
        CelRule(
            cel="self.kvCache.transport != 'rdma' || self.network.rdma.enabled",
            message="kvCache.transport rdma needs network.rdma.enabled",
            check=lambda s: s.kv_cache.transport != "rdma" or s.network.rdma.enabled,
        ),
    )
