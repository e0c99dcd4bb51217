"""The offline text sources of the corpus: where each lives on a Debian machine, its license, and a reader."""

import gzip
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Document:
    source: str
    title: str
    text: str


@dataclass(frozen=True)
class Source:
    name: str
    provider: str  # the Debian package or Python distribution that ships it
    path: str
    license: str


PYTHON_DOCS = Source(
    "python-docs", "Debian python3.11-doc", "/usr/share/doc/python3.11/html/_sources",
    "PSF License Agreement (Python documentation)",
)
PYTHON_STDLIB = Source(
    "python-stdlib", "the running CPython's standard library", sysconfig.get_paths()["stdlib"],
    "PSF License Agreement",
)
WORDNET = Source(
    "wordnet", "Debian wordnet-base", "/usr/share/wordnet",
    "WordNet 3.0 license (Princeton University; permissive, BSD-style)",
)
JARGON = Source(
    "jargon-file", "Debian jargon-text", "/usr/share/doc/jargon-text/jargon.txt.gz",
    "public domain (The Jargon File 4.4.7)",
)
ALL_SOURCES = (PYTHON_DOCS, PYTHON_STDLIB, WORDNET, JARGON)

# Sphinx markup that only makes sense to Sphinx: `:func:`json.dumps`` -> `json.dumps`.
_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`~?([^`<]*?)(?:\s*<[^>]*>)?`")
_DIRECTIVE_NOISE = re.compile(r"^\.\. (index|_[^:]*|highlight|testsetup|testcleanup|toctree|only|sectionauthor|moduleauthor)\b")
_SKIP_STDLIB_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3",
                     "ensurepip", "turtledemo", "pydoc_data"}


def require(source: Source) -> Path:
    path = Path(source.path)
    if not path.exists():
        raise FileNotFoundError(f"{source.name}: {path} is missing; install {source.provider} first")
    return path


def clean_rst(text: str) -> str:
    """Keep the prose and examples of a reST page, drop Sphinx-only markup."""
    lines = [line for line in text.splitlines() if not _DIRECTIVE_NOISE.match(line)]
    text = _ROLE.sub(r"``\1``", "\n".join(lines))
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def read_python_docs(max_bytes: int) -> Iterator[Document]:
    root = require(PYTHON_DOCS)
    total = 0
    for path in sorted(root.rglob("*.rst.txt")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("whatsnew/", "c-api/", "distutils/", "includes/")):
            continue  # changelogs and the C API say little a small model can use
        text = clean_rst(path.read_text(encoding="utf-8", errors="replace"))
        if len(text) < 200:
            continue
        total += len(text)
        if total > max_bytes:
            return
        yield Document(PYTHON_DOCS.name, rel.removesuffix(".rst.txt"), text)


def iter_stdlib_files() -> Iterator[Path]:
    root = require(PYTHON_STDLIB)
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if any(part in _SKIP_STDLIB_DIRS or part.startswith(("test_", "config-")) for part in rel):
            continue
        yield path


def read_stdlib(max_bytes: int) -> Iterator[Document]:
    root = Path(PYTHON_STDLIB.path)
    total = 0
    for path in iter_stdlib_files():
        text = path.read_text(encoding="utf-8", errors="replace").strip()
        if not 200 <= len(text) <= 200_000:
            continue
        total += len(text)
        if total > max_bytes:
            return
        yield Document(PYTHON_STDLIB.name, path.relative_to(root).as_posix(), text)


def read_jargon() -> Iterator[Document]:
    """One document per Jargon File entry: "headword: part of speech" then its text."""
    path = require(JARGON)
    text = gzip.decompress(path.read_bytes()).decode("utf-8", errors="replace")
    lines = [line.strip() for line in text.splitlines()]
    # An entry starts with a line like ":baroque: adj."; {braces} mark cross-references.
    starts = [i for i, line in enumerate(lines) if re.fullmatch(r":[^:]{1,60}:.*", line)]
    for begin, end in zip(starts, starts[1:] + [len(lines)]):
        head = lines[begin][1:]
        body = re.sub(r"\n{3,}", "\n\n", "\n".join(lines[begin + 1:end])).strip()
        entry = re.sub(r"[{}]", "", f"{head}\n\n{body}")
        if len(body) >= 40:
            yield Document(JARGON.name, head.split(":", 1)[0], entry)
