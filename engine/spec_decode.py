"""Speculative decoding with DeepSeek's multi-token-prediction (MTP) layer.

A step verifies each running request's k draft tokens: the target runs over its last token and the
drafts (k + 1 rows, one pass: the weights are read once for k + 1 positions), and the sampler draws a
token at every row with the request's own sampling: greedy, or its noise keyed by the output position
(`engine.sampler`). The drafts are accepted while each equals the token drawn at the row before it;
the request gains those tokens and one more, the token drawn at the first row that disagrees (or
after the last draft). Every token it emits is therefore the one the target itself draws at that
position, so the output is exactly the target's: greedy tokens identical to plain decoding, and for
temperature > 0 the target's distribution. The draft is deterministic (the MTP layer's argmax), and
for such a draft this rule accepts a draft d with the target's probability p(d), as the rejection
sampling of Leviathan et al. does with a one-hot draft distribution (whose residual is p with d taken
out: the token drawn given that it is not d); on a GPU, where the noise is keyed by position, a seeded
request's tokens are even the same with and without speculation.

After the target, the MTP layer runs over every row of the step (its own cache gets each position:
row i's input is the target's hidden state at i and the token after i), then drafts from each
request's last accepted row: k tokens, the layer fed its own output past the first, as SGLang and
vLLM reuse one MTP layer for several drafts. Rejected rows' cache entries, the target's and the MTP
layer's, sit past the request's computed tokens: the next step writes those positions before any
query reads them, and the prefix cache registers a block only once its tokens are accepted. State that
is not a row per position (DeepSeek-V4's compressors' open windows) is put back on the device to the
state after each verification's last accepted token before the MTP pass (`DraftPlan.verifications`
and their accepted counts, the model's `keep_accepted`; engine.models.deepseek_v4 says why it is exact).
"""

import logging
from dataclasses import dataclass

import torch

from engine.config import SpeculativeConfig
from engine.copies import ToHost, to_device
from engine.sampler import Draws
from engine.sequence import Sequence
from engine.step_plan import DraftPlan, StepPlan

logger = logging.getLogger(__name__)


def accepted_counts(tokens: torch.Tensor, first: list[int], num_drafts: list[int], drafts: list[list[int]] | None,
                    inputs: torch.Tensor | None = None, input_first: list[int] | None = None) -> torch.Tensor:
    """How many drafts each verification keeps: tokens [R] drawn at the step's sampled rows, first[s]
    the index of sequence s's first row there, num_drafts[s] the drafts it verifies (rows first[s] ..
    first[s] + num_drafts[s] verify them) -> [S] int64 on tokens' device: the leading drafts equal to the
    token drawn at the row before each. The drafts are drafts[s] on the host, or, where a step was
    launched before they were read, on the device: the step's inputs [T], whose token input_first[s] + 1
    + j is sequence s's draft j."""
    width = max(num_drafts, default=0)
    dev = tokens.device
    if not width:
        return torch.zeros(len(first), dtype=torch.long, device=dev)
    rows = width + 1
    if (tokens.shape[0] == len(first) * rows and all(n == width for n in num_drafts)
            and first == list(range(0, tokens.shape[0], rows))
            and (drafts is not None or (inputs.shape[0] == tokens.shape[0] and input_first == first))):
        # every row is a verification of `width` drafts, back to back (one stream, or all alike): views
        want = (to_device([d[:width] for d in drafts], torch.long, dev) if drafts is not None
                else inputs.view(-1, rows)[:, 1:])
        return (tokens.view(-1, rows)[:, :width] == want).long().cumprod(dim=1).sum(dim=1)
    last = tokens.shape[0] - 1
    draws = [[min(f + j, last) for j in range(width)] for f in first]
    if drafts is not None:
        # one copy: the drafts (padded with -1, which never matches) and the draw each is compared with
        both = to_device([[d[:n] + [-1] * (width - n) for d, n in zip(drafts, num_drafts)], draws], torch.long, dev)
        want, at = both[0], both[1]
    else:
        end = inputs.shape[0] - 1
        both = to_device([draws, [[min(f + 1 + j, end) for j in range(width)] for f in input_first],
                          [[int(j < n) for j in range(width)] for n in num_drafts]], torch.long, dev)  # [3, S, width]
        want, at = inputs[both[1]].masked_fill(both[2] == 0, -1), both[0]
    return (tokens[at] == want).long().cumprod(dim=1).sum(dim=1)


def counts_of(counts: torch.Tensor | None, keep: list[int], device: torch.device) -> torch.Tensor | None:
    """The accepted counts [S] of the sequences at `keep` (None: none kept; all of them: counts itself)."""
    if counts is None or not keep:
        return None
    return counts if len(keep) == counts.shape[0] else counts.index_select(0, to_device(keep, torch.long, device))


@dataclass
class StepTimes:
    """What a step takes at each padded batch size, measured on the engine itself at start
    (`LLMEngine.measure_batch_cutoff`): seconds a step without drafts (`plain`) and with k drafts
    verified and drafted again (`spec`), per size in `sizes` (ascending)."""

    sizes: list[int]
    plain: list[float]
    spec: list[float]


def measured_sizes(graph_sizes: list[int], max_num_seqs: int, max_rows: int, k: int) -> list[int]:
    """The batch sizes the cutoff is measured at: the decode graphs' padded sizes below the largest batch
    whose k + 1 rows a request fit the graphs (and max_num_seqs), then that batch itself, which pads to a
    graph that fits: every running count up to it is covered by a measured size at or above it."""
    top = min(max_num_seqs, max_rows // (k + 1))
    return [s for s in graph_sizes if s < top] + [top] if top else []


def batch_cutoff(times: StepTimes, k: int, acceptance: float, margin: float) -> int:
    """The largest batch size up to which drafting pays at every measured size: a step of k drafts
    accepted at `acceptance` a draft gains 1 + k * acceptance tokens where a plain step gains one, so it
    pays where (1 + k * acceptance) * t(plain) > (1 + margin) * t(spec) -> that size (0: nowhere). Past
    the largest measured size nothing drafts (its verification rows would overflow the graphs)."""
    gain = 1 + k * acceptance
    limit = 0
    for size, plain, spec in zip(times.sizes, times.plain, times.spec):
        if gain * plain <= (1 + margin) * spec:
            break
        limit = size
    return limit


@dataclass
class SpecStep:
    """One step's verifications and drafts, on the device until `result()`."""

    seqs: list[Sequence]  # the sequences that verified drafts or draft now
    num_verified: list[int]  # drafts each verified this step (0: none)
    drafting: list[bool]  # whether each drafts for the next step
    copy: ToHost | None  # (accepted counts [S], drafts [S', k]) on their way to the host, from `offset` on
    counts: torch.Tensor | None = None  # the same on the device: a step launched ahead reads them there
    drafts: torch.Tensor | None = None
    offset: int = 0
    # a fused step's next rows and their offsets on the device (`FusedVerify`), for a step launched ahead
    # with every sequence going on with k drafts
    next: tuple[torch.Tensor, torch.Tensor] | None = None

    def result(self) -> tuple[list[int], list[list[int]]]:
        """-> (accepted drafts per sequence, next drafts per drafting sequence)."""
        if self.counts is None:
            return [0] * len(self.seqs), []
        host = self.copy.lists()[self.offset :]
        return host[0], host[1] if len(host) > 1 else []


class Speculator:
    """Decides who drafts, verifies drafts on the device and runs the MTP draft after each step."""

    # the acceptance assumed before drafts are counted, worth PRIOR_DRAFTS counted ones: between
    # deepseek-tiny's 0.73 a draft at k = 3 and what an untrained layer gets
    PRIOR_ACCEPTANCE = 0.6
    PRIOR_DRAFTS = 200
    MARGIN = 0.1  # drafting must beat plain steps by this share of a speculative step's time
    RECHECK_DRAFTS = 512  # the measured cutoff is weighed again after this many more drafts

    def __init__(self, config: SpeculativeConfig, executor, max_model_len: int):
        self.config = config
        self.k = config.num_speculative_tokens
        self.executor = executor
        self.max_model_len = max_model_len
        # a model whose state rejected drafts advance (V4's compressors) is told each step's verifications
        # (`DraftPlan.verifications`); the others are spared gathering them
        self.rolls_back = executor is not None and hasattr(executor.runner.model, "keep_accepted")
        self.num_draft_tokens = 0  # since start: drafts verified, and of them accepted (metrics)
        self.num_accepted_tokens = 0
        # where `disable_by_batch_size` is not set: step times measured at start (`use_times`), and the
        # batch size they allow drafts up to at the acceptance counted so far
        self.times: StepTimes | None = None
        self.limit: int | None = None
        self._weighed_at = 0
        self.forced: bool | None = None  # while the step times are measured: draft (or not) at any size

    def drafts_at(self, num_running: int) -> bool:
        """Whether steps draft at this batch size: up to `disable_by_batch_size` where set, else up to the
        measured cutoff (`batch_cutoff`, weighed again as drafts are counted), else always."""
        if self.forced is not None:
            return self.forced
        limit = self.config.disable_by_batch_size
        if limit is None and self.times is not None:
            if abs(self.num_draft_tokens - self._weighed_at) >= self.RECHECK_DRAFTS:  # (counters may be reset)
                self._weigh()
            limit = self.limit
        return limit is None or num_running <= limit

    def acceptance(self) -> float:
        """Accepted drafts per draft so far, starting from PRIOR_ACCEPTANCE. Where the cutoff stops every
        batch size from drafting, nothing more is counted and it stays there."""
        return ((self.num_accepted_tokens + self.PRIOR_ACCEPTANCE * self.PRIOR_DRAFTS)
                / (self.num_draft_tokens + self.PRIOR_DRAFTS))

    def use_times(self, times: StepTimes) -> int:
        """Draft by the measured step times from now on -> the batch size drafts are made up to."""
        self.times = times
        self._weigh()
        return self.limit

    def _weigh(self) -> None:
        limit = batch_cutoff(self.times, self.k, self.acceptance(), self.MARGIN)
        if limit != self.limit and self.limit is not None:
            logger.info("speculative decoding: drafting now at batch sizes up to %d (was %d; %.2f of drafts "
                        "accepted)", limit, self.limit, self.acceptance())
        self.limit, self._weighed_at = limit, self.num_draft_tokens

    def may_draft(self, seq: Sequence, end: int) -> bool:
        """Whether a sequence whose step ends at position `end` (exclusive) drafts after it: not a guided
        one (its grammar would have to follow every draft), not one scoring a prompt, and only where the
        drafts' cache positions fit the context."""
        return seq.guide is None and not seq.collect_logits and end + self.k <= self.max_model_len

    def allowed_drafts(self, seq: Sequence, num_tokens: int | None = None) -> int:
        """Drafts to verify next step: k, or what the context leaves room for. Not fewer near the
        request's max_tokens: tokens past it are dropped when read, while a verification of fewer than
        k drafts leaves the fused step and its draft graphs (on the H200 a request's last two steps
        then cost ~8 ms each in eager drafts against ~0.5 ms a fused step). num_tokens: its tokens by
        then, where more than the host holds (the most a step in flight adds)."""
        num_tokens = seq.num_tokens if num_tokens is None else num_tokens
        return max(0, min(self.k, self.max_model_len - 1 - num_tokens))

    def launch(self, plan: StepPlan, items: list[tuple[Sequence, int]], groups: list[tuple[Sequence, int]],
               tokens: torch.Tensor | None, num_running: int, device: torch.device,
               inputs: torch.Tensor | None = None, unresolved: dict[int, int] | None = None,
               draws: Draws | None = None) -> SpecStep:
        """After a step's draws are queued: verify its drafts, run the MTP layer over its rows and draft.
        items: the batch's (sequence, rows); groups: (sequence, sampled rows) in the draws' order;
        tokens: the draws [R] on the device (None: nothing sampled). A step launched ahead of the one
        that drafted: inputs [T] its token ids on the device (the drafts among them), unresolved:
        id(seq) -> the drafts the step before verifies, every one of which may be accepted (its rows
        may lie that much further on). draws: the step's, whose copy to the host this starts with the
        accepted counts and drafts (one copy a step)."""
        # the token after each row: known on the host (prompt, earlier output), or drawn at the row itself
        if tokens is not None and len(plan.sample_indices) == plan.num_tokens:
            next_dev = tokens  # every row sampled (decodes and verifications): its draw comes after it
        else:
            next_ids: list[int] = []
            for (seq, n), start in zip(items, plan.num_computed):
                known = seq.token_ids(start + 1, min(start + n + 1, seq.num_tokens)) if start + 1 < seq.num_tokens else []
                next_ids += known + [0] * (n - len(known))
            next_dev = to_device(next_ids, torch.long, device)
            if tokens is not None:
                next_dev.index_copy_(0, to_device(plan.sample_indices, torch.long, device), tokens)
        drafting_now = self.drafts_at(num_running)
        seqs, first, verified, drafting, rows, slots = [], [], [], [], [], []
        slot_of = {id(seq): slot for (seq, _), slot in zip(items, plan.slots)}
        unresolved = unresolved or {}
        end_of = {id(seq): start + n + unresolved.get(id(seq), 0) for (seq, n), start in zip(items, plan.num_computed)}
        index = 0
        for seq, num_rows in groups:
            drafts = drafting_now and self.may_draft(seq, end_of[id(seq)])
            if num_rows > 1 or drafts:
                seqs.append(seq)
                first.append(index)
                verified.append(num_rows - 1)
                drafting.append(drafts)
                if drafts:
                    rows.append(plan.sample_indices[index])
                    slots.append(slot_of[id(seq)])
            index += num_rows
        counts = None
        if seqs:
            if plan.input_ids is None and any(verified):  # launched ahead: the drafts are the inputs on the device
                counts = accepted_counts(tokens, first, verified, None, inputs,
                                         [plan.sample_indices[f] for f in first])
            else:
                counts = accepted_counts(tokens, first, verified, [seq.draft_token_ids for seq in seqs])
        draft_counts = counts_of(counts, [i for i, d in enumerate(drafting) if d], device)
        # the verifications' plan rows and accepted counts: V4 puts its compressors' state back by them
        checked = [i for i, n in enumerate(verified) if n] if self.rolls_back else []
        verified_counts = counts_of(counts, checked, device)
        verifications = []
        if checked:
            row_of = {id(seq): i for i, (seq, _) in enumerate(items)}
            verifications = [row_of[id(seqs[i])] for i in checked]
        drafts = self.executor.propose(DraftPlan(self.k if rows else 0, rows, slots, verifications), next_dev,
                                       draft_counts, verified_counts)
        parts = [t for t in (counts, drafts) if t is not None]
        if draws is not None:
            offset = draws.send(*parts)
            return SpecStep(seqs, verified, drafting, draws.copy, counts, drafts, offset)
        return SpecStep(seqs, verified, drafting, ToHost(*parts) if parts else None, counts, drafts)
