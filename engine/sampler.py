"""Turn one step's logits into tokens (and logprobs).

On a GPU the sampled rows are drawn together on the device (`draw_on_device`: temperature and top-k as
tensor ops over the batch, then the Gumbel-max kernel, which also applies top-p without a sort); the step's tokens stay there as the
next step's inputs, and one asynchronous copy brings them to the host (`Draws`). Drawing row by row
on the host instead copies each row's probabilities over (~0.5 MB for DeepSeek's 129k vocabulary)
and runs a multinomial per request: milliseconds per request per step.
The noise is keyed by (the request's seed, its output position), so a seeded request draws the same
noise whatever else shares its batches (its tokens repeat as far as its logits do: a batch's size can
change the kernels that compute them). On CPU rows are drawn one by one from each request's generator
by inverse transform (the same distribution, another random stream).
"""

import torch

from engine.copies import HostSpan, ToHost, index_to_device, to_device
from engine.sequence import Sequence
from engine.structured_output import apply_guides

_MASK64 = (1 << 64) - 1


def noise_key(seed: int, position: int) -> int:
    """A 63-bit key per (seed, output position): splitmix64 of the pair, so nearby seeds and positions
    give unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 that holds it."""
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's `>>` keeps the sign)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def noise_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`noise_key` over int64 tensors [R] (seeds as their 64-bit patterns), on their device: the key of a
    position the host does not know yet (a row launched before the accepted drafts ahead of it were
    read). int64 products wrap modulo 2**64, so the bits are the host's. One Triton launch where the
    kernels run (`kernels.sampling.noise_keys`)."""
    from engine.kernels import runs_here

    if runs_here(seeds):
        from engine.kernels.sampling import noise_keys as keys_kernel

        return keys_kernel(seeds, positions)
    z = seeds * _signed(0x9E3779B97F4A7C15) + positions + 1
    z = (z ^ _shift_right(z, 30)) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ _shift_right(z, 27)) * _signed(0x94D049BB133111EB)
    return _shift_right(z ^ _shift_right(z, 31), 1)


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


def filter_rows(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[R, V] logits already divided by their temperature -> the same with everything outside each row's
    top-k (ties with the k-th value kept) and top-p nucleus at -inf (a token is dropped once the mass
    before it reaches top_p, so the top token always stays). top_k [R] int64 (the vocabulary size: off),
    top_p [R] float32 (inf: off), on scaled's device (`row_filters`): device tensors only, so a CUDA
    graph can hold it."""
    sorted_vals, order = scaled.sort(dim=-1, descending=True, stable=True)  # ties in index order everywhere
    kth = sorted_vals.gather(1, (top_k - 1)[:, None])  # ties with the k-th value stay
    sorted_vals = sorted_vals.masked_fill(sorted_vals < kth, float("-inf"))
    probs = sorted_vals.softmax(-1)
    drop = probs.cumsum(-1) - probs >= top_p[:, None]
    drop[:, 0] = False  # the top token always stays, however small top_p (it may round to 0 in float32)
    return scaled.scatter(1, order, sorted_vals.masked_fill(drop, float("-inf")))


def row_filters(params: list, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's SamplingParams -> its top-k [R] int64 and top-p [R] float32 for `filter_rows`, on device.
    top_p 1 is off (inf): rounding in a 129k-long running sum must not drop the tail."""
    both = to_device([[p.top_k if 0 < p.top_k < vocab else vocab for p in params],
                      [p.top_p if p.top_p < 1.0 else float("inf") for p in params]], torch.float64, device)
    return both[0].long(), both[1].float()


def scaled_and_filtered(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Rows [R, V] of sequences that sample -> logits / temperature, outside top-k / top-p at -inf."""
    temps = to_device([s.params.temperature for s in seqs], logits.dtype, logits.device)
    scaled = logits / temps[:, None]
    vocab = logits.shape[1]
    if any(0 < s.params.top_k < vocab or s.params.top_p < 1.0 for s in seqs):
        scaled = filter_rows(scaled, *row_filters([s.params for s in seqs], vocab, logits.device))
    return scaled


def draw_on_device(logits: torch.Tensor, seqs: list[Sequence], ahead: list[int] | None = None,
                   offsets: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of logits [R, V] (float32) for sequences that sample (temperature > 0), drawn
    on logits' device in one launch -> [R] int64 there. ahead: per row, how many positions past the
    sequence's next one it samples (a verification's rows after its first); offsets: [R] on the device,
    positions further still that the host does not know yet (drafts accepted by a step in flight)."""
    from engine.kernels.sampling import sample  # first use: Triton picks compiled or interpreted then

    dev = logits.device
    temps = to_device([s.params.temperature for s in seqs], logits.dtype, dev)
    scaled = logits / temps[:, None]
    vocab = logits.shape[1]
    top_p = None  # the sampling kernel applies top-p (no sort); top-k sorts first
    if any(0 < s.params.top_k < vocab or s.params.top_p < 1.0 for s in seqs):
        top_k, top_p = row_filters([s.params for s in seqs], vocab, dev)
        if any(0 < s.params.top_k < vocab for s in seqs):
            scaled = filter_rows(scaled, top_k, torch.full_like(top_p, float("inf")))
    ahead = ahead or [0] * len(seqs)
    # the output position of the token drawn: tokens drawn by steps still in flight come before it
    positions = [s.num_drawn_tokens - s.num_prompt_tokens + j for s, j in zip(seqs, ahead)]
    if offsets is None:
        keys = to_device([noise_key(s.seed, p) for s, p in zip(seqs, positions)], torch.int64, dev)
    else:
        both = to_device([[_signed(s.seed) for s in seqs], positions], torch.int64, dev)
        keys = noise_keys(both[0], both[1] + offsets)
    ones = torch.ones(len(seqs), dtype=torch.float32, device=dev)  # temperature is applied above
    return sample(scaled.contiguous(), ones, keys, torch.zeros(1, dtype=torch.int64, device=dev), top_p=top_p)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence], pending: torch.Tensor | None = None,
                    drafts_before: list[list[int]] | None = None) -> torch.Tensor:
    """OpenAI-style presence/frequency penalties over each sequence's generated tokens. pending: [R] the
    token each row drew in the step still in flight (not yet in output_token_ids), on the device;
    drafts_before: per row, the draft tokens a verification's row comes after (generated, if accepted)."""
    for i, seq in enumerate(seqs):
        p = seq.params
        drafts = drafts_before[i] if drafts_before else []
        if not p.has_penalties or not (seq.output_token_ids or pending is not None or drafts):
            continue
        counts = torch.zeros(logits.shape[1], dtype=logits.dtype, device=logits.device)
        if seq.output_token_ids or drafts:
            ids = to_device(seq.output_token_ids + drafts, torch.long, logits.device)
            counts.scatter_add_(0, ids, torch.ones_like(ids, dtype=logits.dtype))
        if pending is not None:
            counts.scatter_add_(0, pending[i : i + 1], torch.ones(1, dtype=logits.dtype, device=logits.device))
        logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


class Draws:
    """One step's tokens: on the device at once (where the next step can read them as its inputs), on
    the host from `result()`, which waits for this step's copies only."""

    def __init__(self, tokens: torch.Tensor, seqs: list[Sequence], raw_logprobs: torch.Tensor | None,
                 send: bool = True):
        self.tokens = tokens  # [R] int64 on the logits' device
        self.top_n = [s.params.logprobs for s in seqs]  # None: no logprobs for the row
        self.parts = [tokens]
        if raw_logprobs is not None:
            self.parts.append(raw_logprobs.gather(1, tokens[:, None])[:, 0])
            k = max(n or 0 for n in self.top_n)
            if k:
                top = raw_logprobs.topk(k)
                self.parts += [top.values, top.indices]
        self.copy: ToHost | None = None
        if send:
            self.send()

    def send(self, *more: torch.Tensor, within: HostSpan | None = None) -> int:
        """Start the copy to the host, with more of the step's tensors after the draws' own (one copy, one
        wait) -> where those begin in `copy.get()`. within: one device buffer holding them all (`ToHost`)."""
        self.copy = ToHost(*self.parts, *more, within=within)
        return len(self.parts)

    def result(self) -> tuple[list[int], list[dict[int, float] | None]]:
        host = self.copy.lists()[: len(self.parts)]
        tokens = host[0]
        logprobs: list[dict[int, float] | None] = []
        for i, (token, n) in enumerate(zip(tokens, self.top_n)):
            if n is None:
                logprobs.append(None)
                continue
            entry = {token: host[1][i]}
            if n:
                for t, v in zip(host[3][i][:n], host[2][i][:n]):
                    entry.setdefault(t, v)
            logprobs.append(entry)
        return tokens, logprobs


class Sampler:
    def __init__(self, on_device: bool = False):
        self.on_device = on_device  # draw sampled rows with `draw_on_device` (where the Triton kernels run)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[dict[int, float] | None]]:
        """-> (tokens, logprobs) on the host."""
        return self.sample(logits, seqs).result()

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence], pending: torch.Tensor | None = None,
               drafts_before: list[list[int]] | None = None, ahead: list[int] | None = None,
               offsets: torch.Tensor | None = None, send: bool = True) -> Draws:
        """Queue one step's draws; logits: [B, vocab] float32 for the rows that sample this step, seqs
        their sequences (one several times where a row verifies drafts). pending: [B] the tokens drawn
        for them by the step still in flight (async scheduling), on the device: the penalties count them
        too. drafts_before: per row, the drafts a verification's row follows: it samples that many
        positions further on, as if they had been generated (a row past a rejected draft is discarded).
        ahead: those counts where the drafts are on the device (then no row has penalties); offsets: [B]
        on the device, positions further still (`draw_on_device`). send: False where the caller starts
        the copy to the host itself (`Draws.send`), with more of the step's tensors."""
        raw_logprobs = None
        if any(s.params.logprobs is not None for s in seqs):
            raw_logprobs = logits.log_softmax(dim=-1)  # the model's distribution, before masks and penalties
        apply_guides(logits, [s.guide for s in seqs])
        logits = apply_penalties(logits, seqs, pending, drafts_before)
        drawn = [i for i, seq in enumerate(seqs) if not seq.params.is_greedy]
        dev = logits.device
        if ahead is None and drafts_before:
            ahead = [len(d) for d in drafts_before]
        if drawn and self.on_device and len(drawn) == len(seqs):  # every row samples: no argmax
            return Draws(draw_on_device(logits, seqs, ahead, offsets), seqs, raw_logprobs, send)
        chosen = logits.argmax(dim=-1)
        if drawn:
            rows = index_to_device(tuple(drawn), dev)
            if self.on_device:
                chosen[rows] = draw_on_device(logits.index_select(0, rows), [seqs[i] for i in drawn],
                                              [ahead[i] for i in drawn] if ahead else None,
                                              None if offsets is None else offsets.index_select(0, rows))
            else:  # on the host: filtered together, then drawn row by row from each request's generator
                probs = scaled_and_filtered(logits[drawn], [seqs[i] for i in drawn]).softmax(-1).cpu()
                picks = [draw_inverse_cdf(row, seqs[i].generator) for row, i in zip(probs, drawn)]
                chosen[rows] = to_device(picks, torch.long, dev)
        return Draws(chosen, seqs, raw_logprobs, send)
