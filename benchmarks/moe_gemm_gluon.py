"""The FP8 routed experts' grouped GEMMs in Gluon, warp-specialised as DeepGEMM builds them
(`engine.kernels.fused_moe_gluon`), beside the engine's Triton kernels, in three schedules.

The engine's `_moe_gemm_tma_kernel` promotes each 128-K block's product into its float32 accumulator
(times the activations' and the weight block's scales), so every K step waits for its `wgmma` before the
scale FMAs, and nothing else issues meanwhile: the 128-row tile's two warpgroups run in lockstep
(`num_warps=8`), and the same warps issue the TMA loads. Here a producer warp only feeds a ring of A and
B tiles by TMA, and two consumer warpgroups take 64 rows each of a 128-row block: while one waits for its
product and promotes it, the other's product runs on the tensor cores.

Both GEMMs read A by TMA: w2 its sorted intermediate, w13 x's rows copied into the pairs' sorted order
first (`engine.kernels.fused_moe.sort_rows`). B is [E * rows, K]
with DeepSeek's 128 x 128 scales; a tile never crosses an expert. w13 (gated) reads the gate and the up
tiles and writes SiLU(gate) * up at the pair's sorted row; w2 multiplies by the routing weight and writes
each pair's row at its id. Same contract and math as `fused_experts_tma`.

    python benchmarks/moe_gemm_gluon.py [--tokens 2048,8192,32768] [--out FILE]  # Hopper: check, then time
    python benchmarks/moe_gemm_gluon.py --compile [--ptx DIR]                    # no GPU: compile for sm_90

On an H200 (2026-12-05): the same outputs as the engine's kernels, n64 / n128 tiles in five stages 1.17x
them at 32k tokens; four stages, 64-wide w2 tiles and issuing a step ahead were slower (the last since removed
from the kernel).
"""

import json
import sys

import torch
import triton

from engine.kernels._gluon import descriptor, signature_of
from engine.kernels.fused_moe_gluon import _ws_moe_gemm_kernel, ws_fused_experts


def compile_only():
    """sm_90 compile through GluonASTSource (no GPU needed): shared memory, op counts, the PTX for ptxas."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from mla_prefill_gluon import report_compiled  # this folder's

    for gated, block_n, stages in [(True, 64, 5), (False, 128, 5), (True, 64, 4), (False, 128, 4)]:
        sig = dict(a_desc=signature_of(descriptor(torch.empty(256, 512, dtype=torch.float8_e4m3fn), [64, 128])),
                   b_desc=signature_of(descriptor(torch.empty(256, 512, dtype=torch.float8_e4m3fn), [block_n, 128])),
                   AS="*fp32", BS="*fp32", C="*bf16", Weights="*fp32", SortedIds="*i32", BlockExpert="*i32",
                   NumPadded="*i32", N="i32", K="i32", num_pairs="i32", top_k="i32", stride_asm="i32",
                   stride_ask="i32", stride_bse="i32", stride_bsn="i32", stride_cm="i32")
        constexprs = dict(GATED=gated, BLOCK_N=block_n, BLOCK_K=128, GROUP_M=8, STAGES=stages, NUM_PROGRAMS=132,
                          CONSUMER_REGS=232, PRODUCER_REGS=40)
        sig.update({c: "constexpr" for c in constexprs})
        sig = {name: sig[name] for name in _ws_moe_gemm_kernel.arg_names}
        src = GluonASTSource(_ws_moe_gemm_kernel, sig, constexprs=constexprs)
        report_compiled(f"{'w13' if gated else 'w2'} n{block_n} s{stages}",
                        triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)))


def main():
    if "--compile" in sys.argv:
        compile_only()
        return
    from triton.testing import do_bench

    from engine.kernels import fused_moe
    from fp8_prefill_gemms import BLOCK, EXPERTS, HIDDEN, INTER, TOP_K, v3_experts  # this folder's

    tokens = [int(t) for t in sys.argv[sys.argv.index("--tokens") + 1].split(",")] if "--tokens" in sys.argv \
        else [2048, 8192, 32768]
    experts, top_k, hidden, inter, block = EXPERTS, TOP_K, HIDDEN, INTER, BLOCK  # V3's
    fused_moe.GLUON = False  # the engine's Triton kernels as the baseline (the Gluon variants are called directly)
    g = torch.Generator(device="cuda").manual_seed(1)
    w13, s13, w2, s2 = v3_experts(g)
    rows, failed = [], False
    variants = {"gluon n64/n128 s5": dict(), "gluon n64/n128 s4": dict(stages=4), "gluon n64/n64 s5": dict(bn2=64)}
    for t in tokens:
        x = torch.randn(t, hidden, generator=g, device="cuda").to(torch.bfloat16)
        ids = torch.rand(t, experts, generator=g, device="cuda").topk(top_k, dim=-1).indices.int()
        w = torch.rand(t, top_k, generator=g, device="cuda")
        flops = 6.0 * t * top_k * hidden * inter
        ref = fused_moe.fused_experts(x, w13, w2, w, ids, s13, s2, block)
        fns = {"triton (engine)": lambda: fused_moe.fused_experts(x, w13, w2, w, ids, s13, s2, block)}
        for name, kw in variants.items():
            fns[name] = lambda kw=kw: ws_fused_experts(x, w13, w2, w, ids, s13, s2, **kw)
        line = f"T={t}:"
        for name, fn in fns.items():
            try:
                out = fn()
                torch.cuda.synchronize()
            except Exception as e:  # a variant the installed Triton cannot build: report it, time the rest
                print(f"T={t} {name}: failed: {str(e)[:400]}", flush=True)
                failed = True
                continue
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            failed |= not err < 1e-2
            ms = do_bench(fn)
            rows.append(dict(variant=name, tokens=t, ms=ms, tflops=flops / ms / 1e9, rel_err_to_engine=err))
            line += f" | {name} {ms:.2f} ms {flops / ms / 1e9:.0f} TFLOP/s ({err:.0e})"
        print(line, flush=True)
    if "--out" in sys.argv:
        with open(sys.argv[sys.argv.index("--out") + 1], "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           rows=rows), f, indent=1)
    if failed:
        sys.exit("a variant failed or differs from the engine's kernels")


if __name__ == "__main__":
    main()
