"""`deepseek-engine serve` over several ranks, as a pod runs it: a rank that dies takes the replica down
at once (exit non-zero, `/ready` gone) instead of hanging, and one replica spans two "nodes" (two serve
processes on this machine, one rank each, meeting at --dist-init-addr)."""

import os
import signal
import subprocess
import sys
import time

from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.engine.conftest_server import MODEL_NAME, ServerProcess, free_port, tiny_checkpoint  # noqa: F401


def chat(server: ServerProcess) -> str:
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=6, temperature=0)
    return reply.choices[0].message.content


def descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every process below pid, oldest first, read from /proc."""
    parent, cmdline = {}, {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                parent[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                cmdline[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [pid]
    while todo:
        below = todo.pop()
        children = sorted(p for p, pp in parent.items() if pp == below)
        out += [(c, cmdline[c]) for c in children]
        todo += children
    return sorted(out)


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_killed_rank_ends_the_replica_within_seconds(tiny_checkpoint, tmp_path):  # noqa: F811
    server = ServerProcess(tiny_checkpoint, tmp_path / "tp2.log", "--tensor-parallel-size", "2").wait_ready()
    try:
        assert chat(server)
        # the engine process, and rank 1: forked by the fork server the engine process started (the fork
        # server and multiprocessing's resource trackers are no ranks)
        below = descendants(server.proc.pid)
        (engine,) = [pid for pid, cmd in below if "spawn_main" in cmd]
        forked = [pid for pid, cmd in descendants(engine) if "forkserver" in cmd]
        (fork_server,) = [pid for pid in forked if parent_of(pid) == engine]
        ranks = [pid for pid in forked if parent_of(pid) == fork_server]
        assert len(ranks) == 1, below
        killed = time.monotonic()
        os.kill(ranks[0], signal.SIGKILL)
        code = server.proc.wait(15)
        assert code != 0 and time.monotonic() - killed < 10
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{server.url}/ready", timeout=1)
        assert "rank1 exited" in server.log()
    finally:
        server.stop(signal.SIGKILL)


def test_one_replica_over_two_nodes(tiny_checkpoint, tmp_path):  # noqa: F811
    addr = f"127.0.0.1:{free_port()}"
    multi = ("--tensor-parallel-size", "2", "--nnodes", "2", "--dist-init-addr", addr)
    log = open(tmp_path / "node1.log", "w")
    node1 = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--model", str(tiny_checkpoint),
                              "--dtype", "float32", *multi, "--node-rank", "1"],
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    node0 = ServerProcess(tiny_checkpoint, tmp_path / "node0.log", *multi, "--node-rank", "0")
    single = ServerProcess(tiny_checkpoint, tmp_path / "single.log")
    try:
        node0.wait_ready(180)
        single.wait_ready()
        assert chat(node0) == chat(single)  # the same greedy reply as one rank gives
        assert "2 ranks ready (tensor parallel, 2 node(s))" in node0.log()
        node0.stop()
        assert node1.wait(30) == 0  # rank 0 told the other node's rank to stop
        assert "starting ranks 1..1" in (tmp_path / "node1.log").read_text()
    finally:
        single.stop(signal.SIGKILL)
        node0.stop(signal.SIGKILL)
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
