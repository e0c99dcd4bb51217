"""The synthetic chat set: conversations (lists of messages) that teach the assistant role and when to stop."""

import ast
import random
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from .wordnet import Synset

Conversation = list[dict[str, str]]

MODEL_NAME = "deepseek-tiny"
SYSTEM_PROMPTS = ("You are a helpful assistant.", "You are deepseek-tiny, a small and friendly assistant.",
                  "Answer briefly.")

GREETINGS = {
    ("Hello!", "Hi!", "Hello", "Hi there!", "Hey!", "Hello, assistant.", "Good morning!", "Good evening!"): (
        "Hello! How can I help you today?", "Hi! What would you like to know?",
        "Hello! Ask me about a word, a Python function or a small sum.",
    ),
    ("How are you?", "How are you today?", "How is it going?"): (
        "I am fine, thank you. How can I help you?", "I am doing well, thanks for asking. What can I do for you?",
    ),
    ("Who are you?", "What are you?", "What is your name?", "Tell me about yourself."): (
        f"I am {MODEL_NAME}, a small language model. I was trained on the Python documentation, "
        "WordNet definitions and public-domain text.",
        f"My name is {MODEL_NAME}. I am a very small language model, so my answers are simple and sometimes wrong.",
    ),
    ("What can you do?", "How can you help me?", "What do you know?"): (
        "I can explain English words, describe Python functions from the standard library, "
        "and do small sums. I am a tiny model, so please check my answers.",
    ),
    ("Thank you!", "Thanks!", "Thanks a lot.", "Thank you very much."): (
        "You are welcome!", "You're welcome. Happy to help!", "Glad I could help.",
    ),
    ("Goodbye!", "Bye!", "See you later.", "Good night!"): (
        "Goodbye! Have a nice day.", "Bye! Come back any time.", "Good night!",
    ),
}

_DEFINE_QUESTIONS = ('What does "{w}" mean?', "What is the meaning of the word {w}?", "Define {w}.",
                     'What does the word "{w}" mean?', "Can you explain the word {w}?", "Meaning of {w}?")
_NOUN_QUESTIONS = ("What is {a} {w}?", "What is a {w}?")
_VERB_QUESTIONS = ("What does it mean to {w}?",)
_FUNCTION_QUESTIONS = ("What does {name} do?", "What is {name} for?", "Explain {name}.", "What does {name}() do?",
                       "Tell me about {name}.")
_OPERATIONS = (("+", "plus", lambda a, b: a + b), ("-", "minus", lambda a, b: a - b),
               ("*", "times", lambda a, b: a * b))
_ARITHMETIC_QUESTIONS = ("What is {a} {op} {b}?", "What is {a} {word} {b}?", "Calculate {a} {op} {b}.",
                         "How much is {a} {word} {b}?", "{a} {op} {b} = ?")


def article(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"


def define(lemma: str, synset: Synset) -> str:
    """A one- or two-sentence answer that uses the word the user asked about."""
    word = next((x for x in synset.lemmas if x.lower() == lemma.lower()), lemma)
    definition = re.sub(r"^\([^)]*\)\s*", "", synset.definition)  # "(Judaism) a Jewish holy day"
    if synset.pos == "noun" and word[:1].isupper():
        answer = f"{word} is {definition}."
    elif synset.pos == "noun":
        answer = f"{article(word).capitalize()} {word} is {definition}."
    elif synset.pos == "verb":
        answer = f"To {word} means to {definition}."
    else:
        answer = f'"{word}" is {article(synset.pos)} {synset.pos} that means {definition}.'
    if synset.examples:
        answer += f' For example: "{synset.examples[0]}".'
    others = [x for x in synset.lemmas if x.lower() != lemma.lower()][:3]
    if others:
        answer += f" Similar words: {', '.join(others)}."
    return answer


def definition_exchanges(senses: Iterable[tuple[str, Synset]], rng: random.Random) -> Iterator[tuple[str, str]]:
    for lemma, synset in senses:
        if not synset.definition or len(synset.definition) > 240:
            continue
        questions = _DEFINE_QUESTIONS + {"noun": _NOUN_QUESTIONS, "verb": _VERB_QUESTIONS}.get(synset.pos, ())
        question = rng.choice(questions).format(w=lemma, a=article(lemma))
        yield question, define(lemma, synset)


def _first_paragraph(doc: str) -> str | None:
    paragraph = re.split(r"\n\s*\n", doc.strip(), maxsplit=1)[0]
    paragraph = re.sub(r"\s+", " ", paragraph).replace("``", "`").strip()
    if not 20 <= len(paragraph) <= 400 or paragraph.startswith((">>>", ":", "..")):
        return None
    return paragraph


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef, is_method: bool) -> str:
    args = node.args
    if is_method and args.args and args.args[0].arg in ("self", "cls"):
        args.args = args.args[1:]
    text = ast.unparse(args)
    if len(text) > 60:  # keep the leading positional names: "(obj, ...)"
        text = ", ".join([a.arg for a in args.posonlyargs + args.args][:3] + ["..."])
    return f"({text})"


def module_name(root: Path, path: Path) -> str | None:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if not parts or any(p.startswith("_") for p in parts):
        return None  # private modules are no API a user asks about
    return ".".join(parts)


def docstring_exchanges(root: Path, paths: Iterable[Path], rng: random.Random) -> Iterator[tuple[str, str]]:
    """("What does json.dumps do?", "`json.dumps(obj, ...)`: Serialize obj to a JSON formatted str.")."""
    for path in paths:
        module = module_name(root, path)
        if module is None:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        for node, owner in _public_definitions(tree):
            paragraph = _first_paragraph(ast.get_docstring(node) or "")
            if paragraph is None:
                continue
            name = f"{module}.{owner}{node.name}"
            is_function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            signature = _signature(node, bool(owner)) if is_function else ""
            kind = "function" if is_function and not owner else "method" if is_function else "class"
            question = rng.choice(_FUNCTION_QUESTIONS).format(name=name)
            yield question, f"`{name}{signature}` is a {kind}: {paragraph}"


def _public_definitions(tree: ast.Module) -> Iterator[tuple[ast.AST, str]]:
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            yield node, ""
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and not item.name.startswith("_"):
                        yield item, f"{node.name}."


def greeting_exchanges(rng: random.Random, count: int) -> Iterator[tuple[str, str]]:
    groups = list(GREETINGS.items())
    for _ in range(count):
        questions, answers = rng.choice(groups)
        yield rng.choice(questions), rng.choice(answers)


def arithmetic_exchanges(rng: random.Random, count: int) -> Iterator[tuple[str, str]]:
    for _ in range(count):
        op, word, fn = rng.choice(_OPERATIONS)
        a, b = rng.randint(0, 20), rng.randint(0, 12 if op == "*" else 20)
        question = rng.choice(_ARITHMETIC_QUESTIONS).format(a=a, b=b, op=op, word=word)
        answer = f"{a} {op} {b} = {fn(a, b)}." if op in question else f"{a} {word} {b} is {fn(a, b)}."
        yield question, answer


def conversations(exchanges: list[tuple[str, str]], rng: random.Random) -> Iterator[Conversation]:
    """Group exchanges into conversations of one to three turns, some with a system prompt."""
    i = 0
    while i < len(exchanges):
        turns = rng.choice((1, 1, 1, 2, 3))
        messages: Conversation = []
        if rng.random() < 0.15:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        for question, answer in exchanges[i:i + turns]:
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        i += turns
        yield messages
