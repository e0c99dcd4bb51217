"""The Helm chart: lints clean, renders valid Kubernetes 1.33 objects, and takes its CRD and RBAC
from the operator's generators, never from hand-written copies. Runs the real Helm binary."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from admission import admit

from fleet.options import DEFAULT_ENGINE_IMAGE
from fleet.rbac import cluster_role, rules
from fleet.settings import OperatorSettings
from fleet.validation import validate

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "deepseek-fleet-operator"
RELEASE, RELEASE_NAMESPACE = "fleet-ops", "deepseek-system"
KUBE_VERSION = "1.33.0"

SCENARIOS = {
    "defaults": {},
    "namespaced": {"watchNamespaces": ["team-a", "team-b"]},
    "monitoring": {"monitoring": {"podMonitors": True, "serviceMonitor": {"enabled": True, "labels": {"release": "kps"}}},
                   "metrics": {"port": 9191}, "routing": {"inferencePools": True}},
    "overrides": {
        "image": {"repository": "registry.example.com/platform/deepseek-operator", "tag": "0.1.0-rc1",
                  "digest": "sha256:" + "ab" * 32, "pullPolicy": "Always"},
        "imagePullSecrets": [{"name": "registry-creds"}],
        "engineImage": "registry.example.com/platform/deepseek-engine:0.1.0",
        "watchNamespaces": ["llm"],
        "logLevel": "debug",
        "resyncSeconds": 30,
        "serviceAccount": {"create": False, "name": "platform-operator"},
        "liveness": {"enabled": False},
        "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
        "podAnnotations": {"example.com/team": "platform"},
        "podLabels": {"team": "platform"},
        "priorityClassName": "system-cluster-critical",
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "CriticalAddonsOnly", "operator": "Exists"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64", "arm64"]}]}]}}},
        "fullnameOverride": "dsf-operator",
    },
}
STANDARD_LABELS = ("helm.sh/chart", "app.kubernetes.io/name", "app.kubernetes.io/instance",
                   "app.kubernetes.io/version", "app.kubernetes.io/managed-by")


@functools.cache
def helm_binary() -> str:
    """`.tools/bin/helm` (scripts/install-helm.sh puts it there), else helm on PATH."""
    local = ROOT / ".tools" / "bin" / "helm"
    found = str(local) if local.is_file() else shutil.which("helm")
    if found is None:
        pytest.fail("no helm binary: run scripts/install-helm.sh (it installs .tools/bin/helm)")
    return found


def helm(*args: str, values: dict[str, Any] | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run helm with the given values (as a values file, exactly as a user would pass them)."""
    command = [helm_binary(), *args]
    if values is not None:
        command += ["--values", "-"]
    result = subprocess.run(command, input=yaml.safe_dump(values or {}), capture_output=True, text=True, timeout=60)
    if check:
        assert result.returncode == 0, f"{' '.join(args)} failed:\n{result.stderr}"
    return result


@functools.cache
def _render(values_yaml: str) -> str:
    return helm("template", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE, "--kube-version", KUBE_VERSION,
                "--include-crds", values=yaml.safe_load(values_yaml)).stdout


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    """Every object `helm template` renders (CRDs included) for these values."""
    return [d for d in yaml.safe_load_all(_render(yaml.safe_dump(values))) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def the(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = by_kind(docs, kind)
    return doc


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (operator,) = the(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return operator


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_lint_is_clean(scenario: str) -> None:
    result = helm("lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION, values=SCENARIOS[scenario])
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout, result.stdout


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_rendered_object_is_valid_for_kubernetes_1_33(scenario: str) -> None:
    docs = render(SCENARIOS[scenario])
    assert {"CustomResourceDefinition", "Deployment"} <= {d["kind"] for d in docs}
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a Prometheus Operator kind: no schema offline (test_service_monitor checks it)
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_standard_labels_and_one_release_namespace(scenario: str) -> None:
    docs = [d for d in render(SCENARIOS[scenario]) if d["kind"] != "CustomResourceDefinition"]
    for doc in docs:
        labels = doc["metadata"]["labels"]
        assert all(key in labels for key in STANDARD_LABELS), (doc["kind"], labels)
        assert labels["app.kubernetes.io/managed-by"] == "Helm"  # never the operator's own children label
    for doc in by_kind(docs, "Deployment") + by_kind(docs, "ServiceAccount"):
        assert doc["metadata"]["namespace"] == RELEASE_NAMESPACE


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_one_operator_replica_replaced_with_recreate(scenario: str) -> None:
    docs = render(SCENARIOS[scenario])
    deployment = the(docs, "Deployment")
    spec, pod = deployment["spec"], deployment["spec"]["template"]
    # Standalone Kopf (no peering): two operators must never run at once.
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    assert spec["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert container(docs)["securityContext"]["readOnlyRootFilesystem"] is True
    if scenario != "overrides":
        (account,) = by_kind(docs, "ServiceAccount")
        assert pod["spec"]["serviceAccountName"] == account["metadata"]["name"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_operator_reads_the_settings_the_chart_sets(scenario: str) -> None:
    values = SCENARIOS[scenario]
    docs = render(values)
    operator = container(docs)
    env = {e["name"]: e["value"] for e in operator["env"]}
    settings = OperatorSettings.load(operator.get("args", []), env)
    assert list(settings.namespaces) == values.get("watchNamespaces", [])
    assert settings.verbose == (values.get("logLevel") == "debug")
    chart_default = yaml.safe_load((CHART / "values.yaml").read_text())["engineImage"]
    assert settings.engine_image == values.get("engineImage", chart_default)
    assert settings.resync_seconds == values.get("resyncSeconds", 60)
    assert settings.pod_monitors == values.get("monitoring", {}).get("podMonitors", False)
    assert settings.inference_pools == values.get("routing", {}).get("inferencePools", False)
    (metrics,) = [p for p in operator["ports"] if p["name"] == "metrics"]
    assert settings.metrics_port == metrics["containerPort"] == values.get("metrics", {}).get("port", 9090)
    if values.get("liveness", {}).get("enabled", True):
        port = operator["livenessProbe"]["httpGet"]["port"]
        (declared,) = [p for p in operator["ports"] if p["name"] == port]
        assert settings.liveness_endpoint == f"http://0.0.0.0:{declared['containerPort']}/healthz"
        assert operator["livenessProbe"]["httpGet"]["path"] == "/healthz"
    else:
        assert settings.liveness_endpoint is None and "livenessProbe" not in operator


def test_overrides_reach_the_pod() -> None:
    values = SCENARIOS["overrides"]
    docs = render(values)
    pod = the(docs, "Deployment")["spec"]["template"]
    operator = container(docs)
    assert operator["image"] == f"{values['image']['repository']}@{values['image']['digest']}"
    assert operator["imagePullPolicy"] == "Always" and operator["resources"] == values["resources"]
    assert pod["spec"]["serviceAccountName"] == "platform-operator" and not by_kind(docs, "ServiceAccount")
    for key in ("nodeSelector", "tolerations", "affinity", "imagePullSecrets", "priorityClassName"):
        assert pod["spec"][key] == values[key], key
    assert pod["metadata"]["labels"]["team"] == "platform"
    assert pod["metadata"]["annotations"]["example.com/team"] == "platform"
    assert the(docs, "Deployment")["metadata"]["name"] == "dsf-operator"
    (binding,) = by_kind(docs, "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "platform-operator", "namespace": RELEASE_NAMESPACE}]


def test_service_monitor_only_when_asked_and_it_finds_the_operator() -> None:
    assert not [d for d in render({}) if d["kind"] in ("ServiceMonitor", "Service")]
    docs = render(SCENARIOS["monitoring"])
    monitor, service, deployment = the(docs, "ServiceMonitor"), the(docs, "Service"), the(docs, "Deployment")
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == service["spec"]["ports"][0]["name"] == "metrics" and endpoint["path"] == "/metrics"


def test_default_image_is_the_app_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert chart["appVersion"] == version, "Chart.yaml appVersion must follow pyproject's version"
    assert container(render({}))["image"].endswith(f":{version}")
    assert yaml.safe_load((CHART / "values.yaml").read_text())["engineImage"] == DEFAULT_ENGINE_IMAGE
    assert DEFAULT_ENGINE_IMAGE.endswith(f":{version}")


def test_cluster_wide_rbac_is_the_generated_rules() -> None:
    docs = render({})
    role, binding = the(docs, "ClusterRole"), the(docs, "ClusterRoleBinding")
    assert role["rules"] == rules()
    assert not by_kind(docs, "Role") and not by_kind(docs, "RoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": role["metadata"]["name"]}
    account = the(docs, "ServiceAccount")["metadata"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["name"], "namespace": RELEASE_NAMESPACE}]


def test_namespaced_rbac_is_a_role_per_watched_namespace() -> None:
    docs = render(SCENARIOS["namespaced"])
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")
    roles, bindings = by_kind(docs, "Role"), by_kind(docs, "RoleBinding")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert all(r["rules"] == rules() for r in roles)
    account = the(docs, "ServiceAccount")["metadata"]
    for binding in bindings:
        role = next(r for r in roles if r["metadata"]["namespace"] == binding["metadata"]["namespace"])
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                      "name": role["metadata"]["name"]}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["name"], "namespace": RELEASE_NAMESPACE}]
    assert len(bindings) == len(roles)


def test_rbac_can_be_left_to_the_platform_team() -> None:
    kinds = {d["kind"] for d in render({"rbac": {"create": False}})}
    assert not kinds & {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}


def test_chart_crds_are_identical_to_crds() -> None:
    committed = {p.name: p.read_bytes() for p in (ROOT / "crds").glob("*.yaml")}
    in_chart = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*.yaml")}
    assert in_chart == committed, "the chart's crds/ is stale: run scripts/sync-chart-crds.sh"
    (crd,) = [d for d in render({}) if d["kind"] == "CustomResourceDefinition"]
    assert [crd] == [yaml.safe_load(text) for text in committed.values()]


def test_chart_rbac_file_is_the_generator_output() -> None:
    generated = yaml.safe_load((CHART / "files" / "operator-rbac.yaml").read_text())
    assert generated == cluster_role(), "the chart's RBAC is stale: run scripts/sync-chart-crds.sh"


def test_sync_script_check_passes_on_the_committed_chart() -> None:
    result = subprocess.run(["bash", "scripts/sync-chart-crds.sh", "--check"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_sync_script_finds_and_repairs_a_stale_chart(tmp_path: Path) -> None:
    for part in ("crds", "charts", "scripts", "operator"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    stale_crd = next((tmp_path / CHART.relative_to(ROOT) / "crds").glob("*.yaml"))
    stale_crd.write_text(stale_crd.read_text().replace("DeepSeekDeployment runs", "A hand edit of"))
    rbac_file = tmp_path / CHART.relative_to(ROOT) / "files" / "operator-rbac.yaml"
    rbac_file.write_text(rbac_file.read_text().replace("- watch\n", "", 1))
    script = tmp_path / "scripts" / "sync-chart-crds.sh"

    check = subprocess.run(["bash", str(script), "--check"], capture_output=True, text=True, timeout=60)
    assert check.returncode == 1 and "run scripts/sync-chart-crds.sh" in check.stderr
    assert "A hand edit of" in stale_crd.read_text()  # --check changes nothing
    subprocess.run(["bash", str(script)], check=True, capture_output=True, timeout=60)
    assert stale_crd.read_bytes() == (ROOT / "crds" / stale_crd.name).read_bytes()
    assert yaml.safe_load(rbac_file.read_text()) == cluster_role()


BAD_VALUES = [
    ({"logLevel": "trace"}, "logLevel"),
    ({"watchNamespaces": ["team-*"]}, "watchNamespaces"),
    ({"watchNamspaces": ["a"]}, "watchNamspaces"),
    ({"image": {"repository": ""}}, "repository"),
    ({"image": {"repository": "r", "digest": "latest"}}, "digest"),
    ({"liveness": {"port": 0}}, "port"),
    ({"resyncSeconds": -1}, "resyncSeconds"),
    ({"serviceAccount": {"create": False}}, "serviceAccount.name is required"),
]


@pytest.mark.parametrize(("values", "named"), BAD_VALUES, ids=[n for _, n in BAD_VALUES])
def test_bad_values_fail_with_a_message_naming_them(values: dict[str, Any], named: str) -> None:
    result = helm("template", RELEASE, str(CHART), values=values, check=False)
    assert result.returncode != 0 and named in result.stderr, result.stderr


def test_old_clusters_are_refused() -> None:
    result = helm("template", RELEASE, str(CHART), "--kube-version", "1.29.0", check=False)
    assert result.returncode != 0 and "kubeVersion" in result.stderr


@pytest.mark.parametrize("scenario", ["defaults", "namespaced"])
def test_notes_give_a_first_fleet_that_the_crd_admits(scenario: str) -> None:
    values = SCENARIOS[scenario]
    out = helm("install", RELEASE, str(CHART), "--dry-run=client", "--namespace", RELEASE_NAMESPACE,
               values=values).stdout
    notes = out.split("NOTES:", 1)[1]
    assert f"rollout status deployment/{RELEASE}-deepseek-fleet-operator" in notes
    assert "docs/conditions.md" in notes
    manifest = notes.split("<<'YAML'\n", 1)[1].split("YAML\n", 1)[0]
    fleet = yaml.safe_load(manifest)
    assert "engine" not in fleet["spec"]  # the operator's engineImage applies
    assert yaml.safe_load((CHART / "values.yaml").read_text())["engineImage"] in notes
    assert admit(fleet) == []
    namespace = values.get("watchNamespaces", ["default"])[0]
    validate({**fleet, "metadata": {**fleet["metadata"], "namespace": namespace}})
    if values.get("watchNamespaces"):
        assert f"kubectl apply -n {namespace} -f -" in notes
