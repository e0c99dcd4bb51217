"""Held-out figures: main-model loss, MTP loss, MTP one-token-ahead accuracy and its agreement with the model."""

import math

import torch
import torch.nn.functional as F

from .mtp import mtp_logits


def windows(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping windows of seq_len + 2 tokens (input, next-token and token-after-next targets): [N, L+2]."""
    count = (tokens.numel() - 2) // seq_len
    if count == 0:
        raise ValueError(f"need more than {seq_len + 2} held-out tokens, have {tokens.numel()}")
    starts = torch.arange(count, device=tokens.device) * seq_len
    return tokens[starts[:, None] + torch.arange(seq_len + 2, device=tokens.device)]


@torch.no_grad()
def evaluate(model, mtp, tokens: torch.Tensor, seq_len: int, batch_size: int, autocast) -> dict:
    model.eval()
    mtp.eval()
    sums = dict.fromkeys(("loss", "mtp_loss", "accuracy", "mtp_accuracy", "mtp_agreement"), 0.0)
    count = 0
    for batch in windows(tokens, seq_len).split(batch_size):
        inputs, targets, targets2 = batch[:, :seq_len], batch[:, 1:seq_len + 1], batch[:, 2:]
        with autocast():
            hidden = model.model(input_ids=inputs, use_cache=False).last_hidden_state
            logits = model.lm_head(hidden).float()
            positions = torch.arange(1, seq_len + 1, device=batch.device)[None]
            draft = mtp_logits(model, mtp, hidden, targets, positions).float()
        main_next = logits.argmax(-1)  # [B, L]: the model's greedy choice for token i+1
        draft_ids = draft.argmax(-1)  # [B, L]: the MTP head's guess for token i+2
        sums["loss"] += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
        sums["mtp_loss"] += F.cross_entropy(draft.flatten(0, 1), targets2.flatten(), reduction="sum").item()
        sums["accuracy"] += (main_next == targets).sum().item()
        sums["mtp_accuracy"] += (draft_ids == targets2).sum().item()
        # Greedy speculative decoding keeps a draft when it equals the model's own next choice; the model's
        # choice for i+2 sits at position i+1, so compare draft[:, :-1] with main_next[:, 1:].
        sums["mtp_agreement"] += (draft_ids[:, :-1] == main_next[:, 1:]).float().mean(1).sum().item() * seq_len
        count += inputs.numel()
    model.train()
    mtp.train()
    result = {name: value / count for name, value in sums.items()}
    result["perplexity"] = math.exp(result["loss"])
    result["tokens"] = count
    return result
