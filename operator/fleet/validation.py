"""Checks a spec must pass before anything is built: the models' own rules plus what CEL cannot see."""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from fleet.manifests import kv_transfer
from fleet.manifests.engine import MANAGED_FLAGS
from fleet.manifests.kv_directory import PASSWORD_ENV
from fleet.options import BuildOptions
from fleet.parent import Parent
from fleet.spec import DeepSeekDeploymentSpec

# Children are named parent + suffix; the longest Service name ("-peers") must stay a DNS label.
MAX_NAME_LEN = 57
NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
NAME_RULE = {
    "rule": f"self.metadata.name.matches('{NAME.pattern}') && size(self.metadata.name) <= {MAX_NAME_LEN}",
    "message": f"metadata.name must be a DNS label of at most {MAX_NAME_LEN} characters starting with a letter "
    "(children append suffixes such as -peers)",
}
OPERATOR_VOLUMES = ("model", "dshm", "api-key", kv_transfer.VOLUME)
OPERATOR_CONTAINERS = ("engine", "model-download")
RESERVED_ENV = {"POD_NAME", "POD_IP", PASSWORD_ENV} | {
    "DEEPSEEK_ENGINE_" + flag.removeprefix("--").replace("-", "_").upper() for flag in MANAGED_FLAGS
}


class InvalidSpec(Exception):
    """The resource asks for something that cannot be built; retrying will not help."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def validate(body: dict[str, Any], options: BuildOptions = BuildOptions()) -> Parent:
    """The parent with its validated spec, or InvalidSpec naming every problem found."""
    name = body.get("metadata", {}).get("name", "")
    problems = [] if NAME.match(name) and len(name) <= MAX_NAME_LEN else [NAME_RULE["message"]]
    try:
        spec = DeepSeekDeploymentSpec.model_validate(body.get("spec") or {})
    except ValidationError as exc:
        raise InvalidSpec(problems + [_describe(error) for error in exc.errors()]) from None
    problems += _semantic_problems(spec)
    if problems:
        raise InvalidSpec(problems)
    return Parent.from_body(body, spec, options)


def _describe(error: Any) -> str:
    path = ".".join(["spec", *(str(p) for p in error["loc"])])
    return f"{path}: {error['msg'].removeprefix('Value error, ')}"


def _semantic_problems(spec: DeepSeekDeploymentSpec) -> list[str]:
    problems = []
    for arg in spec.engine.extra_args:
        flag = arg.split("=", 1)[0]
        if flag in MANAGED_FLAGS:
            problems.append(f"spec.engine.extraArgs sets {flag}, which the operator sets from the spec")
    for var in spec.engine.env:
        if var.name in RESERVED_ENV:
            problems.append(f"spec.engine.env sets {var.name}, which the operator sets")
    template = spec.template
    for volume in template.volumes:
        if volume.get("name") in OPERATOR_VOLUMES or not volume.get("name"):
            problems.append(f"spec.template.volumes: a volume needs a name other than {', '.join(OPERATOR_VOLUMES)}")
    for sidecar in template.sidecars:
        if sidecar.get("name") in OPERATOR_CONTAINERS or not sidecar.get("name") or not sidecar.get("image"):
            problems.append("spec.template.sidecars: a sidecar needs an image and a name other than "
                            + ", ".join(OPERATOR_CONTAINERS))
    device_names = {spec.gpu_resource_name}
    if spec.network.rdma.resource_name:
        device_names.add(spec.network.rdma.resource_name)
    resources = spec.template.resources
    for name in sorted(device_names & (set(resources.requests) | set(resources.limits))):
        problems.append(
            f"spec.template.resources sets {name}; use gpusPerReplica or network.rdma.count for devices"
        )
    return problems
