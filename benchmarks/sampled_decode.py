"""What drawing tokens costs a decode stream: greedy against temperature, top-k and top-p sampling.

    python benchmarks/sampled_decode.py [--model deepseek-tiny] [--streams 1] [--max-tokens 256]
                                        [--repeats 3] [--eager-draws] [--out results.json]
    python benchmarks/sampled_decode.py --draws-only [--vocab 8192 129280] [--batches 1 8 64]

Each setting decodes `streams` seeded chat answers (ignore_eos, `--max-tokens` each) through
`LLMEngine.step`, after one unmeasured run; decode tokens/s count the tokens after each request's first,
over the time after the first, best of `--repeats`, the settings interleaved. `--eager-draws` turns the
decode steps' draw graphs off (the draws made eagerly after the decode graph, as before them).

`--draws-only` times a draw alone on the GPU (`engine.bench.timing.time_replayed`: each variant 200
times in one CUDA graph, the median of 5 replays): temperature only, top-p 0.95 two ways (the filter as a sort, `sampler.filter_rows`, then
the sampling kernel; and in the sampling kernel, no sort: the two must draw the same tokens), and top-k
50 (a sort).
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from spec_decode import chat_prompts  # noqa: E402

from engine import SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature 0.7": dict(temperature=0.7),
    "temperature 0.7, top-k 50": dict(temperature=0.7, top_k=50),
    "temperature 0.7, top-p 0.95": dict(temperature=0.7, top_p=0.95),
}


def decode_rate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, **sampling) -> float:
    tag = time.monotonic_ns()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"s{tag}-{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i,
                                                                 **sampling))
    start, tokens = None, 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        if start is None and outs:
            start = time.perf_counter()
            continue
        tokens += sum(1 for o in outs if o.token_ids) if start is not None else 0
    return tokens / (time.perf_counter() - start)


def draw_times(vocab: int, batch: int) -> dict[str, float]:
    """Microseconds per draw of `batch` rows over `vocab` logits, each variant graph-replayed."""
    import torch

    from engine.bench.timing import time_replayed
    from engine.kernels.sampling import sample
    from engine.sampler import filter_rows

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(batch, vocab, device=dev, generator=g) * 2
    temp = torch.ones(batch, device=dev)
    keys = torch.arange(batch, device=dev) * 7919
    step = torch.zeros(1, dtype=torch.long, device=dev)
    top_p = torch.full((batch,), 0.95, device=dev)
    top_k = torch.full((batch,), 50, dtype=torch.long, device=dev)
    off_k, off_p = torch.full_like(top_k, vocab), torch.full_like(top_p, float("inf"))
    variants = {
        "temperature": lambda: sample(logits, temp, keys, step),
        "top-p, sort": lambda: sample(filter_rows(logits, off_k, top_p), temp, keys, step),
        "top-p, kernel": lambda: sample(logits, temp, keys, step, top_p=top_p),
        "top-k (sort)": lambda: sample(filter_rows(logits, top_k, off_p), temp, keys, step),
    }
    assert torch.equal(variants["top-p, sort"](), variants["top-p, kernel"]()), "top-p: the two draws differ"
    # each variant captured 200 times in a CUDA graph, replayed: the median of 5 replays, per call
    times = {name: time_replayed(fn, dev, calls=200, repeats=5) * 1e6 for name, fn in variants.items()}
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="deepseek-tiny")
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--eager-draws", action="store_true")
    p.add_argument("--out")
    p.add_argument("--draws-only", action="store_true")
    p.add_argument("--vocab", type=int, nargs="+", default=[8192, 129280])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    args = p.parse_args()
    if args.draws_only:
        rows = [dict(vocab=v, batch=b, us=draw_times(v, b)) for v in args.vocab for b in args.batches]
        for r in rows:
            print(f"vocab {r['vocab']:6d} batch {r['batch']:3d}: " + ", ".join(f"{k} {t:.1f} us" for k, t in r["us"].items()))
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"draws_us": rows}, f, indent=1)
        return
    engine = LLMEngine(EngineConfig(model=args.model, max_num_seqs=max(args.streams, 1), show_progress=False))
    if args.eager_draws:
        engine.runner.draw_graphs = None
    prompts = chat_prompts(engine, args.streams, 0)
    best = dict.fromkeys(SETTINGS, 0.0)
    for r in range(args.repeats + 1):
        for name, sampling in SETTINGS.items():
            rate = decode_rate(engine, prompts, args.max_tokens, **sampling)
            if r:  # the first round warms up
                best[name] = max(best[name], rate)
    device = engine.runner.device
    result = {"model": args.model, "streams": args.streams, "max_tokens": args.max_tokens,
              "draws_in_graph": engine.runner.draw_graphs is not None, "device": str(device),
              "decode_tok_s": best}
    for name, rate in best.items():
        print(f"{name:30s} {rate:9.0f} tok/s")
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
