"""Train deepseek-tiny with transformers' DeepseekV3ForCausalLM plus our MTP layer, then export it."""

import contextlib
import json
import math
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from .evaluate import evaluate
from .export import published_state_dict, save_checkpoint
from .model_config import tiny_config
from .mtp import MTPLayer, mtp_logits


@dataclass(frozen=True)
class TrainSettings:
    seq_len: int = 1024
    batch_size: int = 96
    max_steps: int | None = None  # a fixed step count (to replay a run) ...
    time_budget_s: float | None = None  # ... or as many steps as fit, timed over the first probe_steps
    probe_steps: int = 30  # steps timed before the first plan (the first ones include warm-up)
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_weight: float = 0.3  # the V3 paper's lambda for the first 10T tokens
    bias_update_speed: float = 1e-3  # V3's gamma for auxiliary-loss-free balancing
    eval_every: int = 250
    eval_batch_size: int = 32
    eval_max_tokens: int | None = None  # None: all held-out tokens
    seed: int = 0


class ExpertLoad:
    """Counts the experts each router picks; after a step, nudges e_score_correction_bias towards balance."""

    def __init__(self, gates, speed: float):
        self.gates = list(gates)
        self.speed = speed
        self.counts = [torch.zeros(g.e_score_correction_bias.numel(), device=g.weight.device) for g in self.gates]
        for gate, counts in zip(self.gates, self.counts):
            gate.register_forward_hook(self._hook(counts))

    @staticmethod
    def _hook(counts: torch.Tensor):
        def record(module, args, output):
            if module.training:
                top_k_indices = output[2]
                counts.add_(torch.bincount(top_k_indices.flatten(), minlength=counts.numel()).float())
        return record

    @torch.no_grad()
    def update(self) -> float:
        """Apply the bias update; return the worst layer's max/mean load ratio of this step."""
        imbalance = 1.0
        for gate, counts in zip(self.gates, self.counts):
            gate.e_score_correction_bias += self.speed * torch.sign(counts.mean() - counts)
            imbalance = max(imbalance, (counts.max() / counts.mean().clamp(min=1)).item())
            counts.zero_()
        return imbalance


def build_model(config_fields: dict, seed: int, device: torch.device):
    """The main model (transformers' V3) and our MTP layer, freshly initialised."""
    torch.manual_seed(seed)
    config = DeepseekV3Config(**config_fields)
    config._attn_implementation = "sdpa"
    model = DeepseekV3ForCausalLM(config)
    # The eager experts loop runs under autocast with fp32 master weights on any device.
    model.set_experts_implementation("eager")
    mtp = MTPLayer(config)
    mtp.apply(model._init_weights)  # the same initialisation as the decoder layers it mirrors
    return model.to(device), mtp.to(device)


def _lr(step: int, total: int, s: TrainSettings) -> float:
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    progress = min(1.0, (step - s.warmup_steps) / max(1, total - s.warmup_steps))
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _optimizer(modules, s: TrainSettings, device: torch.device) -> torch.optim.Optimizer:
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": s.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=s.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def load_tokens(path: Path, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.fromfile(path, dtype=np.uint16).astype(np.int64)).to(device)


def train(data_dir: Path, tokenizer_dir: Path, out: Path, settings: TrainSettings, config: dict | None = None,
          log=print) -> dict:
    """Train, evaluate on held-out text, write out/checkpoint and out/metrics.json; return the metrics.

    `config` is the config.json of the model to train (default: deepseek-tiny's shape for this vocabulary).
    """
    s = settings
    if (s.max_steps is None) == (s.time_budget_s is None):
        raise ValueError("give exactly one of max_steps and time_budget_s")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" \
        else contextlib.nullcontext
    meta = json.loads((data_dir / "meta.json").read_text())
    train_tokens = load_tokens(data_dir / "train.bin", device)
    heldout_tokens = load_tokens(data_dir / "heldout.bin", device)[:s.eval_max_tokens]
    config = config or tiny_config(meta["vocab_size"], s.seq_len)
    model, mtp = build_model(config, s.seed, device)
    loads = ExpertLoad([layer.mlp.gate for layer in [*model.model.layers, mtp.block] if hasattr(layer.mlp, "gate")],
                       s.bias_update_speed)
    optimizer = _optimizer([model, mtp], s, device)
    generator = torch.Generator(device=device).manual_seed(s.seed)
    window = torch.arange(s.seq_len + 2, device=device)
    positions = torch.arange(s.seq_len, device=device)[None]

    total_steps = s.max_steps or 10**9
    history, recent, started = [], [], time.perf_counter()
    eval_seconds, step = 0.0, 0
    while step < total_steps:
        if s.time_budget_s is not None and step >= s.probe_steps and step % 10 == 0:
            # Re-plan from the mean training step time so far (evaluation time excluded).
            _synchronize(device)
            elapsed = time.perf_counter() - started
            per_step = (elapsed - eval_seconds) / step
            planned = step + int((s.time_budget_s - elapsed) / per_step)
            if step == s.probe_steps:
                log(f"step time {per_step * 1000:.0f} ms: planning {planned} steps")
            total_steps = max(step + 1, planned)
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, total_steps, s)
        starts = torch.randint(0, train_tokens.numel() - s.seq_len - 2, (s.batch_size,), device=device,
                               generator=generator)
        batch = train_tokens[starts[:, None] + window]  # [B, L+2]
        inputs, targets, targets2 = batch[:, :s.seq_len], batch[:, 1:s.seq_len + 1], batch[:, 2:]
        with autocast():
            hidden = model.model(input_ids=inputs, use_cache=False).last_hidden_state
            loss = F.cross_entropy(model.lm_head(hidden).float().flatten(0, 1), targets.flatten())
            # MTP positions follow the token whose embedding enters (as transformers does); RoPE is relative.
            draft = mtp_logits(model, mtp, hidden, targets, positions + 1)
            mtp_loss = F.cross_entropy(draft.float().flatten(0, 1), targets2.flatten())
        (loss + s.mtp_weight * mtp_loss).backward()
        torch.nn.utils.clip_grad_norm_([*model.parameters(), *mtp.parameters()], s.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        imbalance = loads.update()
        recent.append((loss.detach(), mtp_loss.detach()))
        step += 1
        if step % s.eval_every == 0 or step == total_steps:
            eval_started = time.perf_counter()
            train_loss = torch.stack([r[0] for r in recent[-50:]]).mean().item()
            train_mtp = torch.stack([r[1] for r in recent[-50:]]).mean().item()
            recent = recent[-50:]
            held = evaluate(model, mtp, heldout_tokens, s.seq_len, s.eval_batch_size, autocast)
            entry = {"step": step, "seconds": round(time.perf_counter() - started, 1), "train_loss": train_loss,
                     "train_mtp_loss": train_mtp, "heldout_loss": held["loss"], "heldout_mtp_loss": held["mtp_loss"],
                     "expert_imbalance": imbalance}
            history.append(entry)
            log(json.dumps(entry))
            # A checkpoint at every evaluation: a run cut short still leaves a usable model behind.
            save_checkpoint(published_state_dict(model, mtp), config, tokenizer_dir, out / "checkpoint")
            eval_seconds += time.perf_counter() - eval_started

    elapsed = time.perf_counter() - started - eval_seconds
    final = evaluate(model, mtp, heldout_tokens, s.seq_len, s.eval_batch_size, autocast)
    tensors = published_state_dict(model, mtp)
    save_checkpoint(tensors, config, tokenizer_dir, out / "checkpoint")
    metrics = {
        "settings": asdict(s),
        "steps": step,
        "tokens_seen": step * s.batch_size * s.seq_len,
        "train_seconds": round(elapsed, 1),  # evaluation and checkpoints excluded
        "epochs": step * s.batch_size * s.seq_len / meta["train_tokens"],
        "parameters": {
            "main": sum(p.numel() for p in model.parameters()),
            "mtp_layer": sum(p.numel() for p in mtp.parameters()),
            "stored": sum(t.numel() for t in tensors.values()),
        },
        "final_train_loss": history[-1]["train_loss"],
        "final_train_mtp_loss": history[-1]["train_mtp_loss"],
        "heldout": final,
        "data": meta,
        "history": history,
        "hardware": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics
