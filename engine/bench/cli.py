"""Arguments of `deepseek-engine bench` (also `python -m engine.bench`, which needs no server packages)."""

import argparse
import sys
from pathlib import Path

from engine.bench.presets import PRESETS


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _turns(text: str) -> list[tuple[int, int]]:
    try:
        turns = [tuple(int(x) for x in item.split(":")) for item in text.split(",") if item.strip()]
    except ValueError:
        turns = []
    if not turns or any(len(t) != 2 or min(t) < 1 for t in turns):
        raise argparse.ArgumentTypeError(f"expected comma-separated PREFIX:NEW token counts, got {text!r}")
    return turns


def add_bench_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=sorted(PRESETS), help="a named shape with random weights (default v2-lite)")
    src.add_argument("--model", help="a checkpoint directory instead of a preset")
    p.add_argument("--compare-hf", action="store_true", help="also time HF transformers on the same weights")
    p.add_argument("--prompt-lens", type=_ints, default=[2048, 8192, 32768], help="prefill prompt lengths")
    p.add_argument("--concurrency", type=_ints, default=[1, 8, 64], help="decode batch sizes")
    p.add_argument("--decode-context", type=int, default=1024, help="prompt tokens before decoding")
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--long-contexts", type=_ints, default=[],
                   help="also decode one stream after prompts this long (e.g. 32768,131072)")
    p.add_argument("--turns", type=_turns, default=[], metavar="PREFIX:NEW,...",
                   help="also time a conversation's next turn: NEW tokens over PREFIX cached ones (e.g. 16384:1024)")
    p.add_argument("--hf-decode-steps", type=int, default=8)
    p.add_argument("--hf-max-prompt-len", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-kernels", dest="kernels", action="store_false", help="skip the per-kernel measurements")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--weights", default="checkpoint", choices=["checkpoint", "bf16"],
                   help="checkpoint: quantized as the preset or checkpoint ships them (V3's FP8 blocks, V4's FP8 "
                        "and MXFP4 experts); bf16: dequantized (results as <preset>-bf16)")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bf16", "fp8"],
                   help="the latent cache's dtype (fp8: e4m3 c_kv with a scale per token; V3-family models, one rank)")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--prefill-graphs", type=int, metavar="TOKENS",
                   help="steps of up to TOKENS tokens replayed from CUDA graphs of their padded length, as the "
                        "engine's --prefill-graph-tokens (default: the engine's, 2048; 0: eager)")
    p.add_argument("--no-gluon", dest="gluon", action="store_false",
                   help="the Triton kernels where Hopper would take the warp-specialised Gluon ones (prefill's bf16 "
                        "attention and FP8 expert GEMMs, decode attention's split programs), to measure what they give")
    p.add_argument("--no-fold-chunks", dest="fold_chunks", action="store_false",
                   help="a step's equal short chunks (a next turn: --turns) as rows of the decode kernel each, not "
                        "folded into its heads (each sequence's cache read once for its tokens), to measure the fold")
    p.add_argument("--no-shared-early", dest="shared_early", action="store_false",
                   help="the shared experts' GEMV programs wait for the router like the routed ones, to measure "
                        "what starting them early gives (under PDL)")
    p.add_argument("--expert-dot", action="store_true",
                   help="FP8 experts' GEMVs with their products on the tensor cores, to measure them")
    p.add_argument("--no-projection-dot", dest="projection_dot", action="store_false",
                   help="FP8 projections of 2-16 rows by the FP8 GEMM, not the GEMV with its products on the tensor "
                        "cores (one read of the weight for every row), to measure what that gives")
    p.add_argument("--no-grouped-dot", dest="grouped_dot", action="store_false",
                   help="FP8 block-diagonal projections (DeepSeek-V4's wo_a) of 2-16 rows by an FP8 GEMM a group, not "
                        "one tensor-core GEMV launch for all, to measure what that gives")
    p.add_argument("--no-pdl", dest="pdl", action="store_false",
                   help="kernels without programmatic dependent launch (Hopper+), to measure what it gives")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks (GPUs): steps through the executor")
    p.add_argument("--enable-expert-parallel", action="store_true", help="routed experts partitioned over the ranks")
    p.add_argument("--parallel-path", action="store_true",
                   help="at one rank too, measure through the executor (the like-for-like baseline of TP/EP)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="where the JSON and PNG go")


def run_bench(args: argparse.Namespace, command: str) -> int:
    """Run the benchmark the arguments describe; `command` is recorded in the results as given."""
    import logging

    from engine.bench.suite import BenchOptions, run

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    preset = args.preset or (None if args.model else "v2-lite")
    opts = BenchOptions(preset=preset, model=args.model, compare_hf=args.compare_hf, prompt_lens=args.prompt_lens,
                        concurrency=args.concurrency, decode_context=args.decode_context,
                        decode_steps=args.decode_steps, long_contexts=args.long_contexts, turns=args.turns,
                        hf_decode_steps=args.hf_decode_steps,
                        hf_max_prompt_len=args.hf_max_prompt_len, repeats=args.repeats, kernels=args.kernels,
                        device=args.device, dtype=args.dtype, weights=args.weights, backend=args.backend,
                        block_size=args.block_size, eager=args.eager, prefill_graphs=args.prefill_graphs,
                        pdl=args.pdl, gluon=args.gluon, fold_chunks=args.fold_chunks,
                        shared_early=args.shared_early,
                        expert_dot=args.expert_dot, projection_dot=args.projection_dot,
                        grouped_dot=args.grouped_dot, seed=args.seed,
                        kv_cache_dtype=args.kv_cache_dtype,
                        out_dir=args.out, command=command,
                        tensor_parallel_size=args.tensor_parallel_size,
                        enable_expert_parallel=args.enable_expert_parallel, parallel_path=args.parallel_path)
    try:
        result = run(opts)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary(result))
    return 0


def summary(result: dict) -> str:
    ranks = (f", TP={result['tensor_parallel_size']}" + (" + EP" if result["enable_expert_parallel"] else "")
             if "tensor_parallel_size" in result else "")
    cache = f", {result['kv_cache_dtype']} latent cache" if result.get("kv_cache_dtype", "auto") != "auto" else ""
    lines = [f"{result['preset']} on {result['gpu']} ({result['weights']}, {result['backend']}, "
             f"graphs={result['cuda_graphs']}{ranks}{cache}):"]
    hf = result.get("hf") or {}
    for key, label in (("prefill_tok_s", "prefill tok/s"), ("decode_tok_s", "decode tok/s"),
                       ("long_context_decode_tok_s", "1 stream at"), ("turn_tok_s", "next turn")):
        for k, v in (result.get(key) or {}).items():
            peer = (hf.get(key) or {}).get(k)
            lines.append(f"  {label:14s} {k:>6s}: {v if v is None else round(v, 1)!s:>10s}"
                         + (f"   HF {round(peer, 1)}" if peer else ""))
    return "\n".join(lines)
