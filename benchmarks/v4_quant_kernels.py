"""DeepSeek-V4 Flash's quantized weights on their kernels, against their bytes floors: the MXFP4 routed
experts as GEMVs (1, 2 and 8 tokens' top-6) for each decode of the codes (`moe_gemv.FP4_DECODES`) and
several tiles, each checked against the float32 math of the dequantized experts; where prefill batches
should leave the GEMV (8, 32, 64 and 128 tokens: the GEMV, the MXFP4 grouped GEMM that decodes its tiles,
and every expert dequantized to bf16 then the bf16 grouped GEMM); the MXFP4 grouped GEMM at a prefill's
rows against bf16 on the same experts dequantized; and the grouped wo_a GEMV (FP8 and bf16) against the
bf16 batched product it replaces.

    python benchmarks/v4_quant_kernels.py [--out DIR] [--sections gemv,threshold,prefill,wo_a,dot_scaled]

Each GEMV timing replays 20 calls in one CUDA graph, each call on experts of its own (the weights are not
in L2 from the call before). Floors: the bytes each launch must read (MXFP4: codes and E8M0 scales of the
experts picked, 17 bytes per 32 values; FP8: a byte a weight and the float32 block scales) over the
measured copy bandwidth. Writes v4_quant_kernels.json (rows as they come, so a cut run keeps its rows)
and prints one table.
"""

import argparse
import datetime
import itertools
import json
from pathlib import Path

import torch

from engine.bench.roofline import measure_ceilings
from engine.bench.timing import time_replayed
from engine.kernels.fp8_gemm import FP8
from engine.kernels.fused_moe import fused_experts, reference_fused_experts
from engine.kernels.gemv import gemv
from engine.kernels.moe_gemv import FP4_CONFIG, FP4_DECODE, moe_gemv
from engine.kernels.mxfp4 import dequantize, dequantize_experts

HIDDEN, INTER, EXPERTS, TOP_K = 4096, 2048, 256, 6
# the word decodes' tiles: BLOCK_N * groups = 32 * num_warps (one 16-byte chunk of a row per thread; more
# and the scales' loads take a layout of their own, moved through shared memory each step)
WORD_CONFIGS = [(8, 16, 4), (16, 8, 4), (32, 4, 4), (8, 8, 2), (16, 4, 2), (16, 16, 8)]
# (decode, how many of WORD_CONFIGS are swept); one code at a time and x as float32 planes, measured slower
# on an H200 (88.9 and 60.9 us at one token against asm's 58.5, docs/perf.md), are removed from moe_gemv
VARIANTS = [("asm", 6), ("words", 6)]
CALLS = 20  # calls per replayed graph, each on its own experts


class Experts:
    """V4 Flash's routed experts of one layer as shipped (random codes, E8M0 near 2^-7: weights of std
    ~0.02) and the routing of `tokens` tokens, CALLS draws of it."""

    def __init__(self, dev: torch.device, g: torch.Generator):
        codes = lambda *s: torch.randint(-128, 128, s, generator=g, device=dev, dtype=torch.int8)
        scales = lambda *s: torch.randint(118, 124, s, generator=g, device=dev, dtype=torch.uint8).view(
            torch.float8_e8m0fnu)
        self.w13, self.s13 = codes(EXPERTS, 2 * INTER, HIDDEN // 2), scales(EXPERTS, 2 * INTER, HIDDEN // 32)
        self.w2, self.s2 = codes(EXPERTS, HIDDEN, INTER // 2), scales(EXPERTS, HIDDEN, INTER // 32)
        self.bytes = sum(t[0].numel() for t in (self.w13, self.s13, self.w2, self.s2))
        self.dev, self.g, self.cpu_g = dev, g, torch.Generator().manual_seed(1)

    def draws(self, tokens: int, calls: int = CALLS) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(x, ids, weights) per call; each token's top-6 distinct experts."""
        out = []
        for _ in range(calls):
            x = torch.randn(tokens, HIDDEN, generator=self.g, device=self.dev, dtype=torch.bfloat16)
            ids = torch.stack([torch.randperm(EXPERTS, generator=self.cpu_g)[:TOP_K] for _ in range(tokens)])
            out.append((x, ids.int().to(self.dev), torch.rand(tokens, TOP_K, generator=self.g, device=self.dev)))
        return out

    def floor_s(self, draws, bw: float) -> float:
        """Mean bytes floor of a call: the distinct experts it picks."""
        return sum(len(set(ids.flatten().tolist())) for _, ids, _ in draws) / len(draws) * self.bytes / bw

    def reference(self, x, ids, weights) -> torch.Tensor:
        """The float32 math of the dequantized experts picked (exact weights)."""
        used, local = torch.unique(ids, return_inverse=True)
        d13, d2 = dequantize_experts(self.w13[used], self.s13[used]), dequantize_experts(self.w2[used], self.s2[used])
        return reference_fused_experts(x, d13, d2, weights, local.int(), swiglu_limit=10.0).float()


def _cycling(fn, draws):
    """fn over the draws in turn: captured CALLS times, each call reads its own experts."""
    it = itertools.cycle(draws)
    return lambda: fn(*next(it))


def _rel(out: torch.Tensor, want: torch.Tensor) -> float:
    return ((out.float() - want).norm() / want.norm()).item()


def gemv_section(ex: Experts, bw: float, emit) -> dict:
    """Every decode against the float32 reference at 1, 2 and 8 tokens; tiles swept at 1 token; the best
    two tiles of each at 2 and 8 tokens. Returns the best (variant, config) by the 1-token time."""
    def run(decode, cfg):
        return lambda x, ids, w: moe_gemv(x, ex.w13, ex.w2, w, ids, ex.s13, ex.s2, config=cfg, swiglu_limit=10.0,
                                          fp4_decode=decode)

    checks = {t: ex.draws(t, 1)[0] for t in (1, 2, 8)}
    wants = {t: ex.reference(*d) for t, d in checks.items()}
    for decode, _ in VARIANTS:
        cfg = WORD_CONFIGS[0]
        for t, d in checks.items():
            emit(dict(what="check moe_gemv mxfp4", variant=decode, tokens=t, config=cfg,
                      rel_err_vs_f32=_rel(run(decode, cfg)(*d), wants[t])))
    draws = {t: ex.draws(t) for t in (1, 2, 8)}
    floors = {t: ex.floor_s(d, bw) for t, d in draws.items()}
    timed = {}
    for decode, swept in VARIANTS:
        for cfg in WORD_CONFIGS[:swept]:
            s = time_replayed(_cycling(run(decode, cfg), draws[1]), ex.dev, calls=CALLS)
            timed[(decode, cfg)] = s
            emit(dict(what="moe_gemv mxfp4", variant=decode, tokens=1, config=cfg, seconds=s,
                      floor_s=floors[1], ratio=s / floors[1]))
    for decode, _ in VARIANTS:
        best = sorted((s, cfg) for (d, cfg), s in timed.items() if d == decode)[:2]
        for t in (2, 8):
            for _, cfg in best:
                s = time_replayed(_cycling(run(decode, cfg), draws[t]), ex.dev, calls=CALLS)
                emit(dict(what="moe_gemv mxfp4", variant=decode, tokens=t, config=cfg, seconds=s,
                          floor_s=floors[t], ratio=s / floors[t]))
    (decode, cfg), _ = min(timed.items(), key=lambda kv: kv[1])
    return dict(decode=decode, config=cfg)


def _grouped_ways(ex: Experts, dot_scaled: bool = False) -> dict:
    """The grouped paths over all of a layer's MXFP4 experts, (x, ids, weights) -> output: decoding the
    tiles in the kernel, (dot_scaled) handing codes and scales to `tl.dot_scaled`, and every expert
    dequantized to bf16 first (one launch) then the bf16 grouped GEMM."""
    ways = {"fused_experts mxfp4 tiles": lambda x, ids, w: fused_experts(x, ex.w13, ex.w2, w, ids, ex.s13, ex.s2,
                                                                         swiglu_limit=10.0)}
    if dot_scaled:
        ways["fused_experts mxfp4 dot_scaled"] = lambda x, ids, w: fused_experts(
            x, ex.w13, ex.w2, w, ids, ex.s13, ex.s2, swiglu_limit=10.0, fp4_dot_scaled=True)
    ways["dequantize + bf16 fused_experts"] = lambda x, ids, w: fused_experts(
        x, dequantize(ex.w13, ex.s13, torch.bfloat16), dequantize(ex.w2, ex.s2, torch.bfloat16), w, ids,
        swiglu_limit=10.0)
    return ways


def threshold_section(ex: Experts, best: dict, emit) -> None:
    """At 8, 32, 64 and 128 tokens (all 256 experts, V4 Flash's layer without expert parallelism): the GEMV
    (best decode and tile), the grouped GEMM decoding MXFP4 tiles, and every expert dequantized to bf16
    (one launch) then the bf16 grouped GEMM; each against the float32 reference."""
    ways = {
        "moe_gemv " + best["decode"]: lambda x, ids, w: moe_gemv(
            x, ex.w13, ex.w2, w, ids, ex.s13, ex.s2, config=best["config"], swiglu_limit=10.0,
            fp4_decode=best["decode"]),
        **_grouped_ways(ex),
    }
    for tokens in (8, 32, 64, 128):
        draws = ex.draws(tokens, 4)
        want = ex.reference(*draws[0])
        for name, fn in ways.items():
            err = _rel(fn(*draws[0]), want)
            s = time_replayed(_cycling(fn, draws), ex.dev, calls=4, repeats=3)
            emit(dict(what="threshold " + name, tokens=tokens, seconds=s, rel_err_vs_f32=err))


def prefill_section(ex: Experts, g: torch.Generator, emit) -> None:
    """The MXFP4 grouped GEMM against bf16 on 32 of the experts dequantized, at 64 and 2,048 tokens."""
    dev, few = ex.dev, 32
    w13, s13, w2, s2 = ex.w13[:few], ex.s13[:few], ex.w2[:few], ex.s2[:few]
    d13, d2 = dequantize(w13, s13, torch.bfloat16), dequantize(w2, s2, torch.bfloat16)
    for tokens in (64, 2048):
        x = torch.randn(tokens, HIDDEN, generator=g, device=dev, dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(few, device=dev)[:TOP_K] for _ in range(tokens)]).int()
        weights = torch.rand(tokens, TOP_K, generator=g, device=dev)
        fp4 = lambda: fused_experts(x, w13, w2, weights, ids, s13, s2, swiglu_limit=10.0)
        bf16 = lambda: fused_experts(x, d13, d2, weights, ids, swiglu_limit=10.0)
        err = _rel(fp4(), bf16().float())
        for name, fn in (("fused_experts mxfp4", fp4), ("fused_experts bf16", bf16)):
            s = time_replayed(fn, dev, calls=5)
            flops = 6.0 * tokens * TOP_K * HIDDEN * INTER
            emit(dict(what=name, tokens=tokens, experts=few, seconds=s, tflops=flops / s / 1e12, rel_err_vs_bf16=err))


def dot_scaled_section(ex: Experts, emit) -> None:
    """A prefill's batches over all 256 experts (128, 512 and 2,048 tokens): the grouped GEMM decoding
    MXFP4 tiles, the same GEMM handing codes and scales to `tl.dot_scaled`, and every expert dequantized
    to bf16 then the bf16 grouped GEMM (what prefill runs past one pair per expert); each against the
    float32 reference."""
    ways = _grouped_ways(ex, dot_scaled=True)
    for tokens in (128, 512, 2048):
        draws = ex.draws(tokens, 2)
        # the float32 reference loops over (token, expert) pairs: past 512 tokens the bf16 path stands in
        want = ex.reference(*draws[0]) if tokens <= 512 else ways["dequantize + bf16 fused_experts"](*draws[0]).float()
        flops = 6.0 * tokens * TOP_K * HIDDEN * INTER
        for name, fn in ways.items():
            err = _rel(fn(*draws[0]), want)
            s = time_replayed(_cycling(fn, draws), ex.dev, calls=2, repeats=3)
            emit(dict(what="dot_scaled " + name, tokens=tokens, seconds=s, tflops=flops / s / 1e12,
                      **{"rel_err_vs_f32" if tokens <= 512 else "rel_err_vs_bf16": err}))


def wo_a_section(dev: torch.device, g: torch.Generator, bw: float, emit) -> None:
    """wo_a: 8 groups of 1024 x 4096, one token."""
    groups, o_lora, width = 8, 1024, 4096
    x = torch.randn(1, groups * width, generator=g, device=dev, dtype=torch.bfloat16)
    wb = torch.randn(groups * o_lora, width, generator=g, device=dev, dtype=torch.bfloat16) * 0.02
    wq = wb.to(FP8)
    ws = torch.ones(groups * o_lora // 128, width // 128, device=dev)
    bmm = lambda: torch.bmm(x.view(1, groups, width).transpose(0, 1), wb.view(groups, o_lora, width).transpose(1, 2))
    for name, fn, nbytes in (("wo_a bmm bf16", bmm, wb.numel() * 2),
                             ("wo_a gemv bf16", lambda: gemv(x, wb, groups=groups), wb.numel() * 2),
                             ("wo_a gemv fp8", lambda: gemv(x, wq, ws, (128, 128), groups=groups),
                              wq.numel() + ws.numel() * 4)):
        s = time_replayed(fn, dev)
        emit(dict(what=name, tokens=1, seconds=s, floor_s=nbytes / bw, ratio=s * bw / nbytes))


def _line(r: dict) -> str:
    head = f"{r['what']:42s} {r.get('variant', ''):16s} T={r['tokens']:5d} {str(r.get('config', '')):12s}"
    if "seconds" not in r:
        return f"{head} rel err vs f32 {r['rel_err_vs_f32']:.2e}"
    extra = (f"floor {r['floor_s'] * 1e6:7.1f} us  ratio {r['ratio']:.2f}x" if "floor_s" in r
             else f"{r['tflops']:.0f} TFLOP/s  err vs bf16 {r['rel_err_vs_bf16']:.2e}" if "rel_err_vs_bf16" in r
             else f"{r['tflops']:.0f} TFLOP/s  rel err vs f32 {r['rel_err_vs_f32']:.2e}" if "tflops" in r
             else f"rel err vs f32 {r['rel_err_vs_f32']:.2e}")
    return f"{head} {r['seconds'] * 1e6:9.1f} us  {extra}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--sections", default="gemv,threshold,prefill,wo_a", help="also: dot_scaled")
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    sections = a.sections.split(",")
    dev = torch.device(a.device)
    ceilings = measure_ceilings(dev)
    bw = ceilings.copy_bytes_per_s
    g = torch.Generator(dev).manual_seed(0)
    rows = []
    result = dict(command="python benchmarks/v4_quant_kernels.py --sections " + a.sections,
                  gpu=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", date=datetime.date.today().isoformat(), torch=torch.__version__,
                  ceilings=ceilings.as_dict(), rows=rows)
    a.out.mkdir(parents=True, exist_ok=True)

    def emit(row: dict) -> None:
        rows.append(row)
        print(_line(row), flush=True)
        (a.out / "v4_quant_kernels.json").write_text(json.dumps(result, indent=1))

    ex = Experts(dev, g) if {"gemv", "threshold", "prefill", "dot_scaled"} & set(sections) else None
    best = dict(decode=FP4_DECODE, config=FP4_CONFIG[FP4_DECODE])  # the engine's, unless the gemv section runs
    if "gemv" in sections:
        best = gemv_section(ex, bw, emit)
        result["best_gemv"] = best
        print(f"fastest at one token: moe_gemv.FP4_DECODE = {best['decode']!r}, "
              f"FP4_CONFIG[{best['decode']!r}] = {best['config']}", flush=True)
    if "threshold" in sections:
        threshold_section(ex, best, emit)
    if "prefill" in sections:
        prefill_section(ex, g, emit)
    if "dot_scaled" in sections:
        dot_scaled_section(ex, emit)
    if "wo_a" in sections:
        wo_a_section(dev, g, bw, emit)
    (a.out / "v4_quant_kernels.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
