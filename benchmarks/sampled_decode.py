"""What drawing tokens costs a decode stream: greedy against temperature, top-k and top-p sampling.

    python benchmarks/sampled_decode.py [--model deepseek-tiny] [--streams 1] [--max-tokens 256]
                                        [--repeats 3] [--eager-draws] [--out results.json]

Each setting decodes `streams` seeded chat answers (ignore_eos, `--max-tokens` each) through
`LLMEngine.step`, after one unmeasured run; decode tokens/s count the tokens after each request's first,
over the time after the first, best of `--repeats`, the settings interleaved. `--eager-draws` turns the
decode steps' draw graphs off (the draws made eagerly after the decode graph, as before them).
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="deepseek-tiny")
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--eager-draws", action="store_true")
    p.add_argument("--out")
    args = p.parse_args()
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
