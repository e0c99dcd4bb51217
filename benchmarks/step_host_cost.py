"""The host's cost of preparing one decode step of a batch at long contexts, before and after the engine
kept block tables on the device.

before: every step rebuilt each sequence's whole block table and cache slots from Python lists and
copied them over (what `ModelRunner._prepare` did until the plan/execute seam);
after: `PlanBuilder.build` (the plan rank 0 broadcasts: table deltas only) + `ModelRunner._prepare`
(block tables gathered from the persistent device tables, slots computed there).

    python benchmarks/step_host_cost.py [--batch 64] [--contexts 4096 32768 131072] [--device cpu]
"""

import argparse
import time

import torch

from engine.config import EngineConfig, ModelConfig, resolve_model_path
from engine.copies import to_device
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence, SequenceStatus
from engine.step_plan import PlanBuilder


def legacy_prepare(seqs: list[Sequence], block_size: int, device: torch.device) -> None:
    """The per-step work the engine did before: whole tables and per-token slots from lists."""
    slots, positions, tables = [], [], []
    for seq in seqs:
        start = seq.num_computed_tokens
        positions.append(start)
        slots.append(seq.block_table[start // block_size] * block_size + start % block_size)
        tables.append(seq.block_table)
    max_blocks = max(len(t) for t in tables)
    to_device([t + [0] * (max_blocks - len(t)) for t in tables], torch.long, device)
    to_device(slots, torch.long, device)
    to_device(positions, torch.long, device)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=50)
    args = p.parse_args()
    bs, longest = 16, max(args.contexts)
    path = resolve_model_path("deepseek-tiny")
    config = EngineConfig(model=str(path), device=args.device, max_num_seqs=args.batch, num_kv_blocks=64,
                          show_progress=False, extra={"capture_graphs_at_start": False})
    runner = ModelRunner(config, ModelConfig.from_dir(path), path, longest + 2 * bs)
    runner.init_cache(64)  # block ids only index the tables here: a small pool will do
    dev = runner.device
    print(f"decode step of {args.batch} sequences, host time per step (median of {args.repeats}), {dev}")
    print(f"{'context':>8} {'before (ms)':>12} {'after (ms)':>11}")
    for context in args.contexts:
        seqs = []
        for i in range(args.batch):
            seq = Sequence(f"s{i}", [5] * context, SamplingParams(), torch.Generator())
            seq.block_table = [(i + j) % 64 for j in range(-(-(context + 1) // bs))]
            seq.num_computed_tokens, seq.status = context - 1, SequenceStatus.RUNNING
            seqs.append(seq)
        planner = PlanBuilder(args.batch)
        runner.tables.apply(planner.build(ScheduledBatch(decodes=seqs)).table_deltas)  # admission, once

        def after():
            plan = planner.build(ScheduledBatch(decodes=seqs))
            runner.tables.apply(plan.table_deltas)
            runner._prepare(plan)

        timings = {}
        for name, fn in (("before", lambda: legacy_prepare(seqs, bs, dev)), ("after", after)):
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                fn()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                times.append(time.perf_counter() - t0)
            timings[name] = sorted(times)[len(times) // 2] * 1e3
        print(f"{context:>8} {timings['before']:>12.3f} {timings['after']:>11.3f}")


if __name__ == "__main__":
    main()
