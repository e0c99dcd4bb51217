"""The CustomResourceDefinition, rendered from the pydantic models (`python -m fleet.crd` rewrites the file)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

from fleet import names
from fleet.schema import structural
from fleet.spec import DeepSeekDeploymentSpec
from fleet.status import DeepSeekDeploymentStatus
from fleet.validation import NAME_RULE

CRD_PATH = Path("crds") / f"{names.CRD_NAME}.yaml"


def build_crd() -> dict[str, Any]:
    """The CRD manifest: structural schema, defaults, CEL rules, subresources and printer columns."""
    spec_schema = structural(DeepSeekDeploymentSpec.model_json_schema(by_alias=True, mode="validation"))
    status_schema = structural(DeepSeekDeploymentStatus.model_json_schema(by_alias=True, mode="validation"))
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": names.CRD_NAME},
        "spec": {
            "group": names.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": names.KIND,
                "listKind": f"{names.KIND}List",
                "plural": names.PLURAL,
                "singular": names.SINGULAR,
                "shortNames": [names.SHORT_NAME],
                "categories": ["deepseek-fleet"],
            },
            "versions": [
                {
                    "name": names.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "DeepSeekDeployment runs a fleet of DeepSeek inference replicas "
                            "with a shared KV-cache directory behind one OpenAI-compatible endpoint.",
                            "required": ["spec"],
                            "x-kubernetes-validations": [NAME_RULE],
                            "properties": {
                                "apiVersion": {"type": "string", "description": "API version of the object."},
                                "kind": {"type": "string", "description": "Kind of the object."},
                                # The API server implies the root metadata's schema: anything beyond
                                # `type: object` (even a description) gets the CRD rejected.
                                "metadata": {"type": "object"},
                                "spec": spec_schema,
                                "status": status_schema,
                            },
                        }
                    },
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": [
                        {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
                        {"name": "Replicas", "type": "integer", "jsonPath": ".status.readyReplicas",
                         "description": "Ready engine replicas."},
                        {"name": "Queue", "type": "number", "jsonPath": ".status.queueDepth",
                         "description": "Requests waiting or running over the ready replicas."},
                        {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint"},
                        {"name": "Image", "type": "string", "jsonPath": ".status.engineImage", "priority": 1,
                         "description": "Engine image of the current pod template."},
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    ],
                }
            ],
        },
    }


def render_crd() -> str:
    """The CRD as the YAML text committed under crds/."""
    header = "# Generated from the pydantic models in operator/fleet by `python -m fleet.crd`; do not edit.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=120)


def render_reference() -> str:
    """A Markdown table of every spec and status field (docs/crd.md embeds it)."""
    root = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    lines = ["| field | type | default | description |", "|---|---|---|---|"]
    for top in ("spec", "status"):
        for path, node in _fields(root[top], top):
            kind = "int or string" if node.get("x-kubernetes-int-or-string") else node.get("type", "")
            if "enum" in node:
                kind += " (" + " \\| ".join(map(str, node["enum"])) + ")"
            default = json.dumps(node["default"]) if "default" in node and not isinstance(node["default"], dict) else ""
            text = " ".join(node.get("description", "").split()).replace("|", "\\|")
            lines.append(f"| `{path}` | {kind} | {default and f'`{default}`'} | {text} |")
    return "\n".join(lines) + "\n"


def _fields(node: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for name, prop in node.get("properties", {}).items():
        out.append((f"{path}.{name}", prop))
        child = prop.get("items", prop)
        out += _fields(child, f"{path}.{name}" + ("[]" if "items" in prop else ""))
    return out


def main() -> None:
    """Write the CRD file (run from the repository root); `-` prints it, `reference` prints the field table."""
    if sys.argv[1:] == ["-"]:
        sys.stdout.write(render_crd())
    elif sys.argv[1:] == ["reference"]:
        sys.stdout.write(render_reference())
    else:
        CRD_PATH.write_text(render_crd())


if __name__ == "__main__":
    main()
