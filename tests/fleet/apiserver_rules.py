"""The rules kube-apiserver applies to a CustomResourceDefinition before it accepts it, offline.

kubernetes-validate checks a CRD against the CustomResourceDefinition type's OpenAPI schema,
which says nothing about what the apiextensions API server then refuses. The rules below are
the ones of `apiextensions-apiserver` (pkg/apis/apiextensions/validation and
pkg/apiserver/schema): structural schemas, the root metadata invariant, x-kubernetes-*
placement, defaults, CEL rules (compiled with cel-python and typed against the schema by hand,
as the API server's compiler does), subresource paths and printer columns. Messages follow the
API server's `path: Reason: detail` form.

Not reproduced: the exact CEL cost estimate. `cost_problems` applies a conservative stand-in
instead: a rule below an unbounded list or map may only use constant-cost operations.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import celpy
import jsonschema
import lark

SCHEMA_KEYS = {
    "id", "$schema", "$ref", "description", "type", "format", "title", "default", "maximum", "exclusiveMaximum",
    "minimum", "exclusiveMinimum", "maxLength", "minLength", "pattern", "maxItems", "minItems", "uniqueItems",
    "multipleOf", "enum", "maxProperties", "minProperties", "required", "items", "allOf", "oneOf", "anyOf", "not",
    "properties", "additionalProperties", "patternProperties", "dependencies", "additionalItems", "definitions",
    "externalDocs", "example", "nullable", "x-kubernetes-preserve-unknown-fields", "x-kubernetes-embedded-resource",
    "x-kubernetes-int-or-string", "x-kubernetes-list-map-keys", "x-kubernetes-list-type", "x-kubernetes-map-type",
    "x-kubernetes-validations",
}
FORBIDDEN = {
    "$ref": "$ref is not supported",
    "$schema": "$schema is not supported",
    "id": "id is not supported",
    "definitions": "definitions are not supported",
    "dependencies": "dependencies are not supported",
    "additionalItems": "additionalItems is not supported",
    "patternProperties": "patternProperties is not supported",
}
TYPES = {"array", "boolean", "integer", "number", "object", "string"}
SCALARS = {"boolean", "integer", "number", "string"}
# What a schema inside anyOf/allOf/oneOf/not may not say ("must be empty to be structural").
NOT_IN_VALUE_VALIDATION = (
    "type", "default", "description", "title", "nullable", "additionalProperties",
    "x-kubernetes-preserve-unknown-fields", "x-kubernetes-embedded-resource", "x-kubernetes-int-or-string",
    "x-kubernetes-list-map-keys", "x-kubernetes-list-type", "x-kubernetes-map-type", "x-kubernetes-validations",
)
INT_OR_STRING = [{"type": "integer"}, {"type": "string"}]
RULE_KEYS = {"rule", "message", "messageExpression", "reason", "fieldPath", "optionalOldSelf"}
RULE_REASONS = {"FieldValueInvalid", "FieldValueForbidden", "FieldValueRequired", "FieldValueDuplicate"}
COLUMN_TYPES = {"integer", "number", "string", "boolean", "date"}
COLUMN_FORMATS = {"int32", "int64", "float", "double", "byte", "date", "date-time", "password"}
# Functions and macros whose cost grows with the size of what they work on.
UNBOUNDED_COST = {"matches", "all", "exists", "exists_one", "map", "filter", "split", "join", "replace",
                  "indexOf", "lastIndexOf", "find", "findAll", "contains"}


def crd_problems(crd: dict[str, Any]) -> list[str]:
    """Every reason a real API server would refuse this CRD (empty when it would accept it)."""
    problems = _names_problems(crd)
    versions = crd.get("spec", {}).get("versions", [])
    if sum(1 for v in versions if v.get("storage")) != 1:
        problems.append("spec.versions: Invalid value: must have exactly one version marked as storage version")
    for i, version in enumerate(versions):
        where = f"spec.versions[{i}]"
        root = version.get("schema", {}).get("openAPIV3Schema")
        if root is None:
            problems.append(f"{where}.schema.openAPIV3Schema: Required value")
            continue
        path = f"{where}.schema.openAPIV3Schema"
        problems += schema_problems(root, path)
        problems += metadata_problems(root, path)
        problems += default_problems(root, path)
        problems += cel_problems(root, path)
        problems += cost_problems(root, path)
        problems += _subresource_problems(version, root, where)
        problems += _column_problems(version, root, where)
    return problems


def _names_problems(crd: dict[str, Any]) -> list[str]:
    spec, problems = crd.get("spec", {}), []
    names = spec.get("names", {})
    if crd.get("metadata", {}).get("name") != f"{names.get('plural')}.{spec.get('group')}":
        problems.append("metadata.name: Invalid value: must be spec.names.plural+\".\"+spec.group")
    dns_label = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
    for key in ("plural", "singular"):
        if key in names and not dns_label.match(names[key]):
            problems.append(f"spec.names.{key}: Invalid value: must be a lowercase DNS label")
    for key in ("kind", "listKind"):
        if key in names and not re.match(r"^[A-Za-z][A-Za-z0-9]*$", names[key]):
            problems.append(f"spec.names.{key}: Invalid value: must be a valid kind")
    return problems


# --- structural schema --------------------------------------------------------------------------


def schema_problems(node: Any, path: str, *, level: str = "root") -> list[str]:
    """Structural-schema and x-kubernetes-* rules for node and everything below it.

    level: "root", "field" (under properties, items or additionalProperties) or "value"
    (inside anyOf/allOf/oneOf/not, where only value validations may appear).
    """
    if not isinstance(node, dict):
        return [f"{path}: Invalid value: a schema must be an object"]
    problems = [f"{path}.{key}: Forbidden: unknown field" for key in node if key not in SCHEMA_KEYS]
    problems += [f"{path}.{key}: Forbidden: {why}" for key, why in FORBIDDEN.items() if key in node]
    type_ = node.get("type")
    int_or_string = node.get("x-kubernetes-int-or-string") is True
    preserve = node.get("x-kubernetes-preserve-unknown-fields")
    if level == "value":
        for key in NOT_IN_VALUE_VALIDATION:
            if key in node:
                problems.append(f"{path}.{key}: Forbidden: must be empty to be structural")
    else:
        if type_ is None and not int_or_string and preserve is not True:
            kind = "the root" if level == "root" else "specified fields"
            problems.append(f"{path}.type: Required value: must not be empty for {kind}")
        if level == "root" and type_ not in (None, "object"):
            problems.append(f"{path}.type: Invalid value: {type_!r}: must be object at the root")
    if type_ == "null":
        problems.append(f"{path}.type: Forbidden: type cannot be set to null, use nullable as an alternative")
    elif type_ is not None and type_ not in TYPES:
        problems.append(f"{path}.type: Unsupported value: {type_!r}")
    if node.get("nullable") is not None and type_ is None and level != "value":
        problems.append(f"{path}.nullable: Forbidden: nullable needs a type")
    if node.get("uniqueItems") is True:
        problems.append(f"{path}.uniqueItems: Forbidden: uniqueItems cannot be set to true since the runtime "
                        "complexity becomes quadratic")
    problems += _shape_problems(node, path, type_, level)
    problems += _extension_problems(node, path, type_, int_or_string, preserve)
    for name, prop in (node.get("properties") or {}).items():
        problems += schema_problems(prop, f"{path}.properties[{name}]", level="value" if level == "value" else "field")
    items = node.get("items")
    if isinstance(items, list):
        problems.append(f"{path}.items: Forbidden: items must be a schema object and not an array")
    elif items is not None:
        problems += schema_problems(items, f"{path}.items", level="value" if level == "value" else "field")
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        problems += schema_problems(extra, f"{path}.additionalProperties", level="value" if level == "value" else "field")
    for key in ("anyOf", "allOf", "oneOf"):
        for i, branch in enumerate(node.get(key) or []):
            if int_or_string and _is_int_or_string_pattern(node, key, i):
                continue
            problems += schema_problems(branch, f"{path}.{key}[{i}]", level="value")
            problems += _completeness_problems(branch, node, f"{path}.{key}[{i}]")
    if "not" in node:
        problems += schema_problems(node["not"], f"{path}.not", level="value")
        problems += _completeness_problems(node["not"], node, f"{path}.not")
    return problems


def _shape_problems(node: dict[str, Any], path: str, type_: str | None, level: str) -> list[str]:
    problems = []
    if level != "value":
        if type_ == "array" and "items" not in node:
            problems.append(f"{path}.items: Required value: must be specified")
        if "items" in node and type_ not in (None, "array"):
            problems.append(f"{path}.items: Forbidden: must be empty for type={type_}")
        for key in ("properties", "additionalProperties"):
            if key in node and type_ not in (None, "object"):
                problems.append(f"{path}.{key}: Forbidden: must be empty for type={type_}")
    extra = node.get("additionalProperties")
    if extra is False:
        problems.append(f"{path}.additionalProperties: Forbidden: additionalProperties cannot be set to false")
    if node.get("properties") and isinstance(extra, dict):
        problems.append(f"{path}.additionalProperties: Forbidden: additionalProperties and properties are mutual exclusive")
    return problems


def _is_int_or_string_pattern(node: dict[str, Any], key: str, index: int) -> bool:
    branch = node[key][index]
    if key == "anyOf":
        return node["anyOf"] == INT_OR_STRING
    return key == "allOf" and branch == {"anyOf": INT_OR_STRING}


def _extension_problems(node: dict[str, Any], path: str, type_: str | None, int_or_string: bool,
                        preserve: Any) -> list[str]:
    problems = []
    if preserve is not None and preserve is not True:
        problems.append(f"{path}.x-kubernetes-preserve-unknown-fields: Invalid value: {preserve!r}: must be true or undefined")
    if "x-kubernetes-int-or-string" in node and not isinstance(node["x-kubernetes-int-or-string"], bool):
        problems.append(f"{path}.x-kubernetes-int-or-string: Invalid value: must be a boolean")
    if int_or_string:
        if type_ is not None:
            problems.append(f"{path}.type: Invalid value: {type_!r}: must be empty if x-kubernetes-int-or-string is true")
        any_of, all_of = node.get("anyOf"), node.get("allOf")
        if any_of is not None and any_of != INT_OR_STRING:
            problems.append(f"{path}.anyOf: Forbidden: with x-kubernetes-int-or-string only "
                            "anyOf: [{type: integer}, {type: string}] is allowed")
        if all_of is not None and any_of is None and (not all_of or all_of[0] != {"anyOf": INT_OR_STRING}):
            problems.append(f"{path}.allOf: Forbidden: with x-kubernetes-int-or-string, allOf must start with "
                            "anyOf: [{type: integer}, {type: string}]")
    if node.get("x-kubernetes-embedded-resource") is True:
        if type_ != "object":
            problems.append(f"{path}.type: Invalid value: must be object if x-kubernetes-embedded-resource is true")
        if not node.get("properties") and preserve is not True:
            problems.append(f"{path}.properties: Required value: must not be empty if x-kubernetes-embedded-resource "
                            "is true without x-kubernetes-preserve-unknown-fields")
    problems += _list_problems(node, path, type_)
    map_type = node.get("x-kubernetes-map-type")
    if map_type is not None:
        if map_type not in ("granular", "atomic"):
            problems.append(f"{path}.x-kubernetes-map-type: Unsupported value: {map_type!r}")
        if type_ != "object":
            problems.append(f"{path}.x-kubernetes-map-type: Invalid value: must only be used on type=object")
    return problems


def _list_problems(node: dict[str, Any], path: str, type_: str | None) -> list[str]:
    problems = []
    list_type, keys = node.get("x-kubernetes-list-type"), node.get("x-kubernetes-list-map-keys")
    if keys is not None and list_type != "map":
        problems.append(f"{path}.x-kubernetes-list-map-keys: Forbidden: requires x-kubernetes-list-type=map")
    if list_type is None:
        return problems
    if list_type not in ("atomic", "set", "map"):
        return problems + [f"{path}.x-kubernetes-list-type: Unsupported value: {list_type!r}"]
    if type_ != "array":
        return problems + [f"{path}.type: Invalid value: must be array if x-kubernetes-list-type is set"]
    items = node.get("items") if isinstance(node.get("items"), dict) else {}
    if list_type == "set":
        if items.get("type") not in SCALARS and items.get("x-kubernetes-map-type") != "atomic":
            problems.append(f"{path}.items: Invalid value: items of x-kubernetes-list-type=set must be scalars "
                            "or atomic maps")
    if list_type == "map":
        if not keys:
            problems.append(f"{path}.x-kubernetes-list-map-keys: Required value: must not be empty if "
                            "x-kubernetes-list-type is map")
        if items.get("type") != "object":
            problems.append(f"{path}.items.type: Invalid value: must be object if x-kubernetes-list-type is map")
        if len(set(keys or [])) != len(keys or []):
            problems.append(f"{path}.x-kubernetes-list-map-keys: Duplicate value")
        properties, required = items.get("properties") or {}, set(items.get("required") or [])
        for key in keys or []:
            prop = properties.get(key)
            if prop is None:
                problems.append(f"{path}.x-kubernetes-list-map-keys: Invalid value: {key!r}: entries must all be "
                                "names of item properties")
            elif prop.get("type") not in SCALARS and not prop.get("x-kubernetes-int-or-string"):
                problems.append(f"{path}.items.properties[{key}].type: Invalid value: must be a scalar type if "
                                "the property is a map key")
            elif key not in required and "default" not in prop:
                problems.append(f"{path}.items.properties[{key}]: Required value: a map key must be required "
                                "or have a default")
    return problems


def _completeness_problems(branch: Any, structural: dict[str, Any], path: str) -> list[str]:
    """A value validation may only mention properties and items the structural schema specifies."""
    if not isinstance(branch, dict):
        return []
    problems = []
    for name, sub in (branch.get("properties") or {}).items():
        target = (structural.get("properties") or {}).get(name)
        if target is None and structural.get("x-kubernetes-preserve-unknown-fields") is not True:
            problems.append(f"{path}.properties[{name}]: Required value: because it is defined in "
                            f"{path.rsplit('.', 1)[-1]}, it must be specified in the structural schema")
        elif target is not None:
            problems += _completeness_problems(sub, target, f"{path}.properties[{name}]")
    if isinstance(branch.get("items"), dict):
        if "items" not in structural and structural.get("x-kubernetes-preserve-unknown-fields") is not True:
            problems.append(f"{path}.items: Required value: must be specified in the structural schema")
        elif "items" in structural:
            problems += _completeness_problems(branch["items"], structural["items"], f"{path}.items")
    for key in ("anyOf", "allOf", "oneOf"):
        for i, sub in enumerate(branch.get(key) or []):
            problems += _completeness_problems(sub, structural, f"{path}.{key}[{i}]")
    return problems


def metadata_problems(root: dict[str, Any], path: str) -> list[str]:
    """The root's apiVersion, kind and metadata: the API server implies their schemas."""
    properties, problems = root.get("properties") or {}, []
    for key in ("apiVersion", "kind"):
        if key in properties and properties[key].get("type") != "string":
            problems.append(f"{path}.properties[{key}].type: Invalid value: must be string")
    metadata = properties.get("metadata")
    if metadata is None:
        return problems
    if metadata.get("type") != "object":
        problems.append(f"{path}.properties[metadata].type: Invalid value: must be object")
    rest = {k: v for k, v in metadata.items() if k != "type"}
    fields = set((rest.pop("properties", None) or {}))
    if rest or not fields <= {"name", "generateName"}:
        problems.append(f"{path}.properties[metadata]: Forbidden: must not specify anything other than name and "
                        "generateName, but metadata is implicitly specified")
    return problems


# --- defaults ----------------------------------------------------------------------------------


def default_problems(node: dict[str, Any], path: str, *, in_metadata: bool = False) -> list[str]:
    """Defaults: valid against their own schema, already pruned, not null unless nullable, not in metadata."""
    problems = []
    if "default" in node:
        value = node["default"]
        if in_metadata:
            problems.append(f"{path}.default: Forbidden: must not be set inside metadata")
        elif value is None and not node.get("nullable"):
            problems.append(f"{path}.default: Invalid value: null: must not be null for a non-nullable field")
        else:
            if prune(value, node) != value:
                problems.append(f"{path}.default: Invalid value: must not have unknown fields")
            for error in jsonschema.Draft4Validator(_as_json_schema(node)).iter_errors(value):
                where = "".join(f"[{p}]" for p in error.path)
                problems.append(f"{path}.default{where}: Invalid value: {error.message}")
            problems += [f"{path}.default: Invalid value: {failure}" for failure in _cel_failures(value, node)]
    for name, prop in (node.get("properties") or {}).items():
        metadata = in_metadata or (path.endswith("openAPIV3Schema") and name == "metadata")
        problems += default_problems(prop, f"{path}.properties[{name}]", in_metadata=metadata)
    if isinstance(node.get("items"), dict):
        problems += default_problems(node["items"], f"{path}.items", in_metadata=in_metadata)
    if isinstance(node.get("additionalProperties"), dict):
        problems += default_problems(node["additionalProperties"], f"{path}.additionalProperties",
                                     in_metadata=in_metadata)
    return problems


def prune(value: Any, node: dict[str, Any]) -> Any:
    """value with every field the schema does not specify removed, as the API server stores it."""
    if isinstance(value, dict) and node.get("x-kubernetes-preserve-unknown-fields") is not True:
        properties, extra = node.get("properties"), node.get("additionalProperties")
        if properties is not None:
            return {k: prune(v, properties[k]) for k, v in value.items() if k in properties}
        if isinstance(extra, dict):
            return {k: prune(v, extra) for k, v in value.items()}
        return {}
    if isinstance(value, list) and isinstance(node.get("items"), dict):
        return [prune(v, node["items"]) for v in value]
    return copy.deepcopy(value)


def _as_json_schema(node: Any) -> Any:
    """A CRD schema as draft-4 JSON schema: int-or-string and nullable spelled out."""
    if isinstance(node, list):
        return [_as_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _as_json_schema(v) for k, v in node.items() if not k.startswith("x-kubernetes-") and k != "nullable"}
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if node.get("x-kubernetes-int-or-string"):
        out.pop("anyOf", None)
        out["type"] = ["integer", "string"]
    return out


# --- CEL ---------------------------------------------------------------------------------------


def _rules(node: dict[str, Any]) -> list[dict[str, Any]]:
    return node.get("x-kubernetes-validations") or []


def _cel_failures(value: Any, node: dict[str, Any]) -> list[str]:
    """Messages of the CEL rules at node and below that value breaks (used for defaults)."""
    env, failures = celpy.Environment(), []
    for rule in _rules(node):
        try:
            result = env.program(env.compile(rule["rule"])).evaluate({"self": celpy.json_to_cel(value)})
        except Exception:  # noqa: BLE001  (a rule that cannot be evaluated rejects the object too)
            result = None
        if not (isinstance(result, celpy.celtypes.BoolType) and bool(result)):
            failures.append(f"{rule.get('message', rule['rule'])} (x-kubernetes-validations)")
    if isinstance(value, dict):
        for name, prop in (node.get("properties") or {}).items():
            if name in value:
                failures += _cel_failures(value[name], prop)
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for item in value:
            failures += _cel_failures(item, node["items"])
    return failures


def cel_problems(node: dict[str, Any], path: str, *, is_root: bool = True) -> list[str]:
    """Every rule compiles, names only fields its schema declares, and has well-formed options."""
    problems = []
    env = celpy.Environment()
    scope = _cel_scope(node, is_root)
    for i, rule in enumerate(_rules(node)):
        where = f"{path}.x-kubernetes-validations[{i}]"
        problems += [f"{where}.{key}: Forbidden: unknown field" for key in rule if key not in RULE_KEYS]
        if not rule.get("rule"):
            problems.append(f"{where}.rule: Required value")
            continue
        try:
            tree = env.compile(rule["rule"])
        except celpy.CELParseError as exc:
            problems.append(f"{where}.rule: Invalid value: compilation failed: {str(exc).splitlines()[0]}")
            continue
        problems += [f"{where}.rule: Invalid value: {p}" for p in _reference_problems(tree, scope)]
        if "oldSelf" in _identifiers(tree):
            problems.append(f"{where}.rule: Invalid value: transition rules (oldSelf) are not expected here")
        message = rule.get("message")
        if message is not None and (not message.strip() or "\n" in message or len(message) > 4096):
            problems.append(f"{where}.message: Invalid value: must be non-empty, one line, at most 4096 characters")
        if "reason" in rule and rule["reason"] not in RULE_REASONS:
            problems.append(f"{where}.reason: Unsupported value: {rule['reason']!r}")
        if "fieldPath" in rule and _resolve(scope, _field_path(rule["fieldPath"])) is None:
            problems.append(f"{where}.fieldPath: Invalid value: {rule['fieldPath']!r}: does not name a field")
    for name, prop in (node.get("properties") or {}).items():
        if not (is_root and name == "metadata"):
            problems += cel_problems(prop, f"{path}.properties[{name}]", is_root=False)
    if isinstance(node.get("items"), dict):
        problems += cel_problems(node["items"], f"{path}.items", is_root=False)
    if isinstance(node.get("additionalProperties"), dict):
        problems += cel_problems(node["additionalProperties"], f"{path}.additionalProperties", is_root=False)
    return problems


def _cel_scope(node: dict[str, Any], is_root: bool) -> dict[str, Any]:
    """What `self` is typed as: at the root, metadata exposes only name and generateName."""
    if not is_root:
        return node
    properties = dict(node.get("properties") or {})
    if "metadata" in properties:
        properties["metadata"] = {"type": "object", "properties": {
            "name": {"type": "string"}, "generateName": {"type": "string"}}}
    return {**node, "properties": properties}


def _field_path(text: str) -> list[str]:
    return [part for part in re.split(r"[.\[\]']", text) if part]


def _resolve(node: dict[str, Any] | None, parts: list[str]) -> dict[str, Any] | None:
    for part in parts:
        if node is None:
            return None
        if node.get("x-kubernetes-preserve-unknown-fields") is True:
            return {}  # dynamic below here
        if part in (node.get("properties") or {}):
            node = node["properties"][part]
        elif isinstance(node.get("additionalProperties"), dict):
            node = node["additionalProperties"]
        else:
            return None
    return node


def _identifiers(tree: lark.Tree) -> set[str]:
    return {str(t.children[0]) for t in tree.iter_subtrees() if t.data == "ident" and t.children}


def _self_paths(tree: lark.Tree) -> list[list[str]]:
    """Every `self.a.b...` chain in a rule, longest form only."""
    paths = []

    def chain(member: lark.Tree) -> list[str] | None:
        if member.data == "member_dot":
            base = chain(member.children[0])
            return None if base is None else base + [str(member.children[1])]
        if member.data in ("member", "primary") and len(member.children) == 1 and isinstance(member.children[0], lark.Tree):
            return chain(member.children[0])
        if member.data == "ident" and str(member.children[0]) == "self":
            return []
        return None

    for sub in tree.iter_subtrees():
        if sub.data == "member_dot":
            found = chain(sub)
            if found:
                paths.append(found)
    return [p for p in paths if not any(len(q) > len(p) and q[:len(p)] == p for q in paths)]


def _reference_problems(tree: lark.Tree, scope: dict[str, Any]) -> list[str]:
    problems = []
    for parts in _self_paths(tree):
        node: dict[str, Any] | None = scope
        for depth, part in enumerate(parts):
            if node is None or node.get("x-kubernetes-preserve-unknown-fields") is True:
                break
            properties = node.get("properties") or {}
            if part in properties:
                node = properties[part]
            elif isinstance(node.get("additionalProperties"), dict):
                node = node["additionalProperties"]
            else:
                problems.append(f"undefined field '{part}' (self.{'.'.join(parts[:depth + 1])})")
                break
    return problems


def cost_problems(node: dict[str, Any], path: str, *, unbounded: bool = False) -> list[str]:
    """Below an unbounded list or map, a rule may only use constant-cost operations.

    The API server estimates each rule's cost times the most elements it can run on; an unbounded
    list counts as large as a request can hold, so a regex or a macro there exceeds the budget.
    """
    problems = []
    env = celpy.Environment()
    if unbounded:
        for i, rule in enumerate(_rules(node)):
            try:
                tree = env.compile(rule["rule"])
            except celpy.CELParseError:
                continue  # reported by cel_problems
            called = {str(_function_name(t)) for t in tree.iter_subtrees() if t.data in ("member_dot_arg", "ident_arg")}
            costly = sorted(called & UNBOUNDED_COST)
            if costly:
                problems.append(f"{path}.x-kubernetes-validations[{i}].rule: Forbidden: estimated rule cost exceeds "
                                f"budget: {', '.join(costly)} under an unbounded list or map (set maxItems/maxProperties)")
    for name, prop in (node.get("properties") or {}).items():
        problems += cost_problems(prop, f"{path}.properties[{name}]", unbounded=unbounded)
    if isinstance(node.get("items"), dict):
        problems += cost_problems(node["items"], f"{path}.items", unbounded=unbounded or "maxItems" not in node)
    if isinstance(node.get("additionalProperties"), dict):
        problems += cost_problems(node["additionalProperties"], f"{path}.additionalProperties",
                                  unbounded=unbounded or "maxProperties" not in node)
    return problems


def _function_name(call: lark.Tree) -> str:
    # member_dot_arg: [receiver, name, args]; ident_arg: [name, args]
    return str(call.children[1] if call.data == "member_dot_arg" else call.children[0])


# --- subresources and printer columns ----------------------------------------------------------


def _subresource_problems(version: dict[str, Any], root: dict[str, Any], where: str) -> list[str]:
    scale = (version.get("subresources") or {}).get("scale")
    if scale is None:
        return []
    problems = []
    wanted = (("specReplicasPath", ".spec.", "integer"), ("statusReplicasPath", ".status.", "integer"),
              ("labelSelectorPath", None, "string"))
    for key, prefix, type_ in wanted:
        value = scale.get(key)
        if value is None:
            if key != "labelSelectorPath":
                problems.append(f"{where}.subresources.scale.{key}: Required value")
            continue
        if prefix and not value.startswith(prefix) or not value.startswith((".spec.", ".status.")):
            problems.append(f"{where}.subresources.scale.{key}: Invalid value: {value!r}: should be a json path "
                            f"under {prefix or '.spec or .status'}")
            continue
        target = _resolve(root, _field_path(value))
        if target is None or target.get("type") != type_:
            problems.append(f"{where}.subresources.scale.{key}: Invalid value: {value!r}: must point to a field of "
                            f"type {type_} in the schema")
    return problems


def _column_problems(version: dict[str, Any], root: dict[str, Any], where: str) -> list[str]:
    problems = []
    for i, column in enumerate(version.get("additionalPrinterColumns") or []):
        at = f"{where}.additionalPrinterColumns[{i}]"
        if not column.get("name"):
            problems.append(f"{at}.name: Required value")
        if column.get("type") not in COLUMN_TYPES:
            problems.append(f"{at}.type: Unsupported value: {column.get('type')!r}")
        if "format" in column and column["format"] not in COLUMN_FORMATS:
            problems.append(f"{at}.format: Unsupported value: {column['format']!r}")
        json_path = column.get("jsonPath", "")
        if not json_path.startswith("."):
            problems.append(f"{at}.jsonPath: Invalid value: {json_path!r}: must be a simple json path starting with .")
            continue
        plain = json_path.split("[", 1)[0]
        if not plain.startswith(".metadata.") and _resolve(root, _field_path(plain)) is None:
            problems.append(f"{at}.jsonPath: Invalid value: {json_path!r}: names no field of the schema")
    return problems
