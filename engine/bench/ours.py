"""Our engine, measured below the server: one rank's ModelRunner, sequences laid out by hand in the cache
and turned into plans as the engine does (`PlanBuilder`)."""

import time

import torch

from engine.bench.timing import sync, time_fn
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence, SequenceStatus
from engine.step_plan import PlanBuilder, StepPlan

PREFILL_TOKENS_PER_STEP = 16384  # when filling many sequences' contexts before a decode measurement


class BlockPool:
    """Hands out consecutive cache blocks; the benchmark owns the whole cache."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size, self.next = num_blocks, block_size, 0

    def take(self, num_tokens: int) -> list[int]:
        n = -(-num_tokens // self.block_size)
        if self.next + n > self.num_blocks:
            raise ValueError(f"the benchmark's KV cache ({self.num_blocks} blocks) is too small")
        self.next += n
        return list(range(self.next - n, self.next))

    def reset(self) -> None:
        self.next = 0


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(2, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_sequence(ids: list[int], blocks: list[int], name: str) -> Sequence:
    seq = Sequence(name, ids, SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True),
                   torch.Generator())
    seq.block_table = blocks
    seq.status = SequenceStatus.RUNNING  # holds its block-table slot while measured
    return seq


def make_planner(runner: ModelRunner) -> PlanBuilder:
    """A plan builder as the engine sets it up for this model (V4.1's Engram: the look-back tokens)."""
    planner = PlanBuilder(runner.config.max_num_seqs)
    planner.lookback = getattr(runner.model, "lookback", 0)
    return planner


def run_plan(runner: ModelRunner, planner: PlanBuilder, batch: ScheduledBatch) -> tuple[StepPlan, object]:
    """A batch as the engine runs it: planned, its table deltas applied, then run (from a graph where the
    engine's executor would replay one)."""
    plan = planner.build(batch)
    runner.tables.apply(plan.table_deltas)
    plan.table_deltas = []
    plan.use_graph = runner.takes_graph(plan)
    return plan, runner.run(plan)


def prefill(runner: ModelRunner, seqs: list[Sequence], planner: PlanBuilder | None = None) -> list[int]:
    """Prefill whole prompts (one chunk each), append each one's greedy first token -> those tokens."""
    planner = planner or make_planner(runner)
    seqs_left, firsts = list(seqs), []
    while seqs_left:
        step, budget = [], PREFILL_TOKENS_PER_STEP
        while seqs_left and (not step or seqs_left[0].num_tokens <= budget):
            budget -= seqs_left[0].num_tokens
            step.append(seqs_left.pop(0))
        _, result = run_plan(runner, planner, ScheduledBatch(prefills=[(s, s.num_tokens) for s in step]))
        for seq, token in zip(step, result.logits.argmax(-1).tolist()):
            seq.num_computed_tokens = seq.num_tokens
            seq.output_token_ids.append(token)
            firsts.append(token)
    return firsts


def time_to_first_token(once, device: torch.device, repeats: int) -> float:
    """The median host-observed time of `once()` (which ends on the host), after two untimed runs: the
    first compiles kernels for the shape, the second reaches a steady state, as a server's (the
    allocator's blocks for the size, the host's caches)."""
    once()
    once()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure_prefill(runner: ModelRunner, pool: BlockPool, length: int, vocab: int, repeats: int) -> dict:
    """Time to first token and prefill throughput for one prompt of `length` tokens."""
    ids = random_prompt(length, vocab, seed=length)

    def once():
        pool.reset()
        prefill(runner, [make_sequence(ids, pool.take(length + 1), "prefill")])  # ends on the host: a sync

    seconds = time_to_first_token(once, runner.device, repeats)
    return dict(seconds=seconds, tok_s=length / seconds)


def measure_turn(runner: ModelRunner, pool: BlockPool, prefix: int, new: int, vocab: int, repeats: int) -> dict:
    """Time to first token of a conversation's next turn: `new` tokens in one chunk over `prefix` tokens
    already in the cache (computed once, untimed), as a coding agent's next request is."""
    pool.reset()
    seq = make_sequence(random_prompt(prefix + new, vocab, seed=prefix + new), pool.take(prefix + new + 1), "turn")
    planner = make_planner(runner)
    run_plan(runner, planner, ScheduledBatch(prefills=[(seq, prefix)]))
    seq.num_computed_tokens = prefix

    def once():  # the chunk's latents land where they did the run before: each run is the same turn
        _, result = run_plan(runner, planner, ScheduledBatch(prefills=[(seq, new)]))
        result.logits.argmax(-1).tolist()  # ends on the host: a sync

    seconds = time_to_first_token(once, runner.device, repeats)
    return dict(seconds=seconds, tok_s=new / seconds, prefix=prefix, new=new)


def measure_decode(runner: ModelRunner, pool: BlockPool, concurrency: int, context: int, steps: int,
                   vocab: int) -> dict:
    """Decode throughput of `concurrency` sequences after `context`-token prompts: CUDA-graph steps
    replayed back to back (inputs prepared on the device), or eager engine steps without graphs."""
    pool.reset()
    warmup = 3
    seqs = [make_sequence(random_prompt(context, vocab, seed=1000 + i), pool.take(context + steps + warmup + 2),
                          f"decode-{i}") for i in range(concurrency)]
    planner = make_planner(runner)
    prefill(runner, seqs, planner)
    if runner.graphs is not None:
        graphs = runner.graphs
        plan = planner.build(ScheduledBatch(decodes=seqs))
        runner.tables.apply(plan.table_deltas)
        graphs.load(plan)
        for _ in range(warmup):
            graphs.replay(concurrency)  # the first replay captures the graph
        seconds = time_fn(lambda: [graphs.replay(concurrency) for _ in range(steps)], runner.device,
                          repeats=1, warmup=0)
        mode = "cuda_graph"
    else:
        def step():
            _, result = run_plan(runner, planner, ScheduledBatch(decodes=seqs))
            for seq, token in zip(seqs, result.logits.argmax(-1).tolist()):
                seq.num_computed_tokens += 1
                seq.output_token_ids.append(token)

        for _ in range(warmup):
            step()
        seconds = time_fn(lambda: [step() for _ in range(steps)], runner.device, repeats=1, warmup=0)
        mode = "eager"
    return dict(seconds_per_step=seconds / steps, tok_s=concurrency * steps / seconds, mode=mode,
                context=context + warmup + steps // 2)


def one_decode(runner: ModelRunner, pool: BlockPool, context: int, vocab: int):
    """One sequence prefilled to `context` tokens and its next decode step's (sequence, positions, metadata),
    from the graphs' buffers where graphs exist."""
    pool.reset()
    seq = make_sequence(random_prompt(context, vocab, seed=7), pool.take(context + 4), "layers")
    planner = make_planner(runner)
    prefill(runner, [seq], planner)
    plan = planner.build(ScheduledBatch(decodes=[seq]))
    runner.tables.apply(plan.table_deltas)
    if runner.graphs is not None:
        runner.graphs.load(plan)
        meta, positions = runner.graphs.metadata(1)
    else:
        _, positions, meta = runner._prepare(plan)
    return seq, positions, meta


def time_replayed(runner: ModelRunner, run, repeats: int) -> float:
    """Seconds per call of `run`, captured as a CUDA graph and replayed where graphs exist."""
    if runner.graphs is not None:
        run()  # warm-up (kernels compile) outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=runner.graphs.pool):
            run()
        run = graph.replay
    return time_fn(lambda: [run() for _ in range(repeats)], runner.device, repeats=3, warmup=1) / repeats


@torch.inference_mode()
def measure_layers(runner: ModelRunner, pool: BlockPool, context: int, vocab: int, repeats: int = 50) -> list[dict]:
    """Each decoder layer alone, one sequence at `context` tokens (graph-replayed where graphs exist)."""
    _, positions, meta = one_decode(runner, pool, context, vocab)
    model, dev = runner.model, runner.device
    hidden = runner.model_config.hidden_size
    g = torch.Generator(dev).manual_seed(0)
    h = torch.randn(1, hidden, generator=g, device=dev, dtype=runner.dtype)
    residual = torch.randn(1, hidden, generator=g, device=dev, dtype=runner.dtype)
    out = []
    for i, layer in enumerate(model.model.layers):
        seconds = time_replayed(runner, lambda: layer(positions, h, residual, meta), repeats)
        out.append(dict(layer=i, kind="moe" if hasattr(layer.mlp, "experts") else "dense", seconds=seconds))
    return out
