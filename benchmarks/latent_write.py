"""MLA's latent write alone (`engine.kernels.latent_cache.write_latent_`): the kv norm, the rope of k_pe and of
the queries' rope parts, the paged cache write, at decode and prefill sizes, the rope pairs loaded apart
or split in registers.

    python benchmarks/latent_write.py [--heads 16,128] [--tokens 1,64,512,8192,131072]
                                      [--kv-cache-dtype bf16,fp8] [--variants a,b] [--out results.json]

DeepSeek's shapes (kv_lora 512, rope 64; the queries [T, H, 192] with their rope part a strided view), a
shuffled slot mapping over 64-token pages, bf16 activations. Every variant's cache bytes and rotated
queries are compared with the first variant's (equal but for values on a rounding edge, where a product
is fused into an FMA in one and not the other), then timed replayed from a CUDA graph. Bytes moved: kv
read, the cache row written, the queries' rope parts read and written, the cos/sin rows read.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.bench.timing import time_replayed  # noqa: E402
from engine.kernels.latent_cache import write_latent_  # noqa: E402
from engine.layers.fp8_latent import FP8LatentLayout  # noqa: E402

LORA, ROPE, NOPE, PAGE = 512, 64, 128, 64
VARIANTS = {
    # the rope pairs' halves loaded and stored apart: every access 2 bytes at a 4-byte stride (the kernel before)
    "pairs apart": dict(split_pairs=False),
    # whole rope rows loaded and stored, the pairs split and joined in registers (the default)
    "pairs split": dict(split_pairs=True),
}


def make_case(tokens: int, heads: int, fp8: bool, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(tokens, heads, NOPE + ROPE, generator=g, device="cuda").to(torch.bfloat16)
    kv = torch.randn(tokens, LORA + ROPE, generator=g, device="cuda").to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(LORA, generator=g, device="cuda")).to(torch.bfloat16)
    cos = torch.randn(tokens + 16, ROPE // 2, generator=g, device="cuda")
    sin = torch.randn(tokens + 16, ROPE // 2, generator=g, device="cuda")
    pos = torch.arange(tokens, device="cuda")
    blocks = -(-tokens // PAGE) + 1
    slots = torch.randperm(blocks * PAGE, generator=g, device="cuda")[:tokens]
    width = FP8LatentLayout(LORA, ROPE, torch.bfloat16).token_bytes if fp8 else LORA + ROPE
    cache = torch.zeros(blocks, PAGE, width, dtype=torch.uint8 if fp8 else torch.bfloat16, device="cuda")
    return q, kv, weight, cos, sin, pos, slots, cache


def moved_bytes(tokens: int, heads: int, fp8: bool) -> int:
    row = LORA + 2 * ROPE + 4 if fp8 else 2 * (LORA + ROPE)
    return tokens * (2 * (LORA + ROPE) + row + heads * ROPE * 2 * 2 + ROPE * 4)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", default="16,128")
    p.add_argument("--tokens", default="1,64,512,8192,131072")
    p.add_argument("--kv-cache-dtype", default="bf16,fp8")
    p.add_argument("--variants", help="comma-separated names of the variants to time")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    keep = args.variants.split(",") if args.variants else list(VARIANTS)
    unknown = [k for k in keep if k not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)} (quote names with spaces)")
    result = dict(gpu=torch.cuda.get_device_name(), rows=[], mismatches=[])
    for kv_dtype in args.kv_cache_dtype.split(","):
        fp8 = kv_dtype == "fp8"
        for heads in [int(h) for h in args.heads.split(",")]:
            for tokens in [int(t) for t in args.tokens.split(",")]:
                q, kv, weight, cos, sin, pos, slots, cache = make_case(tokens, heads, fp8)
                want = None
                for name in keep:
                    how = VARIANTS[name]
                    qq, cc = q.clone(), torch.zeros_like(cache)
                    write_latent_(cc, kv, weight, 1e-6, qq[..., NOPE:], pos, cos, sin, slots, **how)
                    if want is None:
                        want = (qq.clone(), cc.clone())
                    else:  # equal but for rare values on a rounding edge
                        q_differ = (qq != want[0]).float().mean().item()
                        differ = (cc.view(torch.uint8) != want[1].view(torch.uint8)).float().mean().item()
                        if q_differ > 1e-3 or differ > 1e-3:
                            result["mismatches"].append(dict(variant=name, heads=heads, tokens=tokens, kv=kv_dtype,
                                                             q_differ=q_differ, cache_bytes_differ=differ))
                            print(f"MISMATCH {name} H={heads} T={tokens} {kv_dtype}: {result['mismatches'][-1]}",
                                  flush=True)
                    run = lambda: write_latent_(cc, kv, weight, 1e-6, qq[..., NOPE:], pos, cos, sin, slots, **how)
                    sec = time_replayed(run, torch.device("cuda"), calls=20, repeats=5)
                    row = dict(variant=name, kv=kv_dtype, heads=heads, tokens=tokens, us=sec * 1e6,
                               gb_per_s=moved_bytes(tokens, heads, fp8) / sec / 1e9)
                    result["rows"].append(row)
                    print(json.dumps(row), flush=True)
                del q, kv, cache, want
                torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print(f"\n{result['gpu']}: MLA latent write (norm, rope, cache write)")
    print(f"{'variant':<18} {'cache':>5} {'heads':>5} {'tokens':>7} {'us':>9} {'GB/s':>7}")
    for r in result["rows"]:
        print(f"{r['variant']:<18} {r['kv']:>5} {r['heads']:>5} {r['tokens']:>7} {r['us']:>9.1f} {r['gb_per_s']:>7.0f}")
    if result["mismatches"]:
        raise SystemExit(f"{len(result['mismatches'])} variant(s) wrote other values than the first: see above")


if __name__ == "__main__":
    main()
