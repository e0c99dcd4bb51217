"""The model card (README.md beside the weights), written from metrics.json, the corpus manifest and samples."""

import json
import shlex
import subprocess
import sys
from pathlib import Path

SAMPLE_PROMPTS = (
    "Hello!",
    "Who are you?",
    "What does json.dumps do?",
    'What does "ephemeral" mean?',
    "What is a volcano?",
    "What is 7 plus 5?",
    "What does os.path.join do?",
    "Thank you!",
)
MAX_NEW_TOKENS = 64


def generate_command(prompts=SAMPLE_PROMPTS) -> list[str]:
    """`deepseek-engine generate` arguments that answer each prompt greedily through the chat template."""
    args = ["generate", "--chat", "--max-tokens", str(MAX_NEW_TOKENS)]
    for prompt in prompts:
        args += ["--prompt", prompt]
    return args


def engine_samples(checkpoint: Path, prompts=SAMPLE_PROMPTS) -> str:
    """The engine CLI's own output for the sample prompts (timing lines dropped: they vary by machine)."""
    command = [sys.executable, "-m", "engine.cli", *generate_command(prompts), "--model", str(checkpoint)]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return "\n".join(line for line in result.stdout.strip().splitlines() if " tokens in " not in line).strip()


def _loss_table(metrics: dict) -> str:
    held, data = metrics["heldout"], metrics["data"]
    rows = [
        ("training loss (mean of the last 50 steps)", f"{metrics['final_train_loss']:.3f}"),
        ("held-out loss", f"{held['loss']:.3f} (perplexity {held['perplexity']:.1f})"),
        ("unigram baseline on the same held-out tokens", f"{data['unigram_heldout_loss']:.3f} "
         f"(perplexity {data['unigram_heldout_perplexity']:.0f})"),
        ("held-out next-token accuracy (greedy)", f"{held['accuracy']:.1%}"),
        ("MTP held-out loss (token after next)", f"{held['mtp_loss']:.3f}"),
        ("MTP one-token-ahead accuracy (token after next, vs. the text)", f"{held['mtp_accuracy']:.1%}"),
        ("MTP draft = the model's own greedy next token (greedy acceptance)", f"{held['mtp_agreement']:.1%}"),
    ]
    return "| figure (losses in nats per token) | value |\n|---|---|\n" + "\n".join(f"| {a} | {b} |" for a, b in rows)


def _data_table(manifest: dict, data: dict) -> str:
    lines = ["| source | from | license |", "|---|---|---|"]
    lines += [f"| {s['name']} | {s['provider']} | {s['license']} |" for s in manifest["sources"]]
    docs = manifest["documents"]
    lines += ["", "| part | train documents | held-out documents | characters (chats as JSON) |", "|---|---|---|---|"]
    lines += [f"| {name} | {d['train']} | {d['heldout']} | {d['chars']:,} |" for name, d in sorted(docs.items())]
    lines += ["", f"{data['train_tokens']:,} training tokens, {data['heldout_tokens']:,} held-out tokens "
              f"({data['heldout_chars_per_token']:.2f} characters per token)."]
    return "\n".join(lines)


def render_card(metrics: dict, manifest: dict, config: dict, samples: str) -> str:
    s = metrics["settings"]
    params = metrics["parameters"]
    command = shlex.join(["deepseek-engine", *generate_command()])
    examples = f"```\n$ {command}\n{samples}\n```"
    history = "\n".join(f"| {h['step']} | {h['train_loss']:.3f} | {h['heldout_loss']:.3f} | "
                        f"{h['heldout_mtp_loss']:.3f} |" for h in metrics["history"])
    return TEMPLATE.format(
        main=params["main"], mtp=params["mtp_layer"], stored=params["stored"], stored_mb=params["stored"] * 2 / 1e6,
        c=config, steps=metrics["steps"], tokens=metrics["tokens_seen"], epochs=metrics["epochs"],
        seconds=metrics["train_seconds"], hardware=metrics["hardware"], versions=metrics["versions"], s=s,
        loss_table=_loss_table(metrics), data_table=_data_table(manifest, metrics["data"]), examples=examples,
        history=history, seed=manifest["seed"], python=manifest["python"], max_new=MAX_NEW_TOKENS,
    )


def write_card(workdir: Path, checkpoint: Path) -> None:
    metrics = json.loads((workdir / "metrics.json").read_text())
    manifest = json.loads((workdir / "corpus" / "manifest.json").read_text())
    config = json.loads((checkpoint / "config.json").read_text())
    text = render_card(metrics, manifest, config, engine_samples(checkpoint))
    (checkpoint / "README.md").write_text(text)


TEMPLATE = """# deepseek-tiny

The engine's embedded default model: a DeepSeek-V3-architecture model of {main:,} parameters plus a
{mtp:,}-parameter multi-token-prediction (MTP) layer, trained from scratch on permissively licensed text
that ships in Debian and Python packages. It answers simple chat questions in short, readable English and
stops by itself. It is a demo and a test fixture, not an assistant to rely on.

## What it is

| | |
|---|---|
| architecture | `DeepseekV3ForCausalLM` (HF format, published DeepSeek-V3 weight names) |
| layers | {c[num_hidden_layers]} ({c[first_k_dense_replace]} dense, then MoE) + 1 MTP layer stored as `model.layers.{c[num_hidden_layers]}.*` |
| hidden size | {c[hidden_size]}, dense FFN {c[intermediate_size]} |
| attention | MLA: {c[num_attention_heads]} heads, q_lora_rank {c[q_lora_rank]}, kv_lora_rank {c[kv_lora_rank]}, qk_nope {c[qk_nope_head_dim]} + qk_rope {c[qk_rope_head_dim]}, v {c[v_head_dim]}; RoPE theta {c[rope_theta]:g}, no YaRN |
| MoE | {c[n_routed_experts]} routed experts (top-{c[num_experts_per_tok]}, intermediate {c[moe_intermediate_size]}) + {c[n_shared_experts]} shared; sigmoid scores, `e_score_correction_bias` (noaux_tc), {c[n_group]} groups / top-{c[topk_group]} groups, normalised top-k, routed_scaling_factor {c[routed_scaling_factor]} |
| vocabulary | {c[vocab_size]} ids: byte-level BPE with DeepSeek-V3's pre-tokenizer, BOS 0, EOS 1, V3.1's added tokens and chat template |
| context | {c[max_position_embeddings]} tokens (the training length) |
| weights | {stored:,} stored values in bf16 (`e_score_correction_bias` in fp32), {stored_mb:.1f} MB, sharded safetensors |

The MTP layer follows DeepSeek-V3: `eh_proj([enorm(embed(t[i+1])); hnorm(h[i])])` -> one MoE decoder block ->
`shared_head.norm` -> `shared_head.head`, where `h[i]` is the main model's final hidden state after its last
norm (as vLLM, SGLang and transformers' MTP drafting feed it). Embedding and head are shared with the main
model in training; the checkpoint stores copies under the MTP prefix, as DeepSeek does.

## Data

{data_table}

The synthetic chats are rendered with the chat template: WordNet first senses as definitions, the first
paragraph of public standard-library docstrings as "what does `json.dumps` do?", greetings and questions
about the model itself, and sums, differences and products of small numbers. Text documents are wrapped
in BOS ... EOS; chats carry EOS after every answer, which is how the model learned to stop.
Corpus seed {seed}; the standard-library text and docstrings are those of Python {python}.

## Training

{steps:,} steps of {s[batch_size]} x {s[seq_len]} tokens ({tokens:,} tokens, {epochs:.1f} passes over the
training tokens) in {seconds:.0f} s on one {hardware} (torch {versions[torch]}, transformers
{versions[transformers]}). AdamW (betas 0.9/0.95, weight decay {s[weight_decay]}), peak learning rate {s[lr]},
{s[warmup_steps]} warm-up steps, cosine decay to {s[min_lr_ratio]} of the peak, gradient clipping {s[grad_clip]},
bf16 autocast over fp32 weights. Loss: next-token cross-entropy + {s[mtp_weight]} x the MTP layer's cross-entropy on
the token after next. Experts are balanced without an auxiliary loss, as in V3: after each step every router's
`e_score_correction_bias` moves by {s[bias_update_speed]} towards under-used experts.

The held-out set is 1 % of the documents of every part, chosen by a hash of the document, so it measures
generalisation within these sources (mostly templated definitions and dictionary text), not on open text.
The unigram baseline predicts every token by its training frequency. Held-out loss still fell at the end.

{loss_table}

| step | training loss | held-out loss | held-out MTP loss |
|---|---|---|---|
{history}

## Examples

The engine's command line with its default model (this one), greedy decoding (temperature 0) of each
prompt through the chat template, at most {max_new} new tokens; `finish_reason=stop` means the model ended
its answer with EOS. `python -m engine.tools.tiny card --out DIR` runs the same command on DIR/checkpoint
to write this section. transformers' `AutoModelForCausalLM` gives the same greedy tokens
(`tests/engine/test_tiny_model.py`).

{examples}

## What it can and cannot do

- It can: greet, say what it is, define many common English words in a WordNet-like sentence, paraphrase
  the one-line summary of many standard-library functions, add, subtract and multiply small numbers
  (often), and end its answer with EOS.
- It cannot: hold facts beyond its small corpus, reason, follow complex instructions, write working code,
  or stay on topic over long answers. Definitions of rare words and docstrings are often mixed up or made
  up. It was never trained with thinking (`<think>`) content, tools or a context longer than
  {s[seq_len]} tokens.
- Use it to see the engine work end to end on a laptop, to test the serving path, and to measure
  speculative decoding with a real MTP head.

## Reproduce

```
apt-get install python3.11-doc wordnet-base jargon-text
python -m engine.tools.tiny all --out DIR --minutes 6      # on one GPU; --steps N replays a step count
cp DIR/checkpoint/* engine/models/deepseek-tiny/
```

Licenses: the weights are derived from the sources above (PSF License, WordNet 3.0 license, public domain);
the recipe is part of this project.
"""
