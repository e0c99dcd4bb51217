"""A byte-level BPE tokenizer in DeepSeek-V3's format: its special tokens, BOS 0 / EOS 1, its chat template."""

import functools
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
USER, ASSISTANT, THINK, END_THINK = "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"
# Appended after the BPE vocabulary, in DeepSeek-V3.1's order; special=True only where V3.1 has it.
ADDED_TOKENS = (
    ("<｜search▁begin｜>", False), ("<｜search▁end｜>", False), (THINK, False), (END_THINK, False),
    ("<｜fim▁hole｜>", False), ("<｜fim▁begin｜>", False), ("<｜fim▁end｜>", False), (USER, False),
    (ASSISTANT, False), ("<|EOT|>", True), ("<｜tool▁calls▁begin｜>", False), ("<｜tool▁calls▁end｜>", False),
    ("<｜tool▁call▁begin｜>", False), ("<｜tool▁call▁end｜>", False), ("<｜tool▁outputs▁begin｜>", False),
    ("<｜tool▁outputs▁end｜>", False), ("<｜tool▁output▁begin｜>", False), ("<｜tool▁output▁end｜>", False),
    ("<｜tool▁sep｜>", False),
)
_ALL_SPECIAL = re.compile("|".join(re.escape(t) for t in (BOS, EOS, PAD, *(t for t, _ in ADDED_TOKENS))))

# DeepSeek-V3's pre-tokenizer: digits in groups of up to three, CJK runs, then a GPT-style word split.
_SPLITS = (
    r"\p{N}{1,3}",
    "[一-龥\u3040-ゟ゠-ヿ]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
)

# DeepSeek-V3.1's published chat template, verbatim: non-thinking answers open with </think>.
CHAT_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% if not thinking is defined %}{% set thinking = false %}{% endif %}"
    "{% set ns = namespace(is_first=false, is_tool=false, system_prompt='', is_first_sp=true, is_last_user=false) %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}"
    "{% set ns.system_prompt = ns.system_prompt + message['content'] %}"
    "{% set ns.is_first_sp = false %}{%- else %}"
    "{% set ns.system_prompt = ns.system_prompt + '\n\n' + message['content'] %}{%- endif %}"
    "{%- endif %}{%- endfor %}{{ bos_token }}{{ ns.system_prompt }}{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}"
    "{%- set ns.is_first = false -%}"
    "{%- set ns.is_last_user = true -%}{{'<｜User｜>' + message['content']}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] is not none %}"
    "{%- if ns.is_last_user %}{{'<｜Assistant｜></think>'}}{%- endif %}"
    "{%- set ns.is_last_user = false -%}{%- set ns.is_first = false %}{%- set ns.is_tool = false -%}"
    "{%- for tool in message['tool_calls'] %}{%- if not ns.is_first %}"
    "{%- if message['content'] is none %}{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}"
    "{%- else %}{{message['content'] + '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}"
    "{%- endif %}{%- set ns.is_first = true -%}"
    "{%- else %}{{'<｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}"
    "{%- endif %}{%- endfor %}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and (message['tool_calls'] is not defined or message['tool_calls'] is none) %}"
    "{%- if ns.is_last_user %}{{'<｜Assistant｜>'}}"
    "{%- if message['prefix'] is defined and message['prefix'] and thinking %}{{'<think>'}}  "
    "{%- else %}{{'</think>'}}{%- endif %}{%- endif %}{%- set ns.is_last_user = false -%}"
    "{%- if ns.is_tool %}{{message['content'] + '<｜end▁of▁sentence｜>'}}"
    "{%- set ns.is_tool = false -%}{%- else %}{%- set content = message['content'] -%}"
    "{%- if '</think>' in content %}{%- set content = content.split('</think>', 1)[1] -%}"
    "{%- endif %}{{content + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}"
    "{%- if message['role'] == 'tool' %}{%- set ns.is_last_user = false -%}"
    "{%- set ns.is_tool = true -%}{{'<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}"
    "{%- endif %}{%- endfor -%}"
    "{%- if add_generation_prompt and ns.is_last_user and not ns.is_tool %}{{'<｜Assistant｜>'}}"
    "{%- if not thinking %}{{'</think>'}}{%- else %}{{'<think>'}}{%- endif %}{% endif %}"
)


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    splits = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in _SPLITS]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def plain_segments(texts: Iterable[str]) -> Iterator[str]:
    """Text between special-token strings: BPE merges must never learn across them."""
    for text in texts:
        yield from (part for part in _ALL_SPECIAL.split(text) if part)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train BPE so that BPE + specials + added tokens fill exactly `vocab_size` ids."""
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    # V3 ships a byte-level post-processor that adds no BOS: add_bos_token in tokenizer_config.json asks for it.
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(ADDED_TOKENS),
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in (BOS, EOS, PAD)],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(plain_segments(texts), trainer=trainer)
    for content, special in ADDED_TOKENS:
        tokenizer.add_tokens([AddedToken(content, special=special, normalized=not special)])
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"the corpus holds too few repeated pairs for {vocab_size} ids "
                         f"(BPE stopped at {tokenizer.get_vocab_size()}): give it more text or a smaller vocabulary")
    assert tokenizer.token_to_id(BOS) == 0 and tokenizer.token_to_id(EOS) == 1
    return tokenizer


def tokenizer_config(max_len: int) -> dict:
    def token(content: str) -> dict:
        return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": True,
                "rstrip": False, "single_word": False}

    return {
        "add_bos_token": True, "add_eos_token": False, "bos_token": token(BOS), "eos_token": token(EOS),
        "pad_token": token(EOS), "clean_up_tokenization_spaces": False, "legacy": True,
        "model_max_length": max_len, "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tokenizer: Tokenizer, out: Path, max_len: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = json.dumps(tokenizer_config(max_len), indent=2, ensure_ascii=False)
    (out / "tokenizer_config.json").write_text(config + "\n", encoding="utf-8")


@functools.cache
def _compiled_template():
    # The same jinja settings transformers and the engine render chat templates with.
    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(CHAT_TEMPLATE)


def render_chat(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The conversation as the model sees it (it starts with BOS: encode without adding another)."""
    return _compiled_template().render(messages=messages, add_generation_prompt=add_generation_prompt,
                           bos_token=BOS, eos_token=EOS)
