"""Without a GPU, the kernel tests need Triton's interpreter, which Triton picks once, at its first
import. In a full test run some earlier module (transformers, say) imports Triton first, so the kernel
and fast-path modules skip themselves there and this test runs them again in a fresh process.

That process takes minutes of one core while the rest of the run keeps to one thread (tests/conftest.py
sets OMP_NUM_THREADS=1), so the run starts it as soon as collection ends (`interpreter_run`, called from
tests/conftest.py) and this test, moved to the end, only waits for its result."""

import functools
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

MODULES = ["test_kernels.py", "test_fast_path.py"]
ON_GPU = torch.cuda.is_available()


@functools.cache
def interpreter_run() -> tuple[subprocess.Popen, Path]:
    """The interpreted kernel and fast-path tests, started once, in the background; their output goes
    to a file (a pipe nobody reads until the end would fill and stall them)."""
    here = Path(__file__).parent
    log = Path(tempfile.mkstemp(prefix="interpreted-kernels-", suffix=".log")[1])
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                                 *(str(here / m) for m in MODULES)],
                                cwd=here.parent.parent, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    return proc, log


@pytest.mark.skipif(ON_GPU, reason="on a GPU the kernel tests run compiled, in place")
def test_kernel_and_fast_path_tests_pass_under_the_interpreter():
    proc, log = interpreter_run()
    try:
        proc.wait(timeout=900)
    finally:
        proc.kill()
    output = log.read_text()
    log.unlink()
    tail = output[-8000:]
    assert proc.returncode == 0, tail
    # the only skips allowed there are the real-shape checks that need a GPU
    skipped = [line for line in output.splitlines() if line.startswith("SKIPPED")]
    assert all("need a GPU" in line for line in skipped), tail
    assert " passed" in output, tail
