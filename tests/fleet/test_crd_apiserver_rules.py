"""The CRD passes the rules a real kube-apiserver applies to CRDs, and the checker of those rules
catches each kind of mistake it claims to (apiserver_rules.py says what is and is not covered)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from apiserver_rules import crd_problems

from fleet.crd import CRD_PATH, build_crd

ROOT = Path(__file__).resolve().parents[2]
CHART_CRD = ROOT / "charts" / "deepseek-fleet-operator" / CRD_PATH


@pytest.mark.parametrize("source", ["models", "crds/", "chart"])
def test_the_crd_would_be_accepted_by_an_api_server(source: str) -> None:
    crd = {"models": build_crd, "crds/": lambda: yaml.safe_load((ROOT / CRD_PATH).read_text()),
           "chart": lambda: yaml.safe_load(CHART_CRD.read_text())}[source]()
    assert crd_problems(crd) == []


def _root(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _node(crd: dict[str, Any], path: str) -> dict[str, Any]:
    node = _root(crd)
    for part in filter(None, path.split("/")):
        node = node["items"] if part == "[]" else node["properties"][part]
    return node


def _set(path: str, **fields: Any) -> Callable[[dict[str, Any]], None]:
    return lambda crd: _node(crd, path).update(fields)


def _drop(path: str, key: str) -> Callable[[dict[str, Any]], None]:
    return lambda crd: _node(crd, path).pop(key)


def _rule(path: str, rule: str) -> Callable[[dict[str, Any]], None]:
    return lambda crd: _node(crd, path).setdefault("x-kubernetes-validations", []).append({"rule": rule, "message": "m"})


# mutation of today's CRD -> what the API server would say about it
BROKEN = {
    # The rejection seen on a real cluster: the generator once wrote a description here.
    "metadata-description": (_set("metadata", description="Standard object metadata."),
                             "properties[metadata]: Forbidden: must not specify anything other than name and generateName"),
    "metadata-labels": (_set("metadata", properties={"labels": {"type": "object"}}),
                        "properties[metadata]: Forbidden"),
    "metadata-default": (_set("metadata", default={"name": "x"}), "must not be set inside metadata"),
    "kind-not-string": (_set("kind", type="integer"), "properties[kind].type: Invalid value: must be string"),
    "untyped-field": (_drop("spec/replicas", "type"), "properties[replicas].type: Required value"),
    "type-null": (_set("spec/replicas", type="null"), "type cannot be set to null"),
    "nullable-without-type": (lambda crd: _node(crd, "spec/replicas").update(nullable=True) or
                              _node(crd, "spec/replicas").pop("type"), "nullable needs a type"),
    "array-without-items": (_drop("spec/engine/extraArgs", "items"), "extraArgs].items: Required value"),
    "items-on-a-string": (_set("spec/model/name", items={"type": "string"}), "must be empty for type=string"),
    "items-as-a-list": (_set("spec/engine/extraArgs", items=[{"type": "string"}]), "must be a schema object and not an array"),
    "ref": (_set("spec/model", **{"$ref": "#/x"}), "$ref is not supported"),
    "unique-items": (_set("spec/engine/extraArgs", uniqueItems=True), "uniqueItems cannot be set to true"),
    "additional-properties-false": (_set("spec/model", additionalProperties=False),
                                    "additionalProperties cannot be set to false"),
    "properties-and-additional": (_set("spec/model", additionalProperties={"type": "string"}), "mutual exclusive"),
    "preserve-false": (_set("spec/template/affinity", **{"x-kubernetes-preserve-unknown-fields": False}),
                       "must be true or undefined"),
    "int-or-string-typed": (_set("spec/rollout/maxSurge", type="string"), "must be empty if x-kubernetes-int-or-string"),
    "int-or-string-other-anyof": (_set("spec/rollout/maxSurge", anyOf=[{"type": "integer"}, {"type": "number"}]),
                                  "anyOf"),
    "description-in-anyof": (_set("spec/engine/image", anyOf=[{"description": "d"}]),
                             "anyOf[0].description: Forbidden: must be empty to be structural"),
    "anyof-names-unknown-field": (_set("spec/model", anyOf=[{"properties": {"nope": {"minLength": 1}}}]),
                                  "anyOf[0].properties[nope]: Required value"),
    "list-type-on-object": (_set("spec/model", **{"x-kubernetes-list-type": "atomic"}), "must be array"),
    "list-type-unknown": (_set("status/conditions", **{"x-kubernetes-list-type": "bag"}), "Unsupported value: 'bag'"),
    "map-keys-without-map": (_set("spec/engine/extraArgs", **{"x-kubernetes-list-map-keys": ["x"]}),
                             "requires x-kubernetes-list-type=map"),
    "map-list-without-keys": (_drop("status/conditions", "x-kubernetes-list-map-keys"), "must not be empty"),
    "map-key-optional": (lambda crd: _node(crd, "status/conditions/[]")["required"].remove("type"),
                         "a map key must be required or have a default"),
    "map-key-not-a-property": (_set("status/conditions", **{"x-kubernetes-list-map-keys": ["kind"]}),
                               "entries must all be names of item properties"),
    "set-of-objects": (_set("status/conditions", **{"x-kubernetes-list-type": "set"}), "must be scalars or atomic maps"),
    "map-type-on-array": (_set("spec/engine/extraArgs", **{"x-kubernetes-map-type": "atomic"}),
                          "must only be used on type=object"),
    "default-out-of-range": (_set("spec/replicas", default=-1), "default: Invalid value: -1 is less than the minimum"),
    "default-unknown-field": (_set("spec/rollout", default={"maxSurge": 0, "nope": 1}), "must not have unknown fields"),
    "default-null": (_set("spec/replicas", default=None), "must not be null"),
    "default-breaks-cel": (_set("spec/autoscaling", default={"enabled": True}), "maxReplicas is required"),
    "cel-syntax": (_rule("spec", "self.replicas >"), "compilation failed"),
    "cel-unknown-field": (_rule("spec", "self.replica > 0"), "undefined field 'replica'"),
    "cel-metadata-labels": (_rule("", "has(self.metadata.labels)"), "undefined field 'labels'"),
    "cel-bad-reason": (lambda crd: _node(crd, "spec").setdefault("x-kubernetes-validations", []).append(
        {"rule": "true", "reason": "Nope"}), "reason: Unsupported value"),
    "cel-bad-field-path": (lambda crd: _node(crd, "spec").setdefault("x-kubernetes-validations", []).append(
        {"rule": "true", "fieldPath": ".nope"}), "fieldPath: Invalid value"),
    "cel-regex-in-unbounded-list": (_rule("spec/engine/env/[]", "self.name.matches('^[A-Z_]+$')"),
                                    "estimated rule cost exceeds budget: matches"),
    "scale-path-missing": (lambda crd: crd["spec"]["versions"][0]["subresources"]["scale"].update(
        specReplicasPath=".spec.count"), "must point to a field of type integer"),
    "column-type": (lambda crd: crd["spec"]["versions"][0]["additionalPrinterColumns"][0].update(type="list"),
                    "additionalPrinterColumns[0].type: Unsupported value"),
    "two-storage-versions": (lambda crd: crd["spec"]["versions"].append(
        {**copy.deepcopy(crd["spec"]["versions"][0]), "name": "v1beta1"}), "exactly one version marked as storage"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_each_rule_catches_its_mistake(case: str) -> None:
    mutate, expected = BROKEN[case]
    crd = copy.deepcopy(build_crd())
    mutate(crd)
    problems = crd_problems(crd)
    assert any(expected in p for p in problems), problems
