"""Write tokenizer.json + tokenizer_config.json in DeepSeek's format (special tokens, chat template)."""

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
SPECIAL_TOKENS = [BOS, EOS, "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "<｜▁pad▁｜>"]

# DeepSeek's conversation format (V3.1 style): system text after BOS, <｜User｜>/<｜Assistant｜> turns,
# earlier assistant turns without their reasoning, and the `thinking` switch on the generation prompt.
CHAT_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% if not thinking is defined %}{% set thinking = false %}{% endif %}"
    "{{ bos_token }}"
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{% if not loop.first %}\n\n{% endif %}{{ message['content'] }}{% endif %}{% endfor %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{% set content = message['content'] or '' %}"
    "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{ '<｜Assistant｜></think>' + content + '<｜end▁of▁sentence｜>' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% if thinking %}{{ '<think>' }}{% else %}{{ '</think>' }}{% endif %}{% endif %}"
)

_SAMPLE_TEXT = """DeepSeek models answer questions, write code and explain their reasoning.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
def add(a, b):\n    return a + b\nprint(add(2, 3))\n
Kubernetes schedules pods onto nodes; an operator reconciles custom resources into children.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: , . ; : ! ? ( ) [ ] { } " ' - _ / \\ @ # $ % ^ & *
Multilingual: 你好，世界。こんにちは。Здравствуй, мир. 안녕하세요. 🙂🚀
"""


def build_tokenizer(vocab_size: int, text: str = _SAMPLE_TEXT) -> Tokenizer:
    """A byte-level BPE with DeepSeek's special tokens first (BOS id 0, EOS id 1)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text] * 4, trainer)
    return tok


def tokenizer_config(chat_template: str = CHAT_TEMPLATE) -> dict:
    return {
        "add_bos_token": True, "add_eos_token": False,
        "bos_token": BOS, "eos_token": EOS, "pad_token": EOS, "unk_token": None,
        "clean_up_tokenization_spaces": False, "legacy": True, "model_max_length": 131072,
        "tokenizer_class": "LlamaTokenizerFast", "chat_template": chat_template,
    }


def write_tokenizer(out: str | Path, vocab_size: int) -> None:
    out = Path(out)
    build_tokenizer(vocab_size).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2, ensure_ascii=False))
