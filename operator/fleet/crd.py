"""The CustomResourceDefinition, rendered from the pydantic models (`python -m fleet.crd` rewrites the file)."""

from __future__ import annotations

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
                                "metadata": {"type": "object", "description": "Standard object metadata."},
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
                         "description": "Waiting requests over all replicas."},
                        {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint"},
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


def main() -> None:
    """Write the CRD file (run from the repository root), or print it with `-`."""
    text = render_crd()
    if sys.argv[1:] == ["-"]:
        sys.stdout.write(text)
    else:
        CRD_PATH.write_text(text)


if __name__ == "__main__":
    main()
