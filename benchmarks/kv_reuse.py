"""Second-turn time to first token: pulling the prefix from another replica vs recomputing it.

    python -m benchmarks.kv_reuse [--prefixes 1024 8192 32768] [--device cpu|cuda] [--out FILE]
                                    [--redis-server PATH] [--stripes N]

Two engine processes share a real redis-server. Process A prefills each prefix (turn 1) and publishes
its blocks; process B then serves turn 2 (the prefix plus 32 new tokens) twice: once pulling the prefix
from A over TCP, once recomputing it (engine C beside B, which never pulls). B pulls once before the
measured turns, so its transport has learnt the block size and holds a staging buffer, as a replica
that has served for a while does. A third turn on B, whose prefix is then local, gives the floor: the
prefill of the new tokens over the cached prefix. Raw pull loops then measure the TCP transfer rate on
its own (best of 5), over one stream and striped over --stripes connections. The model is random, with
DeepSeek-V3's latent width (kv_lora 512 + rope 64).
"""

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

SHAPE = dict(vocab_size=2048, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
             num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=None,
             kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
             n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
             max_position_embeddings=40000, rope_scaling=None)
NEW_TOKENS = 32
WARM_TOKENS = 100
BLOCK_SIZE = 16
RAW_PULLS = 5  # per prefix and transport; the best is reported (other work on the machine only slows)


def tokens(n: int, offset: int = 0) -> list[int]:
    """A deterministic pseudo-random prompt inside the vocabulary."""
    return [(i * 7919 + offset * 104729) % (SHAPE["vocab_size"] - 2) + 2 for i in range(n)]


def prefix(n: int) -> list[int]:
    """Turn 1 of the n-token conversation; no two share a leading block, so no prefix is partly cached."""
    return tokens(n, offset=n + 10)


class RedisServer:
    """A private redis-server on a unix socket: the fleet's KV directory."""

    def __init__(self, binary: str, workdir: Path):
        path = shutil.which(binary)
        if path is None:
            raise SystemExit(f"redis-server not found at {binary!r}: install it or pass --redis-server PATH")
        self.socket = workdir / "redis.sock"
        self.proc = subprocess.Popen([path, "--port", "0", "--unixsocket", str(self.socket), "--save", "",
                                      "--appendonly", "no", "--dir", str(workdir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        import redis

        client, deadline = redis.Redis(unix_socket_path=str(self.socket)), time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.RedisError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise SystemExit(f"{path} did not start")
                time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


def engine(ckpt, redis_url, name, device, policy, prefixes):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(ckpt), dtype="bfloat16" if device == "cuda" else "float32", device=device,
                                  kv_directory=redis_url, replica_id=name, kv_transfer_port=0, kv_pull_policy=policy,
                                  block_size=BLOCK_SIZE, max_num_batched_tokens=4096,
                                  max_model_len=max(*prefixes, WARM_TOKENS) + 2 * NEW_TOKENS,
                                  # every conversation stays cached (warm-up prompts get evicted first)
                                  num_kv_blocks=(sum(prefixes) + len(prefixes) * 2 * NEW_TOKENS) // BLOCK_SIZE + 64,
                                  max_num_seqs=4,
                                  show_progress=False))


def ttft(eng, rid, prompt):
    from engine import SamplingParams

    start = time.perf_counter()
    eng.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                return time.perf_counter() - start, out
    raise RuntimeError("lost request")


def replica_a(ckpt, redis_url, device, prefixes, conn):
    eng = engine(ckpt, redis_url, "a", device, "never", prefixes)
    for n in prefixes:
        ttft(eng, f"a{n}", prefix(n))
    time.sleep(1.0)  # let the directory publisher flush
    conn.send(("ready", eng.kv.server.port))
    conn.recv()  # until B is done
    eng.shutdown()


def prefix_hashes(eng, prompt, num_blocks):
    from engine import SamplingParams
    from engine.sequence import Sequence

    return eng.block_manager.prefix_hashes(Sequence("probe", prompt, SamplingParams()))[:num_blocks]


def best_rate(transport, addr, hashes) -> float:
    """Bytes/s of the fastest of RAW_PULLS pulls of the same blocks."""
    rates = []
    for _ in range(RAW_PULLS):
        pulled = transport.pull(addr, hashes)
        rates.append(pulled.num_bytes / pulled.seconds)
        pulled.release()
    return max(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefixes", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", default="benchmarks/results/kv_reuse.json")
    ap.add_argument("--redis-server", default="redis-server", help="the redis-server binary (default: from PATH)")
    ap.add_argument("--stripes", type=int, default=None, help="connections of the striped raw pull "
                    "(default: the transport's default)")
    args = ap.parse_args()
    if any(n < BLOCK_SIZE for n in args.prefixes):
        ap.error(f"every prefix needs at least one full block ({BLOCK_SIZE} tokens)")

    load_at_start = os.getloadavg()  # other work on the machine slows every figure here
    with tempfile.TemporaryDirectory() as work:
        rows, num_stripes = run(args, Path(work))
    import torch

    gpu = f", {torch.cuda.get_device_name()}" if args.device == "cuda" else ""
    result = {"benchmark": "kv_reuse", "date": date.today().isoformat(), "device": args.device,
              "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores{gpu}, torch {torch.__version__}",
              "shape": SHAPE, "block_size": BLOCK_SIZE, "new_tokens": NEW_TOKENS, "stripes": num_stripes,
              "loadavg_1_5_15min": {"start": load_at_start, "end": os.getloadavg()}, "rows": rows,
              "command": " ".join(["python -m benchmarks.kv_reuse", *sys.argv[1:]])}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'prefix':>7} {'ttft pull':>10} {'ttft recompute':>15} {'speedup':>8} {'pull GB/s':>10} "
          f"{'raw 1-stream':>13} {'raw striped':>12}")
    for r in rows:
        print(f"{r['prefix_tokens']:>7} {r['ttft_pull_s']:>10.3f} {r['ttft_recompute_s']:>15.3f} {r['speedup']:>8.1f} "
              f"{r['pull_gb_s'] or 0:>10.2f} {r['raw_one_stream_gb_s']:>13.2f} "
              f"{r['raw_striped_gb_s']:>12.2f} (x{r['raw_striped_streams']})")


def run(args, work: Path) -> tuple[list[dict], int]:
    """-> (one row per prefix, streams of the striped raw pull)."""
    from engine.kv.transfer import TcpTransport
    from engine.tools.make_random_checkpoint import make_random_checkpoint

    ckpt = make_random_checkpoint(work / "ckpt", seed=0, **SHAPE)
    redis = RedisServer(args.redis_server, work)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=replica_a, args=(ckpt, redis.url, args.device, args.prefixes, child))
    proc.start()
    try:
        _, port_a = parent.recv()
        addr = f"127.0.0.1:{port_a}"
        b = engine(ckpt, redis.url, "b", args.device, "always", args.prefixes)
        c = engine(ckpt, redis.url, "c", args.device, "never", args.prefixes)
        # a prefill from scratch, then one after a cached prefix; on a GPU at every length, since kernels
        # compile (and tune) per shape on first use, which would land in whichever turn came first
        for n in args.prefixes if args.device == "cuda" else [WARM_TOKENS]:
            for eng in (b, c):
                ttft(eng, f"warm{n}", tokens(n, 1))
                ttft(eng, f"warm{n}-hit", tokens(n, 1) + tokens(NEW_TOKENS, 2))
        one_stream = TcpTransport(b.model_key, num_stripes=1)
        striped = TcpTransport(b.model_key, num_stripes=args.stripes)
        longest = max(args.prefixes)
        for transport in (b.kv.transport, one_stream, striped):  # learn the block size, take a buffer
            transport.pull(addr, prefix_hashes(b, prefix(longest) + [2], longest // BLOCK_SIZE)).release()
        rows = []
        for n in args.prefixes:
            turn2 = prefix(n) + tokens(NEW_TOKENS, 2)
            before = (b.kv.stats.transfer_bytes, b.kv.stats.transfer_seconds)
            t_pull, out = ttft(b, f"b{n}", turn2)
            moved = b.kv.stats.transfer_bytes - before[0]
            secs = b.kv.stats.transfer_seconds - before[1]
            t_recompute, ref = ttft(c, f"c{n}", turn2)
            assert out.token_ids == ref.token_ids, "pulled and recomputed prefixes disagree"
            t_local, _ = ttft(b, f"b{n}-again", prefix(n) + tokens(NEW_TOKENS, 3))  # the prefix is B's own now
            hashes = prefix_hashes(b, turn2, n // BLOCK_SIZE)
            rows.append({"prefix_tokens": n, "cached_tokens": out.num_cached_tokens,
                         "remote_tokens": out.num_remote_cached_tokens, "ttft_pull_s": round(t_pull, 4),
                         "ttft_recompute_s": round(t_recompute, 4),
                         "ttft_local_hit_s": round(t_local, 4), "speedup": round(t_recompute / t_pull, 2),
                         "pull_bytes": moved, "pull_seconds": round(secs, 4),
                         "pull_gb_s": round(moved / secs / 1e9, 2) if secs else None,
                         "raw_one_stream_gb_s": round(best_rate(one_stream, addr, hashes) / 1e9, 2),
                         "raw_striped_gb_s": round(best_rate(striped, addr, hashes) / 1e9, 2),
                         "raw_striped_streams": len(striped.stripes(len(hashes)))})
            print(rows[-1], flush=True)
        b.shutdown()
        c.shutdown()
        return rows, striped.num_stripes
    finally:
        if proc.is_alive():
            parent.send("done")
        proc.join()
        redis.stop()


if __name__ == "__main__":
    main()
