"""The one contract between planning (rank 0's scheduler) and execution (every rank's worker).

A `StepPlan` is flat and picklable: rows of one step with their slot in the persistent device block
tables, how many tokens each has cached and brings, which token positions sample, the new tokens (or
"the draws of the step still in flight, on the device"), and only the block-table entries that changed
since the last plan. No `Sequence` crosses it, so every rank can run it and the host cost of a step
does not grow with context length (a decode step sends a table entry once per block_size tokens).
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.copies import HostSpan
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence, SequenceStatus


@dataclass
class PlanImage:
    """Part of an image's span that a step's tokens cover: span positions [first, first + count) land on
    the step's flat tokens [index, index + count). The first plan to reach an image (since its sequence
    was admitted) carries its patches; the worker keeps the span's embeddings until the plan with
    `last` (or its key in `drop_images`), so the tower runs once per image however chunks split it."""

    key: str  # request id and the image's place in the prompt
    index: int
    first: int
    count: int
    last: bool  # this step reaches the span's end: the worker drops the embeddings after it
    pixel_values: torch.Tensor | None = None  # [h*w, 3*p*p] on the first plan, None after
    grid: tuple[int, int] = (0, 0)


@dataclass
class StepPlan:
    slots: list[int]  # per row: its sequence's row in the block tables (prefill chunks first, then decodes)
    num_computed: list[int]  # per row: tokens already in the cache (the chunk's first position)
    query_lens: list[int]  # per row: new tokens this step
    num_prefills: int  # the first num_prefills rows are chunks (prefill, or a decode verifying drafts)
    input_ids: list[int] | None  # the new tokens, flat; None: the previous step's draws, on the device
    sample_indices: list[int]  # flat token indices whose logits are sampled
    # (slot, first column, block ids): entries written before the step; column 0 also resets the row
    table_deltas: list[tuple[int, int, list[int]]] = field(default_factory=list)
    replicate_blocks: list[int] = field(default_factory=list)  # rank 0's blocks to copy to every rank first
    # (block, page) changes of the block -> window page map (`KVPool.window_page`), applied before the step
    window_pages: list[tuple[int, int]] = field(default_factory=list)
    collect_logits: bool = False  # every token's logits too (scoring a prompt)
    use_graph: bool = False  # set by rank 0's worker: replay a CUDA graph
    images: list[PlanImage] = field(default_factory=list)  # image tokens of this step (always run eagerly)
    drop_images: list[str] = field(default_factory=list)  # keys whose embeddings the workers forget first
    # per row, the `PlanBuilder.lookback` token ids before its first new token (-1 before the sequence), flat
    lookback: list[int] | None = None
    # launched ahead of a speculative step: each token's position is num_computed's plus an offset known
    # only on the device (`offsets` [T] next to the plan: the drafts that step accepts for its sequence)
    shifted: bool = False
    # every row a verification of k drafts whose sequence drafts again (k + 1 tokens each): the
    # runner may verify, accept and draft in one replay (`model_runner.SpecGraphs`) instead of handing
    # logits back
    fused_verify: bool = False
    # every row a decode that draws one token and needs nothing of the host (no logprobs, penalties or
    # grammar): the runner may draw them in a graph after the decode graph (`model_runner.DrawGraphs`)
    # and hand the tokens back (`StepResult.tokens`)
    draw_in_graph: bool = False
    # a fused verification's or an in-graph draw's rows that sample (None: all greedy): what they draw
    # with, per sequence
    fused_sampling: "FusedSampling | None" = None

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def positions(self) -> list[int]:
        return [p for start, n in zip(self.num_computed, self.query_lens) for p in range(start, start + n)]

    def context_lens(self) -> list[int]:
        return [start + n for start, n in zip(self.num_computed, self.query_lens)]


@dataclass
class FusedSampling:
    """Per sequence of a fused verification or an in-graph draw (`StepPlan.fused_sampling`), what its
    rows draw with inside the graph, as `engine.sampler.draw_on_device` draws outside it: logits / temperature, top-k and
    top-p, Gumbel noise keyed by (seed, output position)."""

    temperature: list[float]  # 0: greedy (argmax)
    seeds: list[int]  # Sequence.seed
    num_prompt_tokens: list[int]  # a row's output position is its cache position + 1 - this
    top_k: list[int]  # 0: off
    top_p: list[float]  # 1: off

    @classmethod
    def of(cls, seqs: list[Sequence]) -> "FusedSampling | None":
        """None where every sequence is greedy."""
        if all(seq.params.is_greedy for seq in seqs):
            return None
        return cls([0.0 if s.params.is_greedy else s.params.temperature for s in seqs], [s.seed for s in seqs],
                   [s.num_prompt_tokens for s in seqs], [s.params.top_k for s in seqs],
                   [s.params.top_p for s in seqs])


@dataclass
class DraftPlan:
    """The speculative draft after a step, on every rank: the MTP layer runs over every row of the step
    (its cache gets each one), then, from each drafting sequence's last accepted row, `num_drafts`
    tokens ahead. The device inputs that go with it: the token after each row of the step [T] (prompt
    tokens, and the step's draws where a row sampled) and each drafting sequence's accepted count [S]
    (the rows its verification kept past the first)."""

    num_drafts: int  # tokens drafted per sequence (0: the MTP pass over the step's rows only)
    rows: list[int]  # per drafting sequence: the step row of its first sampled position
    slots: list[int]  # per drafting sequence: its block-table slot
    # the step's verifications: each one's row (its index in the plan's slots), in the order of their accepted
    # counts, which go with the plan ([V] on the device): a model whose state the rejected drafts advanced
    # (V4's compressors) puts it back to the state after the last accepted token
    verifications: list[int] = field(default_factory=list)


@dataclass
class StepResult:
    """What rank 0's worker hands back: tensors on its device, nothing read to the host yet."""

    logits: torch.Tensor | None  # [len(sample_indices), vocab] float32
    all_logits: torch.Tensor | None = None  # [num_tokens, vocab] float32 when the plan collects them
    spec: "FusedVerify | None" = None  # a fused verification's outputs (`StepPlan.fused_verify`)
    tokens: torch.Tensor | None = None  # [R] int64: the rows' draws, made in a graph (`StepPlan.draw_in_graph`)


@dataclass
class FusedVerify:
    """A fused verification's outputs on the device: views of one buffer that the graph's next replay
    rewrites (whatever reads them on the device is queued before it)."""

    tokens: torch.Tensor  # [T] the draw at every row
    counts: torch.Tensor  # [S] drafts each sequence accepted
    drafts: torch.Tensor  # [S, k] its next drafts
    # the span that holds those three (padding between) and a host buffer for it: one copy (`copies.HostSpan`)
    sent: HostSpan
    # the next step's rows where every sequence goes on with k drafts: its bonus token (the draw at its last
    # accepted row) and drafts [T], and their positions past the host's (the sequence's count) [T]
    next_inputs: torch.Tensor
    next_offsets: torch.Tensor


class PlanBuilder:
    """Turns a scheduled batch into a plan: gives each running sequence a slot, and sends its block
    table to the workers as deltas (the whole table once, at admission; then each new block)."""

    def __init__(self, num_slots: int):
        self.free_slots = list(range(num_slots - 1, -1, -1))
        # token ids a row needs before its chunk (Engram's n-grams: the model's `lookback`), known on the host:
        # a step launched ahead lacks only its own inputs
        self.lookback = 0
        # id(seq) -> (seq, slot, the table list whose entries were sent, how many): BlockManager.release
        # gives a sequence a new list, so a sequence preempted and admitted again between two plans is
        # seen as a new table even when no plan saw it leave
        self.held: dict[int, tuple[Sequence, int, list[int], int]] = {}
        self._replicate: list[int] = []
        self.images_sent: dict[int, set[str]] = {}  # id(seq) -> keys of images whose patches the workers hold
        self._drop_images: list[str] = []
        # the block manager's window page changes since the last plan (`BlockManager.take_window_deltas`)
        self.window_deltas: Callable[[], list[tuple[int, int]]] | None = None

    def replicate(self, block_ids: list[int]) -> None:
        """Blocks written on rank 0 only (pulled from a peer): the next plan copies them to every rank."""
        self._replicate += block_ids

    def build(self, batch: ScheduledBatch, inputs_on_device: bool = False, shifted: bool = False) -> StepPlan:
        items = batch.items
        self._release_idle()
        slots, deltas, computed, lens, ids, sample, images, back = [], [], [], [], [], [], [], []
        verifying = {id(seq) for seq in batch.verifies}
        end = 0
        for seq, n in items:
            slot, sent = self._slot(seq)
            if len(seq.block_table) > sent:
                deltas.append((slot, sent, seq.block_table[sent:]))
                self.held[id(seq)] = (seq, slot, seq.block_table, len(seq.block_table))
            start = seq.num_computed_tokens
            if self.lookback:
                before = seq.token_ids(max(0, start - self.lookback), start)
                if len(before) != min(start, self.lookback):
                    raise RuntimeError(f"the {self.lookback} tokens before position {start} are not known yet")
                back += [-1] * (self.lookback - len(before)) + before
            slots.append(slot)
            computed.append(start)
            lens.append(n)
            verifies = id(seq) in verifying
            if not inputs_on_device:
                ids += seq.token_ids(start, start + 1) + seq.draft_token_ids if verifies else seq.token_ids(start, start + n)
            end += n
            if verifies:  # a verification: every position samples (its last token's, then each draft's)
                sample += range(end - n, end)
            elif start + n == seq.num_drawn_tokens:  # the chunk reaches the end: it samples
                sample.append(end - 1)
            if seq.images and start < seq.images[-1].span[1]:
                images += self._images(seq, start, n, end - n)
        replicate, self._replicate = self._replicate, []
        drop, self._drop_images = self._drop_images, []
        window = self.window_deltas() if self.window_deltas is not None else []
        return StepPlan(slots, computed, lens, batch.num_chunks, None if inputs_on_device else ids, sample,
                        deltas, replicate, window, collect_logits=any(seq.collect_logits for seq, _ in items),
                        images=images, drop_images=drop, lookback=back if self.lookback else None, shifted=shifted)

    def _images(self, seq: Sequence, start: int, n: int, index: int) -> list[PlanImage]:
        """The parts of seq's image spans that its tokens [start, start + n) cover (flat from `index`)."""
        sent = self.images_sent.setdefault(id(seq), set())
        out = []
        for i, image in enumerate(seq.images):
            first, stop = image.span
            lo, hi = max(start, first), min(start + n, stop)
            if lo >= hi:
                continue
            key = f"{seq.request_id}#{i}"
            new = key not in sent
            last = hi == stop
            if last:
                sent.discard(key)
            elif new:
                sent.add(key)
            out.append(PlanImage(key, index + lo - start, lo - first, hi - lo, last,
                                 image.pixel_values if new else None, image.grid))
        return out

    def _slot(self, seq: Sequence) -> tuple[int, int]:
        """-> (its slot, table entries already sent: 0 for a new slot or a new table, which resets it)."""
        entry = self.held.get(id(seq))
        if entry is not None:
            _, slot, table, sent = entry
            return slot, sent if table is seq.block_table else 0
        if not self.free_slots:
            raise RuntimeError("no free block-table slot: more sequences run than the tables hold")
        slot = self.free_slots.pop()
        self.held[id(seq)] = (seq, slot, seq.block_table, 0)
        return slot, 0

    def _release_idle(self) -> None:
        """Slots of sequences that stopped running (finished, aborted, preempted) return to the free list;
        a preempted sequence gets a new slot, its table sent again, when it runs again. The step in flight
        that may still read a released row was queued before the next plan's deltas rewrite it."""
        for key, (seq, slot, _, _) in list(self.held.items()):
            if seq.status is not SequenceStatus.RUNNING or not seq.block_table:
                del self.held[key]
                self.free_slots.append(slot)
                # left in the middle of an image (preempted, aborted): its patches go again when it is back
                self._drop_images += sorted(self.images_sent.pop(key, ()))
