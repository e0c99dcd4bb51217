"""Run the whole benchmark for one preset (or checkpoint) and write its JSON and plot."""

import datetime
import gc
import importlib
import json
import logging
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.bench.hf_peer import hf_measure_decode, hf_measure_prefill, peer_in_place_of
from engine.bench.kernels import measure_kernels
from engine.bench.ours import BlockPool, measure_decode, measure_layers, measure_prefill, measure_turn
from engine.bench.presets import preset_config
from engine.bench.report import write_json, write_plot
from engine.bench.roofline import PhaseCosts, fractions, measure_ceilings
from engine.config import EngineConfig, ModelConfig, resolve_model_path
from engine.model_runner import ModelRunner, resolve_device

logger = logging.getLogger(__name__)


@dataclass
class BenchOptions:
    preset: str | None = "v2-lite"
    model: str | None = None  # a checkpoint directory instead of a preset
    compare_hf: bool = False
    prompt_lens: list[int] = field(default_factory=lambda: [2048, 8192, 32768])
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 64])
    decode_context: int = 1024
    decode_steps: int = 64
    long_contexts: list[int] = field(default_factory=list)  # one stream decoding after these many tokens too
    turns: list[tuple[int, int]] = field(default_factory=list)  # (prefix, new): a next turn over a cached prefix
    hf_decode_steps: int = 8
    hf_max_prompt_len: int = 8192  # longer prompts are left to us (the peer's eager attention runs out of memory)
    repeats: int = 3
    kernels: bool = True
    device: str = "auto"
    dtype: str = "auto"
    weights: str = "checkpoint"  # "bf16": the checkpoint's FP8 / MXFP4 weights dequantized
    backend: str = "auto"
    block_size: int = 64
    kv_cache_dtype: str = "auto"  # EngineConfig's: auto, bf16, fp8 (the V3-family latent cache, one rank)
    eager: bool = False
    # steps of up to this many tokens from CUDA graphs (EngineConfig.prefill_graph_tokens; None: the engine's
    # default, 0: eager)
    prefill_graphs: int | None = None
    pdl: bool = True  # kernels launched with programmatic dependent launch where the card has it
    # the Gluon kernels on Hopper (prefill's bf16 attention and FP8 expert GEMMs, decode attention's split
    # programs: mla_prefill / fused_moe / mla_decode.GLUON); False: the Triton kernels
    gluon: bool = True
    fold_chunks: bool = True  # a step's equal short chunks folded into the decode kernel's heads (FOLD_CHUNKS)
    # under PDL the shared experts' GEMV programs start while the router runs (kernels.moe_gemv.SHARED_EARLY)
    shared_early: bool = True
    expert_dot: bool = False  # FP8 experts' GEMVs with their products on the tensor cores (kernels.moe_gemv.DOT)
    projection_dot: bool = True  # FP8 projections of 2-16 rows the same way, every row in one pass (kernels.gemv.DOT)
    grouped_dot: bool = True  # and the block-diagonal ones (V4's wo_a) in one launch (kernels.gemv.DOT_GROUPS)
    seed: int = 0
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    parallel_path: bool = False  # through the executor (engine/bench/parallel.py) even at one rank
    out_dir: Path = Path("benchmarks/results")
    command: str = ""


def _guard(fn, *args, **kwargs) -> dict:
    """A phase that fails (out of memory, say) is reported, not fatal: the other phases still run."""
    try:
        return fn(*args, **kwargs)
    except (RuntimeError, ValueError) as e:
        logger.warning("%s failed: %s", getattr(fn, "__name__", fn), e)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def _gluon_ran(on: bool, device: torch.device) -> bool:
    """Whether Gluon kernels switched on could run (a Hopper card, a Triton that has Gluon); the kernels'
    `applies` still ask the shapes."""
    from engine.kernels import _util

    on = on and device.type == "cuda"
    return bool(on and torch.cuda.get_device_capability(device)[0] == 9 and _util.gluon_available())


def _summary(phases: dict, field_name: str) -> dict:
    return {k: v.get(field_name) for k, v in phases.items()}


# each switch of BenchOptions -> the module flags it sets for one run (restored after it)
SWITCHES = {
    "pdl": ("engine.kernels._util.PDL",),
    "gluon": ("engine.kernels.mla_prefill.GLUON", "engine.kernels.fused_moe.GLUON", "engine.kernels.mla_decode.GLUON"),
    "fold_chunks": ("engine.layers.attention.FOLD_CHUNKS",),
    "shared_early": ("engine.kernels.moe_gemv.SHARED_EARLY",),
    "expert_dot": ("engine.kernels.moe_gemv.DOT",),
    "projection_dot": ("engine.kernels.gemv.DOT",),
    "grouped_dot": ("engine.kernels.gemv.DOT_GROUPS",),
}


def run(opts: BenchOptions) -> dict:
    """-> the results dict (also written to opts.out_dir as <preset>.json and .png)."""
    flags = [(importlib.import_module(module), name, getattr(opts, option))
             for option, paths in SWITCHES.items() for module, name in (path.rsplit(".", 1) for path in paths)]
    saved = [(module, name, getattr(module, name)) for module, name, _ in flags]
    for module, name, value in flags:
        setattr(module, name, value)
    try:
        return _run(opts)
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        gc.unfreeze()


def _run(opts: BenchOptions) -> dict:
    from engine.kernels import _util, fused_moe, mla_decode, mla_prefill

    if opts.model:
        path = resolve_model_path(opts.model)
        hf_config = json.loads((path / "config.json").read_text())
        name = opts.preset or path.name
    else:
        path, hf_config, name = None, preset_config(opts.preset), opts.preset
    if opts.weights == "bf16":
        hf_config = {k: v for k, v in hf_config.items() if k not in ("quantization_config", "expert_dtype")}
        name = f"{name}-bf16"
    model_config = ModelConfig.from_hf(hf_config)
    v3_one_rank = not (opts.tensor_parallel_size > 1 or opts.parallel_path or model_config.architecture
                       in ("DeepseekV4ForCausalLM", "DeepseekV41ForCausalLM"))
    for given, flag in ((opts.kv_cache_dtype != "auto", "--kv-cache-dtype"), (opts.turns, "--turns"),
                        (opts.prefill_graphs, "--prefill-graphs")):
        if given and not v3_one_rank:
            raise ValueError(f"{flag} is measured for V3-family models on one rank")
    if model_config.architecture in ("DeepseekV4ForCausalLM", "DeepseekV41ForCausalLM"):
        from engine.bench.v4 import run_v4
        from engine.bench.v41 import run_v41

        if opts.model or opts.tensor_parallel_size > 1:
            raise ValueError("the V4 and V4.1 benchmarks run presets (random weights) on one GPU")
        if model_config.architecture == "DeepseekV41ForCausalLM":
            return run_v41(opts, hf_config, model_config, name)
        return run_v4(opts, hf_config, model_config, name)
    if opts.tensor_parallel_size > 1 or opts.parallel_path:
        from engine.bench.parallel import run_parallel

        if opts.model:
            raise ValueError("the parallel benchmark runs presets (random weights): use --preset")
        tag = f"tp{opts.tensor_parallel_size}" + ("-ep" if opts.enable_expert_parallel else "")
        result = run_parallel(opts, model_config, name)
        write_json(result, opts.out_dir, f"{name}-{tag}")
        return result
    device = resolve_device(opts.device)
    max_conc, bs = max(opts.concurrency), opts.block_size
    decode_len = opts.decode_context + opts.decode_steps + 16
    long_len = max(opts.long_contexts, default=0) + opts.decode_steps + 16
    turn_len = max((p + n for p, n in opts.turns), default=0)
    max_len = max(opts.prompt_lens + [decode_len, long_len, turn_len, 4 * opts.decode_context]) + bs
    num_blocks = max(-(-max_len // bs), max_conc * -(-decode_len // bs)) + 4
    engine_config = EngineConfig(model=str(path or name), dtype=opts.dtype, device=opts.device,
                                 attention_backend=opts.backend, max_num_seqs=max_conc, block_size=bs,
                                 kv_cache_dtype=opts.kv_cache_dtype,
                                 num_kv_blocks=num_blocks, seed=opts.seed, show_progress=False,
                                 max_num_batched_tokens=max(EngineConfig.max_num_batched_tokens,
                                                            opts.prefill_graphs or 0),
                                 prefill_graph_tokens=opts.prefill_graphs,
                                 extra={"enforce_eager": opts.eager, "capture_graphs_at_start": False})
    runner = ModelRunner(engine_config, model_config, path, max_len)
    runner.init_cache(num_blocks)
    gc.collect()
    gc.freeze()  # as the serving engine's process does once its engine is built (engine_process.py)
    fp8 = model_config.quant is not None and runner.backend == "triton"
    ceilings = measure_ceilings(device)
    # the latent cache's bytes a token and layer, whatever its layout (the FP8 one's sections included)
    kv_token_bytes = runner.kv_specs[0].block_bytes(bs) / bs
    costs = PhaseCosts(runner.model, model_config, torch.empty((), dtype=runner.dtype).element_size(), kv_token_bytes)
    pool = BlockPool(runner.num_blocks, bs)
    vocab = model_config.vocab_size

    prefill, decode = {}, {}
    for n in opts.prompt_lens:
        m = _guard(measure_prefill, runner, pool, n, vocab, opts.repeats)
        if "seconds" in m:
            m.update(fractions(m["seconds"], *costs.prefill(n), ceilings, fp8))
        prefill[str(n)] = m
    for c in opts.concurrency:
        m = _guard(measure_decode, runner, pool, c, opts.decode_context, opts.decode_steps, vocab)
        if "seconds_per_step" in m:
            m.update(fractions(m["seconds_per_step"], *costs.decode(c, m["context"]), ceilings, fp8))
        decode[str(c)] = m
    long = {}  # one stream after a long prompt: the latent cache's reads grow with the context
    for ctx in opts.long_contexts:
        m = _guard(measure_decode, runner, pool, 1, ctx, opts.decode_steps, vocab)
        if "seconds_per_step" in m:
            m.update(fractions(m["seconds_per_step"], *costs.decode(1, m["context"]), ceilings, fp8))
        long[str(ctx)] = m
    turns = {}  # a conversation's next turn: its new tokens over the earlier ones, cached
    for prefix, new in opts.turns:
        m = _guard(measure_turn, runner, pool, prefix, new, vocab, opts.repeats)
        if "seconds" in m:
            m.update(fractions(m["seconds"], *costs.turn(prefix, new), ceilings, fp8))
        turns[f"{prefix}:{new}"] = m
    layers = _guard(measure_layers, runner, pool, opts.decode_context, vocab)
    if isinstance(layers, list):
        for entry in layers:
            entry.update(fractions(entry["seconds"], *costs.decode_layer(entry["layer"], 1, opts.decode_context + 1),
                                   ceilings, fp8))
            entry["ratio_to_bandwidth_floor"] = entry["seconds"] / entry["bandwidth_floor_s"]
    kernels = (_guard(measure_kernels, runner, ceilings, max(p for p in opts.prompt_lens if p <= 8192)
                      if any(p <= 8192 for p in opts.prompt_lens) else min(opts.prompt_lens), opts.decode_context)
               if opts.kernels and runner.backend == "triton" else [])

    variants = {"grouped_moe": _guard(_grouped_variant, runner, pool, opts, costs, ceilings)} if runner.backend == "triton" else {}

    pdl_on = _util.pdl(torch.empty(0, device=device))
    result = dict(
        preset=name, model=str(path) if path else None, command=opts.command, commit=_source_commit(),
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        date=datetime.date.today().isoformat(), torch=torch.__version__,
        dtype=str(runner.dtype).replace("torch.", ""), weights="fp8 e4m3, 128x128 blocks" if fp8 else str(runner.dtype).replace("torch.", ""),
        backend=runner.backend, kv_cache_dtype=opts.kv_cache_dtype, cuda_graphs=runner.graphs is not None,
        prefill_graph_tokens=runner.prefill_graph_sizes[-1] if runner.prefill_graph_sizes else 0,
        pdl=pdl_on, num_layers=model_config.num_hidden_layers,
        gluon_prefill=_gluon_ran(mla_prefill.GLUON or fused_moe.GLUON, device),
        gluon_decode=_gluon_ran(mla_decode.GLUON, device),
        fold_chunks=opts.fold_chunks and runner.backend == "triton",  # the decode kernel's option
        # the GEMVs' options: the first under PDL only, the others for FP8 weights
        shared_early=opts.shared_early and runner.backend == "triton" and pdl_on,
        expert_dot=opts.expert_dot and fp8 and getattr(model_config, "expert_dtype", None) != "fp4",
        projection_dot=opts.projection_dot and fp8,
        grouped_dot=opts.grouped_dot and opts.projection_dot and fp8 and getattr(model_config, "o_groups", 1) > 1,
        decode_context=opts.decode_context, decode_steps=opts.decode_steps, ceilings=ceilings.as_dict(),
        ttft_s=_summary(prefill, "seconds"), prefill_tok_s=_summary(prefill, "tok_s"),
        decode_tok_s=_summary(decode, "tok_s"), prefill=prefill, decode=decode,
        long_context_decode_tok_s=_summary(long, "tok_s"), long_context_decode=long,
        turn_tok_s=_summary(turns, "tok_s"), turn=turns, layers=layers, kernels=kernels,
        variants=variants,
    )
    write_json(result, opts.out_dir)  # ours stays on disk even if the peer then fails
    if opts.compare_hf:
        result["hf"] = _run_hf(runner, hf_config, opts, costs, ceilings)
        result["speedup"] = {
            "decode": {c: _ratio(result["decode_tok_s"][c], result["hf"]["decode_tok_s"].get(c)) for c in decode},
            "prefill": {n: _ratio(result["prefill_tok_s"][n], result["hf"]["prefill_tok_s"].get(n)) for n in prefill},
        }
    write_json(result, opts.out_dir)
    write_plot(result, opts.out_dir)
    return result


def _grouped_variant(runner: ModelRunner, pool: BlockPool, opts: BenchOptions, costs: PhaseCosts, ceilings) -> dict:
    """Decode again with every batch's experts on the grouped GEMM (no GEMV path for small batches,
    shared experts apart), for comparison with the default."""
    from engine.layers.moe import FusedExperts
    from engine.model_runner import DecodeGraphs

    experts = [m for m in runner.model.modules() if isinstance(m, FusedExperts)]
    fp8 = runner.model_config.quant is not None  # the fast path keeps FP8 blocks
    default = {m: m.gemv_max_tokens for m in experts}
    decode = {}
    try:
        for m in experts:
            m.gemv_max_tokens = 0
        runner.graphs = DecodeGraphs(runner) if runner.use_cuda_graphs else None  # graphs of this path
        for c in (c for c in opts.concurrency if c <= max(max(default.values(), default=0), 8)):
            m = measure_decode(runner, pool, c, opts.decode_context, opts.decode_steps, runner.model_config.vocab_size)
            m.update(fractions(m["seconds_per_step"], *costs.decode(c, m["context"]), ceilings, fp8))
            decode[str(c)] = m
        layers = measure_layers(runner, pool, opts.decode_context, runner.model_config.vocab_size)
    finally:
        for m in experts:
            m.gemv_max_tokens = default[m]
        runner.graphs = DecodeGraphs(runner) if runner.use_cuda_graphs else None
    return dict(gemv_max_tokens=0, decode_tok_s=_summary(decode, "tok_s"), decode=decode, layers=layers)


def _source_commit() -> str | None:
    """The engine's git commit, when it runs from a checkout (provenance of the figures)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _ratio(a, b):
    return a / b if a and b else None


def _run_hf(runner: ModelRunner, hf_config: dict, opts: BenchOptions, costs: PhaseCosts, ceilings) -> dict:
    import transformers

    device, vocab = runner.device, runner.model_config.vocab_size
    hf = peer_in_place_of(runner, hf_config)
    prefill, decode = {}, {}
    for n in opts.prompt_lens:
        if n > opts.hf_max_prompt_len:
            prefill[str(n)] = {"skipped": f"prompts over {opts.hf_max_prompt_len} tokens are not run on the peer"}
            continue
        m = _guard(hf_measure_prefill, hf, n, vocab, device, opts.repeats)
        if "seconds" in m:
            m.update(fractions(m["seconds"], *costs.prefill(n), ceilings, False))
        prefill[str(n)] = m
    for c in opts.concurrency:
        m = _guard(hf_measure_decode, hf, c, opts.decode_context, opts.hf_decode_steps, vocab, device)
        if "seconds_per_step" in m:
            m.update(fractions(m["seconds_per_step"], *costs.decode(c, m["context"]), ceilings, False))
        decode[str(c)] = m
    return dict(transformers=transformers.__version__, attn_implementation=hf.config._attn_implementation,
                weights=str(runner.dtype).replace("torch.", ""), ttft_s=_summary(prefill, "seconds"),
                prefill_tok_s=_summary(prefill, "tok_s"), decode_tok_s=_summary(decode, "tok_s"),
                prefill=prefill, decode=decode)
