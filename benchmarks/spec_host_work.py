"""The host's work per step of `LLMEngine.step` at one stream: plain decoding, speculative steps through
the decode and draft graphs, and fused speculative steps (`SpecGraphs`: verify, accept and draft in one
replay) -> torch calls per step and host milliseconds per step, outside the graph replays.

    python -m benchmarks.spec_host_work [--k 3] [--max-tokens 96] [--rounds 3] [--device cpu|cuda] [--dtype float32]

On a CPU each graph's function runs where its replay would be (as the tests run the graph path's host
side) and neither its calls nor its time count; on a GPU the graphs are captured and replayed, and the
time per step is the wall clock's (the host bounds these steps: the device waits for it).
"""

import argparse
import contextlib
import statistics
import time

from torch.overrides import TorchFunctionMode

from engine import LLM, SamplingParams
from engine.model_runner import DecodeGraphs, DraftGraphs, SpecGraphs


class CallCounter(TorchFunctionMode):
    """Counts torch functions and tensor methods called while it is active and not paused."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.paused = 0
        self.paused_seconds = 0.0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.calls += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def pause(self):
        self.paused += 1
        start = time.perf_counter()
        try:
            yield
        finally:
            self.paused_seconds += time.perf_counter() - start
            self.paused -= 1


COUNTER = CallCounter()


class EagerGraph:
    """A captured graph's stand-in on a CPU: its replay runs the function, uncounted."""

    def __init__(self, fn):
        self.fn = fn

    def replay(self):
        with COUNTER.pause():
            self.fn()


def eager_graphs(llm: LLM, fused: bool) -> None:
    """The graphs' host side on a CPU, each graph's function where its replay would be."""
    import engine.kernels.sampling

    engine.kernels.sampling.sample = lambda logits, *args, out=None, **kwargs: (  # greedy stands in
        logits.argmax(-1) if out is None else out.copy_(logits.argmax(-1)))
    runner = llm.engine.runner
    decode = runner.graphs = DecodeGraphs(runner)
    decode._capture = lambda b: decode.graphs.__setitem__(
        b, EagerGraph(lambda: decode.outputs.__setitem__(b, decode._step(b))))
    decode.capture_all()
    if not runner.num_speculative_tokens:
        return
    drafts = runner.draft_graphs = DraftGraphs(runner)
    for s in DecodeGraphs.SIZES:
        if s * (drafts.k + 1) <= drafts.max_rows:
            key = drafts.key(s * (drafts.k + 1), s)
            drafts.graphs[key] = EagerGraph(lambda key=key: drafts.outputs.__setitem__(key, drafts._draft(key)))
    if fused:
        spec = runner.spec_graphs = SpecGraphs(runner)

        def capture(n, draw):  # as a graph does, each replay writes the same output buffer
            key = (n, draw)
            spec.outputs[key] = spec._step(n, draw)
            spec.graphs[key] = EagerGraph(lambda: spec.outputs[key].copy_(spec._step(n, draw)))

        spec._capture = capture
        spec.capture_all()


def measure(llm: LLM, prompt: list[int], max_tokens: int, count: bool) -> tuple[list[int], list[float], int]:
    """One request to its end, from its second step -> (torch calls per step, host seconds per step, the
    number of steps). The request's last steps draft fewer than k tokens and run eagerly: the medians
    are the steady state's."""
    eng = llm.engine
    eng.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    eng.step()  # the prefill
    calls, seconds = [], []
    # counting costs host time itself: a round either counts (calls) or is timed (seconds)
    with COUNTER if count else contextlib.nullcontext():
        while eng.has_unfinished_requests():
            COUNTER.calls, COUNTER.paused_seconds = 0, 0.0
            start = time.perf_counter()
            eng.step()  # on a GPU it waits for the step before only if the device is behind the host
            seconds.append(time.perf_counter() - start - COUNTER.paused_seconds)
            calls.append(COUNTER.calls)
    return calls, seconds, len(calls)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="deepseek-tiny")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    on_gpu = args.device == "cuda"
    settings = [("plain", 0, False), (f"k = {args.k}, decode + draft graphs", args.k, False),
                (f"k = {args.k}, fused", args.k, True)]
    engines = []
    for name, k, fused in settings:
        spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
        llm = LLM(args.model, dtype=args.dtype, device=args.device, max_num_seqs=4, async_scheduling="on",
                  speculative_config=spec)
        if on_gpu:
            if not fused and llm.engine.runner.spec_graphs is not None:
                llm.engine.runner.spec_graphs = None  # the path without the fused graph
        else:
            eager_graphs(llm, fused)
        engines.append(llm)
    tok = engines[0].tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What does json.dumps do?"}]),
                        add_bos=False)
    results = {name: [] for name, _, _ in settings}
    for r in range(args.rounds + 1):  # interleaved: the host's speed drifts; the first round counts calls
        for (name, _, _), llm in zip(settings, engines):
            results[name].append(measure(llm, prompt, args.max_tokens, count=r == 0))
    print(f"one stream, {args.max_tokens} greedy tokens, {args.device}, medians over the steps of {args.rounds} rounds")
    print(f"{'setting':<36} {'steps':>6} {'torch calls/step':>17} {'host ms/step':>13} {'host ms/token':>14}")
    for name, runs in results.items():
        calls = statistics.median(runs[0][0])
        seconds = statistics.median(s for r in runs[1:] for s in r[1])
        steps = runs[0][2]
        per_token = seconds * steps / args.max_tokens  # every step at the median
        print(f"{name:<36} {steps:>6} {calls:>17.1f} {1e3 * seconds:>13.3f} {1e3 * per_token:>14.3f}")

if __name__ == "__main__":
    main()
