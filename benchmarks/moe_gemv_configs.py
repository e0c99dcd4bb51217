"""Tile sizes for the small-batch MoE GEMVs (`engine.kernels.moe_gemv`), measured on the GPU at hand.

    python benchmarks/moe_gemv_configs.py [fp8|bf16 [TOKENS...]]   (only those shapes, token counts)

For DeepSeek-V2-Lite's experts (bf16: 64 experts top-6, hidden 2048, width 1408, two shared experts)
and DeepSeek-V3's (FP8 128x128 blocks: 256 experts top-8, hidden 7168, width 2048, one shared expert),
at 1, 2, 4 and 8 tokens: every (BLOCK_N, K groups per step, num_warps) candidate of the GEMV path, then the
grouped GEMM plus the shared experts' own MLP, which the GEMV path replaces, and for FP8 experts the
GEMV with its products on the tensor cores (`moe_gemv(..., dot=True)`). Each is a CUDA graph of
four calls on different experts (so the weights come from memory, not L2), replayed; printed as
microseconds per call and the weight bytes' rate.
"""

import itertools
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from engine.kernels.fp8_gemm import fp8_linear
from engine.kernels.fused_moe import fused_experts
from engine.kernels.moe_gemv import SharedExperts, moe_gemv
from engine.layers.fp8 import quantize_fp8_block

SHAPES = {
    "v2-lite bf16": dict(experts=64, top_k=6, hidden=2048, inter=1408, shared=2, fp8=False),
    "v3 fp8": dict(experts=256, top_k=8, hidden=7168, inter=2048, shared=1, fp8=True),
}
BLOCK = (128, 128)
# (BLOCK_N, K groups of 128 columns per step, num_warps)
CONFIGS = [(n, g, w) for n, g, w in itertools.product((4, 8, 16, 32), (1, 2, 4), (4, 8)) if n * g * 128 <= 4096]


def fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] -> FP8 blocks and scales (quantized on the GPU, one matrix at a time)."""
    parts = [quantize_fp8_block(m, BLOCK) for m in w.reshape(-1, *w.shape[-2:])]
    q = torch.stack([p[0] for p in parts]).view(*w.shape)
    s = torch.stack([p[1] for p in parts])
    return q, s.view(*w.shape[:-2], *s.shape[-2:])


def build(shape: dict) -> dict:
    e, h, i, s = shape["experts"], shape["hidden"], shape["inter"], shape["shared"] * shape["inter"]
    g = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *size: 0.02 * torch.randn(*size, generator=g, device="cuda", dtype=torch.bfloat16)
    w13, w2, gu, dn = rnd(e, 2 * i, h), rnd(e, h, i), rnd(2 * s, h), rnd(h, s)
    if not shape["fp8"]:
        return dict(w13=w13, w2=w2, scales=(None, None), block=None, shared=SharedExperts(gu, dn))
    (w13, s13), (w2, s2) = fp8(w13), fp8(w2)
    (gu, sgu), (dn, sdn) = fp8(gu), fp8(dn)
    return dict(w13=w13, w2=w2, scales=(s13, s2), block=BLOCK, shared=SharedExperts(gu, dn, sgu, sdn))


def shared_mlp(x: torch.Tensor, sh: SharedExperts, block) -> torch.Tensor:
    if block is None:
        gate, up = F.linear(x, sh.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, sh.down)
    gate, up = fp8_linear(x, sh.gate_up, sh.gate_up_scale, block).chunk(2, dim=-1)
    return fp8_linear(F.silu(gate) * up, sh.down, sh.down_scale, block)


def main() -> None:
    print(f"{torch.cuda.get_device_name()}; times in us per call (4 calls on different experts per replay)")
    best = {}
    for name, shape in SHAPES.items():
        if len(sys.argv) > 1 and sys.argv[1] not in name:
            continue
        m = build(shape)
        e, k, h, i = shape["experts"], shape["top_k"], shape["hidden"], shape["inter"]
        el = 1 if shape["fp8"] else 2
        for tokens in [int(t) for t in sys.argv[2:]] or (1, 2, 4, 8):
            g = torch.Generator(device="cuda").manual_seed(tokens)
            xs = [torch.randn(tokens, h, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
            ids = [torch.rand(tokens, e, generator=g, device="cuda").topk(k, dim=-1).indices.int() for _ in range(4)]
            ws = [torch.rand(tokens, k, generator=g, device="cuda") for _ in range(4)]
            distinct = sum(len(set(t.flatten().tolist())) for t in ids) / 4
            n_bytes = (distinct + shape["shared"]) * 3 * h * i * el
            ref = fused_experts(xs[0], m["w13"], m["w2"], ws[0], ids[0], *m["scales"], block=m["block"]) + shared_mlp(
                xs[0], m["shared"], m["block"])
            rows = []
            for cfg in CONFIGS:
                try:
                    out = moe_gemv(xs[0], m["w13"], m["w2"], ws[0], ids[0], *m["scales"], block=m["block"],
                                   shared=m["shared"], config=cfg, dot=False)
                    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                    fn = lambda: [moe_gemv(x, m["w13"], m["w2"], w, d, *m["scales"], block=m["block"],
                                           shared=m["shared"], config=cfg, dot=False) for x, w, d in zip(xs, ws, ids)]
                    us = do_bench_cudagraph(fn, rep=50) * 1e3 / 4
                    rows.append((us, cfg, err))
                except Exception as exc:  # a tile the compiler refuses: skip it, say so
                    print(f"  {name} T={tokens} {cfg}: {type(exc).__name__}: {str(exc)[:80]}")
            grouped = lambda: [fused_experts(x, m["w13"], m["w2"], w, d, *m["scales"], block=m["block"])
                               + shared_mlp(x, m["shared"], m["block"]) for x, w, d in zip(xs, ws, ids)]
            g_us = do_bench_cudagraph(grouped, rep=50) * 1e3 / 4
            dot = ""
            if shape["fp8"]:  # the products on the tensor cores (`moe_gemv.DOT`), its own tile
                try:
                    out = moe_gemv(xs[0], m["w13"], m["w2"], ws[0], ids[0], *m["scales"], block=m["block"],
                                   shared=m["shared"], dot=True)
                    d_err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                    d_us = do_bench_cudagraph(lambda: [moe_gemv(x, m["w13"], m["w2"], w, d, *m["scales"],
                                                                block=m["block"], shared=m["shared"], dot=True)
                                                       for x, w, d in zip(xs, ws, ids)], rep=50) * 1e3 / 4
                    dot = f" | tensor cores {d_us:7.1f} us ({n_bytes / d_us / 1e6:5.2f} TB/s, rel err {d_err:.1e})"
                except Exception as exc:  # say so, go on with the sweep
                    dot = f" | tensor cores: {type(exc).__name__}: {str(exc)[:80]}"
            rows.sort()
            us, cfg, err = rows[0]
            best[(name, tokens)] = cfg
            print(f"{name:13s} T={tokens}: {n_bytes / 1e6:6.1f} MB | gemv best {cfg} {us:7.1f} us "
                  f"({n_bytes / us / 1e6:5.2f} TB/s, rel err {err:.1e}) | next {[(round(u, 1), c) for u, c, _ in rows[1:4]]}"
                  f" | grouped + shared MLP {g_us:7.1f} us ({n_bytes / g_us / 1e6:5.2f} TB/s)" + dot)
    print("best:", best)


if __name__ == "__main__":
    main()
