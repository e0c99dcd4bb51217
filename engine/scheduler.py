"""Continuous batching: every step mixes decodes and (chunked) prefills under one token budget."""

import time
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens this step)
    # decodes that verify draft tokens: their last token and its drafts, 1 + num_drafts[i] rows each
    verifies: list[Sequence] = field(default_factory=list)
    # per verification: its drafts (its draft_token_ids; on the device when launched ahead of the step
    # that drafted them)
    num_drafts: list[int] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)  # one token each
    num_preempted: int = 0

    @property
    def items(self) -> list[tuple[Sequence, int]]:
        """Batch order: prefill chunks first, then verifications (attention runs both as chunks), then
        decodes."""
        return self.prefills + [(s, 1 + d) for s, d in zip(self.verifies, self.num_drafts)] + [(s, 1) for s in self.decodes]

    @property
    def num_chunks(self) -> int:
        """Rows of several tokens (prefill chunks and verifications), which come first."""
        return len(self.prefills) + len(self.verifies)

    def __bool__(self) -> bool:
        return bool(self.prefills or self.verifies or self.decodes)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 num_lookahead_tokens: int = 0, max_model_len: int | None = None):
        """num_lookahead_tokens: cache slots a sequence needs past its step's tokens (the MTP draft
        writes its cache k - 1 positions ahead of the last verified one); max_model_len caps them."""
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_lookahead_tokens = num_lookahead_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order = priority order
        self.num_preemptions = 0  # since start, for metrics and tests

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []

        # 1. running sequences keep going; when blocks (or window pages) run out, the newest are preempted
        # (recomputed later). First each gives back the window pages behind its next query's window
        for seq in self.running:
            self.bm.slide(seq)
        queue = list(self.running)
        kept: list[Sequence] = []
        while queue:
            seq = queue.pop(0)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n <= 0:
                kept.append(seq)
                continue
            if seq.draft_token_ids:  # a decode verifying its drafts: as many as the budget takes
                del seq.draft_token_ids[budget - 1 :]
                n += len(seq.draft_token_ids)
            while not self.bm.can_grow(seq, self._reach(seq, n)):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                batch.num_preempted += 1
                self.num_preemptions += 1
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.bm.grow(seq, self._reach(seq, n))
            scheduled.append((seq, n))
            kept.append(seq)
            budget -= n
        self.running = kept

        # 2. admit waiting sequences, oldest first, unless this step had to preempt
        while self.waiting and not batch.num_preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = self.bm.match_prefix(seq)
            n = min(seq.num_tokens - len(hits) * self.bm.block_size, budget)
            start = len(hits) * self.bm.block_size
            ok, hits = self.bm.can_admit(seq, self._reach(seq, n, start) - start)
            if not ok:
                break
            self.waiting.popleft()
            self.bm.admit(seq, hits)
            self.bm.grow(seq, self._reach(seq, n))
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.monotonic()
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n

        for seq, n in scheduled:
            if seq.num_computed_tokens + 1 != seq.num_tokens:
                batch.prefills.append((seq, n))
            elif seq.draft_token_ids:  # its last token and the drafts after it
                batch.verifies.append(seq)
                batch.num_drafts.append(len(seq.draft_token_ids))
            else:  # its last token: the decode path
                batch.decodes.append(seq)
        return batch

    def _reach(self, seq: Sequence, n: int, start: int | None = None) -> int:
        """Tokens of cache a sequence needs to compute n tokens from `start` (default: its computed ones)."""
        end = (seq.num_computed_tokens if start is None else start) + n
        if self.max_model_len is None:
            return end + self.num_lookahead_tokens
        return max(end, min(end + self.num_lookahead_tokens, self.max_model_len))

    def can_admit_next(self) -> bool:
        """Whether the next `schedule()` would likely admit the head of the queue (its prefix-cache hits
        left out: hashing a long prompt every step would cost more than the guess saves)."""
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return False
        budget = self.max_num_batched_tokens - len(self.running)  # each running sequence decodes one
        need = self.bm.blocks_needed(min(self.waiting[0].num_tokens, budget))
        if self.bm.window and need > self.bm.num_available_pages:
            return False
        return budget > 0 and need <= self.bm.num_free_blocks

    def schedule_ahead(self, seqs: list[Sequence], num_drafts: list[int] | None = None,
                       unresolved: list[int] | None = None) -> ScheduledBatch | None:
        """The decode step after one still in flight, before its tokens are known: running `seqs`, each
        one token further than its computed ones (num_computed_tokens counts the step in flight), and
        num_drafts[i] drafts more where it verifies drafts still on the device. unresolved[i]: drafts the
        step in flight verifies for it; every one may be accepted, so its blocks are grown for that many
        more (and for the draft's lookahead). None where blocks or the token budget run short: the
        synchronous schedule, with every token known, then preempts."""
        num_drafts = num_drafts or [0] * len(seqs)
        unresolved = unresolved or [0] * len(seqs)
        for seq in seqs:
            self.bm.slide(seq)
        reach = [self._reach(s, u + 1 + d) for s, d, u in zip(seqs, num_drafts, unresolved)]
        need = sum(max(0, self.bm.blocks_needed(r) - len(s.block_table)) for s, r in zip(seqs, reach))
        if need > self.bm.num_free_blocks or len(seqs) + sum(num_drafts) > self.max_num_batched_tokens:
            return None
        if self.bm.window and need > self.bm.num_available_pages:
            return None
        batch = ScheduledBatch()
        for seq, r, d in zip(seqs, reach, num_drafts):
            self.bm.grow(seq, r)
            if d:
                batch.verifies.append(seq)
                batch.num_drafts.append(d)
            else:
                batch.decodes.append(seq)
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.bm.release(seq)
        seq.draft_token_ids = []  # its recompute drafts anew
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take a sequence out of the queues and free its blocks (full blocks stay in the prefix cache)."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.bm.release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
