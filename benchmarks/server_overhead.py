"""What the HTTP server costs: offline `LLM.generate` against the same workload through `deepseek-engine serve`.

    python benchmarks/server_overhead.py [--model DIR|deepseek-tiny] [--streams 1 32] [--max-tokens 128]
                                         [--baseline CHECKOUT] [--kv-cache-memory 4GiB]

Both sides get the same prompts (token ids, so tokenization is not measured), the same sampling
settings and `ignore_eos`, so they generate exactly the same number of tokens. The server side is
32 concurrent streaming clients on /v1/completions (aiohttp, connections kept open between runs); their wall
time runs from the first request to the last `[DONE]`. After unmeasured warm-up runs, offline and
server runs alternate; the best of each is kept, which damps the noise of a shared machine, and the
median is printed too. Without --model a small random checkpoint is written to a temp dir.
On a CPU machine the clients share the cores with the server: there the figure is an upper bound.
The overhead is also given per generated token (the server's extra wall time over offline's, divided
by the tokens): at one stream that is what each token's path from the engine process to the client
costs on the critical path. `--baseline` serves the same model from another checkout of the engine
beside this one, its runs interleaved with the others (before/after a change, on the same machine
state). Several `--streams` values run one after the other on the same servers.
"""

import argparse
import asyncio
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import aiohttp
import httpx


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint directory or deepseek-tiny (default: a random tiny checkpoint)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--streams", type=int, nargs="+", default=[32])
    p.add_argument("--baseline", help="another checkout of the engine: its server runs too, interleaved")
    p.add_argument("--kv-cache-memory", help="KV cache size of every engine (they share the GPU), e.g. 4GiB")
    p.add_argument("--server-log", help="keep the server's log (one line per finished request) in this file")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2, help="unmeasured full runs first (kernels, CUDA graphs)")
    return p.parse_args()


def make_prompts(tokenizer, num: int, num_tokens: int) -> list[list[int]]:
    prompts = []
    for i in range(num):
        ids = tokenizer.encode(f"Request {i}: tell me about DeepSeek models and Kubernetes operators. " * 8)
        prompts.append(ids[:num_tokens])
    return prompts


def run_offline(llm, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    from engine import SamplingParams

    params = SamplingParams(temperature=1.0, seed=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outs)


async def run_server(http: aiohttp.ClientSession, prompts: list[list[int]], max_tokens: int) -> tuple[float, int, dict]:
    """-> (wall time, generated tokens, when (after the run's start) the requests went out, their first
    chunks came back and their streams ended: each [first, last] in seconds)."""
    sent, first, done = [], [], []

    async def one(prompt: list[int]) -> int:
        body = {
            "model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "seed": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        }  # fmt: skip
        tail = b""
        sent.append(time.perf_counter())
        async with http.post("/v1/completions", json=body) as r:
            r.raise_for_status()
            # Raw bytes, no line splitting: the client's own CPU is not what this measures (on a
            # small machine it shares the cores). Only the end matters: the usage chunk, then [DONE].
            async for data in r.content.iter_any():
                if not tail:
                    first.append(time.perf_counter())
                tail = (tail + data)[-512:]
        done.append(time.perf_counter())
        assert tail.endswith(b"data: [DONE]\n\n"), tail
        return int(tail.rsplit(b'"completion_tokens":', 1)[1].split(b",", 1)[0])

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    events = (("sent", sent), ("first", first), ("done", done))
    spans = {name: (min(ts) - start, max(ts) - start) for name, ts in events}
    return time.perf_counter() - start, sum(counts), spans


async def alternate(
    llm, urls: list[str], prompts: list[list[int]], max_tokens: int, repeats: int, warmup: int
) -> tuple[list, list[list]]:
    """Offline and each server's runs in turn; the client keeps its connections open, as real clients do.
    -> (offline runs, each server's runs)."""
    # aiohttp: the 32 requests go out in ~3 ms where httpx took ~13 (2-core machine), time that would
    # otherwise count as the server's
    sessions = [aiohttp.ClientSession(base_url=url, connector=aiohttp.TCPConnector(limit=len(prompts)),
                                      timeout=aiohttp.ClientTimeout(600)) for url in urls]
    try:
        # Warm-up: kernels compile and decode graphs get captured for every batch size a run meets
        # (requests reach the server one by one, so it meets more sizes than offline does).
        for _ in range(warmup):
            run_offline(llm, prompts, max_tokens)
            for http in sessions:
                await run_server(http, prompts, max_tokens)
        offline, served = [], [[] for _ in urls]
        for _ in range(repeats):
            offline.append(run_offline(llm, prompts, max_tokens))
            for http, runs in zip(sessions, served):
                runs.append(await run_server(http, prompts, max_tokens))
        return offline, served
    finally:
        for http in sessions:
            await http.close()


def start_server(model: str, dtype: str, port: int, log, checkout: str | None = None,
                 kv_cache_memory: str | None = None) -> subprocess.Popen:
    """`deepseek-engine serve` of this checkout, or of `checkout` (its own code first on the path)."""
    cmd = [sys.executable, "-m", "engine.cli", "serve", "--model", model, "--dtype", dtype,
           "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    if kv_cache_memory:
        cmd += ["--kv-cache-memory", kv_cache_memory]
    env = dict(os.environ)
    if checkout:
        env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(checkout), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=checkout, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    raise SystemExit("the server did not get ready in 300 s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def report(name: str, runs: list, offline: list) -> None:
    """One server's line: its best and median runs against offline's, per generated token too."""
    (t_off, n_off), (t_srv, n_srv, spans) = min(offline), min(runs, key=lambda r: r[0])
    med_off, med_srv = statistics.median(t for t, _ in offline), statistics.median(t for t, *_ in runs)
    assert n_off == n_srv, (n_off, n_srv)
    tps_off, tps_srv = n_off / t_off, n_srv / t_srv
    all_runs = [round(t, 3) for t, *_ in runs]
    print(f"{name:21s}: {t_srv:7.3f} s  {tps_srv:8.1f} tok/s   all runs: {all_runs}")
    print(f"  overhead           : {1 - tps_srv / tps_off:+.1%} of offline throughput, "
          f"{(t_srv - t_off) / n_srv * 1e6:+.1f} us per generated token (best runs)")
    print(f"                       {1 - med_off / med_srv:+.1%} of offline throughput, "
          f"{(med_srv - med_off) / n_srv * 1e6:+.1f} us per generated token (median runs)")
    print("  best run, from its start: " + ", ".join(
        f"{name} {lo * 1e3:.1f}-{hi * 1e3:.1f} ms" for name, (lo, hi) in spans.items()))


def main() -> None:
    args = parse_args()
    from engine import LLM
    from engine.server.launch import _bytes
    from engine.tools.make_random_checkpoint import make_random_checkpoint

    checkouts = [None] + ([args.baseline] if args.baseline else [])
    kv = {"kv_cache_memory": _bytes(args.kv_cache_memory)} if args.kv_cache_memory else {}
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    print(f"machine: {os.cpu_count()} CPU cores, {device}, python {platform.python_version()}, "
          f"torch {torch.__version__}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(make_random_checkpoint(os.path.join(tmp, "tiny"), seed=0))
        llm = LLM(model, dtype=args.dtype, **kv)
        servers = []
        try:
            for i, checkout in enumerate(checkouts):
                port = free_port()
                log = open(args.server_log + (f".{i}" if i else "") if args.server_log
                           else os.path.join(tmp, f"server{i}.log"), "w")
                servers.append((start_server(model, args.dtype, port, log, checkout, args.kv_cache_memory),
                                f"http://127.0.0.1:{port}", log))
            for streams in args.streams:  # each printed once run: a long session still reports the first
                prompts = make_prompts(llm.tokenizer, streams, args.prompt_tokens)
                offline, served = asyncio.run(alternate(
                    llm, [url for _, url, _ in servers], prompts, args.max_tokens, args.repeats, args.warmup))
                (t_off, n_off) = min(offline)
                assert n_off == streams * args.max_tokens, n_off
                print(f"workload: {streams} streams x {args.max_tokens} tokens, {args.prompt_tokens}-token prompts, "
                      f"model {args.model or 'random tiny'} ({args.dtype}), best of {args.repeats}")  # fmt: skip
                print(f"offline LLM.generate : {t_off:7.3f} s  {n_off / t_off:8.1f} tok/s   "
                      f"all runs: {[round(t, 3) for t, _ in offline]}")
                for checkout, runs in zip(checkouts, served):
                    report("through the server" if checkout is None else "baseline server", runs, offline)
        finally:
            for server, _, log in servers:
                server.send_signal(signal.SIGTERM)
                server.wait(60)
                log.close()


if __name__ == "__main__":
    main()
