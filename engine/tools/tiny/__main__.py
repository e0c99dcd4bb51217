"""`python -m engine.tools.tiny STEP --out DIR`: corpus | tokenizer | pack | train | card | all."""

import argparse
import json
import sys
from pathlib import Path


def _corpus(args) -> None:
    from .corpus import build_corpus

    manifest = build_corpus(args.out / "corpus", seed=args.seed)
    print(json.dumps(manifest["documents"], indent=2))


def _tokenizer(args) -> None:
    from .corpus import read_records, record_text
    from .model_config import MAX_LEN, VOCAB_SIZE
    from .tokenizer import save_tokenizer, train_tokenizer

    texts = (record_text(r) for r in read_records(_need(args.out / "corpus" / "train.jsonl", "corpus")))
    save_tokenizer(train_tokenizer(texts, VOCAB_SIZE), args.out / "tokenizer", MAX_LEN)


def _pack(args) -> None:
    from .pack import pack

    _need(args.out / "tokenizer" / "tokenizer.json", "tokenizer")
    print(json.dumps(pack(args.out / "corpus", args.out / "tokenizer", args.out / "data"), indent=2))


def _train(args) -> None:
    from .train import TrainSettings, train

    settings = TrainSettings(
        seq_len=args.seq_len, batch_size=args.batch_size, max_steps=args.steps,
        time_budget_s=None if args.minutes is None else args.minutes * 60, eval_max_tokens=args.eval_max_tokens,
    )
    _need(args.out / "data" / "meta.json", "pack")
    metrics = train(args.out / "data", args.out / "tokenizer", args.out, settings)
    print(json.dumps(metrics["heldout"], indent=2))


def _card(args) -> None:
    from .card import write_card

    write_card(args.out, _need(args.out / "checkpoint" / "config.json", "train").parent)


def _all(args) -> None:
    for step in (_corpus, _tokenizer, _pack, _train, _card):
        step(args)


def _need(path: Path, step: str) -> Path:
    if not path.exists():
        sys.exit(f"error: {path} is missing; run the '{step}' step first")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine.tools.tiny", description=__doc__)
    parser.add_argument("step", choices=("corpus", "tokenizer", "pack", "train", "card", "all"))
    parser.add_argument("--out", type=Path, required=True, help="working directory of the recipe")
    parser.add_argument("--seed", type=int, default=0)
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, help="train for exactly this many steps")
    budget.add_argument("--minutes", type=float, help="train for as many steps as fit in this time")
    parser.add_argument("--batch-size", type=int, default=96)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--eval-max-tokens", type=int, default=None)
    args = parser.parse_args(argv)
    if args.step in ("train", "all") and args.steps is None and args.minutes is None:
        parser.error("train needs --steps or --minutes")
    steps = {"corpus": _corpus, "tokenizer": _tokenizer, "pack": _pack, "train": _train, "card": _card, "all": _all}
    steps[args.step](args)


if __name__ == "__main__":
    main()
