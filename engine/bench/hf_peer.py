"""The peer: HF transformers' DeepseekV3ForCausalLM with our weights, timed the same way, in the
same process (prefill through a fresh cache, greedy decode one token per forward)."""

import inspect
import time

import torch

from engine.bench.ours import random_prompt
from engine.bench.timing import sync, time_fn
from engine.layers.fp8 import dequantize_fp8_block


def _expert_source(name: str) -> str | None:
    if name.endswith("mlp.experts.gate_up_proj"):
        return name.replace("gate_up_proj", "w13")
    if name.endswith("mlp.experts.down_proj"):
        return name.replace("down_proj", "w2")
    return None


def _dense(params: dict, key: str, block, device) -> torch.Tensor:
    """Our 2-D parameter `key` on `device`, dequantized where we keep FP8 blocks."""
    w = params[key].to(device)
    if w.dtype != torch.float8_e4m3fn:
        return w
    return dequantize_fp8_block(w, params[key + "_scale_inv"].to(device), block)


def _copy_into(dst: torch.Tensor, name: str, params: dict, block) -> None:
    """HF tensor `name` <- our parameters (dense halves of gate_up_proj; experts one at a time)."""
    if (src := _expert_source(name)) is not None:
        w = params[src]
        if w.shape != dst.shape:
            raise ValueError(f"HF tensor {name} has shape {tuple(dst.shape)}, ours {tuple(w.shape)}")
        for e in range(w.shape[0]):  # one expert at a time: no second full-size copy on the device
            if w.dtype == torch.float8_e4m3fn:
                dst[e].copy_(dequantize_fp8_block(w[e].to(dst.device), params[src + "_scale_inv"][e].to(dst.device), block))
            else:
                dst[e].copy_(w[e])
        return
    for proj, half in (("gate_proj", 0), ("up_proj", 1)):
        if name.endswith(f".{proj}.weight"):
            src = _dense(params, name.replace(f".{proj}.", ".gate_up_proj."), block, dst.device).chunk(2, dim=0)[half]
            break
    else:
        if name not in params:
            raise KeyError(f"no source for HF tensor {name}")
        src = _dense(params, name, block, dst.device)
    if src.shape != dst.shape:
        raise ValueError(f"HF tensor {name} has shape {tuple(dst.shape)}, ours {tuple(src.shape)}")
    dst.copy_(src)


@torch.no_grad()
def build_hf_peer(ours: torch.nn.Module, hf_config: dict, device: torch.device, dtype: torch.dtype):
    """HF's model from the same config, holding our weights (bf16 where ours are FP8 blocks).

    Our parameters may sit in host memory by now (to leave the device to the peer); they are moved
    over tensor by tensor."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = {k: v for k, v in hf_config.items() if k != "quantization_config"}
    default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
        with torch.device(device):
            hf = DeepseekV3ForCausalLM(DeepseekV3Config(**cfg)).eval()
    finally:
        torch.set_default_dtype(default)
    block = ours.config.quant.weight_block_size if ours.config.quant else None
    params = dict(ours.named_parameters())
    for name, tensor in hf.state_dict().items():
        if "rotary_emb" not in name:  # rotary tables derive from the config, not weights
            _copy_into(tensor, name, params, block)
    return hf


def peer_in_place_of(runner, hf_config: dict):
    """HF's model on our runner's device holding its weights, after ours left it: our cache, graphs and
    weights go first (the weights to host memory, to be copied over one tensor at a time), since both
    models at once do not fit next to the peer's cache. The runner is spent."""
    import gc

    device, dtype, model = runner.device, runner.dtype, runner.model
    for attn in model.attention_layers():
        attn.kv_cache = None
    runner.model, runner.graphs = None, None
    model.to("cpu")
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    hf = build_hf_peer(model, hf_config, device, dtype)
    del model
    gc.collect()
    return hf


def _cache_kwarg(hf) -> str:
    """transformers renamed `past_key_values` to `cache` (5.2x); use what this version takes."""
    return "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"


def _prefill(hf, ids: torch.Tensor):
    out = hf(input_ids=ids, use_cache=True, logits_to_keep=1)
    return _cache_of(out), out.logits[:, -1].argmax(-1)


def _cache_of(out):
    """The cache an output carries (`cache` in transformers' newer output classes)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


@torch.inference_mode()
def hf_measure_prefill(hf, length: int, vocab: int, device: torch.device, repeats: int) -> dict:
    ids = torch.tensor([random_prompt(length, vocab, seed=length)], device=device)
    for _ in range(2):  # as ours (`ours.measure_prefill`): a steady state
        _prefill(hf, ids)
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        int(_prefill(hf, ids)[1][0])  # the first token on the host: time to first token
        times.append(time.perf_counter() - t0)
    seconds = sorted(times)[len(times) // 2]
    return dict(seconds=seconds, tok_s=length / seconds)


@torch.inference_mode()
def hf_measure_decode(hf, concurrency: int, context: int, steps: int, vocab: int, device: torch.device) -> dict:
    ids = torch.tensor([random_prompt(context, vocab, seed=1000 + i) for i in range(concurrency)], device=device)
    cache, nxt = _prefill(hf, ids)
    state = {"cache": cache, "next": nxt}
    kwarg = _cache_kwarg(hf)

    def step():
        out = hf(input_ids=state["next"][:, None], use_cache=True, **{kwarg: state["cache"]})
        state["cache"], state["next"] = _cache_of(out), out.logits[:, -1].argmax(-1)

    for _ in range(2):
        step()
    seconds = time_fn(lambda: [step() for _ in range(steps)], device, repeats=1, warmup=0)
    return dict(seconds_per_step=seconds / steps, tok_s=concurrency * steps / seconds, mode="eager",
                context=context + 2 + steps // 2)
