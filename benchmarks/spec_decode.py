"""Speculative decoding with the MTP layer: what it buys a stream, and what verifying k drafts costs.

    python benchmarks/spec_decode.py [--model deepseek-tiny] [--k 1,2,3] [--streams 1,4,16]
                                     [--presets v2-lite,v3-slice] [--context N] [--kv-cache-dtype auto|fp8]
                                     [--no-projection-dot] [--no-grouped-dot]
                                     [--out results.json]

1. A real checkpoint with a trained MTP layer (deepseek-tiny by default): greedy chat answers, or
   sampled ones (`--temperature`, `--top-p`, seeded; ignore_eos, `--max-tokens` each) through `LLMEngine.step`, one batch of `streams` requests at a
   time, without speculation and with k = 1, 2, 3 drafts: decode tokens/s (tokens after the first,
   over the time after the first), tokens gained per verification step, and how many requests'
   tokens equal the plain run's (in bf16 a verification's rows and a decode row can round apart).
2. Random-weight shapes (`--presets`): the target's step over k + 1 consecutive rows of one sequence
   (a verification, replayed from the decode graphs; and run eagerly, as a chunk) against a one-row
   decode step at `--context` tokens (the latent cache in `--kv-cache-dtype`), and the MTP draft after it
   (its CUDA graph) -> the single-stream speedup each number of tokens gained per step would buy:
   gained * t(decode) / (t(verify) + t(draft)).
   Then the fused step (`SpecGraphs`: verify, accept and draft in one replay) of one sequence, captured
   with the verification's rows folded into the decode kernel's heads and not
   (`attention.FOLD_VERIFICATIONS`): the device time of a replay at that context, either way.
"""

import argparse
import json
import time

import torch

from engine import SamplingParams
from engine.bench.presets import preset_config
from engine.bench.timing import time_fn
from engine.config import EngineConfig, ModelConfig
from engine.kernels import gemv
from engine.llm_engine import LLMEngine
from engine.layers import attention
from engine.model_runner import DraftGraphs, GraphSampling, ModelRunner, SpecGraphs
from engine.step_plan import StepPlan

QUESTIONS = [
    "What does json.dumps do?", "Define the word harbor.", "What is 17 plus 25?", "Hello! Who are you?",
    "What does os.path.join do?", "Define the word lantern.", "What is 9 times 7?", "What is the jargon word foo?",
    "What does itertools.chain do?", "Define the word meadow.", "What is 40 minus 13?", "What does re.sub do?",
    "Define the word quarrel.", "What does collections.Counter do?", "What is 12 times 12?", "Good morning!",
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="deepseek-tiny")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--k", default="1,2,3", help="draft tokens per step to compare with plain decoding")
    p.add_argument("--streams", default="1,4,16", help="requests decoded together")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="sampled requests (seeded per request) where > 0")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=2, help="batches of `streams` requests per setting")
    p.add_argument("--presets", default="", help="random-weight shapes for the verify-step costs, e.g. v2-lite,v3-slice")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="the presets' latent cache")
    p.add_argument("--always-draft", action="store_true",
                   help="draft at every batch size (by default a GPU measures where drafting pays at start)")
    p.add_argument("--no-projection-dot", dest="projection_dot", action="store_false",
                   help="FP8 projections of 2-16 rows by the FP8 GEMM, not the tensor-core GEMV (kernels.gemv.DOT)")
    p.add_argument("--no-grouped-dot", dest="grouped_dot", action="store_false",
                   help="V4's block-diagonal wo_a by an FP8 GEMM a group, not one tensor-core GEMV launch "
                        "(kernels.gemv.DOT_GROUPS)")
    p.add_argument("--out")
    return p.parse_args()


def chat_prompts(engine: LLMEngine, n: int, offset: int, questions: list[str] = QUESTIONS) -> list[list[int]]:
    tok = engine.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": questions[(offset + i) % len(questions)]}]),
                       add_bos=False) for i in range(n)]


def run_engine(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0,
               top_p: float = 1.0) -> tuple[list[list[int]], float, int]:
    """Decode a batch to the end -> (tokens per request, decode seconds, decode tokens): from the step
    that gave every request its first token on. Sampled requests are seeded by their place in the batch."""
    ids = [f"r{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for i, (rid, prompt) in enumerate(zip(ids, prompts)):
        engine.add_request(rid, prompt, SamplingParams(temperature=temperature, top_p=top_p, seed=i,
                                                       max_tokens=max_tokens, ignore_eos=True))
    outs, start, first_total = {}, None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        if start is None and all(engine.requests.get(r) is None or engine.requests[r].output_token_ids for r in ids):
            start = time.perf_counter()
            first_total = sum(len(engine.requests[r].output_token_ids) for r in ids if r in engine.requests)
    seconds = time.perf_counter() - start
    tokens = [outs[r].token_ids for r in ids]
    return tokens, seconds, sum(map(len, tokens)) - first_total


def real_model(args: argparse.Namespace) -> list[dict]:
    """Per batch size: one engine per setting (plain, then each k), warmed up, then the rounds run
    setting after setting (interleaved, so a drift of the machine's speed touches every setting alike)."""
    rows = []
    ks = [0] + [int(x) for x in args.k.split(",")]
    for streams in [int(s) for s in args.streams.split(",")]:
        engines = {}
        for k in ks:
            spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
            if k and args.always_draft:
                spec["disable_by_batch_size"] = streams  # no measured cutoff
            engines[k] = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=streams,
                                                speculative_config=spec, show_progress=False))
        # every shape once, once every engine is built: a setting warmed before the others were built (their
        # kernels compiled, graphs captured, cutoffs measured) ran its first timed round up to a third slower
        for engine in engines.values():
            run_engine(engine, chat_prompts(engine, streams, 99), args.max_tokens, args.temperature, args.top_p)
        # the counters run on (the measured cutoff weighs them): the rounds' drafts are the differences
        counted = {k: (e.speculator.num_draft_tokens, e.speculator.num_accepted_tokens)
                   for k, e in engines.items() if k}
        tokens = {k: [] for k in ks}
        seconds = dict.fromkeys(ks, 0.0)
        decoded = dict.fromkeys(ks, 0)
        for r in range(args.rounds):
            for k, engine in engines.items():
                t, sec, d = run_engine(engine, chat_prompts(engine, streams, r * streams), args.max_tokens,
                                       args.temperature, args.top_p)
                tokens[k] += t
                seconds[k] += sec
                decoded[k] += d
        plain = decoded[0] / seconds[0]
        for k in ks:
            entry = {"streams": streams, "k": k, "temperature": args.temperature, "top_p": args.top_p,
                     "decode_tok_s": decoded[k] / seconds[k]}
            if k:
                s = engines[k].speculator
                drafts, accepted = s.num_draft_tokens - counted[k][0], s.num_accepted_tokens - counted[k][1]
                entry["accepted_per_draft"] = accepted / max(1, drafts)
                # the batch size drafts were made up to at the end (None: every size), and the step times
                # measured at start that chose it (`LLMEngine.measure_batch_cutoff`)
                limit = s.config.disable_by_batch_size
                entry["draft_limit"] = s.limit if limit is None else limit
                if s.times is not None:
                    entry["cutoff_step_ms"] = {size: [round(1e3 * p, 4), round(1e3 * t, 4)]
                                               for size, p, t in zip(s.times.sizes, s.times.plain, s.times.spec)}
                entry["tokens_per_step"] = 1 + k * entry["accepted_per_draft"]
                # bf16: a verification's rows and a one-row decode can round a near tie apart (seeded draws
                # are the plain ones where the logits are)
                entry["same_tokens_as_plain"] = sum(a == b for a, b in zip(tokens[k], tokens[0])) / len(tokens[0])
                entry["speedup"] = entry["decode_tok_s"] / plain
            rows.append(entry)
            print(json.dumps(entry), flush=True)
        for engine in engines.values():
            engine.shutdown()
        del engines
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def verify_costs(preset: str, ks: list[int], context: int, kv_cache_dtype: str = "auto") -> dict:
    """Step times of one sequence at `context`: 1 row, k + 1 rows (a verification, replayed and eager), the
    MTP draft of k."""
    hf = preset_config(preset)
    hf["num_nextn_predict_layers"] = 1
    model_config = ModelConfig.from_hf(hf)
    bs = max([64, *hf.get("compress_ratios", [])])  # V4: a page holds whole windows of every compressed layer
    # room for the fused steps' replays, each moving the rows on by up to k + 1 positions
    blocks = -(-(context + FUSED_REPLAYS * (max(ks) + 1) + 8) // bs)
    config = EngineConfig(model=preset, dtype="bfloat16", max_num_seqs=8, block_size=bs, num_kv_blocks=blocks + 1,
                          kv_cache_dtype=kv_cache_dtype,
                          show_progress=False, speculative_config={"num_speculative_tokens": max(ks)},
                          extra={"capture_graphs_at_start": False})
    runner = ModelRunner(config, model_config, None, blocks * bs)
    runner.init_cache(blocks + 1)
    dev = runner.device
    runner.tables.apply([(0, 0, list(range(blocks)))])

    def step(n: int, graph: bool = True) -> float:
        plan = StepPlan([0], [context], [n], 1 if n > 1 else 0, [7] * n, list(range(n)), use_graph=graph)
        return time_fn(lambda: runner.run(plan), dev, repeats=20, warmup=3)

    out = {"preset": preset, "context": context, "kv_cache_dtype": kv_cache_dtype, "decode_s": step(1),
           "verify_s": {}, "verify_eager_s": {}, "draft_s": {}}
    for k in ks:
        n = k + 1
        out["verify_eager_s"][k] = step(n, graph=False)
        out["verify_s"][k] = step(n)
        graphs = DraftGraphs(runner)
        graphs.k = k
        graphs.capture_all()
        tables = runner.tables.rows([0])
        rows = torch.tensor([n - 1], device=dev)
        ids = torch.full((n,), 7, dtype=torch.long, device=dev)
        step(n)  # the draft reads the verification's rows in its decode graph's buffers
        out["draft_s"][k] = time_fn(lambda: graphs.replay(ids, rows, None, tables), dev, repeats=20, warmup=3)
        t = out["verify_s"][k] + out["draft_s"][k]
        out.setdefault("speedup_if_gained", {})[k] = {g: g * out["decode_s"] / t for g in range(1, k + 2)}
        if runner.graphs.max_batch >= n:
            out.setdefault("fused_s", {})[k] = {fold: fused_step(runner, k, context, fold) for fold in (False, True)}
        print(json.dumps({"preset": preset, "kv": kv_cache_dtype, "k": k, "decode_ms": out["decode_s"] * 1e3,
                          "verify_ms": out["verify_s"][k] * 1e3, "verify_eager_ms": out["verify_eager_s"][k] * 1e3,
                          "draft_ms": out["draft_s"][k] * 1e3,
                          **{f"fused_{'folded' if fold else 'unfolded'}_ms": t * 1e3
                             for fold, t in out.get("fused_s", {}).get(k, {}).items()}}), flush=True)
    del runner
    torch.cuda.empty_cache()
    return out


FUSED_REPLAYS = 40  # warm-up and timed replays of a fused step, each moving its sequence on


def fused_step(runner: ModelRunner, k: int, context: int, fold: bool) -> float:
    """Device seconds of one fused speculative step (greedy) of one sequence whose k + 1 rows start at
    `context`, captured with `attention.FOLD_VERIFICATIONS = fold`. The rows are loaded once and each
    replay moves them on by what it accepted, as consecutive fused steps do (at most FUSED_REPLAYS (k + 1)
    positions in all)."""
    saved_k, saved_fold = runner.num_speculative_tokens, attention.FOLD_VERIFICATIONS
    runner.num_speculative_tokens, attention.FOLD_VERIFICATIONS = k, fold  # read as the graph is captured
    try:
        spec = SpecGraphs(runner)
        spec._capture(1, GraphSampling.GREEDY)
    finally:
        runner.num_speculative_tokens, attention.FOLD_VERIFICATIONS = saved_k, saved_fold
    n = k + 1
    plan = StepPlan([0], [context], [n], 1, [7] * n, list(range(n)), use_graph=True, fused_verify=True)
    spec.replay(plan, None, None)
    graph = spec.graphs[1, GraphSampling.GREEDY]
    seconds = time_fn(graph.replay, runner.device, repeats=FUSED_REPLAYS - 6, warmup=5)
    del spec, graph
    return seconds


def main() -> None:
    args = parse_args()
    gemv.DOT, gemv.DOT_GROUPS = args.projection_dot, args.grouped_dot
    result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "real_model": real_model(args) if args.model else []}
    if args.presets:
        ks = [int(x) for x in args.k.split(",")]
        result["verify_costs"] = [verify_costs(p, ks, args.context, args.kv_cache_dtype)
                                  for p in args.presets.split(",")]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
