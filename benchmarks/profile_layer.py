"""Where one decode step's layer time goes: each kernel's GPU time against the layer's replayed time.

    python benchmarks/profile_layer.py --preset v2-lite [--layer 1] [--batch 1] [--context 1024]
                                       [--kv-cache-dtype fp8] [--step]

Builds the preset with random weights (as `deepseek-engine bench` does), prefills `batch` sequences of
`context` tokens, then runs one decoder layer: replayed from a CUDA graph (its wall time per call) and
under torch.profiler (each kernel's device time). The difference between the wall time and the sum of
kernel times is what launches and the gaps between dependent kernels cost. Prints one table.

One layer replayed over and over reads its own cache each time, which stays in L2 while it fits (32k
tokens of V2-Lite's bf16 latents are 38 MB): `--step` profiles the whole decode step instead (the
decode graph the engine replays, every layer reading its own cache as in serving), its kernels per
step and their device time per launch.
"""

import argparse
import dataclasses
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from engine.bench.ours import BlockPool, make_sequence, prefill, random_prompt
from engine.bench.presets import preset_config
from engine.bench.timing import time_fn
from engine.config import EngineConfig, ModelConfig
from engine.model_runner import ModelRunner
from engine.scheduler import ScheduledBatch
from engine.step_plan import PlanBuilder, StepPlan


def build(preset: str, batch: int, context: int, kv_cache_dtype: str = "auto") -> tuple[ModelRunner, StepPlan]:
    cfg = ModelConfig.from_hf(preset_config(preset))
    bs = 64
    num_blocks = batch * -(-(context + 64) // bs) + 4
    ec = EngineConfig(model=preset, max_num_seqs=max(batch, 1), block_size=bs, num_kv_blocks=num_blocks,
                      kv_cache_dtype=kv_cache_dtype, show_progress=False, extra={"capture_graphs_at_start": False})
    runner = ModelRunner(ec, cfg, None, context + 64)
    runner.init_cache(num_blocks)
    pool = BlockPool(runner.num_blocks, bs)
    seqs = [make_sequence(random_prompt(context, cfg.vocab_size, 11 + i), pool.take(context + 32), f"p{i}")
            for i in range(batch)]
    planner = PlanBuilder(ec.max_num_seqs)
    prefill(runner, seqs, planner)
    return runner, planner.build(ScheduledBatch(decodes=seqs))


def kernel_events(fn, calls: int) -> list:
    """The CUDA kernel events of `calls` calls of fn, under torch.profiler."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def short(name: str) -> str:
    for cut in ("(", "<"):
        name = name.split(cut)[0]
    return name[:60]


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="v2-lite")
    p.add_argument("--layer", type=int, default=1)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    p.add_argument("--step", action="store_true", help="the whole decode step's graph, not one layer's")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_layer needs a CUDA GPU (it times the layer's CUDA graph)")
    runner, plan = build(a.preset, a.batch, a.context, a.kv_cache_dtype)
    runner.tables.apply(plan.table_deltas)
    plan.table_deltas = []
    if a.step:  # the step as the engine runs it (each run writes the same new token's latent row again)
        plan.use_graph = runner.takes_graph(plan)
        run = lambda: runner.run(plan)
        run()  # the decode graph captured
        wall = time_fn(lambda: [run() for _ in range(10)], runner.device, repeats=5, warmup=1) / 10
        eager = dataclasses.replace(plan, use_graph=False)
        report(f"{a.preset} decode step batch {a.batch} context {a.context} cache {a.kv_cache_dtype}", run,
               lambda: runner.run(eager), a.calls, wall)
        return
    runner.graphs.load(plan)
    meta, positions = runner.graphs.metadata(a.batch)
    layer = runner.model.model.layers[a.layer]
    hidden = runner.model_config.hidden_size
    g = torch.Generator(runner.device).manual_seed(0)
    h = torch.randn(a.batch, hidden, generator=g, device=runner.device, dtype=runner.dtype)
    residual = torch.randn_like(h)
    run = lambda: layer(positions, h, residual, meta)
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=runner.graphs.pool):
        run()
    wall = time_fn(lambda: [graph.replay() for _ in range(50)], runner.device, repeats=5, warmup=1) / 50
    report(f"{a.preset} layer {a.layer} batch {a.batch} context {a.context} cache {a.kv_cache_dtype}", graph.replay,
           run, a.calls, wall)


def report(title: str, replay, eager, calls: int, wall: float) -> None:
    """Each kernel's launches per call and device time, against the replayed wall time per call."""
    # kernels inside a replayed graph where the profiler sees them, else the same work run eagerly
    for src, fn in (("graph", replay), ("eager", eager)):
        kernels = kernel_events(fn, calls)
        if kernels:
            break
    order, times = [], defaultdict(list)
    for e in kernels:
        k = short(e.name)
        if k not in times:
            order.append(k)
        times[k].append(e.device_time)
    total = 0.0
    print(f"{title}: kernels from the {src} run")
    print(f"{'kernel':60s} {'per call':>8s} {'us each':>8s} {'us/call':>8s}")
    for k in order:
        n = len(times[k]) / calls
        us = sum(times[k]) / len(times[k])
        total += us * n
        print(f"{k:60s} {n:8.1f} {us:8.2f} {us * n:8.2f}")
    launches = len(kernels) / calls
    print(f"kernels {launches:.0f} per call, busy {total:.1f} us, replayed wall {wall * 1e6:.1f} us, "
          f"gaps {wall * 1e6 - total:.1f} us ({(wall * 1e6 - total) / max(launches, 1):.2f} us per launch)")


if __name__ == "__main__":
    main()
