"""Pydantic models rendered as Kubernetes structural OpenAPI schemas (the CRD's source)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from kubernetes.utils import parse_quantity
from pydantic import BaseModel, BeforeValidator, ConfigDict, WithJsonSchema, model_validator
from pydantic.alias_generators import to_camel


@dataclass(frozen=True)
class CelRule:
    """One admission rule, written once in CEL (for the API server) and once in Python (for us).

    The operator re-checks every rule because objects can predate a rule or reach it through a
    server that skipped validation; a test evaluates both forms on the same samples.
    """

    cel: str
    message: str
    check: Callable[[Any], bool]


class ApiModel(BaseModel):
    """A CRD object: camelCase on the wire, unknown fields refused, field docstrings as descriptions."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
    )
    # Subclasses list their admission rules in a `CEL_RULES: ClassVar[tuple[CelRule, ...]]`.

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema, handler):  # noqa: ANN001, ANN206
        schema = handler(core_schema)
        rules = cls.__dict__.get("CEL_RULES", ())
        if rules:
            target = handler.resolve_ref_schema(schema)
            target["x-kubernetes-validations"] = [{"rule": r.cel, "message": r.message} for r in rules]
        return schema

    @model_validator(mode="after")
    def _check_cel_rules(self) -> ApiModel:
        for rule in type(self).__dict__.get("CEL_RULES", ()):
            if not rule.check(self):
                raise ValueError(rule.message)
        return self


def _quantity(value: Any) -> str:
    text = str(value)
    parse_quantity(text)  # raises ValueError with the offending text
    return text


Quantity = Annotated[
    str,
    BeforeValidator(_quantity),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "x-kubernetes-int-or-string": True,
            "pattern": r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$",
        }
    ),
]
"""A Kubernetes resource quantity such as `64Gi` or `500m` (the API server accepts ints too)."""

IntOrString = Annotated[
    int | str,
    WithJsonSchema({"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}),
]
"""A count or a percentage (`1`, `"25%"`), as Kubernetes rollout and budget fields take them."""

FreeForm = Annotated[
    dict[str, Any],
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]
"""A Kubernetes object we pass through unchanged (the API server checks it on the child)."""


def structural(schema: dict[str, Any]) -> dict[str, Any]:
    """Turn a pydantic JSON schema into a structural OpenAPI v3 schema for a CRD."""
    defs = schema.get("$defs", {})
    return _convert(schema, defs)


_DROPPED = {"title", "$defs"}


def _convert(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_convert(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _convert(merged, defs)
    if "anyOf" in node and not node.get("x-kubernetes-int-or-string"):
        # Optional[X] arrives as anyOf [X, null]: structural schemas express "may be absent"
        # by leaving the field out of `required`, so the null branch simply goes.
        branches = [b for b in node["anyOf"] if b.get("type") != "null"]
        if len(branches) != 1:
            raise ValueError(f"cannot express a union as a structural schema: {node['anyOf']}")
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        if rest.get("default", "absent") is None:
            del rest["default"]
        return _convert({**branches[0], **rest}, defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROPPED:
            continue
        if key in ("exclusiveMinimum", "exclusiveMaximum"):
            # JSON Schema's numeric form becomes OpenAPI v3.0's bound plus a boolean flag.
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        elif key == "default":
            out[key] = _without_nulls(value)  # an unset optional field is absent, never null
        elif key == "properties":
            out[key] = {name: _convert(prop, defs) for name, prop in value.items()}
        elif key == "additionalProperties" and value is False:
            continue  # structural schemas prune unknown fields already
        else:
            out[key] = _convert(value, defs)
    return out


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value
