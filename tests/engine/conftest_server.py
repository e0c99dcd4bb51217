"""Helpers for the server tests: a tiny random checkpoint and real `deepseek-engine serve` processes."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine.tools.make_random_checkpoint import make_random_checkpoint

SERVE = [sys.executable, "-m", "engine.cli", "serve"]
MODEL_NAME = "tiny-test"
API_KEY = "sk-test-key"
# The metric names of the contract in the design document, as `# TYPE` lines name them.
CONTRACT_METRICS = {
    "deepseek_engine_requests_waiting",
    "deepseek_engine_requests_running",
    "deepseek_engine_kv_cache_usage",
    "deepseek_engine_prompt_tokens_total",
    "deepseek_engine_generation_tokens_total",
    "deepseek_engine_prefix_cache_hit_tokens_total",
    "deepseek_engine_time_to_first_token_seconds",
    "deepseek_engine_inter_token_latency_seconds",
    "deepseek_engine_request_duration_seconds",
    "deepseek_engine_requests_total",
}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random DeepSeek-V3-format checkpoint, float32."""
    return make_random_checkpoint(tmp_path_factory.mktemp("tiny-ckpt"), seed=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`deepseek-engine serve` on a loopback port, its output in a log file."""

    def __init__(self, checkpoint: Path, log_path: Path, *extra: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        args = [
            *SERVE, "--model", str(checkpoint), "--served-model-name", MODEL_NAME, "--dtype", "float32",
            "--host", "127.0.0.1", "--port", str(self.port), *extra,
        ]  # fmt: skip
        self._log = open(log_path, "w")
        # A session of its own: SIGKILL then takes the engine process along, as a dying pod does.
        self.proc = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, start_new_session=True
        )

    def wait_ready(self, timeout: float = 120.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def metrics(self) -> dict[str, float]:
        """`/metrics` as {sample name with labels: value}."""
        text = httpx.get(f"{self.url}/metrics", timeout=5.0).text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """SIGTERM goes to the server alone (as Kubernetes sends it); SIGKILL to all its processes."""
        if sig == signal.SIGKILL:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05):
    """Polls until `predicate()` is truthy; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)
