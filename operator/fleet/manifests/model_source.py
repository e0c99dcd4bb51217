"""Where the checkpoint comes from: a model URI turned into a pod volume (and maybe a downloader)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fleet.spec import EngineSpec, ModelSpec

MODEL_DIR = "/models"
VOLUME = "model"


@dataclass(frozen=True)
class ModelSource:
    """The pod parts that make a checkpoint available at `path`."""

    volume: dict[str, Any]
    path: str
    init_containers: list[dict[str, Any]] = field(default_factory=list)


def parse_uri(uri: str) -> tuple[str, str]:
    """Split `scheme://rest`, refusing schemes we cannot mount."""
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme not in ("pvc", "hostpath", "hf") or not rest:
        raise ValueError(f"model uri {uri!r} must be pvc://claim/path, hostpath:///path or hf://org/repo@revision")
    return scheme, rest


def model_source(model: ModelSpec, engine: EngineSpec, engine_image: str) -> ModelSource:
    """Volume, model path and init containers for spec.model.uri (engine_image: what the engines run)."""
    scheme, rest = parse_uri(model.uri)
    if scheme == "pvc":
        claim, _, subpath = rest.partition("/")
        path = f"{MODEL_DIR}/{subpath}".rstrip("/")
        return ModelSource({"name": VOLUME, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}, path)
    if scheme == "hostpath":
        return ModelSource({"name": VOLUME, "hostPath": {"path": rest, "type": "Directory"}}, MODEL_DIR)
    repo, _, revision = rest.partition("@")
    empty_dir: dict[str, Any] = {"sizeLimit": model.cache_size} if model.cache_size else {}
    downloader: dict[str, Any] = {
        "name": "model-download",
        "image": model.downloader_image or engine_image,
        "command": ["hf", "download", repo, "--revision", revision or "main", "--local-dir", MODEL_DIR],
        "volumeMounts": [{"name": VOLUME, "mountPath": MODEL_DIR}],
    }
    if engine.image_pull_policy:
        downloader["imagePullPolicy"] = engine.image_pull_policy
    if model.token_secret_ref is not None:
        ref = {"name": model.token_secret_ref.name, "key": model.token_secret_ref.key}
        downloader["env"] = [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}}]
    return ModelSource({"name": VOLUME, "emptyDir": empty_dir}, MODEL_DIR, [downloader])
