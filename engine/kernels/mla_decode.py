"""Weight-absorbed MLA decode over the paged latent cache (flash-decoding, split along the sequence).

All heads share one latent row per token: [c_kv (kv_lora) | k_pe (rope)], 576 values for V3. With
q_nope already folded through W_UK, a head's score is q_latent . c_kv + q_pe . k_pe and its output is
the softmax-weighted sum of c_kv rows (W_UV is applied afterwards). So attention is MQA-like: a program
owns BLOCK_H heads of one sequence (the M of its tensor-core products) and one slice of its context,
and reads each cache tile once for all of them.

The grid is (head blocks, slices, sequences), fixed per batch size so a CUDA graph replays it; the
slice count is chosen on the host from the batch and the SM count alone (enough programs to fill the
chip at batch 1), and each program sizes its slice from its sequence's length on the device: at least
MIN_CHUNK tokens, so a short context runs in a few slices and the programs past its end exit at once.
Each slice writes its normalized partial output and log-sum-exp; a second kernel merges the slices of
each head. With one slice the first kernel writes the output itself (one launch). A sequence's
last R query tokens (a verification's k + 1 rows) can be folded into the heads (`queries_per_seq`):
one program's products then take R x H rows, each masked to the rows its token sees, and the
sequence's cache is read once for all R instead of once a row.

On Hopper, where `GLUON` is on, the split programs are `mla_decode_gluon`'s (up to 32 heads a program;
folded query tokens' heads too, where its `FOLDS` is on): the same slices and outputs, each tile loaded
by warps of its own (TMA, or the FP8 rows decoded into shared memory) while a consumer warpgroup runs both
products on wgmma.

Two regimes (measured on an H200, benchmarks/mla_decode.py): with a few sequences, one program per
SM on eight warps, each streaming its tiles through a five-stage pipeline; from batch 5, two programs
per SM (two stages each), which hide each other's latency. The tile's products take M = 16 heads, so a program
is bound by its own latency more than by the bytes: more programs in flight is what pays. Over bf16
rows at up to 16 heads a program, from batch 5 the accumulator is kept transposed ([kv_lora, heads]),
so the second product is a wgmma over the tile in shared memory with M = kv_lora (batch 64 at 16k-32k:
12 % faster, the copy ceiling). Under programmatic dependent launch each split program asks L2 for
its slice's first tiles before it waits for the kernel ahead (the new token's latent write): measured
1 % faster at one stream of V2-Lite.

An FP8 latent cache (`engine.layers.fp8_latent`, each block's c_kv, k_pe and scales in sections of
their own, each one wide load) is read two ways (`_attend_tile`). At up to 32 heads a program: e4m3
c_kv widened in registers for each product (the tile loaded twice, so both loads are pipelined), the
per-token scale folded into the scores and the probabilities, k_pe as stored; two stages on eight
warps at batch 1-4, 32-token tiles on four warps from batch 5: still slower a call than bf16 on an
H200 (1.2-1.3x at batch 1, 1.7x at batch 64 at 16k-32k at 16 heads; docs/perf.md). At 64 heads a
program (V3's 128 heads on one GPU): the tile decoded once into shared memory, then the bf16 cache's
products (1.3-1.5x faster than widening it for each there; at 32 heads a program, V3 over four ranks,
1.3-1.4x slower, so there the tile is widened as at 16).

Bytes: context_len * 576 * elem per sequence and head block (FP8: context_len * 644 at V3's shapes);
FLOPs: 4 * heads * context_len * 544.
"""

import functools

import torch
import triton
import triton.language as tl

from engine.kernels._util import (check, check_float, check_last_contiguous, gluon_available, interpreted, mma, pdl,
                                  pow2, prefetch_l2, wait_for_inputs)
from engine.layers.fp8_latent import FP8LatentLayout, dequantized

LOG2E = 1.4426950408889634
# the split kernel on Hopper through the warp-specialised Gluon one (`mla_decode_gluon`: up to 32 heads,
# bf16 or FP8 rows), where it applies: on an H100 as fast or faster at every batch, context, page and
# cache timed (FP8 rows at batch 64 and 32k: 1.3-1.9x), one stream at 32k over the FP8 cache +6-12 %
# (docs/perf.md, "The Gluon decode kernel on a card"; `benchmarks/mla_decode.py --gluon`, `bench --no-gluon`)
GLUON = True


@triton.jit
def _load_tile(Cache, CacheR, CacheS, Tables, b, stride_tb, stride_cb, stride_ct, stride_rb, stride_rt, stride_sb, n0,
               end, offs_t, offs_c, offs_r, mask_c, mask_r, PAGE: tl.constexpr, ONE_PAGE: tl.constexpr,
               FP8: tl.constexpr, RELOAD: tl.constexpr):
    """Tokens [n0, n0 + BLOCK_N) of one sequence, those before `end`: (c_kv [BLOCK_N, BLOCK_C],
    k_pe [BLOCK_N, BLOCK_R], valid [BLOCK_N], c_kv's scale [BLOCK_N]). A token's c_kv and k_pe are each
    contiguous and 16-byte aligned: in one 576-wide row (bf16), or in their sections of the block (FP8:
    512 bytes of e4m3 a token and its per-token scale, both decoded by the caller, `_attend_tile`)."""
    offs_n = n0 + offs_t
    mask_n = offs_n < end
    if ONE_PAGE:  # the tile lies in one page: one table entry, rows at a fixed stride
        page = tl.load(Tables + b * stride_tb + n0 // PAGE, mask=n0 < end, other=0).to(tl.int64)
        tok = (n0 % PAGE) + offs_t
    else:
        page = tl.load(Tables + b * stride_tb + offs_n // PAGE, mask=mask_n, other=0).to(tl.int64)
        tok = offs_n % PAGE
    row_c = page * stride_cb + tok * stride_ct
    row_r = page * stride_rb + tok * stride_rt
    kv = tl.load(Cache + row_c[:, None] + offs_c[None, :], mask=mask_n[:, None] & mask_c[None, :], other=0.0)
    if RELOAD:  # the same tile again (from L2) for the second product: each load has one use (`_attend_tile`)
        kv2 = tl.load(Cache + row_c[:, None] + offs_c[None, :], mask=mask_n[:, None] & mask_c[None, :], other=0.0,
                      eviction_policy="evict_first")
    else:
        kv2 = kv
    kp = tl.load(CacheR + row_r[:, None] + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :], other=0.0)
    if FP8:
        sc = tl.load(CacheS + page * stride_sb + tok, mask=mask_n, other=0.0)
    else:
        sc = offs_t.to(tl.float32) * 0.0 + 1.0  # unused
    return kv, kv2, kp, mask_n, sc


@triton.jit
def _attend_tile(q, qp, kv, kv2, kp, mask, sc, m_i, l_i, acc, scale_log2, UPCAST: tl.constexpr, FP8: tl.constexpr,
                 ACC_T: tl.constexpr, DEQUANT: tl.constexpr, EMPTY_ROWS: tl.constexpr = False):
    """Online softmax over one tile for every head of the program: -> (m_i, l_i, acc), acc [BLOCK_H, BLOCK_C]
    or (ACC_T) its transpose [BLOCK_C, BLOCK_H]. kv2 is kv, or the same tile loaded again. mask: the
    tokens each row sees, [1, BLOCK_N] (every head the same) or [BLOCK_H, BLOCK_N]; EMPTY_ROWS: a row may
    see none of the tile and none before it (its running max still -inf, kept finite here).

    FP8: c_kv = kv * sc per token, so q . c_kv = (q . kv) * sc and p @ c_kv = (p * sc) @ kv, kv widened
    in registers (exact). One of the two products takes the tile transposed, and one-byte operands have
    no transposing shared-memory load: a tile with two uses goes through registers twice and the
    pipeliner leaves its load synchronous. Hence RELOAD (a second load, from L2, for the second product:
    both loads pipelined) and ACC_T (acc^T += kv^T @ p^T: the tile as the wgmma's register operand,
    M = BLOCK_C instead of BLOCK_H rows). Or DEQUANT: the tile decoded once, each row times its scale;
    the per-row product keeps Triton from moving the widening past the products' layout conversions, so
    the decoded tile is staged in shared memory as a bf16 one is, and the second product reads it
    transposed with ldmatrix (one load, no byte-wide shared loads; then both products are the bf16
    cache's)."""
    if FP8 and DEQUANT:  # the rows as the prefill path decodes them (scaled in float32, rounded to q's dtype)
        kv = (kv.to(tl.float32) * sc[:, None]).to(q.dtype)
        kv2 = kv
    if FP8 and not DEQUANT:
        qk = mma(q, tl.trans(kv).to(q.dtype), UPCAST) * sc[None, :]
    else:
        qk = mma(q.to(kv.dtype), tl.trans(kv), UPCAST)
    qk += mma(qp.to(kp.dtype), tl.trans(kp), UPCAST)  # [BLOCK_H, BLOCK_N]
    qk = tl.where(mask, qk * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    if EMPTY_ROWS:  # -inf - -inf would be NaN: such a row's p and alpha are 0 against any finite max
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    p = tl.exp2(qk - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if FP8 and not DEQUANT:
        pv, v = (p * sc[None, :]).to(q.dtype), kv2.to(q.dtype)
    else:
        pv, v = p.to(kv.dtype), kv2
    if ACC_T:
        acc = acc * alpha[None, :] + mma(tl.trans(v), tl.trans(pv), UPCAST)
    else:
        acc = acc * alpha[:, None] + mma(pv, v, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _slice(ctx, s, num_splits, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr):
    """Slice s of a context of ctx tokens -> [start, end): a whole number of tiles, at least MIN_CHUNK
    tokens (empty past the context)."""
    chunk = tl.maximum(tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N, MIN_CHUNK)
    start = s * chunk
    return start, tl.minimum(start + chunk, ctx)


# neither the table's width (it follows the step's longest sequence) nor the slice count (it follows
# the batch) makes a compiled variant of its own
@triton.jit(do_not_specialize=["stride_tb", "table_width", "num_splits"])
def _split_kernel(QL, QP, Cache, CacheR, CacheS, Tables, Lens, MidO, MidLse, Out,
                  stride_qlb, stride_qlh, stride_qpb, stride_qph, stride_cb, stride_ct, stride_rb, stride_rt, stride_sb,
                  stride_tb, table_width, num_pages, stride_l,
                  stride_mb, stride_mh, stride_ms, stride_ob, stride_oh, num_heads, num_splits, scale_log2, row_heads,
                  KV_LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, MIN_CHUNK: tl.constexpr,
                  DIRECT: tl.constexpr, ONE_PAGE: tl.constexpr, UPCAST: tl.constexpr, FP8: tl.constexpr,
                  RELOAD: tl.constexpr, ACC_T: tl.constexpr, PDL: tl.constexpr, L2_TILES: tl.constexpr,
                  LINES_C: tl.constexpr, LINES_R: tl.constexpr, DEQUANT: tl.constexpr, QROWS: tl.constexpr = 1):
    # head blocks of one slice are neighbours in launch order: they run together and share its tiles in L2.
    # QROWS > 1: a sequence's last QROWS query tokens folded into the heads (num_heads = QROWS x row_heads,
    # head m is token m // row_heads's head m % row_heads), Lens the last token's; token r of them sees
    # QROWS - 1 - r rows fewer
    hb, s, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if L2_TILES > 0:
        # the slice's first tiles asked of L2 while the kernel ahead (the new token's latent write) ends.
        # The length and table read before waiting only aim the prefetch: where the kernel ahead wrote
        # them (an eager step's cast), they may be stale, so the table is read within its width, the page
        # clamped into the cache, and the length read again after the wait for the work itself. Each
        # tile lies in one page (ONE_PAGE), its c_kv rows (and an FP8 cache's k_pe rows) contiguous.
        start, end = _slice(tl.load(Lens + b * stride_l), s, num_splits, BLOCK_N, MIN_CHUNK)
        for i in tl.static_range(L2_TILES):
            n0 = start + i * BLOCK_N
            page = tl.load(Tables + b * stride_tb + n0 // PAGE, mask=(n0 < end) & (n0 // PAGE < table_width), other=0)
            page = tl.minimum(tl.maximum(page, 0), num_pages - 1).to(tl.int64)
            rows = tl.minimum(end - n0, BLOCK_N)
            prefetch_l2(Cache + page * stride_cb + (n0 % PAGE) * stride_ct,
                        rows * stride_ct * (Cache.dtype.element_ty.primitive_bitwidth // 8), LINES_C)
            if FP8:
                prefetch_l2(CacheR + page * stride_rb + (n0 % PAGE) * stride_rt,
                            rows * stride_rt * (CacheR.dtype.element_ty.primitive_bitwidth // 8), LINES_R)
    wait_for_inputs(PDL)
    ctx = tl.load(Lens + b * stride_l)
    start, end = _slice(ctx, s, num_splits, BLOCK_N, MIN_CHUNK)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_heads
    # an empty slice reads nothing (masked loads move no bytes) and writes only its -inf log-sum-exp
    read_h = offs_h < tl.where(start < end, num_heads, 0)
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    offs_t = tl.arange(0, BLOCK_N)
    mask_c, mask_r = offs_c < KV_LORA, offs_r < ROPE
    q = tl.load(QL + b * stride_qlb + offs_h[:, None] * stride_qlh + offs_c[None, :],
                mask=read_h[:, None] & mask_c[None, :], other=0.0)
    qp = tl.load(QP + b * stride_qpb + offs_h[:, None] * stride_qph + offs_r[None, :],
                 mask=read_h[:, None] & mask_r[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    if ACC_T:
        acc = tl.zeros([BLOCK_C, BLOCK_H], tl.float32)
    else:
        acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    # each head row's length (folded query tokens see fewer of the last rows)
    seen = ctx - (QROWS - 1 - offs_h // row_heads)
    for n0 in range(start, end, BLOCK_N):
        kv, kv2, kp, mask_n, sc = _load_tile(Cache, CacheR, CacheS, Tables, b, stride_tb, stride_cb, stride_ct, stride_rb,
                                        stride_rt, stride_sb, n0, end, offs_t, offs_c, offs_r, mask_c, mask_r, PAGE,
                                        ONE_PAGE, FP8, RELOAD)
        if QROWS > 1:
            mask = mask_n[None, :] & ((n0 + offs_t)[None, :] < seen[:, None])
        else:
            mask = mask_n[None, :]
        m_i, l_i, acc = _attend_tile(q, qp, kv, kv2, kp, mask, sc, m_i, l_i, acc, scale_log2, UPCAST, FP8, ACC_T,
                                     DEQUANT, QROWS > 1)
    if ACC_T:
        acc = tl.trans(acc)
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    if DIRECT:  # the only slice: the output itself (zeros for an empty context)
        tl.store(Out + b * stride_ob + offs_h[:, None] * stride_oh + offs_c[None, :],
                 out.to(Out.dtype.element_ty), mask=mask_h[:, None] & mask_c[None, :])
    else:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))  # base 2
        mid = MidO + b * stride_mb + offs_h[:, None] * stride_mh + s * stride_ms + offs_c[None, :]
        tl.store(mid, out.to(MidO.dtype.element_ty), mask=has[:, None] & mask_h[:, None] & mask_c[None, :])
        tl.store(MidLse + (b * num_heads + offs_h) * num_splits + s, lse, mask=mask_h)


@triton.jit
def _merged(MidO, MidLse, b, h, offs_c, mask_c, stride_mb, stride_mh, stride_ms, num_heads, num_splits,
            BLOCK_S: tl.constexpr):
    """Columns offs_c of head h's output, its slices' partial outputs weighted by their log-sum-exps ->
    float32 [len(offs_c)] (zeros where no slice saw a token)."""
    offs_s = tl.arange(0, BLOCK_S)
    lse = tl.load(MidLse + (b * num_heads + h) * num_splits + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    live = lse > float("-inf")  # slices past the context wrote no partial output
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(live, tl.exp2(lse - m), 0.0)  # [BLOCK_S]
    o = tl.load(MidO + b * stride_mb + h * stride_mh + offs_s[:, None] * stride_ms + offs_c[None, :],
                mask=live[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
    total = tl.sum(w, axis=0)
    return tl.sum(o * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(MidO, MidLse, Out, stride_mb, stride_mh, stride_ms, stride_ob, stride_oh, num_heads, num_splits,
                  KV_LORA: tl.constexpr, BLOCK_CM: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    # one program per (sequence, head, BLOCK_CM columns): at batch 1 the merge still spreads over the chip
    b, h, cb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    wait_for_inputs(PDL)
    offs_c = cb * BLOCK_CM + tl.arange(0, BLOCK_CM)
    mask_c = offs_c < KV_LORA
    res = _merged(MidO, MidLse, b, h, offs_c, mask_c, stride_mb, stride_mh, stride_ms, num_heads, num_splits, BLOCK_S)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_c, res.to(Out.dtype.element_ty), mask=mask_c)


# tiles of its slice each split program asks of L2 before it waits for the kernel ahead (under PDL)
L2_PREFETCH_TILES = 2
MAX_SPLITS = 128
# every slice count default_num_splits gives (powers of two): each is one merge variant to warm up
SPLIT_CHOICES = tuple(1 << i for i in range(MAX_SPLITS.bit_length()))


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def block_heads(num_heads: int, fp8: bool = False) -> int:
    """Heads per program: the M of its products, at most 64 (one warpgroup's tile). Over bf16 rows, 32
    heads (V3 over four ranks) run as two programs of 16 a slice, the second reading the tile from L2:
    the 16-head tiles are the tuned ones (measured 12-21 % faster than one program of 32 at batch 1-64
    and 16k-32k); over FP8 rows one program of 32 was faster (two of 16: 5-13 % slower)."""
    block = min(64, pow2(num_heads))
    return 16 if block == 32 and not fp8 else block


def programs_per_sm(batch: int, num_heads: int, sms: int = 132, block_h: int | None = None) -> int:
    """Programs each SM runs at once, by the tile choice `_tiles` makes for this batch: one where few
    sequences leave the slices alone to fill the chip (each program pipelines its tiles deeply), two
    otherwise (two 94 KB programs per SM hide each other's latency: measured 1.4x at batch 8 and 64);
    heads blocks of 64 take the whole SM."""
    block_h = block_h or block_heads(num_heads)
    if block_h > 16:
        return 1
    return 1 if batch * triton.cdiv(num_heads, block_h) * 32 <= sms else 2


def default_num_splits(batch: int, num_heads: int, sms: int = 132, block_h: int | None = None,
                       per_sm: int | None = None) -> int:
    """Slices per sequence so that (sequence, head block, slice) programs fill every SM's program slots
    once, a power of two (each count is a compiled merge variant) at most MAX_SPLITS; from the batch
    alone, since the context lives on the device. The programs size their slices from the context.
    per_sm: programs an SM runs at once (default `programs_per_sm`'s, this kernel's)."""
    block_h = block_h or block_heads(num_heads)
    programs = batch * triton.cdiv(num_heads, block_h)
    fill = max(1, (per_sm or programs_per_sm(batch, num_heads, sms, block_h)) * sms // programs)
    return min(MAX_SPLITS, 1 << (fill.bit_length() - 1))


def _tiles(block_c: int, block_h: int, elem: int, deep: bool, fp8: bool = False) -> dict:
    """64 tokens a tile (a 72 KB bf16 tile of 576-wide rows). Deep: five pipeline stages (two tiles in
    flight, 168 KB: one program per SM) on eight warps, for batches the slices alone spread over the chip
    (measured at batch 1: 2.9 vs 2.5 TB/s at 128k); else two stages (94 KB: two programs per SM). Slices
    of at least one tile (64 tokens: at batch 1 and 1k-16k context, 1.3-2x faster than 256).

    FP8 (elem 1) at up to 32 heads a program: the e4m3 tile loaded twice (`_attend_tile`, RELOAD), so
    that both loads are pipelined; its two 32 KB copies take the shared memory of one bf16 tile, so the
    bf16 tile shapes fit as they are (sm_90 compile: 94 KB at two stages, 168 KB at five). Eight warps:
    the widened tile is a register operand of both products (the bf16 one stays in shared memory), and
    four warps hold it only by spilling (ptxas: 1,096 bytes at four, none at eight): measured 1.6-1.9x
    faster with eight at batch 1, 2.9x at 64 (benchmarks/mla_decode.py --sweep, docs/perf.md). 128-token tiles lost 2x (one load; two
    would need 288 KB), the transposed accumulator 4-5x. At 16 heads a block (the sweep, 16k and 32k):
    two stages at batch 1 (13 % faster than five), and from batch 5 32-token tiles on four warps (two
    stages, 56 KB, no spills: two programs an SM again; 21 % faster at batch 64); at 64 heads a block
    (V3's 128) 32-token tiles lost 2.5-3x, and the tile decoded once (DEQUANT, one load) won: 33 vs 43 us
    at batch 1 and 16k, 1.22 vs 1.80 ms at batch 64; it is taken at 64 heads a block. At 16 and 32 it
    lost (16, batch 64: 629 vs 498 us; 32: 29.7 vs 22.9 us at batch 1 and 16k, 1.19 vs 0.84 ms at batch
    64, 1.3-1.4x at every batch and context measured).

    bf16 at 16 heads a block from batch 5: the transposed accumulator (acc^T += kv^T @ p^T, ACC_T), so
    the second product is a wgmma that reads the tile from shared memory, M = the 512 latent columns
    (untransposed it is mma.sync with M = 16, the tile through registers): at batch 64 293 vs 333 us at
    16k and 570 vs 646 at 32k (4.1-4.2 TB/s), 4 % slower at 1k; at batch 8 within 2 %. At batch 1 (the
    deep tiles) it was no faster, and over the FP8 tile slower."""
    block_n = 64 if block_c * max(elem, 2) <= 1024 else 32
    few_heads = block_h <= 16
    tile = dict(block_n=block_n, num_stages=2, num_warps=8, min_chunk=block_n, block_h=block_h, reload=fp8)
    if fp8 and block_h > 32:
        return dict(tile, dequant=True)
    if fp8 and not deep:
        return dict(tile, block_n=32, num_warps=4, min_chunk=32)
    if fp8:
        return tile
    if deep:  # eight warps where one program has the SM: 3-5 % faster at batch 1 from 1k to 128k
        return dict(tile, num_stages=5 if few_heads and block_c * elem <= 1024 else 2)
    return dict(tile, num_warps=4, acc_t=True)  # two programs an SM (at most 16 heads a block)


def mla_decode_attention(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor, softmax_scale: float,
                         num_splits: int | None = None, out: torch.Tensor | None = None,
                         tiles: dict | None = None, queries_per_seq: int = 1) -> torch.Tensor:
    """q_latent: [B, H, kv_lora], q_pe: [B, H, rope], kv_cache: [num_blocks, page, kv_lora + rope], or an
    FP8 latent cache [num_blocks, page, token_bytes] uint8 (`engine.layers.fp8_latent`, its k_pe in q_latent's dtype),
    block_tables: [B, max_blocks] int32, context_lens: [B] int32 -> latent output [B, H, kv_lora].

    Never reads context_lens on the host, so a CUDA graph can replay it with new lengths. num_splits:
    slices per sequence (default from the batch and the SM count); tiles: override of `_tiles`
    (block_n, num_stages, num_warps, min_chunk, block_h, reload; acc_t: the transposed accumulator of
    `_attend_tile`; dequant: an FP8 tile decoded once; l2_tiles: tiles asked of L2 before the wait;
    merge_cm, merge_warps: the merge's columns a program and warps; gluon: True or False, the Gluon split kernel where it applies or the Triton
    one, whatever `GLUON` says; tiles without it run the Triton kernel; gluon_loaders: its FP8 loader
    warpgroups, 1 or 2; gluon_codes: its FP8 rows staged as their codes, or decoded), for benchmarks and
    tests.

    queries_per_seq R > 1: the rows are sequences' last R query tokens, R consecutive rows a sequence
    (one block table), row r of a sequence seeing R - 1 - r rows fewer than its last row (a chunk's
    tokens as decode rows, a verification's k + 1 rows): each sequence's R rows are folded into the
    heads (R x H rows of one program's products), so its cache is read once for all R, not R times.
    The kernel reads the last row's length and table only; the contract on the others is the caller's."""
    check(q_latent.dim() == 3 and q_pe.dim() == 3 and kv_cache.dim() == 3, "q_latent, q_pe, kv_cache must be 3-D")
    batch, num_heads, kv_lora = q_latent.shape
    rope = q_pe.shape[2]
    check(q_pe.shape[:2] == (batch, num_heads), f"q_pe {tuple(q_pe.shape)} does not match q_latent {tuple(q_latent.shape)}")
    fp8 = kv_cache.dtype == torch.uint8
    if fp8:
        check(kv_cache.is_contiguous(), "an FP8 latent cache must be contiguous")
        cache, cache_r, cache_s = FP8LatentLayout(kv_lora, rope, q_latent.dtype).views(kv_cache)
    else:
        check(kv_cache.shape[2] == kv_lora + rope, f"cache rows hold {kv_cache.shape[2]} values, expected {kv_lora + rope}")
        cache, cache_r, cache_s = kv_cache, kv_cache[..., kv_lora:], kv_cache[..., 0]  # no scales
    for name, t in (("q_latent", q_latent), ("q_pe", q_pe), ("kv_cache", kv_cache)):
        if t is not kv_cache or not fp8:
            check_float(name, t)
        check_last_contiguous(name, t)
    check(block_tables.dtype == torch.int32 and context_lens.dtype == torch.int32,
          "block_tables and context_lens must be int32")
    check(block_tables.shape[0] == batch and context_lens.shape == (batch,), "one block table and length per sequence")
    check(block_tables.stride(-1) == 1, "block_tables must be contiguous in its last dimension")
    rows, heads_per_row = batch, num_heads
    check(queries_per_seq >= 1 and batch % queries_per_seq == 0,
          f"{batch} rows do not split into sequences of {queries_per_seq} query tokens")
    fold = queries_per_seq > 1
    if fold:
        check(all(t.stride(0) == num_heads * t.stride(1) for t in (q_latent, q_pe))
              and (out is None or out.is_contiguous()),
              "folded query tokens need q_latent's and q_pe's rows head after head (and out contiguous)")
        batch, num_heads = batch // queries_per_seq, num_heads * queries_per_seq

        def folded(t: torch.Tensor) -> torch.Tensor:  # [B * R, H, d] -> [B, R * H, d], the same memory
            return t.as_strided((batch, num_heads, t.shape[2]), (t.stride(0) * queries_per_seq, t.stride(1), 1))

        q_latent, q_pe = folded(q_latent), folded(q_pe)
        out = None if out is None else out.view(batch, num_heads, -1)
    # each sequence's last row's table and length (its only row unless folded), at a stride of R
    block_tables = block_tables[queries_per_seq - 1 :: queries_per_seq]
    last_lens = context_lens[queries_per_seq - 1 :]
    sms = num_sms(q_latent.device)
    gluon = _takes_gluon(q_latent, q_pe, kv_cache, queries_per_seq, tiles)
    if gluon:
        from engine.kernels import mla_decode_gluon
    block_h = (tiles or {}).get("block_h") or block_heads(num_heads, fp8)
    deep = programs_per_sm(batch, num_heads, sms, block_h) == 1
    cfg = dict(_tiles(pow2(kv_lora), block_h, kv_cache.element_size(), deep, fp8), **(tiles or {}))
    if num_splits is None:  # the Gluon kernel's programs take an SM each
        num_splits = (mla_decode_gluon.default_num_splits(batch, num_heads, sms) if gluon
                      else default_num_splits(batch, num_heads, sms, block_h))
    check(num_splits >= 1, "num_splits must be >= 1")
    if out is None:
        out = torch.empty(batch, num_heads, kv_lora, dtype=q_latent.dtype, device=q_latent.device)
    check(out.shape == (batch, num_heads, kv_lora) and out.stride(-1) == 1,
          f"out must be [{batch}, {num_heads}, {kv_lora}] contiguous in its last dimension")
    result = out.view(rows, heads_per_row, -1) if fold else out  # the rows as given
    if batch == 0:
        return result
    block_c = pow2(kv_lora)
    direct = num_splits == 1
    shape = (0,) * 4 if direct else (batch, num_heads, num_splits, kv_lora)
    # the slices' partial outputs (normalized: convex combinations of latent rows) in float32 (float16,
    # half the bytes, measured no faster: its bytes are not where a one-stream call's time goes)
    mid_o = torch.empty(shape, dtype=torch.float32, device=q_latent.device)
    mid_lse = torch.empty(shape[:3], dtype=torch.float32, device=q_latent.device)
    grid = (triton.cdiv(num_heads, block_h), num_splits, batch)
    dequant = fp8 and cfg.get("dequant", False)  # a decoded tile has one use: no second load
    on = pdl(q_latent)
    one_page = kv_cache.shape[1] % cfg["block_n"] == 0
    # tiles asked of L2 before waiting for the kernel ahead (PDL, a tile within one page)
    l2_tiles = cfg.get("l2_tiles", L2_PREFETCH_TILES) if on and one_page else 0
    lines = lambda t: pow2(triton.cdiv(cfg["block_n"] * t.stride(1) * t.element_size(), 128), 1)
    if gluon:
        mla_decode_gluon.split(q_latent, q_pe, kv_cache, (cache, cache_r, cache_s) if fp8 else None, block_tables,
                               last_lens, mid_o, mid_lse, out, num_splits, softmax_scale, direct, pdl=on,
                               fp8_loaders=cfg.get("gluon_loaders"), fp8_codes=cfg.get("gluon_codes"),
                               l2_tiles=cfg.get("l2_tiles"), queries_per_seq=queries_per_seq)
    else:
        _split_kernel[grid](q_latent, q_pe, cache, cache_r, cache_s, block_tables, last_lens, mid_o, mid_lse, out,
                            q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
                            cache.stride(0), cache.stride(1), cache_r.stride(0), cache_r.stride(1), cache_s.stride(0),
                            block_tables.stride(0), block_tables.shape[1], kv_cache.shape[0], queries_per_seq,
                            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), out.stride(0), out.stride(1),
                            num_heads, num_splits, softmax_scale * LOG2E, heads_per_row,
                            KV_LORA=kv_lora, ROPE=rope, BLOCK_C=block_c, BLOCK_R=pow2(rope), BLOCK_H=block_h,
                            BLOCK_N=cfg["block_n"], PAGE=kv_cache.shape[1], MIN_CHUNK=cfg["min_chunk"], DIRECT=direct,
                            ONE_PAGE=one_page, UPCAST=interpreted(kv_cache), FP8=fp8,
                            RELOAD=fp8 and cfg.get("reload", False) and not dequant, ACC_T=cfg.get("acc_t", False),
                            DEQUANT=dequant, PDL=on, L2_TILES=l2_tiles, LINES_C=lines(cache), LINES_R=lines(cache_r),
                            QROWS=queries_per_seq, launch_pdl=on, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if not direct:
        # columns per merge program: 32 where the sequences' heads are few (measured on an H200 at 16
        # heads: 0.5-1.2 us faster than 16 at batch 1, 1.5-2 us than 64 at batch 8; one stream of
        # V2-Lite 1 % faster); else ~2K partial values a program (at batch 64, 32 columns lost 1.2-1.5x
        # up to 4k tokens)
        block_s = pow2(num_splits, 2)
        block_cm = cfg.get("merge_cm") or (32 if batch * num_heads <= 128 else max(16, min(block_c, 2048 // block_s)))
        _merge_kernel[(batch, num_heads, triton.cdiv(kv_lora, block_cm))](
            mid_o, mid_lse, out, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), out.stride(0), out.stride(1),
            num_heads, num_splits, KV_LORA=kv_lora, BLOCK_CM=block_cm, BLOCK_S=block_s, PDL=on, launch_pdl=on,
            num_warps=cfg.get("merge_warps", 4))
    return result


def _takes_gluon(q_latent, q_pe, kv_cache, queries_per_seq: int, tiles: dict | None) -> bool:
    """Whether the Gluon split kernel runs: `GLUON` (or tiles' `gluon`, for benchmarks and tests; other
    tile overrides are the Triton kernel's), a Triton with Gluon, and operands it is built for."""
    want = (tiles or {}).get("gluon", GLUON and not tiles)
    if not want or interpreted(q_latent) or not gluon_available():
        return False
    from engine.kernels import mla_decode_gluon

    return mla_decode_gluon.applies(q_latent, q_pe, kv_cache, queries_per_seq)


def reference_mla_decode_attention(q_latent, q_pe, kv_cache, block_tables, context_lens, softmax_scale):
    """Plain PyTorch, float32, one sequence at a time (an empty context gives zeros); an FP8 cache's rows
    pages are decoded first."""
    page, kv_lora = kv_cache.shape[1], q_latent.shape[2]
    outs = []
    for b, n in enumerate(context_lens.tolist()):
        pages = kv_cache[block_tables[b, : -(-n // page)].long()]
        rows = dequantized(pages, kv_lora, q_pe.shape[2], q_latent.dtype).float().flatten(0, 1)[:n]  # [n, kv_lora + rope]
        scores = (q_latent[b].float() @ rows[:, :kv_lora].T + q_pe[b].float() @ rows[:, kv_lora:].T) * softmax_scale
        outs.append(scores.softmax(-1) @ rows[:, :kv_lora] if n else torch.zeros_like(q_latent[b], dtype=torch.float32))
    return torch.stack(outs).to(q_latent.dtype)
