"""The DeepSeekDeployment being reconciled, as the builders see it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleet.options import BuildOptions
from fleet.spec import DeepSeekDeploymentSpec


@dataclass(frozen=True)
class Parent:
    """Identity plus validated spec of one DeepSeekDeployment, and the operator's options for it."""

    name: str
    namespace: str
    spec: DeepSeekDeploymentSpec
    generation: int = 0
    options: BuildOptions = BuildOptions()

    @classmethod
    def from_body(cls, body: dict[str, Any], spec: DeepSeekDeploymentSpec,
                  options: BuildOptions = BuildOptions()) -> Parent:
        """Take identity from a resource body and pair it with its already-validated spec."""
        meta = body["metadata"]
        return cls(name=meta["name"], namespace=meta["namespace"], spec=spec, generation=meta.get("generation", 0),
                   options=options)

    @property
    def engine_image(self) -> str:
        """The image the engine pods run: the spec's, else the operator's default."""
        return self.spec.engine.image or self.options.engine_image
