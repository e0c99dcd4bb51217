"""Where one prefill's time goes, ours and (--hf) HF transformers' on the same weights: kernels by device time.

    python benchmarks/profile_prefill.py --preset v2-lite --tokens 2048 [--hf]

Builds the preset with random weights (as `deepseek-engine bench` does), prefills one prompt once to
compile, then once under torch.profiler: the wall time, the kernels' summed device time (the rest is
the device idle, waiting for the host) and the kernels grouped by name, largest first. With --hf the
same for HF's model holding our weights (bf16 where ours are FP8), after ours has left the device.
"""

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from engine.bench.hf_peer import _prefill as hf_prefill, peer_in_place_of
from engine.bench.ours import BlockPool, make_sequence, prefill, random_prompt
from engine.bench.presets import preset_config
from engine.config import EngineConfig, ModelConfig
from engine.model_runner import ModelRunner


def short(name: str) -> str:
    for cut in ("(", "<"):
        name = name.split(cut)[0]
    return name[:58]


def profiled(fn, top: int) -> str:
    """fn() once under the profiler -> a table: wall, summed kernel time, the `top` kernels by time."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    times, counts = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[short(e.name)] += e.device_time
            counts[short(e.name)] += 1
    busy = sum(times.values())
    lines = [f"wall {wall * 1e3:.1f} ms (profiled), kernels {busy / 1e3:.1f} ms in {sum(counts.values())} launches",
             f"{'kernel':58s} {'calls':>6s} {'ms':>7s} {'share':>6s}"]
    for k in sorted(times, key=times.get, reverse=True)[:top]:
        lines.append(f"{k:58s} {counts[k]:6d} {times[k] / 1e3:7.2f} {times[k] / busy:6.1%}")
    return "\n".join(lines)


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="v2-lite")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--hf", action="store_true", help="also profile HF transformers' prefill on the same weights")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_prefill needs a CUDA GPU")
    hf_config = preset_config(a.preset)
    cfg = ModelConfig.from_hf(hf_config)
    bs = 64
    num_blocks = -(-(a.tokens + 1) // bs) + 4
    ec = EngineConfig(model=a.preset, max_num_seqs=1, block_size=bs, num_kv_blocks=num_blocks, show_progress=False,
                      extra={"capture_graphs_at_start": False})
    runner = ModelRunner(ec, cfg, None, a.tokens + bs)
    runner.init_cache(num_blocks)
    pool = BlockPool(runner.num_blocks, bs)
    ids = random_prompt(a.tokens, cfg.vocab_size, seed=a.tokens)

    def ours():
        pool.reset()
        prefill(runner, [make_sequence(ids, pool.take(a.tokens + 1), "p")])

    ours()
    print(f"ours, {a.preset}, {a.tokens}-token prefill: " + profiled(ours, a.top))
    if a.hf:
        hf = peer_in_place_of(runner, hf_config)
        x = torch.tensor([ids], device=runner.device)
        hf_prefill(hf, x)
        print(f"HF, {a.preset}, {a.tokens}-token prefill: " + profiled(lambda: hf_prefill(hf, x), a.top))


if __name__ == "__main__":
    main()
