"""DeepSeek-V4 Flash's quantized weights on their kernels, against their bytes floors: the MXFP4 routed
experts as GEMVs (one token's top-6, and 8 tokens') for several tiles, the MXFP4 grouped GEMM at a
prefill's rows against the bf16 one on the same experts dequantized, and the grouped wo_a GEMV (FP8 and
bf16) against the bf16 batched product it replaces.

    python benchmarks/v4_quant_kernels.py [--out DIR]

Floors: the bytes each launch must read (MXFP4: codes and E8M0 scales of the experts picked, 17 bytes per
32 values; FP8: a byte a weight and the float32 block scales) over the measured copy bandwidth. Writes
v4_quant_kernels.json and prints one table.
"""

import argparse
import datetime
import json
from pathlib import Path

import torch

from engine.bench.roofline import measure_ceilings
from engine.bench.timing import time_replayed
from engine.kernels.fp8_gemm import FP8
from engine.kernels.fused_moe import fused_experts
from engine.kernels.gemv import gemv
from engine.kernels.moe_gemv import moe_gemv
from engine.kernels.mxfp4 import dequantize_experts

HIDDEN, INTER, EXPERTS, TOP_K = 4096, 2048, 256, 6
FP4_CONFIGS = [(8, 8, 4), (16, 4, 4), (4, 16, 4), (8, 4, 4), (16, 8, 8), (32, 4, 8), (4, 8, 2)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    a = p.parse_args()
    dev = torch.device("cuda")
    ceilings = measure_ceilings(dev)
    bw = ceilings.copy_bytes_per_s
    g = torch.Generator(dev).manual_seed(0)
    codes = lambda *s: torch.randint(-128, 128, s, generator=g, device=dev, dtype=torch.int8)
    # E8M0 exponents near 2^-7 (random weights of std ~0.02)
    scales = lambda *s: torch.randint(118, 124, s, generator=g, device=dev, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    w13, s13 = codes(EXPERTS, 2 * INTER, HIDDEN // 2), scales(EXPERTS, 2 * INTER, HIDDEN // 32)
    w2, s2 = codes(EXPERTS, HIDDEN, INTER // 2), scales(EXPERTS, HIDDEN, INTER // 32)
    expert_bytes = (w13[0].numel() + s13[0].numel() + w2[0].numel() + s2[0].numel())
    rows = []
    for tokens in (1, 8):
        x = torch.randn(tokens, HIDDEN, generator=g, device=dev, dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(EXPERTS, device=dev)[:TOP_K] for _ in range(tokens)]).int()
        weights = torch.rand(tokens, TOP_K, generator=g, device=dev)
        floor = len(set(ids.flatten().tolist())) * expert_bytes / bw
        for cfg in FP4_CONFIGS:
            s = time_replayed(lambda: moe_gemv(x, w13, w2, weights, ids, s13, s2, config=cfg, swiglu_limit=10.0), dev)
            rows.append(dict(what="moe_gemv mxfp4", tokens=tokens, config=cfg, seconds=s, floor_s=floor,
                             ratio=s / floor))
    # prefill rows: the MXFP4 grouped GEMM against bf16 on 32 of the experts dequantized (memory)
    few = 32
    d13 = dequantize_experts(w13[:few], s13[:few]).to(torch.bfloat16)
    d2 = dequantize_experts(w2[:few], s2[:few]).to(torch.bfloat16)
    for tokens in (64, 2048):
        x = torch.randn(tokens, HIDDEN, generator=g, device=dev, dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(few, device=dev)[:TOP_K] for _ in range(tokens)]).int()
        weights = torch.rand(tokens, TOP_K, generator=g, device=dev)
        fp4 = fused_experts(x, w13[:few], w2[:few], weights, ids, s13[:few], s2[:few], swiglu_limit=10.0)
        bf16 = fused_experts(x, d13, d2, weights, ids, swiglu_limit=10.0)
        err = ((fp4.float() - bf16.float()).norm() / bf16.float().norm()).item()
        for name, fn in (("fused_experts mxfp4", lambda: fused_experts(x, w13[:few], w2[:few], weights, ids, s13[:few],
                                                                       s2[:few], swiglu_limit=10.0)),
                         ("fused_experts bf16", lambda: fused_experts(x, d13, d2, weights, ids, swiglu_limit=10.0))):
            s = time_replayed(fn, dev, calls=5)
            flops = 6.0 * tokens * TOP_K * HIDDEN * INTER
            rows.append(dict(what=name, tokens=tokens, experts=few, seconds=s, tflops=flops / s / 1e12,
                             error_vs_bf16=err))
    # wo_a: 8 groups of 1024 x 4096
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
        rows.append(dict(what=name, tokens=1, seconds=s, floor_s=nbytes / bw, ratio=s * bw / nbytes))
    result = dict(command="python benchmarks/v4_quant_kernels.py", gpu=torch.cuda.get_device_name(),
                  date=datetime.date.today().isoformat(), torch=torch.__version__, ceilings=ceilings.as_dict(),
                  rows=rows)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "v4_quant_kernels.json").write_text(json.dumps(result, indent=1))
    for r in rows:
        extra = (f"floor {r['floor_s'] * 1e6:7.1f} us  ratio {r['ratio']:.2f}x" if "floor_s" in r
                 else f"{r['tflops']:.0f} TFLOP/s  err vs bf16 {r['error_vs_bf16']:.2e}")
        print(f"{r['what']:22s} T={r['tokens']:5d} {str(r.get('config', '')):12s} {r['seconds'] * 1e6:9.1f} us  {extra}")


if __name__ == "__main__":
    main()
