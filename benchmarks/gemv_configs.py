"""Tiles and crossovers for the projection GEMVs (`engine.kernels.gemv`), measured on the GPU at hand.

    python benchmarks/gemv_configs.py [bf16|f32|fp8 ...]     # the shapes of those weight kinds (default: all)

For every projection one decode token meets in DeepSeek-V2-Lite (bf16) and DeepSeek-V3 (FP8 128x128
blocks; its router and head stay float32 / bf16): every (BLOCK_N, K groups per step, num_warps) at one
row, then the best one at 2 and 4 rows (FP8 weights also with the products on the tensor cores,
`gemv(..., dot=True)`, at 1 to 16 rows, K split or not), each against what the layer runs without the GEMV (cuBLAS
through F.linear; the FP8 block GEMM with its activation quantization; the router's cast + float32
GEMM). Each is a CUDA graph of calls on several copies of the weight (so it comes from memory, not
L2), replayed; printed as microseconds per call and the weight bytes' rate.
"""

import itertools
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from engine.kernels.fp8_gemm import fp8_linear
from engine.kernels import gemv as gemv_module
from engine.kernels.gemv import dot_rows, gemv
from engine.layers.fp8 import quantize_fp8_block

BLOCK = (128, 128)
# name: (N, K, weight kind)
SHAPES = {
    "v2-lite q+kv_a": (3648, 2048, "bf16"),
    "v2-lite o_proj": (2048, 2048, "bf16"),
    "v2-lite dense gate_up": (21888, 2048, "bf16"),
    "v2-lite dense down": (2048, 10944, "bf16"),
    "v2-lite router": (64, 2048, "f32"),
    "v2-lite lm_head": (102400, 2048, "bf16"),
    "v3 q_a+kv_a": (2112, 7168, "fp8"),
    "v3 q_b": (24576, 1536, "fp8"),
    "v3 o_proj": (7168, 16384, "fp8"),
    "v3 dense down": (7168, 18432, "fp8"),
    "v3 router": (256, 7168, "f32"),
}
CONFIGS = [(n, g, w) for n, g, w in itertools.product((4, 8, 16), (1, 2, 4, 8), (4, 8)) if n * g * 128 <= 8192]


def weights(n: int, k: int, kind: str, copies: int) -> list[tuple]:
    g = torch.Generator(device="cuda").manual_seed(n + k)
    out = []
    for _ in range(copies):
        w = 0.02 * torch.randn(n, k, generator=g, device="cuda")
        if kind == "fp8":
            out.append(quantize_fp8_block(w, BLOCK))
        else:
            out.append((w.to(torch.float32 if kind == "f32" else torch.bfloat16), None))
    return out


def baseline(x: torch.Tensor, w: torch.Tensor, s, kind: str) -> torch.Tensor:
    if kind == "fp8":
        return fp8_linear(x, w, s, BLOCK)
    return F.linear(x.float(), w) if kind == "f32" else F.linear(x, w)


def tensor_cores(xs: list, ws: list, ref: torch.Tensor, n_bytes: int) -> str:
    """The FP8 products on the tensor cores (`gemv(..., dot=True)`: every row in one pass), by the programs
    an SM its K slices aim at (`gemv.DOT_PROGRAMS_PER_SM`; 0: K never split) -> one cell of the table."""
    cells, default = [], gemv_module.DOT_PROGRAMS_PER_SM
    try:
        for per_sm in (0, 2, 4, 8):
            gemv_module.DOT_PROGRAMS_PER_SM = per_sm
            out = gemv(xs[0], *ws[0], BLOCK, dot=True).float()
            us = do_bench_cudagraph(lambda: [gemv(x, w, s, BLOCK, dot=True) for x, (w, s) in zip(xs, ws)],
                                    rep=40) * 1e3 / len(ws)
            cells.append(f"{per_sm}: {us:5.1f} ({n_bytes / us / 1e6:4.2f})")
        err = ((out - ref).norm() / ref.norm()).item()
        return f"tensor cores by programs an SM {', '.join(cells)} err {err:.1e}"
    except Exception as exc:  # say so, go on with the sweep
        return f"tensor cores: {type(exc).__name__}: {str(exc)[:60]}"
    finally:
        gemv_module.DOT_PROGRAMS_PER_SM = default


def main() -> None:
    print(f"{torch.cuda.get_device_name()}; us per call, weights read from memory (copies replayed in turn)")
    kinds = sys.argv[1:] or ["bf16", "f32", "fp8"]
    for name, (n, k, kind) in SHAPES.items():
        if kind not in kinds:
            continue
        el = {"bf16": 2, "f32": 4, "fp8": 1}[kind]
        n_bytes = n * k * el
        copies = max(1, min(8, -(-96 * 2**20 // n_bytes)))
        ws = weights(n, k, kind, copies)
        block = BLOCK if kind == "fp8" else None
        out_dtype = torch.float32 if kind == "f32" else None
        line = []
        best = None
        for rows in (1, 2, 4, 8, 16):
            if rows > 4 and kind != "fp8":
                continue
            g = torch.Generator(device="cuda").manual_seed(rows)
            xs = [torch.randn(rows, k, generator=g, device="cuda", dtype=torch.bfloat16) for _ in ws]
            ref = baseline(xs[0], *ws[0], kind).float()
            base_us = do_bench_cudagraph(lambda: [baseline(x, w, s, kind) for x, (w, s) in zip(xs, ws)],
                                         rep=40) * 1e3 / len(ws)
            results = []
            for cfg in (CONFIGS if rows == 1 else [best] if rows <= 4 else []):
                try:
                    out = gemv(xs[0], *ws[0], block, out_dtype, config=cfg, dot=False).float()
                    err = ((out - ref).norm() / ref.norm()).item()
                    us = do_bench_cudagraph(lambda: [gemv(x, w, s, block, out_dtype, config=cfg, dot=False)
                                                     for x, (w, s) in zip(xs, ws)], rep=40) * 1e3 / len(ws)
                    results.append((us, cfg, err))
                except Exception as exc:  # a tile the compiler refuses: skip it, say so
                    print(f"  {name} {cfg}: {type(exc).__name__}: {str(exc)[:80]}")
            results.sort()
            if results:
                us, cfg, err = results[0]
                best = best or cfg
                line.append(f"M={rows}: gemv {us:6.1f} ({n_bytes / us / 1e6:4.2f} TB/s) vs {base_us:6.1f}")
            else:
                line.append(f"M={rows}: vs {base_us:6.1f}")
            if kind == "fp8" and not dot_rows(xs[0], k, block):
                line.append("tensor cores: not for these blocks")
            elif kind == "fp8":
                line.append(tensor_cores(xs, ws, ref, n_bytes))
            if rows == 1:
                line.append(f"best {cfg} err {err:.1e}, next {[(round(u, 1), c) for u, c, _ in results[1:4]]}")
        print(f"{name:22s} {n_bytes / 1e6:7.1f} MB | " + " | ".join(line))


if __name__ == "__main__":
    main()
