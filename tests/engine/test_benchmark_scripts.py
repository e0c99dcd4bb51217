"""The benchmark scripts that have a CPU mode, run as their docstrings say: they are otherwise run only on
a card, where a script that no longer matches the engine (a renamed argument, a graph's new key) costs
the card's time to find. What they measure is the card's; here only that they run and report."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_script(*args: str, timeout: int = 300) -> str:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_spec_host_work_reports_each_setting():
    """The fused speculative graphs' host side emulated on a CPU (`SpecGraphs` keyed by sequences and
    kind of draw): plain decoding, drafts through the decode and draft graphs, and fused steps."""
    out = run_script("-m", "benchmarks.spec_host_work", "--max-tokens", "24", "--rounds", "1")
    rows = {line.split("  ")[0]: line.split() for line in out.splitlines()}
    assert {"plain", "k = 3, decode + draft graphs", "k = 3, fused"} <= set(rows)
    assert float(rows["k = 3, fused"][-3]) < float(rows["k = 3, decode + draft graphs"][-3])  # torch calls/step


def test_spec_decode_times_the_fused_step_folded_and_not(monkeypatch):
    """`benchmarks/spec_decode.py`'s fused step on the `tiny` preset with an MTP layer on a CPU, each graph's function
    where its replay would be: captured once with the verification folded into the decode kernel's heads
    and once without (the switch read as the graph is captured, and put back), and timed."""
    from benchmarks import spec_decode
    from engine import model_runner
    from engine.bench.presets import preset_config
    from engine.config import EngineConfig, ModelConfig
    from engine.layers import attention

    folds = []

    class Replayed:  # a captured graph's stand-in: replay runs the step again into the same outputs
        def __init__(self, step, out):
            self.step, self.out = step, out

        def replay(self):
            self.out.copy_(self.step())

        def pool(self):
            return None

    def capture(step, pool, reset=None):
        folds.append(attention.FOLD_VERIFICATIONS)
        out = step()
        if reset is not None:
            reset()
        return Replayed(step, out), out

    monkeypatch.setattr(model_runner, "capture_graph", capture)
    hf = dict(preset_config("tiny"), num_nextn_predict_layers=1)
    context, bs, k = 100, 64, 3
    blocks = -(-(context + spec_decode.FUSED_REPLAYS * (k + 1) + 8) // bs)
    config = EngineConfig(model="tiny", dtype="float32", device="cpu", max_num_seqs=4, block_size=bs,
                          num_kv_blocks=blocks + 1, show_progress=False,
                          speculative_config={"num_speculative_tokens": k},
                          extra={"capture_graphs_at_start": False})
    runner = model_runner.ModelRunner(config, ModelConfig.from_hf(hf), None, blocks * bs)
    runner.init_cache(blocks + 1)
    runner.tables.apply([(0, 0, list(range(blocks)))])
    runner.graphs = model_runner.DecodeGraphs(runner)
    seconds = [spec_decode.fused_step(runner, k, context, fold) for fold in (False, True)]
    assert folds == [False, True] and attention.FOLD_VERIFICATIONS is False
    assert all(s > 0 for s in seconds)
    # the replays moved the sequence's rows on from the context, by at least one position a replay
    assert runner.graphs.positions[0].item() >= context + spec_decode.FUSED_REPLAYS - 1


def test_kv_cache_drift_reports_each_cache_against_the_float32_one(tmp_path):
    """`benchmarks/kv_cache_drift.py` on the embedded trained checkpoint: the bf16 and FP8 caches each
    drift from the float32 one, FP8's more (e4m3 keeps 3 mantissa bits to bf16's 7), and teacher-forced
    argmaxes mostly agree."""
    out = tmp_path / "drift.json"
    run_script("benchmarks/kv_cache_drift.py", "--prompts", "2", "--max-tokens", "12", "--out", str(out))
    rows = {r["cache"]: r for r in json.loads(out.read_text())["rows"]}
    assert 0 < rows["bf16"]["mean_abs_logit_drift"] < rows["fp8"]["mean_abs_logit_drift"]
    assert all(r["argmax_agreement"] > 0.9 and 0 <= r["greedy_tokens_alike"] <= 12 for r in rows.values())
