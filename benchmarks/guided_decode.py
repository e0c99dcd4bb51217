"""What constrained decoding costs per token end to end: the same streams decoded through `LLMEngine.step`
free, with every row guided by a JSON schema, and with a few rows guided, on a real model.

    python benchmarks/guided_decode.py [--model deepseek-tiny] [--dtype auto] [--load-format auto]
        [--streams 32] [--mixed 4]
        [--steps 256] [--repeats 3] [--out FILE]

Every stream has the same prompt, seed and sampling in each variant (temperature 1, ignore_eos), and
max_tokens = steps + 1: the first step prefills every prompt and is not timed. A guided row follows a
tool call that writes a file as an array of lines (`{"name": ..., "arguments": {"path": ..., "lines":
[...]}}`), the array's minItems equal to a stream's max_tokens: no token of the vocabulary closes more than
one line, so no row can complete the object before its length limit, and every row stays inside free
text, between lines and in keys, as a real tool call does, for the whole run. The masks, the guided
rows' pause of async scheduling (on by default on a GPU: a guided row's next step waits for its token)
and the masking on the device are all in the step times. Per variant: the median wall time of the decode
steps that return every stream, tokens/s over those steps, the overhead against the free variant, and the
rows that finished before their length limit.

The variants alternate run by run on one engine (the default with a GPU: one engine's steps overlap
each other, so a run must have the device to itself), or step by step (`--interleave steps`, the
default without), each on an engine of its own, the variants moving to the next engine at each repeat,
so that other load on a shared CPU falls on every variant alike.
"""

import argparse
import json
import statistics
import time

import torch

from engine import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.structured_output import StructuredOutput

TOPICS = ["the scheduler", "a KV cache", "prefix caching", "expert routing", "the tokenizer", "a CUDA graph",
          "speculative decoding", "the HTTP server"]


def tool_call_schema(min_lines: int) -> dict:
    lines = {"type": "array", "items": {"type": "string"}, "minItems": min_lines}
    arguments = {"type": "object", "properties": {"path": {"type": "string"}, "lines": lines},
                 "required": ["path", "lines"], "additionalProperties": False}
    return {"type": "object", "properties": {"name": {"enum": ["write_file", "append_file"]}, "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="deepseek-tiny")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                   help="dummy: random weights, for a model dir holding only config.json and a tokenizer")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--mixed", type=int, default=4, help="guided rows of the mixed variant")
    p.add_argument("--steps", type=int, default=256, help="decode steps per run (after the prefill step)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup-steps", type=int, help="decode steps of the untimed first run (default: --steps)")
    p.add_argument("--interleave", choices=("runs", "steps"),
                   help="alternate the variants run by run (default with a GPU) or step by step (default without)")
    p.add_argument("--async-scheduling", default="auto", choices=("auto", "on", "off"))
    p.add_argument("--out", help="write the figures here (JSON)")
    return p.parse_args()


class Run:
    """One variant's streams on an engine, added at its first step and stepped one step at a time; the
    decode steps' wall times kept."""

    def __init__(self, engine: LLMEngine, args: argparse.Namespace, num_guided: int, steps: int, tag: str):
        self.engine, self.num_streams, self.num_guided, self.max_tokens = engine, args.streams, num_guided, steps + 1
        self.ids = [f"{tag}-{i}" for i in range(args.streams)]
        self.started, self.prefilled, self.times, self.finished = False, False, [], {}

    def start(self) -> None:
        structured = StructuredOutput(json_schema=tool_call_schema(self.max_tokens))
        for i, request_id in enumerate(self.ids):
            prompt = f"Write a short file about {TOPICS[i % len(TOPICS)]}, one line at a time. Call {i}:"
            params = SamplingParams(temperature=1.0, seed=i, max_tokens=self.max_tokens, ignore_eos=True,
                                    structured_output=structured if i < self.num_guided else None)
            self.engine.add_request(request_id, prompt, params)
        self.started = True

    @property
    def active(self) -> bool:
        return len(self.finished) < self.num_streams

    def step(self) -> None:
        if not self.started:
            self.start()
        start = time.perf_counter()
        outputs = self.engine.step()
        elapsed = time.perf_counter() - start
        if self.prefilled and len(outputs) == self.num_streams and all(len(o.token_ids) > 1 for o in outputs):
            self.times.append(elapsed)  # a decode step of every stream
        self.prefilled = self.prefilled or bool(outputs)
        self.finished.update({o.request_id: o for o in outputs if o.finished})
        if self.active and not self.engine.has_unfinished_requests():
            raise RuntimeError("the engine has nothing left to run, but some requests did not finish")

    def ends(self) -> list:
        return [self.finished[request_id] for request_id in self.ids]


def run_all(runs: list[Run], interleave: str) -> None:
    if interleave == "runs":
        for run in runs:
            while run.active:
                run.step()
        return
    order = 0
    while any(run.active for run in runs):
        for run in runs[order:] + runs[:order]:  # who steps first rotates
            if run.active:
                run.step()
        order = (order + 1) % len(runs)


@torch.inference_mode()
def main() -> None:
    args = parse_args()
    interleave = args.interleave or ("runs" if torch.cuda.is_available() else "steps")
    variants = {"free": 0, f"{args.mixed} of {args.streams} guided": args.mixed, "all guided": args.streams}
    config = EngineConfig(model=args.model, dtype=args.dtype, load_format=args.load_format,
                          max_num_seqs=max(64, args.streams),
                          async_scheduling=args.async_scheduling, show_progress=False)
    engines = [LLMEngine(config)] if interleave == "runs" else [LLMEngine(config) for _ in variants]
    engine = engines[0]
    # warm-up: kernels and graphs over the whole context range, the matchers' tokenizer, the masking
    warmup_steps = args.steps if args.warmup_steps is None else args.warmup_steps
    run_all([Run(engines[i % len(engines)], args, guided, warmup_steps, f"warm-up-{name}")
             for i, (name, guided) in enumerate(variants.items())], interleave)
    runs = {name: [] for name in variants}
    for r in range(args.repeats):
        names = list(variants)[r % len(variants):] + list(variants)[: r % len(variants)]
        batch = [Run(engines[i % len(engines)], args, variants[name], args.steps, f"{r}-{name}")
                 for i, name in enumerate(names)]
        run_all(batch, interleave)
        for name, run in zip(names, batch):
            runs[name].append(run)

    results = []
    for name, guided in variants.items():
        times = [t for run in runs[name] for t in run.times]
        ends = [o for run in runs[name] for o in run.ends()]
        early = [o for o in ends if len(o.token_ids) < args.steps + 1]
        results.append(dict(variant=name, guided_rows=guided, measured_steps=len(times),
                            median_step_ms=statistics.median(times) * 1e3 if times else float("nan"),
                            tokens_per_s=args.streams * len(times) / sum(times) if times else float("nan"),
                            rows=len(ends), rows_finished_early=len(early),
                            early_reasons=sorted({o.finish_reason for o in early}),
                            sample=ends[0].text[:160] if guided else None))
    free = results[0]["median_step_ms"]
    for r in results:
        r["overhead_pct"] = 100 * (r["median_step_ms"] / free - 1)
        r["extra_us_per_token"] = 1e3 * (r["median_step_ms"] - free) / args.streams

    device = engine.runner.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"{name}, model {args.model} ({engine.runner.dtype}), {args.streams} streams, async scheduling "
          f"{'on' if engine.async_scheduling else 'off'}, {args.repeats} x {args.steps} decode steps per variant, "
          f"interleaved by {interleave}")
    print(f"{'variant':20s} {'step (median)':>14s} {'tokens/s':>9s} {'overhead':>9s} {'per token':>11s} {'ended early':>12s}")
    for r in results:
        print(f"{r['variant']:20s} {r['median_step_ms']:11.3f} ms {r['tokens_per_s']:9.0f} {r['overhead_pct']:8.1f}% "
              f"{r['extra_us_per_token']:+8.1f} us {r['rows_finished_early']:5d} of {r['rows']}")
    if args.out:
        import llguidance

        meta = dict(device=name, model=args.model, dtype=str(engine.runner.dtype), streams=args.streams,
                    steps=args.steps, repeats=args.repeats, interleave=interleave,
                    async_scheduling=engine.async_scheduling, torch=torch.__version__,
                    llguidance=getattr(llguidance, "__version__", None), schema=tool_call_schema(args.steps + 1))
        with open(args.out, "w") as f:
            json.dump(dict(meta, results=results), f, indent=1)


if __name__ == "__main__":
    main()
