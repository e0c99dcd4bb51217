"""FP8 prefill GEMMs at DeepSeek-V3's shapes: the pointer kernels, the persistent TMA kernels and
PyTorch's block-scaled `scaled_mm`, checked against a float32 reference and timed.

    python benchmarks/fp8_prefill_gemms.py [--tokens 2048,8192,32768] [--sweep] [--out FILE]

Dense: every FP8 projection of a `v3-slice` layer (128 x 128 weight blocks, activations quantized per
1 x 128 group) at M = tokens; grouped: the routed experts (256, top-8, H 7168, I 2048) at uniform random
routing. Times are the median of `do_bench` (CUDA events) over fresh inputs; TFLOP/s count 2 M N K
(6 T k H I for the experts) and the share is against an 8192^3 FP8 `torch._scaled_mm` measured in the
same run. The GEMM alone and with its activation quantization are both reported for dense.
"""

import argparse
import json
import statistics
import time
import traceback

import torch
from triton.testing import do_bench

from engine.kernels import fp8_gemm, fused_moe
from engine.kernels.fp8_gemm import (FP8, fp8_block_gemm, fp8_block_gemm_scaled_mm, fp8_block_gemm_tma,
                                     per_token_group_quant)
from engine.layers.fp8 import dequantize_fp8_block, quantize_fp8_block

BLOCK = (128, 128)
# name: (N, K) of the v3-slice projections that prefill runs through the block GEMM
DENSE = {
    "q_a+kv_a": (2112, 7168),
    "q_b": (24576, 1536),
    "o_proj": (7168, 16384),
    "dense gate_up": (36864, 7168),
    "dense down": (7168, 18432),
    "shared gate_up": (4096, 7168),
    "shared down": (7168, 2048),
}
EXPERTS, TOP_K, HIDDEN, INTER = 256, 8, 7168, 2048
# (BLOCK_M, BLOCK_N, num_warps, num_stages, programs per SM)
DENSE_SWEEP = [(128, 128, 8, 3, 1), (128, 128, 8, 5, 1), (64, 128, 4, 4, 2), (64, 128, 4, 3, 2),
               (128, 64, 4, 4, 2), (128, 128, 4, 3, 1)]
SWEEP_SHAPES = ("o_proj", "dense gate_up", "q_b")
QUICK_SHAPES = ("q_a+kv_a", "o_proj", "dense gate_up", "shared down")
# (BLOCK_M, BLOCK_N of w13, BLOCK_N of w2, num_warps, num_stages, programs per SM)
MOE_SWEEP = [(128, 64, 128, 8, 3, 1), (128, 128, 128, 8, 3, 1), (64, 64, 128, 4, 4, 2), (64, 64, 128, 4, 3, 2),
             (64, 64, 128, 4, 4, 1), (64, 128, 128, 4, 3, 1)]


def bench(fn) -> float:
    """Median seconds (CUDA events, 25 ms warm-up, 100 ms of repeats)."""
    return do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(whole-tensor relative error, worst row's): a row never written shows in the second."""
    d, r = (out.double() - ref.double()), ref.double()
    rows = d.norm(dim=-1) / r.norm(dim=-1).clamp(min=1e-30)
    return (d.norm() / r.norm()).item(), rows.max().item()


def fp8_ceiling() -> float:
    a = torch.randn(8192, 8192, device="cuda").to(FP8)
    b = torch.randn(8192, 8192, device="cuda").to(FP8).T
    one = torch.ones((), device="cuda")
    sec = bench(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16))
    return 2 * 8192**3 / sec


def torch_blockwise(a, a_s, w, ws, api: str, ws_layout: str):
    """PyTorch's own 1 x 128 (activations) x 128 x 128 (weights) scaled_mm, if this build has it on this
    card: activation scales outer-dim-major ([M, K / 128] with stride (1, M)); the weight's scales as
    stored ([N / 128, K / 128]) or transposed to B = W^T's [K / 128, N / 128]."""
    a_s_outer = a_s.T.contiguous().T
    b_s = ws if ws_layout == "nk" else ws.T
    if api == "F.scaled_mm":
        from torch.nn.functional import ScalingType, scaled_mm

        return scaled_mm(a, w.T, a_s_outer, ScalingType.BlockWise1x128, b_s, ScalingType.BlockWise128x128,
                         output_dtype=torch.bfloat16)
    return torch._scaled_mm(a, w.T, a_s_outer, b_s, out_dtype=torch.bfloat16)


def dense_rows(tokens_list, sweep: bool, quick: bool, ceiling: float, log) -> list[dict]:
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in DENSE.items():
        if quick and name not in QUICK_SHAPES:
            continue
        wq, ws = quantize_fp8_block(0.02 * torch.randn(n, k, generator=g, device="cuda"), BLOCK)
        for m in tokens_list:
            x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
            q, s = per_token_group_quant(x, 128)
            qk, sk = per_token_group_quant(x, 128, k_major_scales=True)
            flops = 2.0 * m * n * k
            ref = None
            if m * n <= 2**28:  # a float32 product that fits beside the rest
                ref = dequantize_fp8_block(q, s, (1, 128)) @ dequantize_fp8_block(wq, ws, BLOCK).T
            variants = {"pointer": lambda: fp8_block_gemm(q, s, wq, ws, BLOCK, torch.bfloat16),
                        "tma": lambda: fp8_block_gemm_tma(qk, sk, wq, ws, BLOCK, torch.bfloat16),
                        "scaled_mm": lambda: fp8_block_gemm_scaled_mm(qk, sk, wq, ws)}
            if not quick:
                variants |= {"tma_flat": lambda: fp8_block_gemm_tma(qk, sk, wq, ws, BLOCK, torch.bfloat16,
                                                                    flatten=True),
                             "F.scaled_mm_nk": lambda: torch_blockwise(q, s, wq, ws, "F.scaled_mm", "nk"),
                             "torch._scaled_mm_nk": lambda: torch_blockwise(q, s, wq, ws, "_scaled_mm", "nk")}
            if sweep and m == 8192 and name in SWEEP_SHAPES:
                for cfg in DENSE_SWEEP:
                    variants[f"tma{cfg}"] = (lambda c=cfg: fp8_block_gemm_tma(qk, sk, wq, ws, BLOCK, torch.bfloat16,
                                                                             config=c))
            base = None
            for vname, fn in variants.items():
                row = dict(kind="dense", shape=name, M=m, N=n, K=k, variant=vname)
                try:
                    out = fn()
                    torch.cuda.synchronize()
                    if ref is not None:
                        row["rel_err"], row["worst_row_err"] = rel_err(out, ref)
                    elif base is not None:
                        row["rel_err_vs_pointer"], row["worst_row_err"] = rel_err(out, base)
                    if vname == "pointer":
                        base = out
                    sec = bench(fn)
                    row.update(ms=sec * 1e3, tflops=flops / sec / 1e12, share=flops / sec / ceiling)
                except Exception as e:  # noqa: BLE001 -- one variant failing must not stop the table
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    log.write(f"{name} M={m} {vname}\n{traceback.format_exc()}\n")
                rows.append(row)
                print(json.dumps(row), flush=True)
            # with the activation quantization: the pointer kernel, and fp8_linear as wired (its path by shape)
            path = fp8_gemm.prefill_gemm(m, n, k, BLOCK, torch.bfloat16, x.device)
            for vname, fn in (("linear_pointer", lambda: fp8_block_gemm(*per_token_group_quant(x, 128), wq, ws, BLOCK,
                                                                        torch.bfloat16)),
                              (f"linear_{path}", lambda: fp8_gemm.fp8_linear(x, wq, ws, BLOCK))):
                sec = bench(fn)
                row = dict(kind="dense", shape=name, M=m, N=n, K=k, variant=vname, ms=sec * 1e3,
                           tflops=flops / sec / 1e12, share=flops / sec / ceiling)
                rows.append(row)
                print(json.dumps(row), flush=True)
            del x, q, s, qk, sk, ref, base
        del wq, ws
        torch.cuda.empty_cache()
    return rows


def reference_experts(x, w13, s13, w2, s2, weights, ids):
    """The kernels' math in float32 (per-group FP8 activations both times), one expert at a time."""
    xq = dequantize_fp8_block(*per_token_group_quant(x, 128), (1, 128))
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        h = xq[tok] @ dequantize_fp8_block(w13[e], s13[e], BLOCK).T
        act = (torch.nn.functional.silu(h[:, :INTER]) * h[:, INTER:]).to(x.dtype)
        aq = dequantize_fp8_block(*per_token_group_quant(act, 128), (1, 128))
        y = aq @ dequantize_fp8_block(w2[e], s2[e], BLOCK).T
        out.index_add_(0, tok, weights[tok, slot, None] * y)
    return out


def moe_breakdown(x, w13, s13, w2, s2, w, ids, cfg, ceiling) -> list[dict]:
    """Each launch of the TMA path alone: quantize x, align, w13 (gathering x's rows), quantize the
    intermediate, w2, top-k sum; and the copy of x's rows in sorted order the Gluon GEMMs read instead."""
    from engine.kernels.moe_routing import align_by_expert

    t, top_k = ids.shape
    pairs = t * top_k
    bm, bn13, bn2, warps, stages, per_sm = cfg
    align = align_by_expert(ids, EXPERTS, bm)
    a, a_s = per_token_group_quant(x, 128, k_major_scales=True)
    inter = torch.zeros(align[0].shape[0], INTER, dtype=x.dtype, device=x.device)
    a2, a2_s = per_token_group_quant(inter, 128, k_major_scales=True)
    pair_out = torch.empty(pairs, HIDDEN, dtype=x.dtype, device=x.device)
    gemm = 2.0 * pairs * HIDDEN * INTER
    pieces = {
        "quant x": (lambda: per_token_group_quant(x, 128, k_major_scales=True), 0.0),
        "align": (lambda: align_by_expert(ids, EXPERTS, bm), 0.0),
        "w13": (lambda: fused_moe._launch_tma(a, a_s, w13, s13, inter, w, align, pairs, top_k, True, BLOCK, bm, bn13,
                                              warps, stages, per_sm), 2 * gemm),
        "sort x rows": (lambda: fused_moe.sort_rows(a, a_s, align[0], pairs, top_k), 0.0),
        "quant inter": (lambda: per_token_group_quant(inter, 128, k_major_scales=True), 0.0),
        "w2": (lambda: fused_moe._launch_tma(a2, a2_s, w2, s2, pair_out, w, align, pairs, top_k, False, BLOCK, bm, bn2,
                                             warps, stages, per_sm), gemm),
        "top-k sum": (lambda: pair_out.view(t, top_k, HIDDEN).sum(dim=1), 0.0),
    }
    rows = []
    for name, (fn, flops) in pieces.items():
        sec = bench(fn)
        row = dict(kind="grouped piece", shape=name, T=t, variant=str(cfg), ms=sec * 1e3, tflops=flops / sec / 1e12,
                   share=flops / sec / ceiling)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def v3_experts(g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """V3's routed experts with random FP8 weights: (w13, w13 scales, w2, w2 scales)."""
    w13, s13, w2, s2 = [], [], [], []
    for _ in range(EXPERTS):  # one expert at a time: a float32 copy of all would not fit
        a, b = quantize_fp8_block(0.02 * torch.randn(2 * INTER, HIDDEN, generator=g, device="cuda"), BLOCK)
        c, d = quantize_fp8_block(0.02 * torch.randn(HIDDEN, INTER, generator=g, device="cuda"), BLOCK)
        w13.append(a), s13.append(b), w2.append(c), s2.append(d)
    return tuple(torch.stack(t) for t in (w13, s13, w2, s2))


def moe_rows(tokens_list, sweep: bool, ceiling: float, log) -> list[dict]:
    rows = []
    g = torch.Generator(device="cuda").manual_seed(1)
    w13, s13, w2, s2 = v3_experts(g)
    for t in tokens_list:
        x = torch.randn(t, HIDDEN, generator=g, device="cuda").to(torch.bfloat16)
        ids = torch.rand(t, EXPERTS, generator=g, device="cuda").topk(TOP_K, dim=-1).indices.int()
        w = torch.rand(t, TOP_K, generator=g, device="cuda")
        flops = 6.0 * t * TOP_K * HIDDEN * INTER
        ref = reference_experts(x, w13, s13, w2, s2, w, ids) if t <= 8192 else None
        cfg = fused_moe.tma_config(t * TOP_K / EXPERTS, BLOCK, INTER, HIDDEN, x)
        variants = {"pointer": lambda: fused_moe.fused_experts(x, w13, w2, w, ids, s13, s2, BLOCK, tma_path=False)}
        if cfg is not None:
            variants["tma"] = lambda: fused_moe.fused_experts_tma(x, w13, w2, w, ids, s13, s2, BLOCK, cfg)
            variants["tma_noflat"] = lambda: fused_moe.fused_experts_tma(x, w13, w2, w, ids, s13, s2, BLOCK, cfg,
                                                                         flatten=False)
            variants["tma(64,64,128,4,3,3)"] = lambda: fused_moe.fused_experts_tma(x, w13, w2, w, ids, s13, s2, BLOCK,
                                                                                   (64, 64, 128, 4, 3, 3))
        if cfg is not None and t == 8192:
            rows += moe_breakdown(x, w13, s13, w2, s2, w, ids, cfg, ceiling)
        if sweep:
            for c in MOE_SWEEP:
                variants[f"tma{c}"] = lambda c=c: fused_moe.fused_experts_tma(x, w13, w2, w, ids, s13, s2, BLOCK, c)
        for vname, fn in variants.items():
            row = dict(kind="grouped", shape=f"E={EXPERTS} k={TOP_K} H={HIDDEN} I={INTER}", T=t,
                       rows_per_expert=t * TOP_K / EXPERTS, variant=vname)
            try:
                out = fn()
                torch.cuda.synchronize()
                if ref is not None:
                    row["rel_err"], row["worst_row_err"] = rel_err(out, ref)
                sec = bench(fn)
                row.update(ms=sec * 1e3, tflops=flops / sec / 1e12, share=flops / sec / ceiling)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                log.write(f"moe T={t} {vname}\n{traceback.format_exc()}\n")
            rows.append(row)
            print(json.dumps(row), flush=True)
        del x, ids, w, ref
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="2048,8192,32768")
    p.add_argument("--sweep", action="store_true", help="also every tile configuration at 8k tokens")
    p.add_argument("--quick", action="store_true", help="four dense shapes, fewer variants")
    p.add_argument("--skip-dense", action="store_true")
    p.add_argument("--skip-moe", action="store_true")
    p.add_argument("--out", default="fp8_prefill_gemms.json")
    p.add_argument("--log", default="fp8_prefill_gemms.log")
    args = p.parse_args()
    tokens = [int(v) for v in args.tokens.split(",")]
    t0 = time.time()
    ceiling = fp8_ceiling()
    print(f"{torch.cuda.get_device_name()}: FP8 matmul ceiling {ceiling / 1e12:.0f} TFLOP/s", flush=True)
    with open(args.log, "w") as log:
        rows = [] if args.skip_dense else dense_rows(tokens, args.sweep, args.quick, ceiling, log)
        rows += [] if args.skip_moe else moe_rows(tokens, args.sweep, ceiling, log)
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=__import__("triton").__version__, fp8_ceiling_tflops=ceiling / 1e12,
                  tma_configs=dict(dense=fp8_gemm.TMA_TILE, grouped=fused_moe.TMA_CONFIGS), rows=rows,
                  seconds=time.time() - t0)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{'kind':8} {'shape':16} {'M/T':>6} {'variant':28} {'ms':>8} {'TFLOP/s':>8} {'share':>6} {'err':>9}")
    for r in rows:
        err = r.get("rel_err", r.get("rel_err_vs_pointer", float("nan")))
        if "error" in r:
            print(f"{r['kind']:8} {r['shape'][:16]:16} {r.get('M', r.get('T')):>6} {r['variant'][:28]:28} ERROR "
                  f"{r['error'][:60]}")
        else:
            print(f"{r['kind']:8} {r['shape'][:16]:16} {r.get('M', r.get('T')):>6} {r['variant'][:28]:28} "
                  f"{r['ms']:8.3f} {r['tflops']:8.0f} {r['share']:6.1%} {err:9.2e}")
    print(f"total {statistics.fsum([time.time() - t0]):.0f} s")


if __name__ == "__main__":
    main()
