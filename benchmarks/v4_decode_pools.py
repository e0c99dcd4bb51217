"""V4 decode with the pool kernels (compressors, indexer scores, dual-pool attention) against the PyTorch
paths they replace (`Attention.pool_kernels = False`), on v4-slice's shapes with random weights: each
block alone at one stream (graph-replayed) and the whole decode step at one stream, at several
contexts, then where each block's time goes with the kernels on (per-kernel device time, eager).

    python benchmarks/v4_decode_pools.py [--contexts 1024,16384] [--out DIR]

One model serves every context, so max_model_len is the largest context's: the PyTorch path gathers
every entry up to it at every context (its work follows max_model_len), the kernels only what a row
sees. Writes v4_decode_pools.json and prints one table.
"""

import argparse
import dataclasses
import datetime
import json
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from engine.bench.ours import BlockPool, measure_decode, one_decode, time_replayed
from engine.bench.presets import preset_config
from engine.bench.roofline import measure_ceilings
from engine.bench.v4 import V4Costs
from engine.config import DeepseekV4Config, EngineConfig, required_block_size
from engine.model_runner import ModelRunner


def build(preset: str, device: str, max_len: int, max_conc: int) -> tuple[ModelRunner, BlockPool, DeepseekV4Config]:
    cfg = DeepseekV4Config.from_hf(preset_config(preset))
    ec = EngineConfig(model=preset, dtype="auto", device=device, attention_backend="triton", max_num_seqs=max_conc,
                      show_progress=False, extra={"capture_graphs_at_start": False})
    ec = dataclasses.replace(ec, block_size=required_block_size(cfg, ec.block_size))
    num_blocks = max_conc * -(-max_len // ec.block_size) + 4
    runner = ModelRunner(ec, cfg, None, max_len)
    runner.init_cache(num_blocks)
    return runner, BlockPool(runner.num_blocks, ec.block_size), cfg


def set_kernels(runner: ModelRunner, on: bool) -> None:
    for attn in runner.model.attention_layers():
        attn.pool_kernels = on
    if runner.graphs is not None:  # captured steps keep the path they were captured with
        runner.graphs.graphs.clear()
        runner.graphs.outputs.clear()


def kernel_table(fn, calls: int = 5) -> tuple[list[tuple[str, float]], float, float]:
    """-> ([(kernel, us per call)] by time, kernels per call, busy us per call) of fn run eagerly."""
    fn()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        sync()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    times = defaultdict(float)
    for e in events:
        times[e.name.split("(")[0].split("<")[0][:48]] += e.device_time / calls
    ranked = sorted(times.items(), key=lambda kv: -kv[1])
    return ranked, len(events) / calls, sum(times.values())


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--contexts", default="1024,16384")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--preset", default="v4-slice")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run (TRITON_INTERPRET=1, v4-tiny)")
    a = p.parse_args()
    contexts = [int(c) for c in a.contexts.split(",")]
    runner, pool, cfg = build(a.preset, a.device, max(contexts) + 64, 1)
    ceilings = measure_ceilings(runner.device)
    costs = V4Costs(runner.model, cfg, 2)
    vocab = cfg.vocab_size
    result = dict(command="python benchmarks/v4_decode_pools.py --contexts " + a.contexts, preset=a.preset,
                  date=datetime.date.today().isoformat(), max_model_len=max(contexts) + 64, torch=torch.__version__,
                  gpu=torch.cuda.get_device_name() if runner.device.type == "cuda" else "cpu",
                  ceilings=ceilings.as_dict(), contexts={})
    g = torch.Generator(runner.device).manual_seed(0)
    h = torch.randn(1, cfg.hc_mult, cfg.hidden_size, generator=g, device=runner.device, dtype=runner.dtype)
    for context in contexts:
        entry = dict(layers=[], decode={})
        seq, positions, meta = one_decode(runner, pool, context, vocab)
        ids = torch.tensor([seq.output_token_ids[-1]], device=runner.device)
        for i, layer in enumerate(runner.model.layers):
            row = dict(layer=i, kind=cfg.layer_kind(i))
            floor = costs.decode_layer(i, 1, context + 1)[0] / ceilings.copy_bytes_per_s
            for on in (False, True):
                set_kernels(runner, on)
                row["kernels_s" if on else "torch_s"] = time_replayed(
                    runner, lambda: layer(positions, h, ids, meta), a.repeats)
            row["bandwidth_floor_s"] = floor
            row["ratio"] = row["kernels_s"] / floor
            if runner.device.type == "cuda" and context in (contexts[0], contexts[-1]):
                ranked, launches, busy = kernel_table(lambda: layer(positions, h, ids, meta))
                row["kernels_per_call"], row["busy_us"] = launches, busy
                row["top_kernels_us"] = [(k, round(us, 2)) for k, us in ranked[:10]]
            entry["layers"].append(row)
        for on in (False, True):
            set_kernels(runner, on)
            m = measure_decode(runner, pool, 1, context, 16, vocab)
            entry["decode"]["kernels" if on else "torch"] = m
        result["contexts"][str(context)] = entry
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "v4_decode_pools.json").write_text(json.dumps(result, indent=1))
        print(f"context {context} (max_model_len {result['max_model_len']}): decode 1 stream "
              f"{entry['decode']['torch']['tok_s']:.1f} -> {entry['decode']['kernels']['tok_s']:.1f} tok/s", flush=True)
        for row in entry["layers"]:
            print(f"  layer {row['layer']} {row['kind']:6s} torch {row['torch_s'] * 1e6:7.1f} us  kernels "
                  f"{row['kernels_s'] * 1e6:7.1f} us  floor {row['bandwidth_floor_s'] * 1e6:6.1f} us  "
                  f"ratio {row['ratio']:.2f}x  busy {row.get('busy_us', 0):.1f} us in "
                  f"{row.get('kernels_per_call', 0):.0f} kernels", flush=True)
    for context, entry in result["contexts"].items():
        for row in entry["layers"]:
            if "top_kernels_us" in row:
                print(f"context {context} layer {row['layer']} {row['kind']}: " +
                      ", ".join(f"{k} {us}" for k, us in row["top_kernels_us"][:8]))


if __name__ == "__main__":
    main()
