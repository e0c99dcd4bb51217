"""Write the trained model as a HF-format checkpoint in the layout DeepSeek publishes (sharded safetensors)."""

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

# transformers 5 fuses experts in memory as [E, 2I, H] / [E, H, I]; the published layout has one Linear each.
_FUSED = re.compile(r"(.*mlp\.experts)\.(gate_up_proj|down_proj)$")
KEEP_FP32 = ("e_score_correction_bias",)  # routing bias: V3 ships it in float32, ties depend on it


def published_layer_tensors(state: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state.items():
        match = _FUSED.fullmatch(name)
        if match is None:
            out[prefix + name] = tensor
            continue
        base, kind = match.groups()
        for e, weight in enumerate(tensor):
            if kind == "down_proj":
                out[f"{prefix}{base}.{e}.down_proj.weight"] = weight
            else:
                gate, up = weight.chunk(2, dim=0)  # rows [0, I) gate, [I, 2I) up
                out[f"{prefix}{base}.{e}.gate_proj.weight"] = gate
                out[f"{prefix}{base}.{e}.up_proj.weight"] = up
    return out


def published_state_dict(model, mtp=None) -> dict[str, torch.Tensor]:
    tensors = published_layer_tensors(model.state_dict())
    if mtp is not None:
        from .mtp import published_mtp_tensors

        tensors.update(published_mtp_tensors(model, mtp, model.config.num_hidden_layers))
    return tensors


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def save_checkpoint(tensors: dict[str, torch.Tensor], config: dict, tokenizer_dir: Path, out: Path,
                    max_shard_bytes: int = 12 * 2**20) -> None:
    """bf16 safetensors shards + model.safetensors.index.json + config.json + tokenizer files."""
    out.mkdir(parents=True, exist_ok=True)
    ready = {}
    for name, tensor in tensors.items():
        dtype = torch.float32 if name.endswith(KEEP_FP32) else torch.bfloat16
        # clone: the MTP layer's copies of embedding and head must not share storage with the originals
        ready[name] = tensor.detach().to("cpu", dtype).contiguous().clone()
    shards = _shards(ready, max_shard_bytes)
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, filename))
    total = sum(t.numel() * t.element_size() for t in ready.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, out / name)
