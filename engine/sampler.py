"""Turn one step's logits into tokens (and logprobs).

On a GPU the sampled rows are drawn together on the device (`draw_on_device`: temperature, top-k and
top-p as tensor ops over the batch, then one Gumbel-max launch), and the step's tokens come back in one
copy. Drawing row by row on the host instead copies each row's probabilities over (~0.5 MB for
DeepSeek's 129k vocabulary) and runs a multinomial per request: milliseconds per request per step.
The noise is keyed by (the request's seed, its output position), so a seeded request draws the same
noise whatever else shares its batches (its tokens repeat as far as its logits do: a batch's size can
change the kernels that compute them). On CPU rows are drawn one by one from each request's generator
by inverse transform (the same distribution, another random stream).
"""

import torch

from engine.sequence import Sequence

_MASK64 = (1 << 64) - 1


def noise_key(seed: int, position: int) -> int:
    """A 63-bit key per (seed, output position): splitmix64 of the pair, so nearby seeds and positions
    give unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def draw_inverse_cdf(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from a probability row by inverse transform: a uniform number scaled to the row's mass,
    located in its running sum. 20x faster than torch.multinomial over a 129k vocabulary on CPU (0.1
    vs 2 ms); `right=True` never lands on a zero-probability token."""
    cdf = probs.double().cumsum(0)
    u = torch.rand(1, generator=generator, dtype=torch.float64) * cdf[-1]
    i = int(torch.searchsorted(cdf, u, right=True))
    if i >= probs.shape[0] or probs[i] <= 0:  # u rounded up to the total: the last token with mass
        i = int(probs.nonzero()[-1])
    return i


def filter_rows(scaled: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """[R, V] logits already divided by their temperature -> the same with everything outside each row's
    top-k (ties with the k-th value kept; 0 = off) and top-p nucleus at -inf (a token is dropped once
    the mass before it reaches top_p, so the top token always stays)."""
    rows, vocab = scaled.shape
    dev = scaled.device
    sorted_vals, order = scaled.sort(dim=-1, descending=True, stable=True)  # ties in index order everywhere
    k = torch.tensor([t if 0 < t < vocab else vocab for t in top_k]).to(dev, non_blocking=True)
    kth = sorted_vals.gather(1, (k - 1)[:, None])  # ties with the k-th value stay
    sorted_vals = sorted_vals.masked_fill(sorted_vals < kth, float("-inf"))
    probs = sorted_vals.softmax(-1)
    # top_p 1 is off: rounding in a 129k-long running sum must not drop the tail
    p = torch.tensor([q if q < 1.0 else float("inf") for q in top_p], dtype=probs.dtype).to(dev, non_blocking=True)
    drop = probs.cumsum(-1) - probs >= p[:, None]
    drop[:, 0] = False  # the top token always stays, however small top_p (it may round to 0 in float32)
    return scaled.scatter(1, order, sorted_vals.masked_fill(drop, float("-inf")))


def scaled_and_filtered(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Rows [R, V] of sequences that sample -> logits / temperature, outside top-k / top-p at -inf."""
    # host -> device copies of small per-row values: asynchronous, so the step's queue is never waited on
    temps = torch.tensor([s.params.temperature for s in seqs], dtype=logits.dtype).to(logits.device,
                                                                                      non_blocking=True)
    scaled = logits / temps[:, None]
    vocab = logits.shape[1]
    if any(0 < s.params.top_k < vocab or s.params.top_p < 1.0 for s in seqs):
        scaled = filter_rows(scaled, [s.params.top_k for s in seqs], [s.params.top_p for s in seqs])
    return scaled


def draw_on_device(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """One token per row of logits [R, V] (float32) for sequences that sample (temperature > 0), drawn
    on logits' device in one launch -> [R] int64 there."""
    from engine.kernels.sampling import sample  # first use: Triton picks compiled or interpreted then

    dev = logits.device
    scaled = scaled_and_filtered(logits, seqs)
    keys = torch.tensor([noise_key(s.seed, len(s.output_token_ids)) for s in seqs],
                        dtype=torch.int64).to(dev, non_blocking=True)
    ones = torch.ones(len(seqs), dtype=torch.float32, device=dev)  # temperature is applied above
    return sample(scaled.contiguous(), ones, keys, torch.zeros(1, dtype=torch.int64, device=dev))


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """OpenAI-style presence/frequency penalties over each sequence's generated tokens."""
    for i, seq in enumerate(seqs):
        p = seq.params
        if (p.presence_penalty or p.frequency_penalty) and seq.output_token_ids:
            ids = torch.tensor(seq.output_token_ids, device=logits.device)
            counts = torch.bincount(ids, minlength=logits.shape[1]).to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


class Sampler:
    def __init__(self, on_device: bool = False):
        self.on_device = on_device  # draw sampled rows with `draw_on_device` (where the Triton kernels run)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[dict[int, float] | None]]:
        """logits: [B, vocab] float32 for the sequences that sample this step."""
        raw_logprobs = None
        if any(s.params.logprobs is not None for s in seqs):
            raw_logprobs = logits.log_softmax(dim=-1)
        logits = apply_penalties(logits, seqs)
        logprobs: list[dict[int, float] | None] = []
        drawn = [i for i, seq in enumerate(seqs) if not seq.params.is_greedy]
        if drawn and self.on_device and len(drawn) == len(seqs):
            chosen = draw_on_device(logits, seqs)  # every row samples: no argmax needed
            drawn = []
        else:
            chosen = logits.argmax(dim=-1)
        if drawn and self.on_device:
            rows = torch.tensor(drawn).to(logits.device, non_blocking=True)
            chosen[rows] = draw_on_device(logits.index_select(0, rows), [seqs[i] for i in drawn])
            drawn = []
        tokens: list[int] = chosen.tolist()  # the step's one device -> host copy
        if drawn:  # on CPU: filtered together, then drawn row by row from each request's generator
            probs = scaled_and_filtered(logits[drawn], [seqs[i] for i in drawn]).softmax(-1)
            for row, i in zip(probs, drawn):
                tokens[i] = draw_inverse_cdf(row, seqs[i].generator)
        for i, seq in enumerate(seqs):
            p = seq.params
            token = tokens[i]
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
