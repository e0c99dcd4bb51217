"""The serving loop: add requests, then `step()` = schedule -> run the model -> sample -> postprocess.

With async scheduling (on a GPU), a decode step is launched before the host reads the tokens of the
step still running: its inputs are those tokens on the device. The host's work for a step (scheduling,
loading the batch, turning tokens into text and outputs, the server's report) then runs while the
device computes the next one, instead of between the two. A request that ends at a step (an EOS token,
a stop string) was already given a row in the next one; that row's token is dropped. Length limits are
known ahead and cost nothing. With speculative decoding the step after a verification goes ahead the
same way, before its accepted counts are read: its rows are placed and fed on the device
(`_launch_after_drafts`).
"""

import dataclasses
import logging
import random
import statistics
import time
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as futures_wait
from typing import NamedTuple

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig, ModelConfig, model_fingerprint, required_block_size, resolve_model_path
from engine.copies import index_to_device, to_device
from engine.executor import create_executor
from engine.kv_pool import window_of
from engine.model_runner import ModelRunner
from engine.models.deepseek_vit import VisionConfig
from engine.multimodal import ImageInput, check_spans
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.sampler import Draws, Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.spec_decode import SpecStep, Speculator, StepTimes, measured_sizes
from engine.step_plan import FusedSampling, PlanBuilder
from engine.structured_output import Guide, guide_tokenizer
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def _release_pulled(future) -> None:
    pulled = None if future.cancelled() or future.exception() is not None else future.result()
    if pulled is not None:
        pulled.release()


class PromptTooLongError(ValueError):
    """The prompt does not fit the context window (or the KV cache)."""


class LaunchedStep(NamedTuple):
    """A step queued on the device whose tokens the host has not read yet."""

    batch: ScheduledBatch
    groups: list[tuple[Sequence, int]]  # (sequence, its rows that sample), in the draws' order
    draws: Draws | None
    prefill_timer: "StepTimer | None" = None  # how long its prefill took, read once its tokens are
    spec: SpecStep | None = None  # its verifications and the drafts after it (speculative decoding)
    logits: torch.Tensor | None = None  # a step launched ahead with guided rows: sampled once the last is read


class StepTimer:
    """The device time of a step, read after the step's own results (no extra synchronization): CUDA
    events around it on a GPU, the host's clock elsewhere (where the step ran synchronously)."""

    def __init__(self, device: torch.device):
        self.events = None
        if device.type == "cuda":
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        self.start = time.perf_counter()
        self.seconds = 0.0

    def stop(self) -> "StepTimer":
        if self.events is not None:
            self.events[1].record()
        else:
            self.seconds = time.perf_counter() - self.start
        return self

    def elapsed(self) -> float:
        if self.events is not None:
            self.events[1].synchronize()  # done already: the step's tokens were read
            return self.events[0].elapsed_time(self.events[1]) / 1e3
        return self.seconds


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        path = resolve_model_path(config.model)
        self.model_path = path
        self.model_config = ModelConfig.from_dir(path)
        block_size = required_block_size(self.model_config, config.block_size)
        if block_size != config.block_size:
            logger.info("KV pages of %d tokens (a multiple of every compression ratio of %s) instead of %d",
                        block_size, self.model_config.architecture, config.block_size)
            config = self.config = dataclasses.replace(config, block_size=block_size)
        self.tokenizer = Tokenizer(path)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        weights = None if config.load_format == "dummy" else path
        self.executor = create_executor(config, self.model_config, weights, self.max_model_len)
        self.planner = PlanBuilder(config.max_num_seqs)
        if getattr(self.model_config, "engram_layer_ids", ()):  # Engram's n-grams reach before each chunk
            self.planner.lookback = self.model_config.engram_max_ngram_size - 1
        capacity = self.executor.num_blocks * config.block_size
        if self.max_model_len > capacity:
            logger.warning("max_model_len %d exceeds the KV cache (%d tokens); lowering it", self.max_model_len, capacity)
            self.max_model_len = capacity
        self.model_key = model_fingerprint(path, str(self.runner.dtype), config.block_size,
                                           len(getattr(self.runner.model, "mtp", ())), config.kv_cache_dtype)
        pool = self.runner.kv_pool
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                          salt=self.model_key, window=window_of(pool.specs),
                                          num_window_pages=pool.num_window_pages)
        if pool.has_window_pages:  # the blocks' window pages reach the workers with each plan
            self.planner.window_deltas = self.block_manager.take_window_deltas
        k = config.num_speculative_tokens
        self.speculator = Speculator(config.speculative_config, self.executor, self.max_model_len) if k else None
        # the MTP draft writes its cache up to k - 1 positions past a step's last row
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   num_lookahead_tokens=max(0, k - 1), max_model_len=self.max_model_len)
        # sampled rows drawn on the device where the Triton kernels run; the torch backend stays kernel-free
        self.sampler = Sampler(on_device=self.runner.backend == "triton" and self.runner.device.type == "cuda")
        # on a CPU the host is the device: nothing to overlap, and a dropped row costs a whole row
        self.async_scheduling = {"on": True, "off": False}.get(config.async_scheduling,
                                                              self.runner.device.type == "cuda")
        self.inflight: LaunchedStep | None = None
        self.requests: dict[str, Sequence] = {}
        self._rng = random.Random(config.seed)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids)
        self.kv = None
        self.pending_pulls: dict[str, tuple[Sequence, object]] = {}  # request id -> (sequence, PendingPull)
        self.guide_tokenizer = None  # structured outputs' view of the tokenizer, built on first use
        if (self.speculator is not None and config.speculative_config.disable_by_batch_size is None
                and self.runner.graphs is not None and self.runner.graphs.graphs):
            self.measure_batch_cutoff()  # on a GPU, with its graphs: where drafting pays is measured
        if config.kv_directory:  # after the measurement: its requests are nothing the fleet should see
            self.kv = self._make_kv_connector()

    def measure_batch_cutoff(self, sizes: list[int] | None = None, steps: int = 8) -> int:
        """Time this engine's own steps at each padded batch size (every size whose k + 1 rows a request
        fit the decode graphs, by default), once without drafts and once with: `size` greedy requests of
        a short made-up prompt, from their third step after the prefill, the median of `steps` calls of
        `step()` (with async scheduling a step's wall time is the larger of its host work and its device
        time, whichever bounds it). The speculator drafts from then on up to the largest size where the
        drafts pay (`spec_decode.batch_cutoff`) -> that size. The requests are aborted and the counters
        put back; the blocks their tokens filled stay in the prefix cache, unreferenced (evicted first
        when blocks run short)."""
        sp, k = self.speculator, self.speculator.k
        prompt_len, warm = 8, 2
        max_tokens = (warm + steps + 4) * (k + 1)
        if prompt_len + max_tokens + k > self.max_model_len:  # its requests would end inside the timed steps
            logger.warning("speculative decoding: max_model_len %d is too short to measure where drafting pays "
                           "(%d tokens a request); drafting at every batch size", self.max_model_len,
                           prompt_len + max_tokens + k)
            return self.config.max_num_seqs
        if sizes is None:
            graphs = self.runner.graphs
            sizes = measured_sizes(graphs.SIZES, self.config.max_num_seqs, graphs.max_batch, k)
        blocks = -(-(prompt_len + max_tokens + k) // self.config.block_size)
        times = StepTimes([], [], [])
        preemptions = self.scheduler.num_preemptions
        try:
            for size in sizes:
                if size * blocks > self.block_manager.num_free_blocks:
                    break  # larger batches would preempt: not measured, so they do not draft
                plain, spec = (self._time_steps(size, draft, prompt_len, max_tokens, warm, steps)
                               for draft in (False, True))
                times.sizes.append(size)
                times.plain.append(plain)
                times.spec.append(spec)
        finally:
            sp.forced = None
            sp.num_draft_tokens = sp.num_accepted_tokens = 0
            self.scheduler.num_preemptions = preemptions
        if not times.sizes:
            logger.warning("speculative decoding: no batch size could be measured (the KV cache holds too few "
                           "blocks); drafting at every batch size")
            return self.config.max_num_seqs
        limit = sp.use_times(times)
        logger.info("speculative decoding: drafting at batch sizes up to %d, where %d drafts a step pay at %.2f of "
                    "them accepted (step ms without / with drafts by batch size: %s)", limit, k, sp.acceptance(),
                    ", ".join(f"{s}: {1e3 * p:.3f} / {1e3 * t:.3f}" for s, p, t in zip(*dataclasses.astuple(times))))
        return limit

    def _time_steps(self, size: int, draft: bool, prompt_len: int, max_tokens: int, warm: int, steps: int) -> float:
        """The median seconds of `step()` with `size` requests decoding, drafting or not."""
        self.speculator.forced = draft
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, seed=0)
        vocab = self.model_config.vocab_size
        ids = [f"batch-cutoff-{size}-{i}" for i in range(size)]
        for i, rid in enumerate(ids):
            self.add_request(rid, [(7 + 31 * i + j) % vocab for j in range(prompt_len)], params)
        while any(rid in self.requests and not self.requests[rid].output_token_ids for rid in ids):
            self.step()  # the prefill
        for _ in range(warm):
            self.step()
        seconds = []
        for _ in range(steps):
            start = time.perf_counter()
            self.step()
            seconds.append(time.perf_counter() - start)
        for rid in ids:
            self.abort_request(rid)
        while self.inflight is not None or self.has_unfinished_requests():
            self.step()
        return statistics.median(seconds)

    def _make_kv_connector(self):
        from engine.kv.connector import KVConfig, KVConnector

        c = self.config
        kv_config = KVConfig(directory_url=c.kv_directory, replica_id=c.replica_id, advertise_host=c.advertise_host,
                             transfer_port=c.kv_transfer_port, transport=c.kv_transport,
                             transfer_streams=c.kv_transfer_streams,
                             min_prefix_tokens=c.kv_min_prefix_tokens, pull_policy=c.kv_pull_policy,
                             secret=c.kv_secret)
        pool = self.runner.kv_pool
        connector = KVConnector(kv_config, self.block_manager, pool.caches, self.model_key,
                                windowed=[pool.is_window(i) for i in range(len(pool.caches))]
                                if pool.has_window_pages else None)
        connector.start()
        return connector

    @property
    def runner(self) -> ModelRunner:
        """Rank 0's model runner (in this process whatever the number of ranks)."""
        return self.executor.runner

    def shutdown(self) -> None:
        """Stop background services (the KV directory heartbeat and transfer server) and the other ranks."""
        if self.kv is not None:
            self.kv.stop()
            self.kv = None
        self.executor.shutdown()

    # -- state the server and the autoscaler read ---------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self.pending_pulls)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def kv_cache_usage(self) -> float:
        return self.block_manager.usage

    def has_unfinished_requests(self) -> bool:
        # a step in flight holds only running requests (or ended ones, whose rows produce nothing)
        return self.scheduler.has_unfinished() or bool(self.pending_pulls)

    # -- requests -----------------------------------------------------------------------------------
    @property
    def vision_config(self) -> VisionConfig | None:
        """The model's vision tower settings; None for a text-only model."""
        return getattr(self.runner.model, "vision_config", None)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    collect_logits: bool = False, images: list[ImageInput] | None = None) -> None:
        """Queue a request; raises ValueError (PromptTooLongError for length) naming the problem.
        images: the prompt's images (engine.multimodal), each already placed on its span of
        placeholder ids (`place_images`)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params.validate()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if images:
            if self.vision_config is None:
                raise ValueError(f"the model {self.model_config.architecture} has no vision tower: it takes no images")
            check_spans(ids, images, self.vision_config.image_token_id)
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens, but this model's context length (max_model_len) is "
                f"{self.max_model_len} tokens, which leaves no room to generate")
        if params.seed is not None:
            gen = torch.Generator().manual_seed(params.seed)
        else:
            gen = torch.Generator().manual_seed(self._rng.getrandbits(63))
        seq = Sequence(request_id, ids, params, gen, images)
        if params.structured_output is not None:
            seq.guide = Guide(self._guide_tokenizer(), params.structured_output)  # StructuredOutputError: a ValueError
        seq.collect_logits = collect_logits
        seq.prompt_logits = [] if collect_logits else None
        self.requests[request_id] = seq
        self.output_processor.add(seq)
        if self.kv is not None and self._start_pull(seq):
            return
        self.scheduler.add(seq)

    def _guide_tokenizer(self):
        if self.guide_tokenizer is None:
            self.guide_tokenizer = guide_tokenizer((self.model_path / "tokenizer.json").read_text(),
                                                   self.model_config.vocab_size, self.eos_token_ids)
        return self.guide_tokenizer

    def _start_pull(self, seq: Sequence) -> bool:
        """Ask the fleet for the prefix this replica lacks; the request waits for the pull (or its failure)."""
        hashes = self.block_manager.prefix_hashes(seq)
        num_local = len(self.block_manager.match_prefix(seq))
        pending = self.kv.start_pull(hashes, num_local)
        if pending is None:
            return False
        self.pending_pulls[seq.request_id] = (seq, pending)
        return True

    def _finish_pulls(self) -> None:
        """Hand requests whose pull finished (or failed) to the scheduler, their pulled blocks cached."""
        if not self.pending_pulls:
            return
        if not self.scheduler.has_unfinished():
            # nothing else to run: wait a little for a transfer instead of spinning
            futures_wait([p.future for _, p in self.pending_pulls.values()], timeout=0.01, return_when=FIRST_COMPLETED)
        bs = self.block_manager.block_size
        for rid, (seq, pending) in list(self.pending_pulls.items()):
            if not pending.future.done():
                continue
            del self.pending_pulls[rid]
            tokens = [seq.token_ids((pending.first_block + i) * bs, (pending.first_block + i + 1) * bs)
                      for i in range(len(pending.hashes))]
            seq.pinned_blocks = self.kv.install(pending, tokens)
            self.planner.replicate(seq.pinned_blocks)  # written on rank 0: every rank holds the latent cache
            seq.remote_span = (pending.first_block * bs, (pending.first_block + len(seq.pinned_blocks)) * bs)
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Stop a request at any point and free its KV blocks at once."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return
        self.output_processor.remove(request_id)
        pending = self.pending_pulls.pop(request_id, None)
        if pending is not None:
            future = pending[1].future
            # a transfer already under way finishes and is dropped: its staging buffer goes back
            if not future.cancel():
                future.add_done_callback(_release_pulled)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "abort"
            return
        self._unpin(seq)
        if not seq.is_finished:
            self.scheduler.finish(seq, "abort")

    def _unpin(self, seq: Sequence) -> None:
        if seq.pinned_blocks:
            self.block_manager.unpin(seq.pinned_blocks)
            seq.pinned_blocks = []

    # -- the loop -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Launch a step and return the outputs of the step before it (with async scheduling), or of the
        step just launched."""
        self._finish_pulls()
        if self.inflight is None:
            batch = self.scheduler.schedule()
            if not batch:
                return []
            self.inflight = self._launch(batch)
        current, self.inflight = self.inflight, self._launch_ahead(self.inflight)
        outputs = self._resolve(current)
        if self.inflight is not None and self.inflight.logits is not None:
            # guided rows: the forward runs while the host read the last step and advanced the grammars;
            # now their masks are computed and the step's draws queued
            self.inflight = self._sample(self.inflight)
        return outputs

    def _launch(self, batch: ScheduledBatch, inputs: torch.Tensor | None = None, offsets: torch.Tensor | None = None,
                unresolved: dict[int, int] | None = None) -> LaunchedStep:
        """Queue the model and the draws of a step on the device. inputs: a decode batch's token ids on
        the device (the draws of the step in flight). offsets: launched ahead of a speculative step, its
        tokens' positions past the host's (that step's accepted drafts) [T] on the device; unresolved:
        id(seq) -> the drafts that step verifies."""
        for seq, _ in batch.items:
            if seq.pinned_blocks:  # admitted: its own references now hold the pulled blocks
                self._unpin(seq)
        timer = StepTimer(self.runner.device) if self.kv is not None and batch.prefills else None
        plan = self.planner.build(batch, inputs_on_device=inputs is not None, shifted=offsets is not None)
        drafts_of = {id(seq): d for seq, d in zip(batch.verifies, batch.num_drafts)}
        plan.fused_verify = self._fuses(batch, plan, drafts_of, unresolved)
        if plan.fused_verify:
            plan.fused_sampling = FusedSampling.of([seq for seq, _ in batch.items])
        elif self._draws_in_graph(batch, drafts_of):
            plan.draw_in_graph = True
            plan.fused_sampling = FusedSampling.of([seq for seq, _ in batch.items])
        result = self.executor.execute(plan, inputs, offsets)
        if result.spec is not None:
            return self._launched_fused(batch, result.spec)
        logits = result.logits
        if timer is not None:
            timer.stop()  # read when the step's tokens are: the prefill rate the pull policy weighs
        items = batch.items
        offset, groups = 0, []
        for seq, n in items:
            if seq.collect_logits:
                seq.prompt_logits.append(result.all_logits[offset : offset + n])
            drafts = drafts_of.get(id(seq), 0)
            if drafts:
                groups.append((seq, n))  # a verification: each of its rows samples (the plan's order)
            elif seq.num_computed_tokens + n == seq.num_drawn_tokens:  # sampled by the plan (its rows' order)
                groups.append((seq, 1))
            offset += n
            # a verification's drafts count as computed once accepted (`_resolve`): until then the host
            # counts its first row, so a step launched ahead places its rows from there on the device
            seq.num_computed_tokens += n - drafts
        if inputs is not None and any(seq.guide is not None for seq, _ in groups):
            # launched ahead: a guided row's mask needs the token in flight, so it samples after that
            # step is read (`_sample`), while this step's forward runs
            return LaunchedStep(batch, groups, None, timer, logits=logits)
        row_seqs = [seq for seq, rows in groups for _ in range(rows)]
        ahead = [j for _, rows in groups for j in range(rows)] if drafts_of else None
        # penalties count the drafts a row follows; a step launched ahead has none (its drafts are on the device)
        drafts_before = ([seq.draft_token_ids[:j] for seq, rows in groups for j in range(rows)]
                         if drafts_of and inputs is None else None)
        draws = None
        if groups and result.tokens is not None:  # drawn in a graph (`StepPlan.draw_in_graph`)
            draws = Draws(result.tokens, row_seqs, None, send=self.speculator is None)
        elif groups:  # with drafts, the copy to the host waits for the accepted counts and drafts to join it
            draws = self.sampler.sample(logits, row_seqs, inputs, drafts_before, ahead, offsets,
                                        send=self.speculator is None)
        for seq, _ in groups:
            seq.num_inflight_tokens += 1
        spec = None
        if self.speculator is not None:
            spec = self.speculator.launch(plan, items, groups, draws.tokens if draws else None,
                                          len(self.scheduler.running), self.runner.device, inputs, unresolved, draws)
        return LaunchedStep(batch, groups, draws, timer, spec)

    def _draws_in_graph(self, batch: ScheduledBatch, drafts_of: dict[int, int]) -> bool:
        """Whether a step's draws may be made in a graph after the decode graph (`StepPlan.draw_in_graph`):
        every row a decode that draws one token for a request that needs nothing of the host (no
        logprobs, penalties, grammar or prompt scoring); greedy or sampled (temperature, top-k, top-p)."""
        if self.runner.draw_graphs is None or batch.prefills or drafts_of:
            return False
        for seq, n in batch.items:
            p = seq.params
            if (n != 1 or seq.num_computed_tokens + 1 != seq.num_drawn_tokens or p.logprobs is not None
                    or p.has_penalties or seq.guide is not None or seq.collect_logits):
                return False
        return True

    def _fuses(self, batch: ScheduledBatch, plan, drafts_of: dict[int, int], unresolved: dict[int, int] | None) -> bool:
        """Whether a step may verify, accept and draft in one replay (`StepPlan.fused_verify`): every row a
        verification of k drafts by a request that needs nothing of the host (no logprobs, penalties,
        grammar or prompt scoring) and drafts again after it; greedy or sampled (temperature, top-k,
        top-p: drawn in the graph)."""
        sp = self.speculator
        if sp is None or self.runner.spec_graphs is None or len(drafts_of) != len(batch.items) or batch.prefills:
            return False
        if not sp.drafts_at(len(self.scheduler.running)):
            return False
        k, unresolved = sp.k, unresolved or {}
        for (seq, n), start in zip(batch.items, plan.num_computed):
            p = seq.params
            if (n != k + 1 or drafts_of[id(seq)] != k or p.logprobs is not None or p.has_penalties
                    or not sp.may_draft(seq, start + n + unresolved.get(id(seq), 0))):
                return False
        return True

    def _launched_fused(self, batch: ScheduledBatch, fused) -> LaunchedStep:
        """A fused verification's step (`SpecGraphs`): its tokens, accepted counts and drafts already on
        the device (`FusedVerify`), one copy to the host for all three."""
        k = self.speculator.k
        seqs = [seq for seq, _ in batch.items]
        for seq in seqs:
            seq.num_computed_tokens += 1  # the drafts count once accepted (`_resolve`)
            seq.num_inflight_tokens += 1
        draws = Draws(fused.tokens, [seq for seq in seqs for _ in range(k + 1)], None, send=False)
        offset = draws.send(fused.counts, fused.drafts, within=fused.sent)
        spec_step = SpecStep(seqs, [k] * len(seqs), [True] * len(seqs), draws.copy, fused.counts, fused.drafts,
                             offset, (fused.next_inputs, fused.next_offsets))
        return LaunchedStep(batch, [(seq, k + 1) for seq in seqs], draws, None, spec_step)

    def _launch_ahead(self, step: LaunchedStep) -> LaunchedStep | None:
        """The decode step after `step`, launched before its tokens reach the host; None where the next
        step must be scheduled with every token known (admissions, prefills, ...)."""
        if not self.async_scheduling or step.batch.prefills or step.draws is None:
            return None
        if self.speculator is not None and any(seq.guide is not None for seq, _ in step.groups):
            return None  # the MTP pass after a step needs its draws at once: a guided row's wait for its mask
        if self.scheduler.can_admit_next():
            return None  # admit it first (one that cannot be admitted yet does not hold everyone back)
        spec = step.spec if step.spec is not None and step.spec.seqs else None
        row = {id(seq): i for i, (seq, _) in enumerate(step.groups)}
        seqs, rows = [], []
        # every running sequence goes on, or none does: one left out would wait for the chain to end
        for seq in self.scheduler.running:
            if self._ends_at_inflight_tokens(seq):
                continue  # a length limit: known ahead, no row needed
            if id(seq) not in row or seq.collect_logits:
                return None  # not in that step, or scoring (every position's logits, one step at a time)
            if spec is not None and seq.params.has_penalties:
                return None  # its penalties count the tokens before each row: how many is read first
            seqs.append(seq)
            rows.append(row[id(seq)])
        if not seqs:
            return None
        if spec is not None:
            return self._launch_after_drafts(step, seqs)
        batch = self.scheduler.schedule_ahead(seqs)
        if batch is None:
            return None
        inputs = step.draws.tokens
        if rows != list(range(len(step.groups))):
            inputs = inputs.index_select(0, to_device(rows, torch.long, inputs.device))
        return self._launch(batch, inputs)

    def _launch_after_drafts(self, step: LaunchedStep, seqs: list[Sequence]) -> LaunchedStep | None:
        """The step after a speculative one, launched before its accepted counts are read: each sequence's
        rows are its bonus token (drawn at its last accepted row) and the drafts after it, gathered on the
        device, at positions shifted there by its accepted count; blocks are grown as if every draft in
        flight were accepted. A sequence that turns out to have finished has its rows dropped when read."""
        spec, k = step.spec, self.speculator.k
        verified = {id(seq): n for seq, n in zip(spec.seqs, spec.num_verified)}
        counted = {id(seq): i for i, seq in enumerate(spec.seqs)}  # its accepted count's index
        drafted = {id(seq): i for i, seq in enumerate(s for s, d in zip(spec.seqs, spec.drafting) if d)}
        first, index = {}, 0
        for seq, num_rows in step.groups:
            first[id(seq)] = index
            index += num_rows
        num_drafts = []
        for seq in seqs:
            most = seq.num_drawn_tokens + verified.get(id(seq), 0)  # its tokens if every draft is accepted
            num_drafts.append(self.speculator.allowed_drafts(seq, most) if id(seq) in drafted else 0)
        unresolved = [verified.get(id(seq), 0) for seq in seqs]
        batch = self.scheduler.schedule_ahead(seqs, num_drafts, unresolved)
        if batch is None:
            return None
        unresolved = dict(zip(map(id, seqs), unresolved))
        if spec.next is not None and len(batch.items) == len(spec.seqs) and all(
                seq is s and n == k + 1 for (seq, n), s in zip(batch.items, spec.seqs)):
            return self._launch(batch, *spec.next, unresolved)  # the fused step gathered them already
        tokens = step.draws.tokens
        num_drawn = tokens.shape[0]
        # per token of the new step: where its input is (a draw, or a draft past the draws), whose count
        # shifts it, and whether the count moves its input too (the bonus token's row is the accepted one)
        source, count, moves = [], [], []
        none = len(spec.seqs)  # a sequence without a count (it verified nothing) reads a zero appended there
        for seq, n in batch.items:
            c = counted.get(id(seq), none)
            source.append(first[id(seq)])
            source += [num_drawn + drafted.get(id(seq), 0) * k + j for j in range(n - 1)]
            count += [c] * n
            moves += [1] + [0] * (n - 1)
        index = index_to_device((tuple(source), tuple(count), tuple(moves)), tokens.device)
        pool = tokens if spec.drafts is None else torch.cat([tokens, spec.drafts.flatten()])
        counts = spec.counts if none not in count else torch.cat([spec.counts, spec.counts.new_zeros(1)])
        offsets = counts.index_select(0, index[1])
        inputs = pool.index_select(0, index[0] + offsets * index[2])
        return self._launch(batch, inputs, offsets, unresolved)

    def _sample(self, step: LaunchedStep) -> LaunchedStep:
        """Queue the draws of a step launched ahead with guided rows, after the step before it was read
        (its tokens are in the sequences now, so nothing is pending). A row whose request ended meanwhile
        is drawn unguided and dropped when read."""
        seqs = [seq for seq, _ in step.groups]
        guides = [seq.guide for seq in seqs]
        for seq in seqs:
            if seq.is_finished:
                seq.guide = None
        try:
            draws = self.sampler.sample(step.logits, seqs)
        finally:
            for seq, guide in zip(seqs, guides):
                seq.guide = guide
        for seq in seqs:
            seq.num_inflight_tokens += 1
        return step._replace(draws=draws, logits=None)

    def _ends_at_inflight_tokens(self, seq: Sequence) -> bool:
        """Whether the tokens in flight take `seq` to its max_tokens or the context length."""
        max_tokens = seq.params.max_tokens
        num_out = seq.num_drawn_tokens - seq.num_prompt_tokens
        return (max_tokens is not None and num_out >= max_tokens) or seq.num_drawn_tokens >= self.max_model_len

    def _append(self, seq: Sequence, token: int, lp: dict[int, float] | None) -> str | None:
        """One drawn token into its request -> why the request finishes now, or None."""
        off_grammar = seq.guide is not None and not seq.guide.advance(token)
        if off_grammar:  # only if the mask left nothing to draw
            logger.warning("request %s: token %d is outside its grammar; ending it", seq.request_id, token)
        reason = self.output_processor.append(seq, token, lp, self.max_model_len)
        if reason is None and seq.guide is not None and (off_grammar or seq.guide.done):
            reason = "stop"  # the grammar is complete
        return reason

    def _resolve_spec(self, spec: SpecStep | None) -> tuple[dict[int, int], dict[int, list[int]]]:
        """A step's verifications and drafts on the host -> (id(seq) -> drafts accepted, id(seq) -> its
        next drafts)."""
        if spec is None or not spec.seqs:
            return {}, {}
        counts, drafts = spec.result()
        it = iter(drafts)
        next_drafts = {id(seq): next(it) for seq, d in zip(spec.seqs, spec.drafting) if d}
        self.speculator.num_draft_tokens += sum(spec.num_verified)
        self.speculator.num_accepted_tokens += sum(counts)
        return {id(seq): a for seq, a in zip(spec.seqs, counts)}, next_drafts

    def _resolve(self, step: LaunchedStep) -> list[RequestOutput]:
        """Read a launched step's tokens (waiting for it only) and turn them into outputs."""
        for seq, _ in step.batch.items:
            if not seq.is_finished:  # full blocks join the prefix cache (those whose tokens are known)
                self.block_manager.commit(seq)
        outputs = []
        if step.draws is not None:
            tokens, logprobs = step.draws.result()
            accepted, spec = self._resolve_spec(step.spec)
            if step.prefill_timer is not None:
                self.kv.observe_prefill(sum(n for _, n in step.batch.prefills), step.prefill_timer.elapsed())
            now = time.monotonic()
            index = 0
            for seq, num_rows in step.groups:
                rows = slice(index, index + 1 + accepted.get(id(seq), 0))
                index += num_rows
                seq.num_inflight_tokens -= 1
                if seq.is_finished:  # ended (or was aborted) while this step ran: its rows are dropped
                    continue
                if num_rows > 1:  # the accepted drafts' positions are computed; the rejected ones' come again
                    seq.num_computed_tokens += rows.stop - rows.start - 1
                    seq.metrics.num_draft_tokens += num_rows - 1
                    seq.metrics.num_accepted_tokens += rows.stop - rows.start - 1
                    seq.metrics.num_verify_steps += 1
                if seq.metrics.first_token_time is None:
                    seq.metrics.first_token_time = now
                    seq.metrics.num_prefill_tokens = seq.num_prompt_tokens - seq.num_cached_tokens
                seq.draft_token_ids = []
                for token, lp in zip(tokens[rows], logprobs[rows]):
                    reason = self._append(seq, token, lp)
                    if reason is not None:
                        # the blocks this step's accepted drafts completed join the prefix cache before the
                        # blocks are freed (the commit above ran before the drafts counted as computed)
                        self.block_manager.commit(seq)
                        self.scheduler.finish(seq, reason)
                        break
                if not seq.is_finished and id(seq) in spec:
                    seq.draft_token_ids = spec[id(seq)][: self.speculator.allowed_drafts(seq)]
                outputs.append(self.output_processor.output(seq))
                if seq.is_finished:
                    seq.metrics.finished_time = now
                    self.requests.pop(seq.request_id, None)
        return outputs
