"""Tile choices of the bf16 grouped expert GEMMs (`engine.kernels.fused_moe`) at prefill sizes.

    python benchmarks/grouped_gemm_tiles.py [--tokens 2048,8192,32768] [--baseline FILE]

The whole expert block of DeepSeek-V2-Lite (64 experts, top-6, hidden 2048, inter 1408), bf16, for
random routings: each variant replaces `_config`'s tiles for batches of more than 128 rows per expert
(BLOCK_M, BLOCK_N of the gated GEMM, BLOCK_N of the down GEMM, BLOCK_K, warps, stages) of the pointer
kernel (`tma_path=False`: from 129 rows an expert the engine takes the TMA kernel, whose tiles are its
own); "default" is the engine's path as it runs; --baseline times a module file's `fused_experts`
beside (before). CUDA events around 20 calls after 3 to warm up, each variant checked against the
default.
"""

import argparse
import functools
import importlib.util
from pathlib import Path

import torch

import engine.kernels.fused_moe as fm
from grouped_gemm_peer import timed  # this folder is the script's: on sys.path

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 1408, 64, 6
VARIANTS = {  # bm, bn gated, bn down, bk, warps, stages
    "default": None,
    "g64 d128 s3": (128, 64, 128, 64, 8, 3),  # the default before 128 x 256
    "s4": (128, 64, 128, 64, 8, 4),
    "k128 s3": (128, 64, 128, 128, 8, 3),
    "down n256": (128, 64, 256, 64, 8, 3),
    "m64 w4 s4": (64, 64, 128, 64, 4, 4),
    "m256 w8 s3": (256, 64, 64, 64, 8, 3),
    "g128 d128": (128, 128, 128, 64, 8, 3),
    "g128 d256": (128, 128, 256, 64, 8, 3),
    "g128 d256 s4": (128, 128, 256, 64, 8, 4),
    "down n256 s4": (128, 64, 256, 64, 8, 4),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="2048,8192,32768")
    p.add_argument("--baseline", type=Path)
    args = p.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(dev).manual_seed(0)
    w13 = (0.02 * torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=dev, generator=g)).bfloat16()
    w2 = (0.02 * torch.randn(EXPERTS, HIDDEN, INTER, device=dev, generator=g)).bfloat16()
    runs = []
    if args.baseline:
        spec = importlib.util.spec_from_file_location("fused_moe_before", args.baseline)
        before = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(before)
        runs.append(("before", before.fused_experts, None))
    default_config = fm._config
    # the pointer kernel, whose tiles `_config` gives (the TMA path, taken from 129 rows an expert, has its own)
    pointer = functools.partial(fm.fused_experts, tma_path=False)
    runs += [(name, fm.fused_experts if tiles is None else pointer, tiles) for name, tiles in VARIANTS.items()]
    print(f"{torch.cuda.get_device_name()}; V2-Lite experts, bf16")
    print(f"{'variant':<12s} {'tokens':>7s} {'ms':>7s} {'TFLOP/s':>8s} {'rel diff':>9s}")
    for t in (int(s) for s in args.tokens.split(",")):
        x = torch.randn(t, HIDDEN, device=dev, generator=g).bfloat16()
        ids = torch.rand(t, EXPERTS, device=dev, generator=g).argsort(-1)[:, :TOP_K].int().contiguous()
        weights = torch.rand(t, TOP_K, device=dev, generator=g).contiguous()
        want = fm.fused_experts(x, w13, w2, weights, ids).float()
        flops = 2 * t * TOP_K * 3 * INTER * HIDDEN
        for name, fn, tiles in runs:
            def config(rows, on_gpu, gated, block_k, half=False, tiles=tiles):
                if tiles is None or rows <= 128 or not on_gpu:
                    return default_config(rows, on_gpu, gated, block_k, half)
                bm, bn13, bn2, bk, warps, stages = tiles
                return bm, bn13 if gated else bn2, bk, warps, stages
            fm._config = config
            try:
                diff = ((fn(x, w13, w2, weights, ids).float() - want).norm() / want.norm()).item()
                sec = timed(lambda: fn(x, w13, w2, weights, ids))
            except Exception as e:  # over the shared memory, say: reported, not fatal
                print(f"{name:<12s} {t:7d} failed: {str(e)[:120]}")
                continue
            finally:
                fm._config = default_config
            print(f"{name:<12s} {t:7d} {sec * 1e3:7.3f} {flops / sec / 1e12:8.0f} {diff:9.1e}", flush=True)


if __name__ == "__main__":
    main()
