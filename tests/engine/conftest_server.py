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


_TINY: dict[int, Path] = {}


def tiny_checkpoint_in(factory: pytest.TempPathFactory) -> Path:
    """The session's small random DeepSeek-V3-format checkpoint, float32: made once, whichever asks first."""
    if id(factory) not in _TINY:
        _TINY[id(factory)] = make_random_checkpoint(factory.mktemp("tiny-ckpt"), seed=0)
    return _TINY[id(factory)]


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random DeepSeek-V3-format checkpoint, float32 (every module importing this shares one)."""
    return tiny_checkpoint_in(tmp_path_factory)


def module_servers(request: pytest.FixtureRequest) -> dict[str, "ServerProcess"]:
    """The servers of the requesting module's `start_servers(session, tmp_path_factory)` that no fixture has
    taken yet (a fixture pops its own): started while an earlier module ran (`start_the_next_servers` in
    tests/conftest.py), else now, all of the module's at once."""
    started = request.getfixturevalue("early_servers")
    name = request.module.__name__
    if name not in started:
        started[name] = request.module.start_servers(request.session, request.getfixturevalue("tmp_path_factory"))
    return started[name]


def selected_items(session: pytest.Session, module: str) -> list[pytest.Item]:
    """The tests of `module` (its __name__) this run selected."""
    return [item for item in session.items if getattr(getattr(item, "module", None), "__name__", None) == module]


def selected_params(session: pytest.Session, module: str, fixture: str) -> set:
    """The params of the parametrized `fixture` that the selected tests of `module` use."""
    return {item.callspec.params[fixture] for item in selected_items(session, module)
            if fixture in getattr(getattr(item, "callspec", None), "params", {})}


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
