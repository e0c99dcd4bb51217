"""Tokenize the corpus into flat uint16 token streams (train.bin, heldout.bin) and the unigram baseline."""

import json
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from .corpus import read_records, record_text

BATCH = 2048


def _token_arrays(tokenizer: Tokenizer, path: Path) -> Iterator[np.ndarray]:
    texts: list[str] = []
    for record in read_records(path):
        texts.append(record_text(record))
        if len(texts) == BATCH:
            yield from _encode(tokenizer, texts)
            texts = []
    yield from _encode(tokenizer, texts)


def _encode(tokenizer: Tokenizer, texts: list[str]) -> Iterator[np.ndarray]:
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        yield np.asarray(encoding.ids, dtype=np.uint16)


def unigram_cross_entropy(train: np.ndarray, heldout: np.ndarray, vocab_size: int) -> float:
    """Held-out cross-entropy (nats/token) of add-one-smoothed training unigram frequencies."""
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + 1.0
    log_probs = np.log(counts / counts.sum())
    return float(-log_probs[heldout].mean())


def pack(corpus_dir: Path, tokenizer_dir: Path, out: Path) -> dict:
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    vocab_size = tokenizer.get_vocab_size()
    if vocab_size > np.iinfo(np.uint16).max:
        raise ValueError(f"vocabulary of {vocab_size} ids does not fit uint16 token files")
    out.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for split in ("train", "heldout"):
        arrays[split] = np.concatenate(list(_token_arrays(tokenizer, corpus_dir / f"{split}.jsonl")))
        arrays[split].tofile(out / f"{split}.bin")
    chars = sum(len(record_text(r)) for r in read_records(corpus_dir / "heldout.jsonl"))
    meta = {
        "vocab_size": vocab_size,
        "dtype": "uint16",
        "train_tokens": int(arrays["train"].size),
        "heldout_tokens": int(arrays["heldout"].size),
        "heldout_chars_per_token": chars / max(1, arrays["heldout"].size),
        "unigram_heldout_loss": unigram_cross_entropy(arrays["train"], arrays["heldout"], vocab_size),
    }
    meta["unigram_heldout_perplexity"] = math.exp(meta["unigram_heldout_loss"])
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta
