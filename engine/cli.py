"""`deepseek-engine serve | generate | bench`."""

import argparse
import shlex
import sys
import time


def _add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="deepseek-tiny", help="checkpoint directory, or the embedded deepseek-tiny")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--speculative-config", help="""speculative decoding as JSON, e.g. '{"method": "mtp", """
                   """"num_speculative_tokens": 2}' (the checkpoint's MTP layer drafts)""")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable); default: one per line of stdin")
    p.add_argument("--chat", action="store_true", help="send each prompt as a user message through the chat template")
    p.add_argument("--thinking", action="store_true", help="with --chat: let the model think first (DeepSeek's switch)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("error: no prompt given (use --prompt or pipe prompts on stdin)", file=sys.stderr)
        return 2
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos)
        llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, show_progress=True,
                  speculative_config=args.speculative_config)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.chat:
        tok = llm.tokenizer
        inputs = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], thinking=args.thinking),
                             add_bos=False) for p in prompts]
    else:
        inputs = prompts
    start = time.perf_counter()
    try:
        outs = llm.generate(inputs, params)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    for prompt, out in zip(prompts, outs):
        print(f">>> {prompt}\n{out.text}\n[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]\n")
    total = sum(len(o.token_ids) for o in outs)
    print(f"{total} tokens in {elapsed:.2f} s ({total / elapsed:.1f} tokens/s)", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deepseek-engine", description="DeepSeek inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    from engine.server.launch import add_serve_args

    add_serve_args(serve)

    gen = sub.add_parser("generate", help="generate offline for prompts from the command line or stdin")
    _add_generate_args(gen)

    from engine.bench.cli import add_bench_args, run_bench

    bench = sub.add_parser("bench", help="measure prefill and decode against the hardware's ceilings (and HF)")
    add_bench_args(bench)

    args = parser.parse_args(argv)
    if args.command == "serve":
        from engine.server.launch import run

        return run(args)
    if args.command == "bench":
        return run_bench(args, "deepseek-engine " + shlex.join(sys.argv[1:] if argv is None else argv))
    return _generate(args)


if __name__ == "__main__":
    sys.exit(main())
