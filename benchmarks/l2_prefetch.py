"""What asking L2 for a GEMV's weight ahead of time gives, on the GPU at hand (`kernels.l2_prefetch`).

    python benchmarks/l2_prefetch.py [--json out.json]

At one decoding token a layer's attention block is latency-bound for ~20 us while the HBM idles; the
GEMVs after it are byte-bound. Each case is a CUDA graph of a chain, replayed: L2 flushed (a 256 MB
write), then the weight asked of L2 or not, then a wait standing in for the attention block
(`torch.cuda._sleep`), then the GEMV of one token over the weight. The GEMV's time is the chain's less
the same chain without it. Weights: V2-Lite's o_proj (8.4 MB), its two shared experts' gate_up (23 MB)
and both their matrices (34.6 MB, two GEMVs); the chunk one bulk prefetch asks for is swept, and the
weight read just before the wait (L2 as warm as it gets) bounds what the prefetch can give.
"""

import argparse
import json

import torch

from engine.bench.timing import time_replayed
from engine.kernels import l2_prefetch
from engine.kernels.gemv import gemv
from engine.kernels.l2_prefetch import L2Ranges, prefetch_l2_

DEV = torch.device("cuda")
HIDDEN = 2048
WEIGHTS = {"o_proj 8.4 MB": [(2048, 2048)], "shared gate_up 23 MB": [(5632, 2048)],
           "shared gate_up + down 34.6 MB": [(5632, 2048), (2048, 2816)]}
WAIT_CYCLES = 30_000  # ~16 us at the H200's 1.98 GHz: the attention block's length at 1k context


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write the table here too")
    p.add_argument("--chunks", default="4096,16384,65536", help="bytes a bulk prefetch asks for, swept")
    args = p.parse_args()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    rows = []
    for name, shapes in WEIGHTS.items():
        ws = [torch.randn(n, k, device=DEV).to(torch.bfloat16) for n, k in shapes]
        xs = [torch.randn(1, k, device=DEV).to(torch.bfloat16) for _, k in shapes]
        ranges = L2Ranges.of(ws, 1 << 30)

        def chain(ask: bool, run: bool, warm: bool = False):
            def fn():
                flush.add_(1)
                if warm:
                    for w, x in zip(ws, xs):
                        gemv(x, w)
                if ask:
                    prefetch_l2_(ranges)
                torch.cuda._sleep(WAIT_CYCLES)
                if run:
                    for w, x in zip(ws, xs):
                        gemv(x, w)
            return time_replayed(fn, DEV, calls=10, repeats=7) * 1e6

        base = chain(False, False)
        cold = chain(False, True) - base
        warm = chain(False, True, warm=True) - chain(False, False, warm=True)
        row = {"weights": name, "MB": round(ranges.total / 2**20, 1), "cold_us": round(cold, 2),
               "warm_us": round(warm, 2)}
        for chunk in [int(c) for c in args.chunks.split(",")]:
            l2_prefetch.CHUNK = chunk  # the launcher reads the module's constant
            ranges = L2Ranges.of(ws, 1 << 30)
            asked = chain(True, True) - chain(True, False)
            row[f"asked_{chunk // 1024}k_us"] = round(asked, 2)
            row[f"ask_cost_{chunk // 1024}k_us"] = round(chain(True, False) - base, 2)
        l2_prefetch.CHUNK = 16384
        rows.append(row)
        print(row, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "wait_cycles": WAIT_CYCLES,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
