"""MLA prefill attention alone (`engine.kernels.mla_prefill`): causal attention's rate against the
card's bf16 matmul rate.

    python benchmarks/mla_prefill.py [--heads 16,128] [--cases 2048,8192,32768,4096@32768]
                                     [--sweep] [--variants a,b] [--check] [--baseline FILE] [--out results.json]

A case `L` is one prompt of L tokens; `Q@K` is a chunk of Q tokens after a cached prefix of K - Q (the
next turn of a long conversation, or chunked prefill). Heads are DeepSeek's (nope 128, rope 64, v 128;
16 heads: DeepSeek-V2-Lite, 128: V3 on one rank), keys and values expanded per head as the engine
expands them ([T, H, nope + v], one GEMM through W_UKV), bf16. FLOPs = heads x visible (query, key)
pairs x (2 x (nope + rope) + 2 x v); timed with CUDA events, replayed from a CUDA graph when a call is
short.

--sweep also times tile choices (query rows, key tile, warps, pipeline depth, the unmasked tiles before
the diagonal); --check compares every variant with the float32 reference first (where its scores take at most 4 GB).
"""

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.bench.roofline import measure_ceilings  # noqa: E402
from engine.bench.timing import time_replayed  # noqa: E402
from engine.kernels.mla_prefill import mla_prefill_attention, reference_mla_prefill_attention  # noqa: E402

NOPE, ROPE, VDIM = 128, 64, 128
SWEEP = {
    "default": {},
    "masked everywhere": dict(split=False),
    "n64 s2": dict(num_stages=2),
    "n64 s4": dict(num_stages=4),
    "n128 s2": dict(block_n=128, num_stages=2),
    "m64 n64 w4 s3": dict(block_m=64, num_warps=4),
    # the tiles before the diagonal read through pointers by every thread, not by the TMA unit (the
    # default's descriptors; the variants above all take them)
    "no tma": dict(tma=False),
}


def parse_case(text: str) -> tuple[int, int]:
    q, _, k = text.partition("@")
    return int(q), int(k or q)


def make_case(q_len: int, k_len: int, heads: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16)
    q, kv, k_pe = rnd(q_len, heads, NOPE + ROPE), rnd(k_len, heads, NOPE + VDIM), rnd(k_len, ROPE)
    cu = lambda n: torch.tensor([0, n], dtype=torch.int32, device="cuda")
    return (q[..., :NOPE], q[..., NOPE:], kv[..., :NOPE], k_pe, kv[..., NOPE:], cu(q_len), cu(k_len))


def flops(q_len: int, k_len: int, heads: int) -> float:
    prefix = k_len - q_len
    pairs = q_len * prefix + q_len * (q_len + 1) / 2
    return heads * pairs * (2 * (NOPE + ROPE) + 2 * VDIM)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", default="16,128")
    p.add_argument("--cases", default="2048,8192,32768,4096@32768")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--variants", help="comma-separated names of --sweep's variants to keep")
    p.add_argument("--check", action="store_true")
    p.add_argument("--baseline", type=Path, help="a module file whose mla_prefill_attention is timed beside (before)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    variants = dict(SWEEP) if args.sweep else {"default": {}}
    if args.variants:
        keep = args.variants.split(",")
        variants = {k: v for k, v in SWEEP.items() if k in keep}
    runs = list(variants.items())
    if args.baseline:
        spec = importlib.util.spec_from_file_location("mla_prefill_before", args.baseline)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        runs.insert(0, ("before", module.mla_prefill_attention))
    ceilings = measure_ceilings(torch.device("cuda"))
    matmul = ceilings.bf16_flops_per_s
    result = dict(gpu=torch.cuda.get_device_name(), bf16_matmul_tflops=matmul / 1e12, rows=[], failures=[])
    scale = (NOPE + ROPE) ** -0.5
    for heads in [int(h) for h in args.heads.split(",")]:
        for case in args.cases.split(","):
            q_len, k_len = parse_case(case)
            inputs = make_case(q_len, k_len, heads)
            ref = None
            if args.check and heads * q_len * k_len <= 1 << 30:  # the float32 scores fit
                ref = reference_mla_prefill_attention(*inputs, scale).float()
            fl = flops(q_len, k_len, heads)
            calls = max(1, min(20, int(2e12 / fl)))
            for name, how in runs:
                fn = how if callable(how) else (lambda *a, how=how: mla_prefill_attention(*a, tiles=how))
                run = lambda: fn(*inputs, q_len, scale)
                try:
                    out = run()
                    err = None if ref is None else ((out.float() - ref).norm() / ref.norm()).item()
                    sec = time_replayed(run, torch.device("cuda"), calls=calls, repeats=5)
                except Exception as e:  # a variant over the chip's shared memory, say: reported, not fatal
                    result["failures"].append(dict(variant=name, heads=heads, case=case, error=str(e)[:300]))
                    print(f"{name} H={heads} {case}: {str(e)[:200]}", flush=True)
                    continue
                row = dict(variant=name, heads=heads, q_len=q_len, k_len=k_len, ms=sec * 1e3,
                           tflops=fl / sec / 1e12, of_matmul=fl / sec / matmul, rel_err=err)
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
            del inputs, ref
            torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print(f"\n{result['gpu']}: MLA prefill attention, bf16 matmul ceiling {matmul / 1e12:.0f} TFLOP/s")
    print(f"{'variant':<20} {'heads':>5} {'case':>12} {'ms':>9} {'TFLOP/s':>8} {'of matmul':>9} {'rel err':>8}")
    for r in result["rows"]:
        case = f"{r['q_len']}@{r['k_len']}" if r["q_len"] != r["k_len"] else str(r["q_len"])
        err = "" if r["rel_err"] is None else f"{r['rel_err']:.1e}"
        print(f"{r['variant']:<20} {r['heads']:>5} {case:>12} {r['ms']:>9.3f} {r['tflops']:>8.0f} "
              f"{r['of_matmul']:>9.0%} {err:>8}")


if __name__ == "__main__":
    main()
