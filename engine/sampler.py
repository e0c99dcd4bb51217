"""Turn one step's logits into tokens (and logprobs), request by request."""

import torch

from engine.sequence import Sequence


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """OpenAI-style presence/frequency penalties over each sequence's generated tokens."""
    for i, seq in enumerate(seqs):
        p = seq.params
        if (p.presence_penalty or p.frequency_penalty) and seq.output_token_ids:
            ids = torch.tensor(seq.output_token_ids, device=logits.device)
            counts = torch.bincount(ids, minlength=logits.shape[1]).to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask everything outside top-k and the top-p nucleus (1-D logits)."""
    if top_k > 0 and top_k < logits.shape[0]:
        kth = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token once the mass before it already reaches top_p (the top token always stays)
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


class Sampler:
    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[dict[int, float] | None]]:
        """logits: [B, vocab] float32 for the sequences that sample this step."""
        raw_logprobs = None
        if any(s.params.logprobs is not None for s in seqs):
            raw_logprobs = logits.log_softmax(dim=-1)
        logits = apply_penalties(logits, seqs)
        tokens: list[int] = []
        logprobs: list[dict[int, float] | None] = []
        greedy = logits.argmax(dim=-1).tolist()
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.is_greedy:
                token = greedy[i]
            else:
                row = _filter(logits[i] / p.temperature, p.top_k, p.top_p)
                probs = row.softmax(-1)
                token = int(torch.multinomial(probs.cpu(), 1, generator=seq.generator).item())
            tokens.append(token)
            if p.logprobs is None:
                logprobs.append(None)
                continue
            lp = raw_logprobs[i]
            entry = {token: float(lp[token])}
            if p.logprobs > 0:
                top = lp.topk(p.logprobs)
                for t, v in zip(top.indices.tolist(), top.values.tolist()):
                    entry.setdefault(t, v)
            logprobs.append(entry)
        return tokens, logprobs
