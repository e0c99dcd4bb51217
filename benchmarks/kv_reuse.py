"""Second-turn time to first token: pulling the prefix from another replica vs recomputing it.

    python benchmarks/kv_reuse.py [--prefixes 1024 8192 32768] [--device cpu|cuda] [--out FILE]

Two engine processes share a real redis-server. Process A prefills each prefix (turn 1) and publishes
its blocks; process B then serves turn 2 (the prefix plus 32 new tokens) twice: once pulling the prefix
from A over TCP, once recomputing it (a fresh prefix, same length). A raw pull loop measures the TCP
transfer rate on its own. The model is random, with DeepSeek-V3's latent width (kv_lora 512 + rope 64).
"""

import argparse
import json
import multiprocessing as mp
import os
import platform
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


def tokens(n: int, offset: int = 0) -> list[int]:
    """A deterministic pseudo-random prompt inside the vocabulary."""
    return [(i * 7919 + offset * 104729) % (SHAPE["vocab_size"] - 2) + 2 for i in range(n)]


def engine(ckpt, redis_url, name, device, policy):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(ckpt), dtype="bfloat16" if device == "cuda" else "float32", device=device,
                                  kv_directory=redis_url, replica_id=name, kv_transfer_port=0, kv_pull_policy=policy,
                                  max_num_batched_tokens=4096, num_kv_blocks=2 * 40000 // 16 + 64,
                                  max_num_seqs=4, show_progress=False))


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
    eng = engine(ckpt, redis_url, "a", device, "never")
    for n in prefixes:
        ttft(eng, f"a{n}", tokens(n))
    time.sleep(1.0)  # let the directory publisher flush
    conn.send(("ready", eng.kv.server.port))
    conn.recv()  # until B is done
    eng.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefixes", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="benchmarks/results/kv_reuse.json")
    args = ap.parse_args()

    from engine.tools.make_random_checkpoint import make_random_checkpoint
    from tests.redis_server import RedisServer

    work = Path(tempfile.mkdtemp())
    ckpt = make_random_checkpoint(work / "ckpt", seed=0, **SHAPE)
    redis = RedisServer(work).start()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=replica_a, args=(ckpt, redis.url, args.device, args.prefixes, child))
    proc.start()
    _, port_a = parent.recv()

    b = engine(ckpt, redis.url, "b", args.device, "always")
    c = engine(ckpt, redis.url, "c", args.device, "never")
    ttft(b, "warm-b", tokens(100, 1))
    ttft(c, "warm-c", tokens(100, 1))
    rows = []
    for n in args.prefixes:
        turn2 = tokens(n) + tokens(NEW_TOKENS, 2)
        before = (b.kv.stats.transfer_bytes, b.kv.stats.transfer_seconds)
        t_pull, out = ttft(b, f"b{n}", turn2)
        moved = b.kv.stats.transfer_bytes - before[0]
        secs = b.kv.stats.transfer_seconds - before[1]
        t_recompute, ref = ttft(c, f"c{n}", turn2)
        assert out.token_ids == ref.token_ids, "pulled and recomputed prefixes disagree"
        # the raw transfer rate: pull the same blocks again, several times
        hashes = b.block_manager.prefix_hashes(_probe(b, turn2))[: n // 16]
        rates = []
        for _ in range(3):
            pulled = b.kv.transport.pull(f"127.0.0.1:{port_a}", hashes)
            rates.append(pulled.num_bytes / pulled.seconds)
        rows.append({"prefix_tokens": n, "cached_tokens": out.num_cached_tokens,
                     "remote_tokens": out.num_remote_cached_tokens, "ttft_pull_s": round(t_pull, 4),
                     "ttft_recompute_s": round(t_recompute, 4), "speedup": round(t_recompute / t_pull, 2),
                     "pull_bytes": moved, "pull_seconds": round(secs, 4),
                     "raw_transfer_gb_s": round(max(rates) / 1e9, 2)})
        print(rows[-1], flush=True)
    parent.send("done")
    proc.join()
    b.shutdown()
    c.shutdown()
    redis.stop()
    result = {"benchmark": "kv_reuse", "date": date.today().isoformat(), "device": args.device,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores", "shape": SHAPE, "rows": rows,
              "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"{'prefix':>7} {'ttft pull':>10} {'ttft recompute':>15} {'speedup':>8} {'GB/s':>6}")
    for r in rows:
        print(f"{r['prefix_tokens']:>7} {r['ttft_pull_s']:>10.3f} {r['ttft_recompute_s']:>15.3f} "
              f"{r['speedup']:>8.1f} {r['raw_transfer_gb_s']:>6.2f}")


def _probe(eng, prompt):
    from engine import SamplingParams
    from engine.sequence import Sequence

    return Sequence("probe", prompt, SamplingParams(), None, None)


if __name__ == "__main__":
    main()
