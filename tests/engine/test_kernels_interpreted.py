"""Without a GPU, the kernel tests need Triton's interpreter, which Triton picks once, at its first
import. In a full test run some earlier module (transformers, say) imports Triton first, so the kernel
and fast-path modules skip themselves there and this test runs them again in a fresh process."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

MODULES = ["test_kernels.py", "test_fast_path.py"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernel tests run compiled, in place")
def test_kernel_and_fast_path_tests_pass_under_the_interpreter():
    here = Path(__file__).parent
    root = here.parent.parent
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                           *(str(here / m) for m in MODULES)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=900)
    tail = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    # the only skips allowed there are the real-shape checks that need a GPU
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED")]
    assert all("need a GPU" in line for line in skipped), tail
    assert " passed" in proc.stdout, tail
