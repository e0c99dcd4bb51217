"""Where a decode step's time goes: the host's phases against the device's work.

    python benchmarks/step_time.py --model DIR [--dtype bfloat16] [--streams 32] [--max-tokens 256]

Runs `streams` requests (ignore_eos, temperature 1, so every row samples) through `LLMEngine.step`
(the first step prefills every prompt and is timed apart: after the first pass, over their first
block in the prefix cache), then decodes them four ways: with async scheduling and without (wall
time per step); without, instrumented, with the device waited for after each phase that launches
work, so each phase's host time is separated from the device's; and the decode step's CUDA graph
replayed back to back (device time alone). A step whose wall time is well above its device time is
bound by host work the device waits for. Prints one table (median over the decode steps).
"""

import argparse
import statistics
import time

import torch

from engine import SamplingParams
from engine.bench.timing import time_fn
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="deepseek-tiny")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=32)
    return p.parse_args()


class Timed:
    """Wraps a callable; each call's host time (after waiting for the device, when `sync`) is kept."""

    def __init__(self, fn, sync: bool):
        self.fn, self.sync, self.times = fn, sync, []

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        out = self.fn(*args, **kwargs)
        if self.sync and torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - start)
        return out


def add_requests(engine: LLMEngine, tag: str, args: argparse.Namespace) -> None:
    vocab = engine.model_config.vocab_size
    for i in range(args.streams):
        prompt = [(7 * i + 13 * j) % (vocab - 1) + 1 for j in range(args.prompt_tokens)]
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, ignore_eos=True)
        engine.add_request(f"{tag}-{i}", prompt, params)


def decode_steps(engine: LLMEngine, args: argparse.Namespace, tag: str) -> tuple[float, list[float]]:
    """-> (wall time of the first step: every stream's prompt prefilled, eagerly; wall time of every
    step that decodes all streams)."""
    add_requests(engine, tag, args)
    prefill, times = None, []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        if prefill is None:
            prefill = elapsed
        elif len(outputs) == args.streams and all(len(o.token_ids) > 1 for o in outputs):
            times.append(elapsed)
    return prefill, times


def median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3 if xs else float("nan")


@torch.inference_mode()
def main() -> None:
    args = parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=max(64, args.streams),
                                    show_progress=False))
    decode_steps(engine, args, "warm-up")
    walls, prefills = {}, []
    for mode in (True, False):
        engine.async_scheduling = mode
        prefill, walls[mode] = decode_steps(engine, args, f"async-{mode}")
        prefills.append(prefill)

    # instrumented (synchronous): each phase that launches device work waits for it, so the rest is host time;
    # the draws through the sampler (a draw graph would take them out of `sample`'s count)
    engine.runner.draw_graphs = None
    schedule = engine.scheduler.schedule = Timed(engine.scheduler.schedule, sync=False)
    run = engine.runner.run = Timed(engine.runner.run, sync=True)
    sample = engine.sampler.sample = Timed(engine.sampler.sample, sync=True)
    _, instrumented = decode_steps(engine, args, "instrumented")
    n = len(instrumented)
    # the calls of the decode steps only: the last n of each
    phases = {"schedule": schedule.times[-n:], "run (launch + device)": run.times[-n:],
              "sample (launch + device + copy)": sample.times[-n:]}  # fmt: skip
    rest = [t - sum(p[i] for p in phases.values()) for i, t in enumerate(instrumented)]

    device = float("nan")
    graphs = engine.runner.graphs
    if graphs is not None and args.streams <= graphs.max_batch:
        # buffers hold the last batch; replays only walk into the scratch block
        replays = lambda: [graphs.replay(args.streams) for _ in range(50)]  # noqa: E731
        device = time_fn(replays, engine.runner.device, repeats=1, warmup=1) / 50 * 1e3

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"{name}, model {args.model} ({engine.runner.dtype}), {args.streams} streams, median of {n} decode steps")
    print(f"{'prefill step of every prompt (wall)':40s} {median_ms(prefills):8.3f} ms")
    print(f"{'step, async scheduling (wall)':40s} {median_ms(walls[True]):8.3f} ms")
    print(f"{'step, synchronous (wall)':40s} {median_ms(walls[False]):8.3f} ms")
    print(f"{'decode graph replayed alone (device)':40s} {device:8.3f} ms")
    print("instrumented step (device waited for after each phase):")
    for label, times in phases.items():
        print(f"  {label:38s} {median_ms(times):8.3f} ms")
    print(f"  {'postprocess (tokens -> outputs)':38s} {median_ms(rest):8.3f} ms")
    print(f"  {'total':38s} {median_ms(instrumented):8.3f} ms")


if __name__ == "__main__":
    main()
