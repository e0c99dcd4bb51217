"""MLA decode attention alone (`engine.kernels.mla_decode`): effective bandwidth over the latent cache.

    python benchmarks/mla_decode.py [--heads 16] [--batches 1,8,64] [--contexts 1024,...,131072]
                                    [--sweep] [--variants a,b] [--check] [--kv-cache-dtype bf16|fp8|both]
                                    [--queries-per-seq R] [--gluon] [--page 64]
                                    [--out results.json]

For each (batch, context): B sequences of `context` tokens in a paged bf16 cache (64-token pages,
shuffled), all heads of one layer (16: DeepSeek-V2-Lite, 128: V3), timed as a CUDA graph of calls
replayed, each call on another copy of the cache (at least 512 MB in all, so the latents come from
memory, not from the 60 MB L2, as in a model where every layer has its own cache). Effective bandwidth
= cache bytes (B x context x 576 x 2) / time per call, split and merge launches included.

--sweep also times tile choices (tile rows, pipeline depth, warps, least slice, the merge's columns) and slice counts
around the default (FP8: how the e4m3 tile is read, `mla_decode._attend_tile`); --variants keeps the
named ones; --check compares every variant with the float32 reference first.

--gluon times the Gluon split kernel (`engine.kernels.mla_decode_gluon`, Hopper, up to 32 heads a
program; over FP8 rows with two loader warpgroups, its default, and with one, and the rows staged as
codes or decoded) beside the Triton one (with --check, both against the reference first; --variants
keeps the named ones); --page the cache's page size (64 by default; the engine's is 16).

--queries-per-seq R times each batch's sequences with R query tokens each (a verification's k + 1 rows,
row r seeing R - 1 - r tokens fewer than the last): as B x R separate rows, against the R rows folded
into the heads (`queries_per_seq=R`, the cache read once a sequence) by the Gluon kernel where R x H fit
one of its programs (`mla_decode_gluon.FOLDS` forced on) and by the Triton kernel; checked against the
rows apart first.
"""

import argparse
import json
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.kernels import mla_decode_gluon  # noqa: E402
from engine.kernels.mla_decode import (  # noqa: E402
    block_heads, default_num_splits, mla_decode_attention, num_sms, reference_mla_decode_attention,
)
from engine.layers.fp8_latent import FP8LatentLayout  # noqa: E402

FP8_LAYOUT = FP8LatentLayout(512, 64, torch.bfloat16)

KV_LORA, ROPE, PAGE = 512, 64, 64
TILE_SWEEP = {
    "default": dict(gluon=False),  # the Triton kernel's own tiles (on Hopper the engine takes "gluon")
    "n64 s2": dict(block_n=64, num_stages=2),
    "n64 s5": dict(block_n=64, num_stages=5),
    "n64 s2 w8": dict(block_n=64, num_stages=2, num_warps=8),
    "n64 s5 w8": dict(block_n=64, num_stages=5, num_warps=8),
    "n32 s3": dict(block_n=32, num_stages=3, min_chunk=32),
    "min chunk 256": dict(min_chunk=256),
    # the merge's columns a program and warps (forced at every batch; the default takes 32 where
    # batch x heads <= 128)
    "merge cm32": dict(merge_cm=32),
    "merge cm64": dict(merge_cm=64),
    "merge cm128": dict(merge_cm=128),
    "merge cm32 w2": dict(merge_cm=32, merge_warps=2),
    "merge cm64 w8": dict(merge_cm=64, merge_warps=8),
    "merge cm16 w2": dict(merge_cm=16, merge_warps=2),
    # the transposed accumulator (acc^T += kv^T @ p^T): the second product a wgmma over the tile in
    # shared memory, M = the 512 latent columns, N = the heads (the default from batch 5, so every variant
    # above takes it there unless it says acc_t=False)
    "acc_t": dict(acc_t=True),
    "no acc_t": dict(acc_t=False),
    "acc_t s3": dict(acc_t=True, num_stages=3),
    "acc_t w8": dict(acc_t=True, num_warps=8),
    # the warp-specialised Gluon split kernel (Hopper, up to 32 heads a program)
    "gluon": dict(gluon=True),
}
# the FP8 cache (default at up to 16 heads a program: the e4m3 tile loaded twice and widened for each
# product, eight warps; above 16: decoded once; the widening variants say dequant=False so they time
# the same path at every head count): loaded once (its load left synchronous), the transposed
# accumulator (`acc_t`: the tile as the wgmma's register operand), pipeline depth, four warps,
# 128-token tiles (one load: two would take 288 KB), 32-token tiles
FP8_SWEEP = {
    "default": dict(gluon=False),  # the Triton kernel's own tiles (on Hopper the engine takes "gluon")
    "one load s2": dict(dequant=False, reload=False, num_stages=2),
    "reload s2": dict(dequant=False, num_stages=2),
    "reload s5": dict(dequant=False, num_stages=5),
    "reload w4": dict(dequant=False, num_warps=4),
    "acc_t": dict(dequant=False, acc_t=True),
    "one load acc_t s2": dict(dequant=False, reload=False, acc_t=True, num_stages=2),
    "n128 one load s2": dict(dequant=False, block_n=128, min_chunk=128, reload=False, num_stages=2),
    # 32-token tiles keep four warps free of spills (ptxas, sm_90), so two programs fit an SM: the default
    # from batch 5 at 16 heads a program
    "n32 w4 s2": dict(dequant=False, block_n=32, min_chunk=32, num_warps=4, num_stages=2),
    "n32 w4 s5": dict(dequant=False, block_n=32, min_chunk=32, num_warps=4, num_stages=5),
    # the tile decoded once (scaled) before both products: Triton stages the decoded tile through shared
    # memory, so the second product reads it with ldmatrix.trans (the default above 16 heads a program)
    "decode once": dict(dequant=True, reload=False),
    "decode once w4": dict(dequant=True, reload=False, num_warps=4),
    "decode once s3": dict(dequant=True, reload=False, num_stages=3),
    "decode once n32 w4": dict(dequant=True, reload=False, block_n=32, min_chunk=32, num_warps=4),
    "widened twice": dict(dequant=False, reload=True),
    # decoded once, and the transposed accumulator: the second product a wgmma over the decoded tile
    "decode once acc_t": dict(dequant=True, reload=False, acc_t=True),
    "decode once acc_t w4": dict(dequant=True, reload=False, acc_t=True, num_warps=4),
    "decode once acc_t n32 w4": dict(dequant=True, reload=False, acc_t=True, block_n=32, min_chunk=32, num_warps=4),
    "gluon": dict(gluon=True),
    # the Gluon kernel's FP8 rows by one loader warpgroup (a tile's four chunks two at a time) instead of
    # its default two (all four in flight at once)
    "gluon 1wg": dict(gluon=True, gluon_loaders=1),
    # the Gluon kernel's FP8 rows staged as codes (float16, the scales applied to scores and
    # probabilities) or decoded to bf16 rows in the loaders, whichever is not its default
    "gluon codes": dict(gluon=True, gluon_codes=True),
    "gluon rows": dict(gluon=True, gluon_codes=False),
}
HEAD_BLOCK_SWEEP = {"default": dict(gluon=False), "h32": dict(block_h=32), "h16": dict(block_h=16)}
# the variants also timed at other slice counts
SPLIT_SWEEP = ("default", "n64 s2 w8", "n32 s3", "decode once", "decode once w4", "decode once n32 w4", "gluon",
               "gluon 1wg", "gluon codes", "gluon rows")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def row_bytes(kv: str) -> int:
    return FP8_LAYOUT.token_bytes if kv == "fp8" else (KV_LORA + ROPE) * 2


def make_case(batch: int, context: int, heads: int, copies: int, lens: list[int] | None = None, kv: str = "bf16"):
    g = torch.Generator(device="cuda").manual_seed(batch * 7 + context)
    lens = lens or [context] * batch
    per_seq = -(-max(lens) // PAGE)
    blocks = batch * per_seq
    caches = [torch.randn(blocks, PAGE, KV_LORA + ROPE, generator=g, device="cuda").to(torch.bfloat16)
              for _ in range(copies)]
    if kv == "fp8":  # the same pages, quantized (a copy at a time: the bf16 ones are dropped as we go)
        caches = [FP8_LAYOUT.quantize(caches.pop(0)) for _ in range(copies)]
    tables = torch.randperm(blocks, generator=g, device="cuda").view(batch, per_seq).int()
    q = torch.randn(batch, heads, KV_LORA, generator=g, device="cuda").to(torch.bfloat16)
    q_pe = torch.randn(batch, heads, ROPE, generator=g, device="cuda").to(torch.bfloat16)
    return q, q_pe, caches, tables, torch.tensor(lens, dtype=torch.int32, device="cuda")


def time_calls(calls, repeats: int = 5, warmup_s: float = 0.1) -> float:
    """Seconds per call: the calls captured in one graph, replayed for at least `warmup_s` untimed, then the
    median of `repeats` replays. The warm-up is by time, not by count: after one replay of warm-up, the
    first variant timed over a freshly made cache at 16 sequences or more and 16k tokens or more read
    12-18 % slower than the same kernel timed right after it (H100; docs/perf.md, "A second consumer
    warpgroup in the decode kernel")."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls[:2]:
            c()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    warm, replays = 0.0, 0
    while warm < warmup_s and replays < 1000:
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        warm += start.elapsed_time(end) / 1e3
        replays += 1
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(calls))
    return sorted(times)[len(times) // 2]


def measure(batch: int, context: int, heads: int, variants: dict, split_sweep: list[int], baseline=None,
            kv: str = "bf16") -> list[dict]:
    n_bytes = batch * context * row_bytes(kv)
    copies = max(1, min(128, -(-(512 << 20) // n_bytes)))
    q, q_pe, caches, tables, lens = make_case(batch, context, heads, copies, kv=kv)
    rows = []
    runs = [(name, tiles, s) for name, tiles in variants.items()
            for s in [None] + (split_sweep if name in SPLIT_SWEEP else [])]
    if baseline is not None:
        runs.insert(0, ("before", None, None))
    for name, tiles, s in runs:
        if name == "before":
            run = lambda c: baseline(q, q_pe, c, tables, lens, 0.1)
        else:
            run = lambda c, s=s, tiles=tiles: mla_decode_attention(q, q_pe, c, tables, lens, 0.1, num_splits=s,
                                                                   tiles=tiles)
        try:
            sec = time_calls([lambda c=c: run(c) for c in caches])
        except Exception as e:  # a variant over the chip's shared memory, say: reported, not fatal
            rows.append(dict(batch=batch, context=context, heads=heads, kv=kv, variant=name, splits=s,
                             error=str(e)[:200]))
            continue
        if s or tiles is None:
            used = s
        elif tiles.get("gluon"):
            used = mla_decode_gluon.default_num_splits(batch, heads, num_sms(q.device))
        else:
            block_h = tiles.get("block_h") or block_heads(heads, fp8=kv == "fp8")  # the FP8 kernel's 32 heads a program
            used = default_num_splits(batch, heads, num_sms(q.device), block_h)
        rows.append(dict(batch=batch, context=context, heads=heads, kv=kv, variant=name, splits=used, us=sec * 1e6,
                         tb_s=n_bytes / sec / 1e12))
    del caches
    torch.cuda.empty_cache()
    return rows


def compare_and_time(runs: dict, caches: list, case: dict, n_bytes: float) -> tuple[list[dict], list[str]]:
    """Ways to the same output: each checked against the first on the first cache copy (rel. error <
    1e-2), then each graph-timed over every copy -> (rows, failures)."""
    (name_a, run_a), *others = runs.items()
    a = run_a(caches[0]).float().flatten()
    failures = []
    for name_b, run_b in others:
        b = run_b(caches[0]).float().flatten()
        err = ((a - b).norm() / b.norm()).item()
        if err >= 1e-2:
            failures.append(f"{name_b} {case}: rel err {err:.3g} to {name_a}")
    rows = []
    for name, run in runs.items():
        sec = time_calls([lambda c=c, run=run: run(c) for c in caches])
        rows.append(dict(case, variant=name, us=sec * 1e6, tb_s=n_bytes / sec / 1e12))
    caches.clear()
    torch.cuda.empty_cache()
    return rows, failures


def measure_fold(batch: int, context: int, heads: int, queries: int, kv: str = "bf16") -> tuple[list[dict], list[str]]:
    """B sequences of R query tokens each: B x R separate rows against the rows folded into the heads (on
    Hopper by the Gluon kernel where R x H fit one program, and by the Triton kernel)."""
    n_bytes = batch * context * row_bytes(kv)
    copies = max(1, min(128, -(-(512 << 20) // n_bytes)))
    _, _, caches, tables, _ = make_case(batch, context, heads, copies, kv=kv)
    g = torch.Generator(device="cuda").manual_seed(context + queries)
    rows = batch * queries
    q = torch.randn(rows, heads, KV_LORA, generator=g, device="cuda").to(torch.bfloat16)
    q_pe = torch.randn(rows, heads, ROPE, generator=g, device="cuda").to(torch.bfloat16)
    tables = tables.repeat_interleave(queries, dim=0)
    lens = torch.tensor([context - queries + 1 + r for _ in range(batch) for r in range(queries)], dtype=torch.int32,
                        device="cuda")

    def gluon_folded(c):  # the Gluon kernel's fold, whatever its switch says (R x H within one program)
        with mock.patch.object(mla_decode_gluon, "FOLDS", True):
            return mla_decode_attention(q, q_pe, c, tables, lens, 0.1, queries_per_seq=queries)

    runs = {
        f"{queries} rows apart": lambda c: mla_decode_attention(q, q_pe, c, tables, lens, 0.1),
        f"{queries} rows folded": gluon_folded,
        f"{queries} rows folded, Triton": lambda c: mla_decode_attention(q, q_pe, c, tables, lens, 0.1,
                                                                         queries_per_seq=queries,
                                                                         tiles=dict(gluon=False)),
    }
    return compare_and_time(runs, caches, dict(batch=batch, context=context, heads=heads, kv=kv), n_bytes)


def check(variants: dict, heads: int, kv: str = "bf16") -> list[str]:
    """Every variant against the float32 reference on mixed lengths (bf16: rel. error < 1e-2; FP8: against
    the reference over the same FP8 rows)."""
    failures = []
    for lens in ([1, 700, 4096, 63, 20000], [3000, 17]):
        q, q_pe, caches, tables, lens_t = make_case(len(lens), max(lens), heads, 1, lens, kv=kv)
        ref = reference_mla_decode_attention(q, q_pe, caches[0], tables, lens_t, 192**-0.5).double()
        for name, tiles in variants.items():
            for s in (None, 1, 3, 128):
                try:
                    out = mla_decode_attention(q, q_pe, caches[0], tables, lens_t, 192**-0.5, num_splits=s, tiles=tiles)
                except Exception as e:  # noqa: BLE001 -- reported with the variant
                    failures.append(f"{name} splits={s}: {str(e)[:200]}")
                    continue
                err = ((out.double() - ref).norm() / ref.norm()).item()
                if not err < 1e-2:
                    failures.append(f"{name} {kv} splits={s} heads={heads} lens={lens}: rel err {err:.3g}")
    return failures


def main() -> int:
    global PAGE
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=_ints, default=[16])
    p.add_argument("--batches", type=_ints, default=[1, 8, 64])
    p.add_argument("--contexts", type=_ints, default=[1024, 4096, 16384, 32768, 65536, 131072])
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--variants", type=lambda t: t.split(","), help="only these sweep variants (names, comma-separated)")
    p.add_argument("--check", action="store_true")
    p.add_argument("--baseline", type=Path, help="a module file whose mla_decode_attention is timed beside (before)")
    p.add_argument("--kv-cache-dtype", default="bf16", choices=["bf16", "fp8", "both"],
                   help="the latent cache timed (fp8: 644 bytes a token; effective bandwidth counts those bytes)")
    p.add_argument("--queries-per-seq", type=int, default=1,
                   help="R > 1: sequences of R query tokens, as separate rows against folded into the heads")
    p.add_argument("--gluon", action="store_true", help="the Gluon split kernel beside the Triton one")
    p.add_argument("--page", type=int, default=64, help="tokens a cache page")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    PAGE = args.page
    baseline = None
    if args.baseline:
        import importlib.util

        spec = importlib.util.spec_from_file_location("mla_decode_before", args.baseline)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        baseline = module.mla_decode_attention
    result = dict(gpu=torch.cuda.get_device_name(), sms=num_sms(torch.device("cuda")), page=PAGE, rows=[], failures=[])
    for heads in args.heads:
        kvs = ["bf16", "fp8"] if args.kv_cache_dtype == "both" else [args.kv_cache_dtype]

        def variants(kv: str) -> dict:
            if args.gluon:
                return {k: v for k, v in (FP8_SWEEP if kv == "fp8" else TILE_SWEEP).items()
                        if (k == "default" or k.startswith("gluon")) and (not args.variants or k in args.variants)}
            if not args.sweep:
                return {"default": dict(gluon=False)}
            every = FP8_SWEEP if kv == "fp8" else TILE_SWEEP if heads <= 16 else HEAD_BLOCK_SWEEP
            if args.variants:  # variants named are timed at any head count
                every = {**(FP8_SWEEP if kv == "fp8" else TILE_SWEEP), **HEAD_BLOCK_SWEEP}
            return {k: v for k, v in every.items() if not args.variants or k in args.variants}

        if args.check:
            for kv in kvs:
                result["failures"] += check(variants(kv), heads, kv)
            print(f"check, {heads} heads: {len(result['failures'])} failures so far", flush=True)
        if args.queries_per_seq > 1:  # two ways to one output, compared and timed
            for batch in args.batches:
                for ctx in args.contexts:
                    for kv in kvs:
                        rows, failures = measure_fold(batch, ctx, heads, args.queries_per_seq, kv)
                        result["rows"] += rows
                        result["failures"] += failures
                        for row in rows:
                            print(json.dumps(row), flush=True)
            continue
        for batch in args.batches:
            for ctx in args.contexts:
                if batch * ctx > 64 * 131072:
                    continue
                default = default_num_splits(batch, heads, result["sms"])
                splits = [x for x in (default // 2, default * 2, default * 4) if 1 <= x <= 256] if args.sweep else []
                for kv in kvs:
                    for row in measure(batch, ctx, heads, variants(kv), splits, baseline, kv):
                        result["rows"].append(row)
                        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print(f"\n{result['gpu']}, {result['sms']} SMs: MLA decode, TB/s effective (cache bytes / time per call)")
    for row in result["rows"]:
        if "tb_s" in row and (row["variant"] in ("default", "before")
                              or row["variant"].startswith("gluon") or " rows " in row["variant"]):
            print(f"  H={row['heads']:<3} B={row['batch']:<3} ctx={row['context']:<7} {row['kv']:4s} "
                  f"{row['variant']:11s} "
                  f"splits={row.get('splits')!s:<4} {row['us']:9.1f} us {row['tb_s']:6.2f} TB/s")
    for f in result["failures"]:
        print("FAIL", f)
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
