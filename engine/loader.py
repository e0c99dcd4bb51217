"""Load (sharded) safetensors checkpoints into the model by name, FP8 block-scaled weights included."""

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm import tqdm

from engine.layers.fp8 import dequantize_fp8_block, dequantize_mxfp4

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight(_scale_inv)?$")


class CheckpointError(ValueError):
    """The checkpoint on disk does not match the model (missing, corrupt, extra or mis-shaped tensors)."""


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class CheckpointTensor:
    """A checkpoint tensor not read yet. A parameter's loader narrows it to its rank's slice (`narrow`, as
    on a tensor) and `read()` reads that region alone from the file (safetensors slicing), so a rank
    never reads what another rank holds."""

    def __init__(self, source, name: str, region: tuple[tuple[int, int], ...] | None = None):
        self._source, self.name = source, name
        self._region = region or tuple((0, n) for n in source.get_shape())
        self.dtype = _DTYPES.get(source.get_dtype())
        if self.dtype is None:
            raise CheckpointError(f"tensor {name} has an unsupported dtype {source.get_dtype()}")

    @property
    def shape(self) -> torch.Size:
        return torch.Size(end - start for start, end in self._region)

    def dim(self) -> int:
        return len(self._region)

    def narrow(self, dim: int, start: int, length: int) -> "CheckpointTensor":
        first, end = self._region[dim]
        if start < 0 or length < 0 or first + start + length > end:
            raise ValueError(f"shape mismatch: checkpoint tensor {tuple(self.shape)} has no [{start}, "
                             f"{start + length}) along dimension {dim}")
        region = list(self._region)
        region[dim] = (first + start, first + start + length)
        return CheckpointTensor(self._source, self.name, tuple(region))

    def read(self) -> torch.Tensor:
        try:
            return self._source[tuple(slice(a, b) for a, b in self._region)]
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read tensor {self.name}: {e}") from e


def materialize(tensor) -> torch.Tensor:
    """A tensor, whether given or still in the checkpoint."""
    return tensor.read() if isinstance(tensor, CheckpointTensor) else tensor


def checkpoint_files(path: Path) -> dict[str, Path]:
    """tensor name -> safetensors file, from model.safetensors.index.json or the files themselves."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from e
        files = {name: path / f for name, f in weight_map.items()}
        missing = sorted({str(f.name) for f in files.values() if not f.is_file()})
        if missing:
            raise CheckpointError(f"checkpoint shard(s) listed in {index.name} are missing: {', '.join(missing)}")
        return files
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"no *.safetensors files in {path}")
    files = {}
    for shard in shards:
        for name in _open(shard).keys():
            files[name] = shard
    return files


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read checkpoint shard {file.name}: {e}") from e


def load_weights(model: nn.Module, path: Path, num_hidden_layers: int, block_size: tuple[int, int] | None,
                 show_progress: bool = True) -> None:
    """Copy every checkpoint tensor into its parameter; raise CheckpointError naming what does not fit."""
    files = checkpoint_files(path)
    params = dict(model.named_parameters(remove_duplicate=False))
    handles: dict[Path, object] = {}
    loaded: set[str] = set()
    skipped_mtp = 0

    def read(name: str) -> CheckpointTensor:
        """The tensor, lazily: what its parameter's loader keeps of it is read when it is copied."""
        file = files[name]
        if file not in handles:
            handles[file] = _open(file)
        try:
            return CheckpointTensor(handles[file].get_slice(name), name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read tensor {name} from {file.name}: {e}") from e

    def scale_of(name: str) -> str | None:
        """A quantized tensor's scales: `<name>_scale_inv` (V3) or `<module>.scale` (V4)."""
        for candidate in (name + "_scale_inv", name.removesuffix("weight") + "scale"):
            if candidate != name and candidate in files:
                return candidate
        return None

    M = type(model)
    rename = getattr(model, "checkpoint_name", lambda n: n)
    expert_pattern = getattr(M, "expert_pattern", _EXPERT)
    companions = {n for n in files if n.endswith("weight_scale_inv")
                  or (n.endswith(".scale") and n.removesuffix("scale") + "weight" in files)}
    names = [n for n in files if n not in companions]
    for name in tqdm(names, desc="Loading weights", unit="tensor", disable=not show_progress):
        ours = rename(name)
        m = _LAYER.match(ours) if ours is not None else None
        if m and int(m.group(1)) >= num_hidden_layers:  # a multi-token-prediction layer
            ours = _draft_name(ours, int(m.group(1)) - num_hidden_layers, len(getattr(model, "mtp", ())))
        if ours is None:
            skipped_mtp += 1  # an MTP layer not used as a draft, or its copies of the shared embedding and head
            continue
        target, shard_id = _param_name(ours, M)
        if expert_pattern.match(ours) and target in params and not _experts_of(model, target).owns(shard_id[0]):
            continue  # expert parallel: another rank's expert, never read
        tensor = read(name)
        param = params.get(target)
        if param is None:
            raise CheckpointError(f"unexpected tensor {name} in checkpoint: the model has no parameter {target}")
        def keep_scale(scale_name: str) -> None:
            """The model keeps the quantized tensor for its kernels: its scales (`<weight>_scale_inv`, V3, or
            `<module>.scale`, V4) go to the weight's parameter's `_scale_inv` companion."""
            scale_target, _ = _param_name(ours + "_scale_inv", M)
            if scale_target not in params:
                raise CheckpointError(f"the model has no parameter {scale_target} for {scale_name}")
            _load_into(params[scale_target], read(scale_name), shard_id, scale_name)
            loaded.add(f"{scale_target}#{shard_id}")

        if tensor.dtype == torch.float8_e4m3fn:
            scale_name = scale_of(name)
            if scale_name is None:
                raise CheckpointError(f"FP8 tensor {name} has no {name}_scale_inv")
            scale = read(scale_name)
            if param.dtype == torch.float8_e4m3fn:  # the model keeps the blocks for its FP8 kernels
                keep_scale(scale_name)
            else:  # dequantized once at load (the reference path), then sliced
                tensor = dequantize_fp8_block(tensor.read(), scale.read(), block_size or (128, 128))
        elif param.dtype == torch.float8_e4m3fn:
            raise CheckpointError(f"tensor {name} is {tensor.dtype}, but the FP8 model expects float8_e4m3fn blocks")
        elif tensor.dtype in (torch.int8, torch.uint8) and (param.dtype.is_floating_point or param.dtype == torch.int8):
            scale_name = scale_of(name)
            if scale_name is None:
                raise CheckpointError(f"packed FP4 tensor {name} has no scales ({name.removesuffix('weight')}scale)")
            if param.dtype == torch.int8:  # the model keeps the codes (MXFP4 experts) for its kernels
                keep_scale(scale_name)
                tensor = tensor.read().view(torch.int8)
            else:
                try:
                    tensor = dequantize_mxfp4(tensor.read(), read(scale_name).read())
                except ValueError as e:
                    raise CheckpointError(f"tensor {name}: {e}") from e
        _load_into(param, tensor, shard_id, name)
        loaded.add(f"{target}#{shard_id}")

    if skipped_mtp:
        logger.info("skipped %d tensors (multi-token-prediction layers >= %d not drafting, or their copies of "
                    "the embedding and head)", skipped_mtp, num_hidden_layers)
    missing = [n for n in _expected(model) if n not in loaded]
    if missing:
        more = f" (and {len(missing) - 10} more)" if len(missing) > 10 else ""
        raise CheckpointError(f"checkpoint {path} lacks {len(missing)} tensor(s): {', '.join(missing[:10])}{more}")


def _draft_name(name: str, index: int, num_draft_layers: int) -> str | None:
    """`model.layers.{num_hidden_layers + index}.X` -> `mtp.{index}.X` for an MTP layer the model drafts
    with; None for the others and for the layer's copies of the embedding and head (the model shares
    the target's)."""
    rest = _LAYER.sub("", name)
    if index >= num_draft_layers or rest.startswith(("embed_tokens.", "shared_head.head.")):
        return None
    return f"mtp.{index}.{rest}"


def _load_into(param: nn.Parameter, tensor: torch.Tensor, shard_id: object, name: str) -> None:
    loader = getattr(param, "weight_loader", None)
    try:
        if loader is None:
            if param.shape != tensor.shape:
                raise ValueError(f"shape mismatch: checkpoint tensor {tuple(tensor.shape)}, model expects {tuple(param.shape)}")
            param.data.copy_(materialize(tensor))
        else:
            loader(param, tensor, shard_id)
    except ValueError as e:
        raise CheckpointError(f"tensor {name}: {e}") from e


def _param_name(name: str, M: type) -> tuple[str, object]:
    """Checkpoint tensor name -> (model parameter name, shard id for its weight_loader)."""
    if m := getattr(M, "expert_pattern", _EXPERT).match(name):
        param, which = M.expert_params[m.group(3)]
        return f"{m.group(1)}.{param}{m.group(4) or ''}", (int(m.group(2)), which)
    for ckpt, (ours, shard) in M.stacked_params.items():
        if f".{ckpt}." in name:
            return name.replace(f".{ckpt}.", f".{ours}."), shard
    return name, None


def _experts_of(model: nn.Module, param_name: str) -> nn.Module:
    return model.get_submodule(param_name.rsplit(".", 1)[0])


def _expected(model: nn.Module) -> list[str]:
    """Every (parameter, shard) the checkpoint must provide (of the experts: those this rank holds)."""
    out = []
    tied = getattr(model.config, "tie_word_embeddings", False)
    for name, param in model.named_parameters():
        if tied and name == "lm_head.weight":
            continue
        if name.endswith(("experts.w13", "experts.w13_scale_inv", "experts.w2", "experts.w2_scale_inv")):
            first = _experts_of(model, name).expert_offset
            which = ("w2",) if ".w2" in name else ("w1", "w3")
            out += [f"{name}#{(first + e, w)}" for e in range(param.shape[0]) for w in which]
        elif name.endswith(("gate_up_proj.weight", "gate_up_proj.weight_scale_inv")):
            out += [f"{name}#0", f"{name}#1"]
        else:
            out.append(f"{name}#None")
    return out
