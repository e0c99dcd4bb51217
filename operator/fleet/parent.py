"""The DeepSeekDeployment being reconciled, as the builders see it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleet.spec import DeepSeekDeploymentSpec


@dataclass(frozen=True)
class Parent:
    """Identity plus validated spec of one DeepSeekDeployment."""

    name: str
    namespace: str
    spec: DeepSeekDeploymentSpec
    generation: int = 0

    @classmethod
    def from_body(cls, body: dict[str, Any], spec: DeepSeekDeploymentSpec) -> Parent:
        """Take identity from a resource body and pair it with its already-validated spec."""
        meta = body["metadata"]
        return cls(name=meta["name"], namespace=meta["namespace"], spec=spec, generation=meta.get("generation", 0))
