"""The benchmark for DeepSeek-V4 shapes (`bench --preset v4-slice`): prefill, decode and each layer at one
stream against its bytes and FLOPs floors, and HF transformers' DeepseekV4ForCausalLM in the same run.

V4's floors differ from V3's: a decode step reads the sliding window (its last `sliding_window` rows),
every HCA entry, the CSA indexer's keys (one per 4 tokens) and its top-k entries, besides the weights.
"""

import dataclasses
import datetime
import gc
import logging

import torch

from engine.bench.hf_peer import hf_measure_decode, hf_measure_prefill
from engine.bench.ours import BlockPool, measure_decode, measure_prefill, one_decode, time_replayed
from engine.bench.report import write_json
from engine.bench.roofline import param_bytes, expected_experts, fractions, measure_ceilings
from engine.config import DeepseekV4Config, EngineConfig, required_block_size
from engine.model_runner import ModelRunner, resolve_device

logger = logging.getLogger(__name__)


class V4Costs:
    """Bytes and FLOPs of V4 phases from the model's own parameters and shape: bytes as held (FP8 blocks a
    byte a weight plus their float32 scales, MXFP4 experts half a byte plus an E8M0 byte per 32 values),
    FLOPs by the weights' logical sizes."""

    def __init__(self, model: torch.nn.Module, cfg: DeepseekV4Config, kv_elem_bytes: int):
        self.cfg, self.e = cfg, kv_elem_bytes
        self.layers = []
        for layer in model.layers:
            experts = layer.ffn.experts
            ids = {id(p) for p in experts.parameters()}
            rest = [(n, p) for n, p in layer.named_parameters() if id(p) not in ids]
            self.layers.append(dict(rest_bytes=param_bytes(p for _, p in rest),
                                    rest_numel=sum(p.numel() for n, p in rest if not n.endswith("_scale_inv")),
                                    expert_bytes=param_bytes(experts.parameters()) / experts.num_experts,
                                    expert_numel=3 * cfg.hidden_size * experts.inter))
        self.head_bytes = param_bytes(model.head.parameters())
        self.head_numel = model.head.weight.numel()

    def kind(self, i: int) -> str:
        return self.cfg.layer_kind(i)

    def _keys(self, i: int, context: int) -> tuple[int, int]:
        """(main keys a token at `context` attends to, indexer keys it scores)."""
        c, r = self.cfg, self.cfg.compress_ratios[i]
        window = min(c.sliding_window, context)
        if r == 0:
            return window, 0
        entries = context // r
        return (window + min(c.index_topk, entries), entries) if c.layer_kind(i) == "csa" else (window + entries, 0)

    def decode_layer(self, i: int, batch: int, context: int) -> tuple[float, float]:
        c, layer = self.cfg, self.layers[i]
        keys, scored = self._keys(i, context)
        weight_bytes = layer["rest_bytes"] + expected_experts(c.n_routed_experts, c.num_experts_per_tok, batch) * layer["expert_bytes"]
        kv_bytes = batch * (keys * c.head_dim + scored * c.index_head_dim) * self.e
        flops = 2.0 * batch * (layer["rest_numel"] + c.num_experts_per_tok * layer["expert_numel"])
        flops += batch * (4 * c.num_attention_heads * keys * c.head_dim + 2 * c.index_n_heads * scored * c.index_head_dim)
        return weight_bytes + kv_bytes, flops

    def decode(self, batch: int, context: int) -> tuple[float, float]:
        total_bytes, total_flops = float(self.head_bytes), 2.0 * batch * self.head_numel
        for i in range(len(self.layers)):
            b, f = self.decode_layer(i, batch, context)
            total_bytes, total_flops = total_bytes + b, total_flops + f
        return total_bytes, total_flops

    def prefill(self, length: int) -> tuple[float, float]:
        c = self.cfg
        total_bytes, total_flops = float(self.head_bytes), 2.0 * self.head_numel
        for i, layer in enumerate(self.layers):
            experts = expected_experts(c.n_routed_experts, c.num_experts_per_tok, length)
            total_bytes += layer["rest_bytes"] + experts * layer["expert_bytes"]
            total_flops += 2.0 * length * (layer["rest_numel"] + c.num_experts_per_tok * layer["expert_numel"])
            keys, scored = self._keys(i, length // 2)  # the average query sits halfway
            total_flops += length * (4 * c.num_attention_heads * keys * c.head_dim
                                     + 2 * c.index_n_heads * scored * c.index_head_dim)
        return total_bytes, total_flops


@torch.inference_mode()
def measure_v4_layers(runner: ModelRunner, pool: BlockPool, context: int, vocab: int, repeats: int = 50) -> list[dict]:
    """Each V4 block alone, one sequence at `context` tokens (graph-replayed where graphs exist)."""
    seq, positions, meta = one_decode(runner, pool, context, vocab)
    cfg, dev = runner.model_config, runner.device
    g = torch.Generator(dev).manual_seed(0)
    h = torch.randn(1, cfg.hc_mult, cfg.hidden_size, generator=g, device=dev, dtype=runner.dtype)
    ids = torch.tensor([seq.output_token_ids[-1]], device=dev)
    out = []
    for i, layer in enumerate(runner.model.layers):
        seconds = time_replayed(runner, lambda: layer(positions, h, ids, meta), repeats)
        out.append(dict(layer=i, kind=cfg.layer_kind(i), hash_routed=cfg.hash_layers[i], seconds=seconds))
    return out


@torch.inference_mode()
def measure_hc_sites(runner: ModelRunner, token_counts: list[int]) -> list[dict]:
    """Layer 0's attention-site mHC (weights and collapse) at each token count, graph-replayed: the fused
    kernel against the PyTorch path, with the kernel's error against it and its bytes floor (fn once,
    the streams read, the collapsed input written)."""
    from engine.bench.timing import time_replayed as replayed

    cfg, dev, block = runner.model_config, runner.device, runner.model.layers[0]
    n, hidden = cfg.hc_mult, cfg.hidden_size
    g = torch.Generator(dev).manual_seed(1)
    out = []
    for t in token_counts:
        h = torch.randn(t, n, hidden, generator=g, device=dev, dtype=runner.dtype)
        times, results = {}, {}
        for path, on in (("kernel", True), ("torch", False)):
            block.use_kernels = on
            times[path] = replayed(lambda: block.collapse(h, "attn"), dev, calls=10)
            results[path] = block.collapse(h, "attn")
        block.use_kernels = True
        err = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()
        elem = h.element_size()
        floor_bytes = block.hc_attn_fn.numel() * 4 + t * n * hidden * elem + t * hidden * elem
        out.append(dict(tokens=t, kernel_s=times["kernel"], torch_s=times["torch"],
                        speedup=times["torch"] / times["kernel"], bytes=floor_bytes,
                        error_x=err(results["kernel"][0], results["torch"][0]),
                        error_comb=err(results["kernel"][2], results["torch"][2])))
    return out


def _guard(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # one failed phase must not lose the others
        logger.exception("benchmark phase %s failed", getattr(fn, "__name__", fn))
        return {"error": f"{type(e).__name__}: {e}"}


def run_v4(opts, hf_config: dict, cfg: DeepseekV4Config, name: str, costs_cls=V4Costs, measure_layers=None,
           variants=None) -> dict:
    """Ours (random weights), then the HF peer on the same shape; -> the results (written as <name>.json).
    V4.1 passes its own costs, layer measurement and `variants(runner, pool, costs, ceilings) -> dict`."""
    device = resolve_device(opts.device)
    max_conc = max(opts.concurrency)
    decode_len = opts.decode_context + opts.decode_steps + 16
    max_len = max(opts.prompt_lens + [decode_len]) + 256
    engine_config = EngineConfig(model=name, dtype=opts.dtype, device=opts.device, attention_backend=opts.backend,
                                 max_num_seqs=max_conc, block_size=opts.block_size, seed=opts.seed,
                                 show_progress=False,
                                 extra={"enforce_eager": opts.eager, "capture_graphs_at_start": False})
    engine_config = dataclasses.replace(engine_config, block_size=required_block_size(cfg, opts.block_size))
    bs = engine_config.block_size
    num_blocks = max(-(-max_len // bs), max_conc * -(-decode_len // bs)) + 4
    runner = ModelRunner(engine_config, cfg, None, max_len)
    runner.init_cache(num_blocks)
    ceilings = measure_ceilings(device)
    costs = costs_cls(runner.model, cfg, torch.empty((), dtype=runner.dtype).element_size())
    pool = BlockPool(runner.num_blocks, bs)
    prefill_r, decode_r = {}, {}
    for n in opts.prompt_lens:
        m = _guard(measure_prefill, runner, pool, n, cfg.vocab_size, opts.repeats)
        if "seconds" in m:
            m.update(fractions(m["seconds"], *costs.prefill(n), ceilings, False))
        prefill_r[str(n)] = m
    for c in opts.concurrency:
        m = _guard(measure_decode, runner, pool, c, opts.decode_context, opts.decode_steps, cfg.vocab_size)
        if "seconds_per_step" in m:
            m.update(fractions(m["seconds_per_step"], *costs.decode(c, m["context"]), ceilings, False))
        decode_r[str(c)] = m
    layers = _guard(measure_layers or measure_v4_layers, runner, pool, opts.decode_context, cfg.vocab_size)
    if isinstance(layers, list):
        for entry in layers:
            entry.update(fractions(entry["seconds"], *costs.decode_layer(entry["layer"], 1, opts.decode_context + 1),
                                   ceilings, False))
            entry["ratio_to_bandwidth_floor"] = entry["seconds"] / entry["bandwidth_floor_s"]
    hc_sites = None  # the kernel runs where the Triton backend does (V4's sites only)
    if runner.backend == "triton" and hasattr(runner.model.layers[0], "collapse"):
        hc_sites = _guard(measure_hc_sites, runner, sorted({1, 8, 64, *opts.concurrency, *opts.prompt_lens}))
    if isinstance(hc_sites, list):
        for entry in hc_sites:
            entry["bandwidth_floor_s"] = entry["bytes"] / ceilings.copy_bytes_per_s
    extra = _guard(variants, runner, pool, costs, ceilings) if variants is not None else None
    summary = lambda d, k: {n: m.get(k) for n, m in d.items()}
    result = dict(
        preset=name, command=opts.command, gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        date=datetime.date.today().isoformat(), torch=torch.__version__, dtype=str(runner.dtype).removeprefix("torch."),
        weights=weights_held(runner),
        backend=runner.backend, cuda_graphs=runner.graphs is not None, num_layers=cfg.num_hidden_layers,
        layer_kinds=[costs.kind(i) for i in range(cfg.num_hidden_layers)], max_model_len=max_len,
        decode_context=opts.decode_context, decode_steps=opts.decode_steps, ceilings=ceilings.as_dict(),
        prefill=prefill_r, decode=decode_r, layers=layers, hc_sites=hc_sites,
        prefill_tok_s=summary(prefill_r, "tok_s"), decode_tok_s=summary(decode_r, "tok_s"),
    )
    if extra is not None:
        result["variants"] = extra
    write_json(result, opts.out_dir)
    if opts.compare_hf:
        del runner, pool
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        result["hf"] = _guard(_run_hf, hf_config, opts, device, cfg.vocab_size)
        hf = result["hf"] if isinstance(result["hf"], dict) else {}
        ratio = lambda a, b: a / b if a and b else None
        result["speedup"] = {
            "decode": {c: ratio(result["decode_tok_s"][c], hf.get("decode_tok_s", {}).get(c)) for c in decode_r},
            "prefill": {n: ratio(result["prefill_tok_s"][n], hf.get("prefill_tok_s", {}).get(n)) for n in prefill_r},
        }
        write_json(result, opts.out_dir)
    return result


def weights_held(runner: ModelRunner) -> str:
    """What the model's weights are, in words (the results' `weights`)."""
    dtype = str(runner.dtype).removeprefix("torch.")
    quant = runner.model.config.quant
    if quant is None:
        return dtype + " (FP8 / FP4 checkpoints are dequantized at load)"
    experts = "MXFP4" if runner.model.config.expert_dtype == "fp4" else "FP8"
    b0, b1 = quant.weight_block_size
    return (f"FP8 e4m3 {b0}x{b1} blocks (attention projections, shared expert), {experts} routed experts, "
            f"{dtype} elsewhere")


def _run_hf(hf_config: dict, opts, device: torch.device, vocab: int) -> dict:
    """HF transformers' DeepseekV4ForCausalLM, random bf16 weights (timing does not depend on their values;
    HF runs V4's FP8 / MXFP4 checkpoints dequantized to bf16 too)."""
    import transformers
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    hf_config = {k: v for k, v in hf_config.items() if k not in ("quantization_config", "expert_dtype")}

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            hf = DeepseekV4ForCausalLM(DeepseekV4Config(**hf_config)).eval()
    finally:
        torch.set_default_dtype(default)
    prefill_r = {str(n): _guard(hf_measure_prefill, hf, n, vocab, device, opts.repeats)
                 for n in opts.prompt_lens if n <= opts.hf_max_prompt_len}
    decode_r = {str(c): _guard(hf_measure_decode, hf, c, opts.decode_context, opts.hf_decode_steps, vocab, device)
                for c in opts.concurrency}
    return dict(transformers=transformers.__version__, prefill=prefill_r, decode=decode_r,
                prefill_tok_s={n: m.get("tok_s") for n, m in prefill_r.items()},
                decode_tok_s={c: m.get("tok_s") for c, m in decode_r.items()})
