"""The FP8 latent cache's accuracy on a trained checkpoint: logit drift and greedy agreement.

    python benchmarks/kv_cache_drift.py [--model deepseek-tiny] [--prompts 32] [--max-tokens 128]
                                        [--chunk 16] [--out results.json]

Three engines on one checkpoint, on the CPU with float32 activations (the reference path; the kernels'
FP8 reads are held to it by tests/engine/test_kernels.py): the latent cache in float32 (the truth), in bf16,
and as FP8 (`kv_cache_dtype="fp8"`: e4m3 with a scale a token). Each prompt is a chat question whose
answer the truth writes greedily (`--max-tokens`, EOS ignored); then
- teacher-forced: every engine scores prompt + the truth's answer in chunks of `--chunk` tokens over
  pages of 4, so most of what a position attends to comes back from its cache. At the answer's positions:
  mean and max |logit - truth's| (and the mean over the truth's logit std), and how often the argmax is
  the truth's;
- free-running: every engine answers greedily itself: tokens alike before the first difference, and
  answers identical to the truth's, all `--max-tokens` of them; and replies (to EOS, as a user reads
  them) identical to the truth's.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmark's questions
import spec_decode  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

# 32 distinct chat questions: the speculative-decoding benchmark's 16, then 16 more
QUESTIONS = spec_decode.QUESTIONS + [
    "What does str.split do?", "Define the word orchard.", "What is 81 divided by 9?", "How are you today?",
    "What does sorted do?", "Define the word glacier.", "What is 6 plus 15?", "What is a list in Python?",
    "What does dict.get do?", "Define the word compass.", "What is 100 minus 37?", "Thank you!",
    "What does enumerate do?", "Define the word thunder.", "What is 8 times 8?", "What is a variable?",
]
CACHES = {"float32": "auto", "bf16": "bf16", "fp8": "fp8"}  # name -> kv_cache_dtype, float32 activations


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="deepseek-tiny")
    p.add_argument("--prompts", type=int, default=len(QUESTIONS), choices=range(1, len(QUESTIONS) + 1),
                   metavar=f"1..{len(QUESTIONS)}", help="distinct chat questions")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--chunk", type=int, default=16, help="prefill chunk, tokens (pages hold 4)")
    p.add_argument("--out")
    return p.parse_args()


def alike(a: list[int], b: list[int]) -> int:
    """Tokens generated alike before the first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def measure(args: argparse.Namespace) -> dict:
    llms = {name: LLM(args.model, dtype="float32", device="cpu", kv_cache_dtype=kv, block_size=4,
                      max_num_batched_tokens=args.chunk, enable_prefix_caching=False)
            for name, kv in CACHES.items()}
    prompts = spec_decode.chat_prompts(llms["float32"].engine, args.prompts, 0, QUESTIONS)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    answers = {name: [o.token_ids for o in llm.generate(prompts, greedy)] for name, llm in llms.items()}
    eos = llms["float32"].tokenizer.eos_token_id
    # the replies as a user reads them: each answer to its first EOS (greedy, so the same tokens)
    replies = {name: [a[: a.index(eos) + 1] if eos in a else a for a in ans] for name, ans in answers.items()}
    forced = [p + a for p, a in zip(prompts, answers["float32"])]
    # the logits that predict each answer token: positions len(prompt) - 1 .. len(prompt + answer) - 2
    spans = [slice(len(p) - 1, len(f) - 1) for p, f in zip(prompts, forced)]
    logits = {name: [x[s] for x, s in zip(llm.score(forced), spans)] for name, llm in llms.items()}
    truth = logits["float32"]
    std = torch.cat([t.flatten() for t in truth]).std().item()
    rows = []
    for name in ("bf16", "fp8"):
        drift = torch.cat([(x - t).abs().flatten() for x, t in zip(logits[name], truth)])
        top1 = torch.cat([x.argmax(-1) == t.argmax(-1) for x, t in zip(logits[name], truth)]).float()
        same = [alike(a, b) for a, b in zip(answers[name], answers["float32"])]
        rows.append({"cache": name, "mean_abs_logit_drift": drift.mean().item(),
                     "max_abs_logit_drift": drift.max().item(), "mean_drift_over_std": drift.mean().item() / std,
                     "argmax_agreement": top1.mean().item(), "greedy_tokens_alike": sum(same) / len(same),
                     "greedy_answers_identical": sum(s == args.max_tokens for s in same) / len(same),
                     "replies_identical": sum(a == b for a, b in zip(replies[name], replies["float32"])) / len(same)})
    for llm in llms.values():
        llm.engine.shutdown()
    return {"model": args.model, "device": "cpu", "prompts": args.prompts, "max_tokens": args.max_tokens,
            "chunk": args.chunk, "logit_std": std, "rows": rows}


def main() -> None:
    args = parse_args()
    result = measure(args)
    print(f"{result['model']}, {args.prompts} chat answers of {args.max_tokens} tokens, float32 activations; "
          f"against a float32 cache (logit std {result['logit_std']:.2f}):")
    print(f"  {'cache':6} {'mean |dlogit|':>14} {'max':>7} {'/ std':>7} {'argmax':>7} {'alike':>7} "
          f"{'identical':>10} {'replies':>8}")
    for r in result["rows"]:
        print(f"  {r['cache']:6} {r['mean_abs_logit_drift']:14.4f} {r['max_abs_logit_drift']:7.3f} "
              f"{r['mean_drift_over_std']:7.4f} {r['argmax_agreement']:7.1%} {r['greedy_tokens_alike']:7.1f} "
              f"{r['greedy_answers_identical']:10.0%} {r['replies_identical']:8.0%}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
