"""Sorting a step's (token, expert) pairs by expert for the grouped GEMMs (`engine.kernels.moe_routing`):
the chunked kernels against PyTorch's stable sort, on the device and on the host.

    python benchmarks/moe_align.py [--tokens 2048,8192,32768]

DeepSeek-V2-Lite's routing (64 experts, top-6, 128-row blocks) and V3's (256, top-8, 64-row blocks),
random. Device: the call replayed from a CUDA graph. Host: what launching one call costs the Python
thread (the mean of 200 calls, the device left to catch up afterwards), which is what a prefill of a
few thousand tokens waits on.
"""

import argparse
import time

import torch

from engine.bench.timing import time_replayed
from engine.kernels.moe_routing import align_by_expert_chunked, sort_by_expert

ROUTINGS = {"v2-lite": (64, 6, 128), "v3": (256, 8, 64)}  # experts, top_k, block_m


def host_seconds(fn, calls: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    seconds = (time.perf_counter() - t0) / calls
    torch.cuda.synchronize()
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="2048,8192,32768")
    args = p.parse_args()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}: us per call")
    print(f"{'routing':<8s} {'tokens':>6s} {'pairs':>7s} {'chunked dev':>11s} {'sort dev':>9s} "
          f"{'chunked host':>12s} {'sort host':>9s} {'same':>5s}")
    for name, (experts, top_k, block_m) in ROUTINGS.items():
        for tokens in (int(t) for t in args.tokens.split(",")):
            g = torch.Generator(dev).manual_seed(tokens)
            ids = torch.rand(tokens, experts, device=dev, generator=g).argsort(-1)[:, :top_k].int().contiguous()
            chunked = lambda: align_by_expert_chunked(ids, experts, block_m)
            max_padded = chunked()[0].numel()
            sort = lambda: sort_by_expert(ids, experts, block_m, max_padded)
            same = all(torch.equal(a, b) for a, b in zip(chunked(), sort()))
            dev_c, dev_s = time_replayed(chunked, dev), time_replayed(sort, dev)
            host_c, host_s = host_seconds(chunked), host_seconds(sort)
            print(f"{name:<8s} {tokens:6d} {tokens * top_k:7d} {dev_c * 1e6:11.1f} {dev_s * 1e6:9.1f} "
                  f"{host_c * 1e6:12.1f} {host_s * 1e6:9.1f} {str(same):>5s}", flush=True)


if __name__ == "__main__":
    main()
