"""What the operator refuses before building anything, with messages a person can act on."""

from __future__ import annotations

from typing import Any

import pytest

from fleet.validation import InvalidSpec, validate


def body(name: str = "v3", **spec: Any) -> dict[str, Any]:
    base = {"model": {"name": "m", "uri": "pvc://models/m"}, "engine": {"image": "e:1"}}
    return {"metadata": {"name": name, "namespace": "ns", "generation": 4}, "spec": {**base, **spec}}


def problems(b: dict[str, Any]) -> str:
    with pytest.raises(InvalidSpec) as info:
        validate(b)
    return str(info.value)


def test_valid_spec_gives_the_parent() -> None:
    parent = validate(body())
    assert (parent.name, parent.namespace, parent.generation) == ("v3", "ns", 4)
    assert parent.spec.gpus_per_replica == 8


def test_tensor_parallelism_must_divide_the_gpus() -> None:
    assert "engine.tensorParallelSize must divide gpusPerReplica" in problems(body(engine={"image": "e", "tensorParallelSize": 3}))
    validate(body(engine={"image": "e", "tensorParallelSize": 4}))


def test_operator_owned_flags_and_env_are_refused() -> None:
    text = problems(body(engine={"image": "e", "extraArgs": ["--port=9000"],
                                 "env": [{"name": "DEEPSEEK_ENGINE_KV_TRANSPORT", "value": "tcp"}]}))
    assert "extraArgs sets --port" in text and "env sets DEEPSEEK_ENGINE_KV_TRANSPORT" in text


def test_extra_volumes_and_sidecars_keep_off_the_operators_names() -> None:
    text = problems(body(template={"volumes": [{"name": "dshm", "emptyDir": {}}],
                                   "sidecars": [{"name": "engine", "image": "x"}, {"name": "s"}]}))
    assert "spec.template.volumes: a volume needs a name other than model, dshm, api-key" in text
    assert text.count("spec.template.sidecars") == 2


def test_devices_come_from_their_own_fields() -> None:
    text = problems(body(template={"resources": {"limits": {"nvidia.com/gpu": "4"}}}))
    assert "use gpusPerReplica" in text


def test_schema_errors_name_the_field() -> None:
    text = problems({"metadata": {"name": "v3", "namespace": "ns"}, "spec": {"engine": {}, "model": {"uri": "s3://x"}}})
    assert "spec.model.name: Field required" in text and "spec.model.uri" in text


def test_the_engine_image_defaults_to_the_operators() -> None:
    from fleet.options import BuildOptions

    spec = {"model": {"name": "m", "uri": "pvc://models/m"}}
    plain = {"metadata": {"name": "v3", "namespace": "ns"}, "spec": spec}
    assert validate(plain, BuildOptions(engine_image="r/engine:2")).engine_image == "r/engine:2"
    own = {**plain, "spec": {**spec, "engine": {"image": "mine:1"}}}
    assert validate(own, BuildOptions(engine_image="r/engine:2")).engine_image == "mine:1"


def test_unknown_fields_are_refused() -> None:
    assert "spec.engin" in problems(body(engin={"image": "typo"}))


def test_names_must_leave_room_for_child_suffixes() -> None:
    assert "at most 57 characters" in problems(body(name="x" * 58))


def test_cel_rules_are_enforced_by_the_operator_too() -> None:
    assert "set exactly one of managed: true or url" in problems(body(kvCache={"directory": {"managed": False}}))
