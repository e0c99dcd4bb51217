"""What the API server does with a DeepSeekDeployment at admission, from the CRD alone.

Structural defaulting, OpenAPI validation (draft 4 semantics, as OpenAPI v3.0 has) and every
`x-kubernetes-validations` CEL rule, evaluated with cel-python. No API server is needed.
"""

from __future__ import annotations

import copy
from typing import Any

import celpy
import jsonschema

from fleet.crd import build_crd


def root_schema() -> dict[str, Any]:
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def defaulted(obj: Any, schema: dict[str, Any] | None = None) -> Any:
    """Apply schema defaults the way the API server does (absent fields only, recursively)."""
    schema = root_schema() if schema is None else schema
    obj = copy.deepcopy(obj)
    if isinstance(obj, dict):
        for name, prop in schema.get("properties", {}).items():
            if name not in obj and "default" in prop:
                obj[name] = copy.deepcopy(prop["default"])
            if name in obj:
                obj[name] = defaulted(obj[name], prop)
    elif isinstance(obj, list) and "items" in schema:
        obj = [defaulted(item, schema["items"]) for item in obj]
    return obj


def schema_errors(obj: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft4Validator(root_schema())
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(obj)]


def cel_failures(obj: Any, schema: dict[str, Any] | None = None) -> list[str]:
    """Messages of every CEL rule that rejects obj (which should already be defaulted)."""
    schema = root_schema() if schema is None else schema
    failures = []
    env = celpy.Environment()
    for rule in schema.get("x-kubernetes-validations", []):
        program = env.program(env.compile(rule["rule"]))
        if not program.evaluate({"self": celpy.json_to_cel(obj)}):
            failures.append(rule["message"])
    if isinstance(obj, dict):
        for name, prop in schema.get("properties", {}).items():
            if name in obj:
                failures += cel_failures(obj[name], prop)
    elif isinstance(obj, list) and "items" in schema:
        for item in obj:
            failures += cel_failures(item, schema["items"])
    return failures


def admit(obj: dict[str, Any]) -> list[str]:
    """Everything admission would refuse in obj, after defaulting it."""
    full = defaulted(obj)
    return schema_errors(full) + cel_failures(full)
