"""MXFP4 experts dequantized to bf16 alone (`engine.kernels.mxfp4.dequantize`, what a V4 prefill batch runs
before the bf16 grouped GEMM): time and bytes a second, at `v4-slice`'s routed-expert shapes.

    python benchmarks/mxfp4_dequantize.py [--experts 256] [--baseline FILE]

w13 [experts, 2 x 2048, 4096] and w2 [experts, 4096, 2048] (codes two a byte, an E8M0 scale per 32 values),
random codes and scales; bytes = codes read + bf16 values written + scales read. --baseline: a module file
whose `dequantize` is timed beside (an earlier kernel); its output must equal the current one's.
"""

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.bench.timing import time_replayed  # noqa: E402
from engine.kernels.mxfp4 import dequantize  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--baseline", type=Path, help="a module file whose dequantize is timed beside (before)")
    args = p.parse_args()
    runs = [("now", dequantize)]
    if args.baseline:
        spec = importlib.util.spec_from_file_location("mxfp4_before", args.baseline)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        runs.insert(0, ("before", module.dequantize))
    g = torch.Generator(device="cuda").manual_seed(0)
    differ = []
    print(f"{torch.cuda.get_device_name()}: MXFP4 -> bf16 dequantization")
    for name, (rows, cols) in {"w13": (4096, 4096), "w2": (4096, 2048)}.items():
        codes = torch.randint(0, 256, (args.experts, rows, cols // 2), generator=g, device="cuda", dtype=torch.uint8)
        scale = torch.randint(118, 136, (args.experts, rows, cols // 32), generator=g, device="cuda", dtype=torch.uint8)
        nbytes = codes.numel() * (1 + 2 * 2) + scale.numel()
        want = None
        for label, fn in runs:
            out = fn(codes, scale, torch.bfloat16)
            same = "" if want is None else f" equal to before: {torch.equal(out, want)}"
            if want is not None and not torch.equal(out, want):
                differ.append(name)
            want = out if want is None else want
            del out
            sec = time_replayed(lambda: fn(codes, scale, torch.bfloat16), torch.device("cuda"), calls=3, repeats=3)
            print(f"{name} [{args.experts}, {rows}, {cols}] {label:7s} {sec * 1e3:7.2f} ms {nbytes / sec / 1e12:5.2f} TB/s"
                  f"{same}", flush=True)
        del want, codes, scale
        torch.cuda.empty_cache()
    if differ:
        raise SystemExit(f"the kernel's output differs from the baseline's for {', '.join(differ)}")


if __name__ == "__main__":
    main()
