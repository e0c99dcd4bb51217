"""The operator's user docs stay true to the code and the chart: every condition reason the code can
write is explained, every chart value is documented and allowed by the values schema, and every
link between the docs leads somewhere."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import yaml
from test_chart import helm

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
CHART = ROOT / "charts" / "deepseek-fleet-operator"
USER_DOCS = ["install.md", "architecture.md", "conditions.md", "troubleshooting.md", "upgrade.md"]
CAMEL_CASE = re.compile(r"[A-Z][A-Za-z]+")
# Calls whose CamelCase string arguments are condition types or reasons: status.condition(type, ok,
# reason, message), and the autoscaler's Decision(..., reason, message) and _blind(current, reason, ...).
REASON_CALLS = {"condition", "Decision", "_blind"}


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level NAME = "string" assignments (reasons are often named constants)."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    return out


def _strings(node: ast.AST, constants: dict[str, str]) -> list[str]:
    """String values an argument can take: literals, named constants, either side of `a if c else b`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Name) and node.id in constants:
        return [constants[node.id]]
    if isinstance(node, ast.IfExp):
        return _strings(node.body, constants) + _strings(node.orelse, constants)
    return []


def reasons_in_code() -> dict[str, str]:
    """CamelCase condition types and reasons the operator can write -> the file that writes them."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "operator" / "fleet").rglob("*.py")):
        tree = ast.parse(path.read_text())
        constants = _constants(tree)
        for node in ast.walk(tree):
            values: list[str] = []
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in REASON_CALLS:
                for arg in [*node.args, *(k.value for k in node.keywords)]:
                    values += _strings(arg, constants)
            elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "reason" for t in node.targets):
                values += _strings(node.value, constants)
            for value in values:
                if CAMEL_CASE.fullmatch(value):
                    found.setdefault(value, str(path.relative_to(ROOT)))
    return found


def test_every_condition_reason_is_explained() -> None:
    found = reasons_in_code()
    # The extraction itself works: the core's and the autoscaler's reasons are among what it finds.
    assert {"Ready", "FleetReady", "InvalidSpec", "RDMAReady", "NetworkNotAttached"} <= set(found)
    text = (DOCS / "conditions.md").read_text()
    missing = {reason: where for reason, where in found.items() if f"`{reason}`" not in text}
    assert not missing, f"docs/conditions.md does not explain {missing}"


def test_conditions_doc_names_no_reason_the_code_lacks() -> None:
    found = set(reasons_in_code())
    text = (DOCS / "conditions.md").read_text()
    documented = set(re.findall(r"^\| (?:True|False) \| `(\w+)` \|", text, re.M))
    assert documented, "no reason rows found"
    assert documented <= found, f"docs/conditions.md explains reasons the code never writes: {documented - found}"


def _leaves(values: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in values.items():
        if isinstance(value, dict) and value and not key.endswith(("annotations", "Annotations", "Labels", "resources",
                                                                      "Context", "context", "nodeSelector", "affinity")):
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_values_schema_allows_exactly_the_documented_values() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())

    def walk(node: dict, schema_node: dict, where: str) -> None:
        assert set(node) == set(schema_node["properties"]), f"{where or 'values'}: values.yaml and the schema differ"
        for key, value in node.items():
            child = schema_node["properties"][key]
            if isinstance(value, dict) and child.get("additionalProperties") is False:
                walk(value, child, f"{where}{key}.")

    walk(values, schema, "")
    table = (DOCS / "install.md").read_text().split("### Values", 1)[1].split("\n## ", 1)[0]
    rows = {line.split("|")[1] for line in table.splitlines() if line.startswith("| `")}
    for leaf in _leaves(values):
        top, _, rest = leaf.partition(".")
        assert any(f"`{leaf}`" in row or (f"`{top}." in row and f".{rest}`" in row) for row in rows), (
            f"docs/install.md's values table does not document {leaf}")


LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", markdown, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("name", USER_DOCS)
def test_links_lead_somewhere(name: str) -> None:
    for target in LINK.findall((DOCS / name).read_text()):
        if re.match(r"https?://", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (DOCS / path).resolve() if path else DOCS / name
        assert resolved.exists(), f"{name} links to {target}, which does not exist"
        if anchor and resolved.suffix == ".md":
            assert anchor in _anchors(resolved.read_text()), f"{name} links to {target}: no such heading"


def test_install_guide_commands_match_the_chart() -> None:
    guide = (DOCS / "install.md").read_text()
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    release, namespace = re.search(rf"helm install (\S+) charts/{chart['name']} \\\n\s+--namespace (\S+)", guide).groups()
    # The names the guides use are the ones the chart gives its objects for that release.
    rendered = yaml.safe_load_all(helm("template", release, str(CHART), "--namespace", namespace).stdout)
    (deployment,) = [d["metadata"]["name"] for d in rendered if d and d["kind"] == "Deployment"]
    for doc, command in [("install.md", f"-n {namespace} rollout status deployment/{deployment}"),
                         ("upgrade.md", f"-n {namespace} rollout status deployment/{deployment}"),
                         ("troubleshooting.md", f"-n {namespace} logs deploy/{deployment}")]:
        assert command in (DOCS / doc).read_text(), f"{doc} should say `kubectl {command}`"
    assert f"charts/{chart['name']}" in guide
    for dockerfile in ("images/operator/Dockerfile", "images/engine/Dockerfile"):
        assert f"-f {dockerfile}" in guide and (ROOT / dockerfile).is_file()
    minimum = re.search(r">=(\d+\.\d+)", chart["kubeVersion"])[1]
    assert f"Kubernetes {minimum} or newer" in guide
