"""The seam operator -> engine: for every example fleet, the engine container's command, args and env
exactly as the operator renders them.

One rendered replica of each kind starts `deepseek-engine serve` on this machine (no GPU: every rank a
process, gloo) and answers a chat completion through the official openai client: one GPU (external-redis.yaml
given one GPU: its API key, its extraArgs' MTP drafts, its external directory), tensor parallel
(gb300-four-gpus.yaml: four ranks, the RDMA transport, the managed directory) and multi-node
(two-replicas-managed-redis.yaml over two nodes); their processes start ahead of the module, while an
earlier module runs (start_servers). Every example's rendered command, started or not, goes
through the engine's own command line (`engine.cli.main`'s parser, the environment's defaults) and
configuration (`settings_from_args`, `engine_config`) as at a start, and each rendered value is checked to
arrive there. Of the examples not started, eight-gpus-rdma.yaml and external-redis.yaml render exactly a
started command but for the tensor-parallel degree (checked so); the other two differ from the started ones
only in values the parse test checks (the model's name, the degree, --max-model-len, the tcp transport).

Only what a cluster provides is stood in for: the model path (deepseek-tiny), the downward API (pod
name, pod IP = loopback), the Secrets' values, the Secret volumes (a local file holding what the
kubelet would project: the API key, the built KV transfer Secret's key), the Redis Service's address
(a real redis-server with the rendered URL's password on loopback), the ports (free ones, where a
pod has its own network) and the GPUs' memory: on a GPU the engine sizes the KV cache from what it finds
free, on a CPU it takes 1 GiB a rank, which 8 ranks on a few cores spend seconds first touching; 64 MiB
a rank here, through the flag's environment variable, which a rendered flag or variable would override."""

import base64
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis as redis_lib
import yaml

from engine.config import SpeculativeConfig
from engine.kv.auth import PeerAuth
from fleet.manifests import build_children
from fleet.validation import validate
from tests.engine.conftest_server import free_port, module_servers, selected_items, selected_params
from tests.redis_server import RedisServer

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
# The rendered replicas started here, one of each kind but multi-node (its own test below): id -> (example,
# changes to its spec, the tensor-parallel degree it renders).
STARTED = {
    "external-redis.yaml-on-one-gpu": ("external-redis.yaml", {"gpusPerReplica": 1}, 1),
    "gb300-four-gpus.yaml": ("gb300-four-gpus.yaml", {}, 4),
}
# Examples not started whose rendered command and env names are a started one's but for the tensor-parallel
# degree (checked in the parse test, as every example's degree is).
SAME_BUT_DEGREE = {"external-redis.yaml": "external-redis.yaml-on-one-gpu",
                   "eight-gpus-rdma.yaml": "gb300-four-gpus.yaml"}
PASSWORD = "kv-secret"
API_KEY = "sk-fleet-key"
TRANSFER_SECRET = "generated-kv-transfer-secret-0123456789"
# the stand-in for the GPUs' memory (the docstring above says why)
STAND_INS = {"DEEPSEEK_ENGINE_KV_CACHE_MEMORY": "64MiB"}


def engine_container(children: list[dict]) -> dict:
    for child in children:
        for template in _pod_templates(child):
            for container in template["spec"]["containers"]:
                if "serve" in (container.get("args") or []):
                    return container
    raise AssertionError("no engine container among the children")


def _pod_templates(obj):
    """Every pod template in a workload (a Deployment's, a LeaderWorkerSet's leader and workers)."""
    if isinstance(obj, dict):
        if "spec" in obj and isinstance(obj["spec"], dict) and "containers" in obj["spec"]:
            yield obj
        for value in obj.values():
            yield from _pod_templates(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from _pod_templates(value)


def kubelet_env(container: dict, given: dict[str, str]) -> dict[str, str]:
    """The container's env as the kubelet makes it: downward-API and Secret values from `given`, literal
    values with $(VAR) references to earlier variables expanded."""
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        name = entry["name"]
        if "value" in entry:
            env[name] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), entry["value"])
        else:
            env[name] = given[name]
    return env


def kubelet_secret_file(children: list[dict], tmp_path: Path) -> Path:
    """The file the kubelet projects from the built KV transfer Secret into the engine pods' volume."""
    (secret,) = [c for c in children if c["kind"] == "Secret" and c["metadata"]["name"].endswith("-kv-transfer")]
    path = tmp_path / "kv-secret"
    path.write_bytes(base64.b64decode(secret["data"]["secret"]))
    return path


def localize(args: list[str], env: dict[str, str], redis_port: int, api_key_file: Path, port: int,
             kv_secret_file: Path) -> list[str]:
    """Stand-ins for the cluster: the model, the ports, the Secrets' mounts, the Redis Service."""
    out = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]
    replace = {"--model": "deepseek-tiny", "--port": str(port), "--kv-transfer-port": "0",
               "--api-key-file": str(api_key_file), "--kv-secret-file": str(kv_secret_file)}
    for i, a in enumerate(out[:-1]):
        if a in replace:
            out[i + 1] = replace[a]
    for name, value in env.items():
        if value.startswith("redis://"):
            env[name] = re.sub(r"@[^/]+", f"@127.0.0.1:{redis_port}", value)
    return out


def example(name: str, **spec) -> dict:
    (doc,) = yaml.safe_load_all((EXAMPLES[0].parent / name).read_text())
    doc["spec"].update(spec)
    return doc


def render(doc: dict) -> tuple:
    """(the validated parent, its children, the engine container, the env the kubelet gives it)."""
    parent = validate({**doc, "metadata": {**doc["metadata"], "namespace": "ns"}})
    managed = parent.spec.kv_cache.directory.managed
    children = build_children(parent, kv_password=PASSWORD if managed else None, transfer_secret=TRANSFER_SECRET,
                              replicas=1)
    container = engine_container(children)
    assert container["command"] == ["deepseek-engine"]
    env = kubelet_env(container, {"POD_NAME": f"{doc['metadata']['name']}-0", "POD_IP": "127.0.0.1",
                                  "DEEPSEEK_KV_DIRECTORY_PASSWORD": PASSWORD})
    return parent, children, container, env


@dataclass
class Replica:
    """A rendered replica started here: its pods' processes (the leader's first) with the args and env each
    got, its redis-server, its HTTP port, the directory of its logs and mounts."""

    parent: Any
    pods: list[tuple[subprocess.Popen, list[str], dict[str, str]]]
    redis: RedisServer
    port: int
    tmp: Path

    def launch(self, container: dict, args: list[str], env: dict[str, str], log: str) -> None:
        with open(self.tmp / log, "w") as out:
            self.pods.append((subprocess.Popen(container["command"] + args, env={**os.environ, **STAND_INS, **env},
                                               stdout=out, stderr=subprocess.STDOUT, start_new_session=True), args, env))

    def wait_ready(self, log: str) -> None:
        deadline = time.monotonic() + 240
        while not _ready(self.port):
            assert all(proc.poll() is None for proc, _, _ in self.pods), (self.tmp / log).read_text()[-3000:]
            assert time.monotonic() < deadline, "not ready in time"
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGKILL) -> None:
        for proc, _, _ in self.pods:
            if proc.poll() is None:
                os.killpg(proc.pid, sig)
        self.redis.stop()


def start_replica(case: str, tmp: Path) -> Replica:
    """STARTED[case] rendered, and its one pod started on the rendered command, args and env."""
    name, changes, _ = STARTED[case]
    parent, children, container, env = render(example(name, **changes))
    replica = Replica(parent, [], RedisServer(tmp, port=free_port(), password=PASSWORD).start(), free_port(), tmp)
    try:
        key_file = tmp / "api-key"
        key_file.write_text(API_KEY + "\n")
        args = localize(container["args"], env, replica.redis.port, key_file, replica.port,
                        kubelet_secret_file(children, tmp))
        replica.launch(container, args, env, "engine.log")
    except BaseException:
        replica.stop()
        raise
    return replica


def start_multi_node(tmp: Path) -> Replica:
    """gpusPerNode below gpusPerReplica: the LeaderWorkerSet the operator renders, its leader's and worker's
    commands started with the env the LWS controller adds (LWS_WORKER_INDEX, LWS_LEADER_ADDRESS)."""
    doc = example("two-replicas-managed-redis.yaml", gpusPerReplica=4, gpusPerNode=2)
    doc["spec"]["engine"].pop("tensorParallelSize", None)
    parent = validate({**doc, "metadata": {**doc["metadata"], "namespace": "ns"}})
    children = build_children(parent, kv_password=PASSWORD, transfer_secret=TRANSFER_SECRET, replicas=1)
    (lws,) = [c for c in children if c["kind"] == "LeaderWorkerSet"]
    group = lws["spec"]["leaderWorkerTemplate"]
    templates = [group.get("leaderTemplate") or group["workerTemplate"], group["workerTemplate"]]
    replica = Replica(parent, [], RedisServer(tmp, port=free_port(), password=PASSWORD).start(), free_port(), tmp)
    dist_port = free_port()
    try:
        for index, template in enumerate(templates):
            (container,) = [c for c in template["spec"]["containers"] if "serve" in (c.get("args") or [])]
            env = kubelet_env(container, {"POD_NAME": f"v3-0-{index}", "POD_IP": "127.0.0.1",
                                          "DEEPSEEK_KV_DIRECTORY_PASSWORD": PASSWORD})
            env.update(LWS_WORKER_INDEX=str(index), LWS_LEADER_ADDRESS="127.0.0.1")
            args = localize(container["args"], env, replica.redis.port, tmp / "no-key", replica.port,
                            kubelet_secret_file(children, tmp))
            at = args.index("--dist-init-addr") + 1
            assert args[at] == "127.0.0.1:29500" and args[args.index("--node-rank") + 1] == str(index)
            args[at] = f"127.0.0.1:{dist_port}"  # a free port where a pod has its own network
            replica.launch(container, args, env, f"pod-{index}.log")
    except BaseException:
        replica.stop()
        raise
    return replica


def start_servers(session, tmp_path_factory) -> dict[str, Replica]:
    """The replicas of the tests this run selected, started at once (ahead of the module: tests/conftest.py's
    start_the_next_servers), each for its own test."""
    started: dict[str, Replica] = {}
    try:
        for case in selected_params(session, __name__, "case"):
            started[case] = start_replica(case, tmp_path_factory.mktemp("replica"))
        if any(item.name == "test_a_rendered_multi_node_replica_serves_across_its_pods"
               for item in selected_items(session, __name__)):
            started["multi-node"] = start_multi_node(tmp_path_factory.mktemp("multi-node"))
    except BaseException:
        for replica in started.values():
            replica.stop()
        raise
    return started


@pytest.mark.parametrize("case", STARTED)
def test_rendered_engine_command_serves_a_chat_completion(case: str, request: pytest.FixtureRequest) -> None:
    replica = module_servers(request).pop(case)
    ((proc, args, env),), parent, port, tmp_path = replica.pods, replica.parent, replica.port, replica.tmp
    try:
        tp = int(args[args.index("--tensor-parallel-size") + 1])
        assert tp == STARTED[case][2]
        replica.wait_ready("engine.log")
        key = API_KEY if "--api-key-file" in args else "unused"
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key)
        # three tokens: the prefill, then decode steps on every rank (where the MTP layer drafts, its
        # drafts' verification); each step of 8 ranks on a few cores takes a third of a second
        reply = client.chat.completions.create(model=parent.spec.model.name, max_tokens=3,
                                               messages=[{"role": "user", "content": "Hello!"}])
        assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
        assert tp == 1 or f"{tp} ranks ready" in (tmp_path / "engine.log").read_text()
        if "--speculative-config" in args:  # extraArgs reached the engine: its MTP layer drafted
            metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
            assert re.search(r"^deepseek_engine_spec_decode_draft_tokens_total [1-9]", metrics, re.M), metrics
        # the rendered directory URL (its password from the Secret) reached Redis: the replica registered
        url = next(v for v in env.values() if v.startswith("redis://"))
        keys = redis_lib.Redis.from_url(url).keys("*replica:*")
        assert any(env["POD_NAME"].encode() in k for k in keys), keys
        # ... and signed it with the fleet's secret as the operator generated it: the engine read the mount
        (record,) = [redis_lib.Redis.from_url(url, decode_responses=True).hgetall(k) for k in keys]
        fields = (env["POD_NAME"], record["incarnation"], record["addr"], record["transport"])
        assert record["sig"] == PeerAuth(TRANSFER_SECRET.encode()).sign(*fields)
        assert "without a fleet secret" not in (tmp_path / "engine.log").read_text()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(60) == 0
        replica.redis.stop()


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_rendered_engine_command_parses_into_the_engine_config_it_renders(
        path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The command line `deepseek-engine` parses (the rendered env as the flags' defaults), then the
    server's settings and the engine's configuration a start builds from it: every rendered value arrives."""
    import engine.cli
    import engine.server.launch as launch

    doc = example(path.name)
    _, children, container, env = render(doc)
    key_file = tmp_path / "api-key"
    key_file.write_text(API_KEY + "\n")
    args = localize(container["args"], env, 6379, key_file, 8000, kubelet_secret_file(children, tmp_path))
    at = args.index("--kv-transfer-port") + 1
    args[at] = container["args"][at]  # nothing binds it here: as rendered
    for name, value in {**STAND_INS, **env}.items():
        monkeypatch.setenv(name, value)
    parsed = []
    monkeypatch.setattr(launch, "run", lambda namespace: parsed.append(namespace) or 0)
    assert engine.cli.main(args) == 0
    (namespace,) = parsed
    assert namespace.command == "serve"
    settings, config = launch.settings_from_args(namespace), launch.engine_config(namespace)

    spec = doc["spec"]
    assert config.model == "deepseek-tiny" and settings.served_model_name == spec["model"]["name"]
    assert settings.port == 8000
    assert config.tensor_parallel_size == spec["engine"].get("tensorParallelSize", spec["gpusPerReplica"])
    assert config.nnodes == 1 and config.node_rank == 0
    assert config.max_model_len == spec["engine"].get("maxModelLen")
    assert settings.api_key == (API_KEY if "apiKeySecretRef" in spec["engine"] else None)
    extra = spec["engine"].get("extraArgs", [])
    want = SpeculativeConfig.parse(extra[extra.index("--speculative-config") + 1]) if extra else None
    assert config.speculative_config == want
    # the fleet: this pod's name and address, the transport, the secret the operator generated, the directory
    # URL with the password from its Secret (and the host the stand-in put there)
    assert config.replica_id == env["POD_NAME"] and config.advertise_host == "127.0.0.1"
    assert config.kv_transport == spec.get("kvCache", {}).get("transport", "tcp") and config.kv_transfer_port == 8100
    assert config.kv_secret == TRANSFER_SECRET.encode()
    url = next(v for v in env.values() if v.startswith("redis://"))
    assert config.kv_directory == url and url.startswith(f"redis://:{PASSWORD}@127.0.0.1:6379/")
    assert config.kv_cache_memory == 64 << 20  # the stand-in's variable: nothing rendered overrides it

    if path.name in SAME_BUT_DEGREE:  # what a started replica ran, but for the degree checked above
        started, changes, _ = STARTED[SAME_BUT_DEGREE[path.name]]
        _, _, other, _ = render(example(started, **changes))

        def but_degree(rendered: list[str]) -> list[str]:
            at = rendered.index("--tensor-parallel-size") + 1
            return rendered[:at] + rendered[at + 1:]

        assert but_degree(container["args"]) == but_degree(other["args"])
        assert [e["name"] for e in container["env"]] == [e["name"] for e in other["env"]]


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 200
    except httpx.TransportError:
        return False



def test_a_rendered_multi_node_replica_serves_across_its_pods(request: pytest.FixtureRequest) -> None:
    """gpusPerNode below gpusPerReplica: the operator renders a LeaderWorkerSet; its leader's and worker's
    commands, with the env the LWS controller adds (LWS_WORKER_INDEX, LWS_LEADER_ADDRESS), form one
    replica of 4 ranks over 2 "nodes" here and answer through the leader."""
    replica = module_servers(request).pop("multi-node")
    procs, tmp_path = [proc for proc, _, _ in replica.pods], replica.tmp
    try:
        replica.wait_ready("pod-0.log")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{replica.port}/v1", api_key="unused")
        reply = client.chat.completions.create(model=replica.parent.spec.model.name, max_tokens=3,
                                               messages=[{"role": "user", "content": "Hello!"}])
        assert reply.choices[0].message.content
        assert "4 ranks ready (tensor parallel, 2 node(s))" in (tmp_path / "pod-0.log").read_text()
        assert "starting ranks 2..3" in (tmp_path / "pod-1.log").read_text()
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGTERM)
        assert procs[0].wait(60) == 0
        for p in procs[1:]:
            p.wait(60)
        replica.redis.stop()
