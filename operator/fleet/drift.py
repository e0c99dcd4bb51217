"""Comparing a child we want with the child that exists, and the merge patch that reconciles them.

The API server adds defaults to every object, so "unchanged" means every field we set still has
our value. Fields we set earlier but no longer want are found through the last-applied record
we keep on each child (the way client-side `kubectl apply` does it).
"""

from __future__ import annotations

import copy
import json
from typing import Any

from kubernetes.utils import parse_quantity

from fleet import names

QUANTITY_KEYS = {"requests", "limits"}  # maps whose values the API server canonicalises
QUANTITY_FIELDS = {"sizeLimit"}
# Fields that stop being ours when someone else takes them over (the autoscaler's replicas).
UNRECORDED = (("spec", "replicas"),)


def contains(live: Any, desired: Any, *, key: str = "", parent_key: str = "") -> bool:
    """Whether every value set in desired is present and equal in live."""
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return False
        return all(
            k in live and contains(live[k], v, key=k, parent_key=key) for k, v in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(live) == len(desired)
            and all(contains(a, b, key=key, parent_key=parent_key) for a, b in zip(live, desired))
        )
    if live == desired:
        return True
    if parent_key in QUANTITY_KEYS or key in QUANTITY_FIELDS:
        return _same_quantity(live, desired)
    return False


def _same_quantity(a: Any, b: Any) -> bool:
    try:
        return parse_quantity(a) == parse_quantity(b)
    except (ValueError, TypeError):
        return False


def record(desired: dict[str, Any]) -> str:
    """The last-applied record of a child: what we set, minus fields another owner may take over."""
    kept = copy.deepcopy(desired)
    kept.get("metadata", {}).get("annotations", {}).pop(names.LAST_APPLIED, None)
    kept.get("metadata", {}).pop("ownerReferences", None)
    for path in UNRECORDED:
        node = kept
        for part in path[:-1]:
            node = node.get(part, {})
        node.pop(path[-1], None)
    return json.dumps(kept, sort_keys=True, separators=(",", ":"))


def with_record(desired: dict[str, Any]) -> dict[str, Any]:
    """desired carrying its own last-applied record as an annotation."""
    out = copy.deepcopy(desired)
    annotations = out.setdefault("metadata", {}).setdefault("annotations", {})
    annotations[names.LAST_APPLIED] = record(desired)
    return out


def merge_patch(desired: dict[str, Any], live: dict[str, Any]) -> dict[str, Any] | None:
    """JSON merge patch (RFC 7386) turning live into desired, or None if nothing differs.

    desired must already carry its record (see with_record). Lists are replaced whole, which
    is what we want for containers, env and volumes: we own them entirely.
    """
    if contains(live, desired):
        return None
    raw = (live.get("metadata", {}).get("annotations") or {}).get(names.LAST_APPLIED)
    last = json.loads(raw) if raw else {}
    patch = copy.deepcopy(desired)
    _add_removals(patch, last)
    return patch


def _add_removals(patch: dict[str, Any], last: dict[str, Any]) -> None:
    for key, old in last.items():
        if key not in patch:
            patch[key] = None
        elif isinstance(old, dict) and isinstance(patch[key], dict):
            _add_removals(patch[key], old)
