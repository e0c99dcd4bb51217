"""The benchmark scripts that have a CPU mode, run as their docstrings say: they are otherwise run only on
a card, where a script that no longer matches the engine (a renamed argument, a graph's new key) costs
the card's time to find. What they measure is the card's; here only that they run and report."""

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
