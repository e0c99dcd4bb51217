"""WordNet 3.0 database files (as Debian's wordnet-base installs them) -> synsets and first senses."""

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

POS_NAMES = {"noun": "noun", "verb": "verb", "adj": "adjective", "adv": "adverb"}


@dataclass(frozen=True)
class Synset:
    offset: int
    pos: str  # noun | verb | adjective | adverb
    lemmas: tuple[str, ...]
    definition: str
    examples: tuple[str, ...]


def _parse_data_line(line: str, pos: str) -> Synset:
    # "offset lex_filenum ss_type w_cnt(hex) word lex_id ... p_cnt ptrs... | gloss"
    head, _, gloss = line.partition(" | ")
    fields = head.split()
    word_count = int(fields[3], 16)
    lemmas = tuple(fields[4 + 2 * i].replace("_", " ") for i in range(word_count))
    # Adjective lemmas may carry a syntactic marker: "galore(ip)".
    lemmas = tuple(lemma.split("(")[0] for lemma in lemmas)
    parts = [part.strip() for part in gloss.strip().split(";")]
    definition = "; ".join(p for p in parts if p and not p.startswith('"'))
    examples = tuple(p.strip('"') for p in parts if p.startswith('"') and len(p) > 2)
    return Synset(int(fields[0]), pos, lemmas, definition, examples)


def read_synsets(root: Path) -> Iterator[Synset]:
    for suffix, pos in POS_NAMES.items():
        with open(root / f"data.{suffix}", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.startswith(" "):  # the license header lines start with two spaces
                    yield _parse_data_line(line.rstrip("\n"), pos)


def first_senses(root: Path) -> Iterator[tuple[str, Synset]]:
    """(lemma, its most frequent synset) for every lemma and part of speech, in index order."""
    synsets = {(s.pos, s.offset): s for s in read_synsets(root)}
    for suffix, pos in POS_NAMES.items():
        with open(root / f"index.{suffix}", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(" "):
                    continue
                # "lemma pos synset_cnt p_cnt [ptr...] sense_cnt tagsense_cnt offset..."
                fields = line.split()
                synset_count = int(fields[2])
                first_offset = int(fields[-synset_count])
                synset = synsets.get((pos, first_offset))
                if synset is not None:
                    yield fields[0].replace("_", " "), synset


def synset_text(synset: Synset) -> str:
    """A dictionary-style paragraph: 'word, other word (noun): definition. For example: "..."'."""
    text = f"{', '.join(synset.lemmas)} ({synset.pos}): {synset.definition}."
    if synset.examples:
        text += " For example: " + "; ".join(f'"{e}"' for e in synset.examples) + "."
    return text
