"""What asking L2 for a GEMV's weight ahead of time gives, on the GPU at hand. Measured, not kept in the
engine: docs/perf.md, "Weights asked of L2 while attention runs: measured, not kept".

    python benchmarks/l2_prefetch.py [--json out.json]

At one decoding token a layer's attention block is latency-bound for ~20 us while the HBM idles; the
GEMVs after it are byte-bound, and part of what they read is the same for every token (o_proj, the
shared experts). Each case is a CUDA graph of a chain, replayed: L2 flushed (a 256 MB write), then the
weight asked of L2 or not, then a wait standing in for the attention block (`torch.cuda._sleep`), then
the GEMV of one token over the weight. The GEMV's time is the chain's less the same chain without it;
"ask cost" is what the asking launch adds to the chain without the GEMV. Weights: V2-Lite's o_proj
(8.4 MB), its two shared experts' gate_up (23 MB) and both their matrices (34.6 MB, two GEMVs); the
chunk one bulk prefetch asks for is swept, and the weight read just before the wait (L2 as warm as it
gets) bounds what asking can give.

The asking kernel: `cp.async.bulk.prefetch.L2.global [addr], size` (sm_90) has the SM's TMA unit
request `size` bytes into L2, fire and forget; one chunk a lane, one warp a program, so the requests
spread over many SMs.
"""

import argparse
import json

import torch
import triton
import triton.language as tl

from engine.bench.timing import time_replayed
from engine.kernels.gemv import gemv

DEV = torch.device("cuda")
WEIGHTS = {"o_proj 8.4 MB": [(2048, 2048)], "shared gate_up 23 MB": [(5632, 2048)],
           "shared gate_up + down 34.6 MB": [(5632, 2048), (2048, 2816)]}
WAIT_CYCLES = 30_000  # ~16 us at the H200's 1.98 GHz: the attention block's length at 1k context
CHUNKS = 32  # a program's chunks: one a lane of its one warp


@triton.jit
def _prefetch_kernel(Base, nbytes, CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    """Bytes [0, nbytes) at Base (16-byte aligned, nbytes a multiple of 16) asked of L2, CHUNK a lane."""
    off = (tl.program_id(0) * CHUNKS + tl.arange(0, CHUNKS)).to(tl.int64) * CHUNK
    size = tl.maximum(tl.minimum(nbytes - off, CHUNK), 0).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r", [Base.to(tl.pointer_type(tl.int8)) + off, size], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_l2(weights: list[torch.Tensor], chunk: int) -> None:
    for w in weights:
        nbytes = w.numel() * w.element_size() // 16 * 16
        _prefetch_kernel[(triton.cdiv(triton.cdiv(nbytes, chunk), CHUNKS),)](w, nbytes, CHUNK=chunk, CHUNKS=CHUNKS,
                                                                            num_warps=1)


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

        def chain(chunk: int, run: bool, warm: bool = False) -> float:
            def fn():
                flush.add_(1)
                if warm:
                    for w, x in zip(ws, xs):
                        gemv(x, w)
                if chunk:
                    prefetch_l2(ws, chunk)
                torch.cuda._sleep(WAIT_CYCLES)
                if run:
                    for w, x in zip(ws, xs):
                        gemv(x, w)
            return time_replayed(fn, DEV, calls=10, repeats=7) * 1e6

        base = chain(0, False)
        row = {"weights": name, "MB": round(sum(w.numel() * 2 for w in ws) / 2**20, 1),
               "cold_us": round(chain(0, True) - base, 2),
               "warm_us": round(chain(0, True, warm=True) - chain(0, False, warm=True), 2)}
        for chunk in [int(c) for c in args.chunks.split(",")]:
            asked = chain(chunk, False)
            row[f"asked_{chunk // 1024}k_us"] = round(chain(chunk, True) - asked, 2)
            row[f"ask_cost_{chunk // 1024}k_us"] = round(asked - base, 2)
        rows.append(row)
        print(row, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "wait_cycles": WAIT_CYCLES,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
