"""A real redis-server per test, on a unix socket in a temporary directory."""

import shutil
import subprocess
import time
from pathlib import Path

import redis


class RedisServer:
    def __init__(self, workdir: Path, port: int = 0, password: str | None = None):
        """port 0: the unix socket only; a port also listens on 127.0.0.1 (for redis:// URLs)."""
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not installed (scripts/setup.sh --dev installs it)")
        self.dir = workdir
        self.socket = workdir / "redis.sock"
        self.port, self.password = port, password
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def start(self) -> "RedisServer":
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--unixsocket", str(self.socket),
             "--save", "", "--appendonly", "no", "--dir", str(self.dir),
             *(["--requirepass", self.password] if self.password else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        client = redis.Redis(unix_socket_path=str(self.socket), password=self.password)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return self
            except redis.RedisError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not start")
                time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis(unix_socket_path=str(self.socket), password=self.password)
