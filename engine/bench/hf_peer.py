"""The peer: HF transformers' DeepseekV3ForCausalLM with our weights, timed the same way, in the
same process (prefill through a fresh cache, greedy decode one token per forward)."""

import time

import torch

from engine.bench.ours import random_prompt
from engine.bench.timing import sync, time_fn
from engine.layers.fp8 import dequantize_fp8_block


def _ours_as_hf(ours: torch.nn.Module, name: str, like: torch.Tensor, block) -> torch.Tensor:
    """The HF tensor `name` from our parameters (dequantized where we keep FP8 blocks)."""
    params = dict(ours.named_parameters())

    def deq(key: str) -> torch.Tensor:
        w = params[key]
        if w.dtype != torch.float8_e4m3fn:
            return w
        s = params[key + "_scale_inv"]
        if w.dim() == 2:
            return dequantize_fp8_block(w, s, block)
        return torch.stack([dequantize_fp8_block(a, b, block).to(like.dtype) for a, b in zip(w, s)])

    if name.endswith("mlp.experts.gate_up_proj"):
        return deq(name.replace("gate_up_proj", "w13"))
    if name.endswith("mlp.experts.down_proj"):
        return deq(name.replace("down_proj", "w2"))
    for proj, half in (("gate_proj", 0), ("up_proj", 1)):
        if name.endswith(f".{proj}.weight") and ".experts." not in name:
            both = deq(name.replace(f".{proj}.", ".gate_up_proj."))
            return both.chunk(2, dim=0)[half]
    if name in params:
        return deq(name)
    raise KeyError(f"no source for HF tensor {name}")


@torch.no_grad()
def build_hf_peer(ours: torch.nn.Module, hf_config: dict, device: torch.device, dtype: torch.dtype):
    """HF's model from the same config, holding our weights (bf16 where ours are FP8 blocks)."""
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
    for name, tensor in hf.state_dict().items():
        if "rotary_emb" in name:
            continue  # derived from the config, not weights
        src = _ours_as_hf(ours, name, tensor, block)
        if src.shape != tensor.shape:
            raise ValueError(f"HF tensor {name} has shape {tuple(tensor.shape)}, ours {tuple(src.shape)}")
        tensor.copy_(src)
    return hf


def _prefill(hf, ids: torch.Tensor):
    out = hf(input_ids=ids, use_cache=True, logits_to_keep=1)
    return out.past_key_values, out.logits[:, -1].argmax(-1)


@torch.inference_mode()
def hf_measure_prefill(hf, length: int, vocab: int, device: torch.device, repeats: int) -> dict:
    ids = torch.tensor([random_prompt(length, vocab, seed=length)], device=device)
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

    def step():
        out = hf(input_ids=state["next"][:, None], past_key_values=state["cache"], use_cache=True)
        state["cache"], state["next"] = out.past_key_values, out.logits[:, -1].argmax(-1)

    for _ in range(2):
        step()
    seconds = time_fn(lambda: [step() for _ in range(steps)], device, repeats=1, warmup=0)
    return dict(seconds_per_step=seconds / steps, tok_s=concurrency * steps / seconds, mode="eager",
                context=context + 2 + steps // 2)
