"""Tokenizer, chat template and incremental detokenization against the real DeepSeek-V3 tokenizer."""

import pytest
from transformers import AutoTokenizer

from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import ChatTemplateError, Tokenizer

TEXTS = [
    "Hello, world!",
    "DeepSeek-V3 は素晴らしい。你好，世界！",
    "emoji 🙂🚀👨‍👩‍👧 and flags 🇯🇵",
    "def f(x):\n    return x ** 2  # 平方\n",
    "  leading spaces and trailing  ",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi 🙂"}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "再来一次？"},
    ],
    [{"role": "system", "content": "A"}, {"role": "system", "content": "B"}, {"role": "user", "content": "x"}],
]


@pytest.fixture(scope="module")
def ours(deepseek_tokenizer_dir):
    return Tokenizer(deepseek_tokenizer_dir)


@pytest.fixture(scope="module")
def hf(deepseek_tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(deepseek_tokenizer_dir))


def test_special_tokens(ours):
    assert ours.bos_token_id == 0 and ours.eos_token_id == 1
    assert ours.encode("hi")[0] == 0  # DeepSeek's tokenizer_config asks for BOS
    assert ours.encode("hi", add_bos=False)[0] != 0


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_matches_transformers(ours, hf, text):
    ids = ours.encode(text, add_bos=False)
    assert ids == hf(text, add_special_tokens=False).input_ids
    assert ours.decode(ids) == text


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_renders_like_transformers(ours, hf, messages):
    text = ours.apply_chat_template(messages, add_generation_prompt=True)
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert ours.encode(text, add_bos=False) == expected_ids


def test_malformed_conversation_is_a_clear_error(ours):
    with pytest.raises(ChatTemplateError):
        ours.apply_chat_template([{"role": "user"}])  # no content


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenization_never_emits_half_a_character(ours, text):
    ids = ours.encode(text, add_bos=False)
    detok = IncrementalDetokenizer(ours, prompt_ids=[0])
    deltas = [detok.add(t) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == ours.decode(ids) == text


def test_an_output_cut_inside_a_character_still_ends_with_all_its_tokens(ours):
    """max_tokens may end an output inside a multi-byte character: the last delta is what the held
    bytes decode to (U+FFFD), not nothing, so the text covers every token, as a full decode does."""
    ids = ours.encode("🦙🦙 emoji 𝔘𝔫𝔦", add_bos=False)  # several tokens per character
    for cut in range(1, len(ids) + 1):
        detok = IncrementalDetokenizer(ours, prompt_ids=[0])
        text = "".join(detok.add(t) for t in ids[:cut]) + detok.flush()
        assert text == ours.decode(ids[:cut])
        assert detok.flush() == ""
