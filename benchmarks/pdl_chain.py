"""What programmatic dependent launch gives the decode chain's kernels, measured on the GPU at hand.

    python benchmarks/pdl_chain.py [--json out.json]

Decode runs a layer as a chain of a dozen kernels of a few microseconds each. Under programmatic
dependent launch (`engine.kernels._util.PDL`) a kernel starts while its predecessor finishes and waits
only where it needs that kernel's output; a GEMV may also load its first weights before waiting
(`gemv.PREFETCH`). Each case here is a CUDA graph of a chain, replayed, in three ways: without PDL,
with PDL waiting first, and with PDL loading the first weights before waiting.

- projection: (RMSNorm -> GEMV) pairs, each GEMV on its own copy of the weight (so it comes from
  memory, not L2), for every projection one decode token meets in DeepSeek-V2-Lite (bf16) and
  DeepSeek-V3 (FP8 128 x 128 blocks); microseconds per pair;
- MoE block: RMSNorm -> router (its GEMV and top-k in one launch, `route_tokens`, as the engine runs it)
  -> `moe_gemv` (up, down, slot sum) for one token, on copies of the experts; microseconds per block; a
  fourth way, "shared early", lets the shared experts' up programs stream while the router runs
  (`moe_gemv.SHARED_EARLY`; the other ways run without it);
- first, one token's MLA absorptions: cuBLAS batched GEMMs against per-head GEMVs, at 16 to 128 heads.
"""

import argparse
import json

import torch

from engine.bench.timing import time_replayed
from engine.kernels import _util, gemv as gemv_mod, moe_gemv as moe_gemv_mod
from engine.kernels.gemv import gemv
from engine.kernels.moe_gemv import SharedExperts, moe_gemv
from engine.kernels.moe_routing import route_tokens
from engine.kernels.rms_norm import rms_norm
from engine.layers.fp8 import quantize_fp8_block

BLOCK = (128, 128)
DEV = torch.device("cuda")
# name: (N, K, weight kind)
PROJECTIONS = {
    "v2-lite q+kv_a": (3648, 2048, "bf16"),
    "v2-lite o_proj": (2048, 2048, "bf16"),
    "v2-lite dense gate_up": (21888, 2048, "bf16"),
    "v2-lite lm_head": (102400, 2048, "bf16"),
    "v3 q_a+kv_a": (2112, 7168, "fp8"),
    "v3 q_b": (24576, 1536, "fp8"),
    "v3 o_proj": (7168, 16384, "fp8"),
    "v3 dense gate_up": (36864, 7168, "fp8"),
    "v3 dense down": (7168, 18432, "fp8"),
}
# name: (hidden, inter, experts kept, top_k, shared pieces, kind)
MOE = {"v2-lite MoE block": (2048, 1408, 64, 6, 2, "bf16"), "v3 MoE block": (7168, 2048, 32, 8, 1, "fp8")}
WAYS = ("off", "wait first", "prefetch")
MOE_WAYS = WAYS + ("shared early",)


def _weight(n: int, k: int, kind: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    w = 0.02 * torch.randn(n, k, device=DEV)
    return quantize_fp8_block(w, BLOCK) if kind == "fp8" else (w.to(torch.bfloat16), None)


def _copies(nbytes: int) -> int:
    return max(2, min(64, -(-(1 << 30) // nbytes)))  # about 1 GB in all


def _timed(way: str, kind: str, chain) -> float:
    """Seconds of one replay of chain() (its kernels compiled for this way first)."""
    _util.PDL = way != "off"
    gemv_mod.PREFETCH[kind] = moe_gemv_mod.PREFETCH[kind] = way in ("prefetch", "shared early")
    moe_gemv_mod.SHARED_EARLY = way == "shared early"
    return time_replayed(chain, DEV, calls=1, repeats=20)


def projection(n: int, k: int, kind: str) -> dict:
    copies = _copies(n * k * (1 if kind == "fp8" else 2))
    ws = [_weight(n, k, kind) for _ in range(copies)]
    x, norm_w = torch.randn(1, k, device=DEV, dtype=torch.bfloat16), torch.ones(k, device=DEV, dtype=torch.bfloat16)

    def chain():
        for w, s in ws:
            gemv(rms_norm(x, norm_w, 1e-6), w, s, BLOCK if s is not None else None)

    return {way: _timed(way, kind, chain) / copies * 1e6 for way in WAYS}


def moe_block(hidden: int, inter: int, experts: int, top_k: int, shared: int, kind: str) -> dict:
    expert_bytes = 3 * inter * hidden * (1 if kind == "fp8" else 2)
    copies = _copies((top_k + shared) * expert_bytes)
    blocks = []
    for _ in range(copies):
        w13 = [_weight(2 * inter, hidden, kind) for _ in range(experts)]
        w2 = [_weight(hidden, inter, kind) for _ in range(experts)]
        sh13, sh2 = _weight(2 * shared * inter, hidden, kind), _weight(hidden, shared * inter, kind)
        stack = lambda parts, i: torch.stack([p[i] for p in parts]) if parts[0][i] is not None else None
        blocks.append(dict(w13=stack(w13, 0), w2=stack(w2, 0), w13_scale=stack(w13, 1), w2_scale=stack(w2, 1),
                           shared=SharedExperts(sh13[0], sh2[0], *([sh13[1], sh2[1]] if kind == "fp8" else [])),
                           router=0.02 * torch.randn(experts, hidden, device=DEV)))
    counter = torch.zeros(1, dtype=torch.int32, device=DEV)
    x, norm_w = torch.randn(1, hidden, device=DEV, dtype=torch.bfloat16), torch.ones(hidden, device=DEV, dtype=torch.bfloat16)

    def chain():
        for b in blocks:
            h = rms_norm(x, norm_w, 1e-6)
            weights, ids = route_tokens(h, b["router"], counter, None, top_k, "softmax", "greedy", 1, 1, False, 1.0)
            moe_gemv(h, b["w13"], b["w2"], weights, ids, b["w13_scale"], b["w2_scale"],
                     BLOCK if kind == "fp8" else None, shared=b["shared"])

    times = {way: _timed(way, kind, chain) / copies * 1e6 for way in MOE_WAYS}
    del blocks
    torch.cuda.empty_cache()
    return times


def absorptions(heads: int, nope: int = 128, v: int = 128, lora: int = 512) -> dict:
    """One token's two MLA absorptions (q_nope through W_UK, the latent output through W_UV), on copies of
    kv_b_proj: cuBLAS's batched GEMMs (as batches of two or more run them) against the per-head GEMVs
    (`AbsorbWeights`), both under PDL; us per pair."""
    from engine.layers.attention import AbsorbWeights

    copies = _copies(2 * heads * (nope + v) * lora)
    ws = [(0.02 * torch.randn(heads * (nope + v), lora, device=DEV)).to(torch.bfloat16) for _ in range(copies)]
    absorbs = [AbsorbWeights.of(w, nope, v) for w in ws]
    q = torch.randn(1, heads, nope + 64, device=DEV, dtype=torch.bfloat16)[..., :nope]
    latent = torch.randn(1, heads, lora, device=DEV, dtype=torch.bfloat16)
    out = torch.empty(1, heads, v, device=DEV, dtype=torch.bfloat16)

    def bmm():
        for w in ws:
            w = w.view(heads, nope + v, lora)
            torch.bmm(q.transpose(0, 1), w[:, :nope])
            torch.bmm(latent.transpose(0, 1), w[:, nope:].transpose(1, 2), out=out.transpose(0, 1))

    def gemvs(config=None):
        for a in absorbs:
            gemv(q, a.w_uk_t, groups=heads, config=config)
            gemv(latent.view(1, -1), a.w_uv, groups=heads, config=config)

    _util.PDL = True
    return {"batched GEMMs": time_replayed(bmm, DEV, calls=1, repeats=20) / copies * 1e6,
            "GEMVs": time_replayed(gemvs, DEV, calls=1, repeats=20) / copies * 1e6,
            # the projections' tile, 1,024 values of K a step, mostly masked at K = 128 and 512
            "GEMVs, fixed tile": time_replayed(lambda: gemvs(gemv_mod.CONFIG["bf16"]), DEV, calls=1,
                                               repeats=20) / copies * 1e6}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="also write the table here")
    p.add_argument("--absorptions-only", action="store_true", help="only the absorptions table")
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}; us per chain link, graph-replayed")
    rows = {}
    for heads in (16, 32, 64, 128):  # DeepSeek-V2-Lite's heads, V3's on 8, 4, 2 ranks and on one
        rows[f"absorptions, {heads} heads"] = r = absorptions(heads)
        print(f"absorptions, {heads:3d} heads: " + ", ".join(f"{k} {t:.1f}" for k, t in r.items()), flush=True)
    if args.absorptions_only:
        return
    print(f"{'case':24s}" + "".join(f"{w:>12s}" for w in WAYS))
    for name, shape in PROJECTIONS.items():
        rows[name] = projection(*shape)
        print(f"{name:24s}" + "".join(f"{rows[name][w]:12.1f}" for w in WAYS), flush=True)
    print(f"{'case':24s}" + "".join(f"{w:>14s}" for w in MOE_WAYS))
    for name, shape in MOE.items():
        rows[name] = moe_block(*shape)
        print(f"{name:24s}" + "".join(f"{rows[name][w]:14.1f}" for w in MOE_WAYS), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), unit="us", rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
