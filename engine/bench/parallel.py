"""`bench --tensor-parallel-size N [--enable-expert-parallel]`: the engine's steps over N ranks.

Below the server but through the executor, as the engine runs them: every step is a plan broadcast to
the ranks, decode steps take CUDA graphs where they fit, and a decode step's inputs are the previous
step's tokens still on rank 0's device (broadcast inside the step, as async scheduling does), so the
host waits only at the end. Random weights of the preset's shape on every rank; the same figures at
TP=1 come from the same code (`--tensor-parallel-size 1 --parallel-path`), for a like-for-like ratio.
"""

import datetime
import time

import torch

from engine.bench.ours import PREFILL_TOKENS_PER_STEP, make_sequence, random_prompt
from engine.bench.timing import sync
from engine.config import EngineConfig, ModelConfig
from engine.executor import create_executor
from engine.scheduler import ScheduledBatch
from engine.step_plan import PlanBuilder


def run_parallel(opts, model_config: ModelConfig, name: str) -> dict:
    bs, max_conc = opts.block_size, max(opts.concurrency)
    decode_len = opts.decode_context + opts.decode_steps + 16
    max_len = max(opts.prompt_lens + [decode_len]) + bs
    num_blocks = max(-(-max_len // bs), max_conc * -(-decode_len // bs)) + 4
    config = EngineConfig(model=name, dtype=opts.dtype, device=opts.device, attention_backend=opts.backend,
                          max_num_seqs=max_conc, max_num_batched_tokens=max(opts.prompt_lens + [max_conc]),
                          block_size=bs, num_kv_blocks=num_blocks, seed=opts.seed, show_progress=False,
                          tensor_parallel_size=opts.tensor_parallel_size,
                          enable_expert_parallel=opts.enable_expert_parallel,
                          extra={"enforce_eager": opts.eager})
    executor = create_executor(config, model_config, None, max_len)
    try:
        runner = executor.runner
        vocab, dev = model_config.vocab_size, runner.device
        prefill = {str(n): _prefill(executor, n, vocab, opts.repeats, num_blocks) for n in opts.prompt_lens}
        decode = {str(c): _decode(executor, c, opts.decode_context, opts.decode_steps, vocab, bs)
                  for c in opts.concurrency}
        return dict(
            preset=name, command=opts.command, date=datetime.date.today().isoformat(), torch=torch.__version__,
            gpu=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            tensor_parallel_size=opts.tensor_parallel_size, enable_expert_parallel=opts.enable_expert_parallel,
            dtype=str(runner.dtype).replace("torch.", ""), backend=runner.backend, cuda_graphs=runner.graphs is not None,
            weights=str(runner.dtype).replace("torch.", ""), num_layers=model_config.num_hidden_layers,
            decode_context=opts.decode_context, decode_steps=opts.decode_steps,
            prefill_tok_s={k: v["tok_s"] for k, v in prefill.items()}, ttft_s={k: v["seconds"] for k, v in prefill.items()},
            decode_tok_s={k: v["tok_s"] for k, v in decode.items()}, prefill=prefill, decode=decode,
        )
    finally:
        executor.shutdown()


def _prefill(executor, length: int, vocab: int, repeats: int, num_blocks: int) -> dict:
    """One prompt of `length` tokens in one step (its first token read back) -> seconds, tokens/s."""
    ids = random_prompt(length, vocab, seed=length)
    blocks = list(range(-(-(length + 1) // executor.runner.block_size)))
    assert len(blocks) <= num_blocks

    def once():
        seq = make_sequence(ids, list(blocks), "prefill")
        result = executor.execute(PlanBuilder(1).build(ScheduledBatch(prefills=[(seq, length)])))
        result.logits.argmax(-1).tolist()  # the first token on the host: the step is done

    once()  # kernels compile for this shape
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    seconds = sorted(times)[len(times) // 2]
    return dict(seconds=seconds, tok_s=length / seconds)


def _decode(executor, concurrency: int, context: int, steps: int, vocab: int, block_size: int) -> dict:
    """`concurrency` sequences after `context`-token prompts, `steps` decode steps back to back."""
    per_seq = -(-(context + steps + 8) // block_size)
    seqs = [make_sequence(random_prompt(context, vocab, seed=1000 + i), list(range(i * per_seq, (i + 1) * per_seq)),
                          f"decode-{i}") for i in range(concurrency)]
    planner = PlanBuilder(concurrency)
    firsts = []
    for start in range(0, concurrency, max(1, PREFILL_TOKENS_PER_STEP // context)):
        group = seqs[start : start + max(1, PREFILL_TOKENS_PER_STEP // context)]
        result = executor.execute(planner.build(ScheduledBatch(prefills=[(s, s.num_tokens) for s in group])))
        firsts.append(result.logits.argmax(-1))
    tokens = torch.cat(firsts)
    for seq in seqs:
        seq.num_computed_tokens = seq.num_tokens
        seq.num_inflight_tokens = 1  # the token on the device is the next step's input

    def step(tokens):
        out = executor.execute(planner.build(ScheduledBatch(decodes=seqs), inputs_on_device=True), tokens)
        for seq in seqs:
            seq.num_computed_tokens += 1
            seq.output_token_ids.append(0)  # its value stays on the device; the count is what matters
        return out.logits.argmax(-1)

    for _ in range(3):
        tokens = step(tokens)  # graphs and kernels warm
    sync(executor.runner.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        tokens = step(tokens)
    tokens.tolist()
    seconds = time.perf_counter() - t0
    return dict(seconds_per_step=seconds / steps, tok_s=concurrency * steps / seconds)
