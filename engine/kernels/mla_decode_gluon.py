"""MLA decode attention's split kernel in Gluon on Hopper, for up to 32 heads a program (V2-Lite's 16; V3's
128 heads over four or eight GPUs): `mla_decode`'s contract and outputs, each slice's tile work split
over warps that run at once (after FlashMLA's design: loads and conversions beside the warpgroup that
runs the products), for DeepSeek's latent widths (kv_lora 512, rope 64).

Why: at 16 heads a program the Triton split kernel is bound by its own latency (docs/perf.md, "Where the
16-head kernel's time goes": one eight-warp program an SM, no eligible warp in 67-79 % of cycles), and
over the FP8 cache it executes twice the instructions, so it is slower than over bf16 rows although it
reads half the bytes. Here a program is

- a loader: bf16 rows by TMA (one warp: a tile's c_kv and k_pe boxes, one page's 64 rows or four
  16-token pages' pieces, into a free stage of a two-tile ring); or FP8 rows (a warpgroup): a tile's e4m3 c_kv, k_pe and scales loaded, each
  row times its scale rounded to bf16 (the rows the prefill path and the reference decode), stored to the
  stage, so the conversions run beside the products instead of before them;
- a consumer warpgroup: per tile the scores transposed, S^T [64 tokens, H] = K Q^T (M = the tile's 64
  tokens, so 16 heads fill a wgmma without padding), the online softmax down each head's column, P^T
  [64, H] to shared memory, and O^T [512, H] += V^T P^T (M = the 512 latent columns, the tile read
  transposed from shared memory: the Triton kernel's ACC_T products, on wgmma in both). A tile's stage
  is released as soon as its values product is done, so the loader fills one stage while the consumer
  works on the other (decode is bound by bytes: the ring's depth, not the products' overlap, is what
  counts).

The split (slice sizes from the context on the device, an empty slice writing only its -inf log-sum-exp)
and the outputs (each slice's normalized partial output and base-2 log-sum-exp, or with one slice the
output itself) are `mla_decode`'s, so its merge kernels follow unchanged. One program an SM (two bf16
tiles take 144 KB), so the slice count fills the SMs once.

Rows past the context in a tile's last page are read by TMA (it cannot mask rows inside the tensor);
their scores are masked, and their values are multiplied by a zero probability, which is exact as long
as they are finite: the KV pool starts zeroed and only latent rows are written to it.

Triton's interpreter runs no Gluon: this kernel is compiled for sm_90 on the CPU
(`engine.tools.compile_kernels`) and checked against the reference on a card.
"""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from engine.kernels import mla_decode
from engine.kernels._gluon import WS_LIST_FORM, descriptor, thread_barrier, tma_load, wait_for_inputs
from engine.kernels._util import _capability

KV_LORA, ROPE = gl.constexpr(512), gl.constexpr(64)  # the latent widths it is built for (every DeepSeek MLA model's)
BLOCK_N = gl.constexpr(64)  # tokens a tile: the scores' M
MIN_CHUNK = gl.constexpr(64)  # a slice is at least one tile
CHUNK = gl.constexpr(16)  # FP8 rows decoded at a time (a [16, 512] e4m3 chunk: 64 bytes a loader thread)
STAGES = 2  # tiles in the ring (72 KB each as bf16)
MAX_HEADS = 32  # heads a program: O^T [512, H] takes 4 H registers a consumer thread
# FP8 loader warpgroups: one (a tile's four chunks two at a time) or two (each a half: all four in flight);
# two measured as fast or faster everywhere on an H100 (7-22 % at 16k-32k, batch 1-64)
FP8_LOADERS = 2
# registers a thread of the TMA warp and of each FP8 loader warpgroup (by their number), the fewest without
# spills (ptxas for sm_90): the TMA warp 40 (four pieces' rows looked up ahead at 16-token pages); one FP8
# warpgroup 208 (with four chunks in flight it spilled even at 256); two 168 each, which leaves the consumer
# 168, too few for 32 heads' O^T (it spilled): there one loader warpgroup serves.
TMA_REGS, FP8_REGS = 40, {1: 208, 2: 168}


@gluon.jit
def _slice(ctx, s, num_splits, BLOCK_N: gl.constexpr, MIN_CHUNK: gl.constexpr):
    """`mla_decode._slice`: slice s of a context of ctx tokens -> (start, end, its number of tiles)."""
    chunk = gl.maximum(gl.cdiv(gl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N, MIN_CHUNK)
    start = s * chunk
    end = gl.minimum(start + chunk, ctx)
    return start, end, gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)


# ---------------------------------------------------------------------------------------------------------
# the loaders: bf16 rows by TMA, FP8 rows decoded into the stage
# ---------------------------------------------------------------------------------------------------------
@gluon.jit
def _tma_loader(ops, H: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr, DIRECT: gl.constexpr,
                LOADERS: gl.constexpr):
    """One warp: each tile's c_kv and k_pe boxes into the next stage, once the consumer released it. A
    tile is one page's rows, or (pages of 16 or 32 tokens) several pages' pieces; a piece past the
    slice's end loads the last piece's rows again (finite rows, masked by the consumer), so every stage
    receives the same bytes."""
    q_s, qp_s, kv_s, kp_s, p_s, full, empty = ops[0]
    ckv_desc, kpe_desc = ops[1]
    (QL, QP, Tables, MidO, MidLse, Out, b, hb, s, start, n_tiles, end, stride_tb, stride_qlb, stride_qlh, stride_qpb,
     stride_qph, stride_mb, stride_mh, stride_ms, stride_ob, stride_oh, num_heads, num_splits, scale_log2) = ops[2]
    ROWS: gl.constexpr = ckv_desc.block_type.shape[0]  # a piece: min(PAGE, BLOCK_N) rows of one page
    PIECES: gl.constexpr = BLOCK_N // ROWS
    last_piece = (end - 1) // ROWS * ROWS
    for j in range(n_tiles):
        stage = j % STAGES
        # the pieces' rows looked up in the block table before the wait for the stage, off its critical path
        rows = _piece_rows(Tables, b, stride_tb, start + j * BLOCK_N, last_piece, PAGE, ROWS, PIECES)
        if j >= STAGES:
            mbarrier.wait(empty.index(stage), phase=(j // STAGES - 1) & 1)
        bar = full.index(stage)
        mbarrier.expect(bar, PIECES * (ckv_desc.block_type.nbytes + kpe_desc.block_type.nbytes))
        for i in gl.static_range(PIECES):
            tma_load(ckv_desc, [rows[i], 0], bar, kv_s.index(stage).slice(i * ROWS, ROWS, dim=0))
            tma_load(kpe_desc, [rows[i], KV_LORA], bar, kp_s.index(stage).slice(i * ROWS, ROWS, dim=0))


@gluon.jit
def _piece_row(Tables, b, stride_tb, n0, last_piece, PAGE: gl.constexpr):
    """The row (of the [pages * PAGE, 576] view) where the piece starting at token n0 lies; a piece past
    the slice's end: the last piece's."""
    n = gl.minimum(n0, last_piece)
    return (gl.load(Tables + b * stride_tb + n // PAGE).to(gl.int64) * PAGE + n % PAGE).to(gl.int32)


@gluon.jit
def _piece_rows(Tables, b, stride_tb, n0, last_piece, PAGE: gl.constexpr, ROWS: gl.constexpr,
                PIECES: gl.constexpr):
    """A tile's pieces' rows, as a tuple of PIECES (1, 2 or 4): one page's 64 rows, or 32- / 16-token pages'."""
    if PIECES == 1:
        return (_piece_row(Tables, b, stride_tb, n0, last_piece, PAGE), )
    elif PIECES == 2:
        return (_piece_row(Tables, b, stride_tb, n0, last_piece, PAGE),
                _piece_row(Tables, b, stride_tb, n0 + ROWS, last_piece, PAGE))
    else:
        return (_piece_row(Tables, b, stride_tb, n0, last_piece, PAGE),
                _piece_row(Tables, b, stride_tb, n0 + ROWS, last_piece, PAGE),
                _piece_row(Tables, b, stride_tb, n0 + 2 * ROWS, last_piece, PAGE),
                _piece_row(Tables, b, stride_tb, n0 + 3 * ROWS, last_piece, PAGE))


@gluon.jit
def _fp8_chunk(Cache, CacheR, CacheS, Tables, b, stride_tb, n0, end, stride_cb, stride_ct, stride_rb, stride_rt,
               stride_sb, PAGE: gl.constexpr):
    """Tokens [n0, n0 + CHUNK) of sequence b (one page's rows: PAGE is a multiple of CHUNK), those before
    `end`: c_kv e4m3 [CHUNK, 512], k_pe [CHUNK, 64], scales [CHUNK], loaded, not yet decoded."""
    c_layout: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [4, 1], [1, 0])  # 16 bytes a thread, a row a warp
    r_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    page = gl.load(Tables + b * stride_tb + n0 // PAGE, mask=n0 < end, other=0).to(gl.int64)
    tok0 = n0 % PAGE
    rc = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, c_layout))
    cc = gl.arange(0, KV_LORA, layout=gl.SliceLayout(0, c_layout))
    live_c = n0 + rc < end
    kv = gl.load(Cache + page * stride_cb + (tok0 + rc)[:, None] * stride_ct + cc[None, :],
                 mask=live_c[:, None] & (cc < KV_LORA)[None, :], other=0.0)
    sc = gl.load(CacheS + page * stride_sb + tok0 + rc, mask=live_c, other=0.0)
    rr = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, r_layout))
    cr = gl.arange(0, ROPE, layout=gl.SliceLayout(0, r_layout))
    live_r = n0 + rr < end
    kp = gl.load(CacheR + page * stride_rb + (tok0 + rr)[:, None] * stride_rt + cr[None, :],
                 mask=live_r[:, None] & (cr < ROPE)[None, :], other=0.0)
    return kv, sc, kp


@gluon.jit
def _fp8_store(kv_s, kp_s, stage, r0, kv, sc, kp):
    """A loaded chunk decoded (each row times its scale, in float32, rounded to bf16) into the stage."""
    rows = (kv.to(gl.float32) * sc[:, None]).to(gl.bfloat16)
    kv_s.index(stage).slice(r0, CHUNK, dim=0).store(rows)
    kp_s.index(stage).slice(r0, CHUNK, dim=0).store(kp)


@gluon.jit
def _fp8_rows(ops, PAGE: gl.constexpr, STAGES: gl.constexpr, R0: gl.constexpr, CHUNKS: gl.constexpr):
    """One loader warpgroup's rows of every tile, [R0, R0 + CHUNKS x CHUNK): loaded two chunks at a time
    (the first two before it waits for the stage), decoded into the stage once the consumer released it,
    the stage's barrier arrived at when every thread's stores are done (one arrival a loader warpgroup)."""
    q_s, qp_s, kv_s, kp_s, p_s, full, empty = ops[0]
    Cache, CacheR, CacheS, stride_cb, stride_ct, stride_rb, stride_rt, stride_sb = ops[1]
    (QL, QP, Tables, MidO, MidLse, Out, b, hb, s, start, n_tiles, end, stride_tb, stride_qlb, stride_qlh, stride_qpb,
     stride_qph, stride_mb, stride_mh, stride_ms, stride_ob, stride_oh, num_heads, num_splits, scale_log2) = ops[2]
    for j in range(n_tiles):
        stage = j % STAGES
        n0 = start + j * BLOCK_N + R0
        kv0, sc0, kp0 = _fp8_chunk(Cache, CacheR, CacheS, Tables, b, stride_tb, n0, end, stride_cb, stride_ct,
                                   stride_rb, stride_rt, stride_sb, PAGE)
        kv1, sc1, kp1 = _fp8_chunk(Cache, CacheR, CacheS, Tables, b, stride_tb, n0 + CHUNK, end, stride_cb, stride_ct,
                                   stride_rb, stride_rt, stride_sb, PAGE)
        if j >= STAGES:
            mbarrier.wait(empty.index(stage), phase=(j // STAGES - 1) & 1)
        _fp8_store(kv_s, kp_s, stage, R0, kv0, sc0, kp0)
        if CHUNKS == 4:  # the next chunk's loads issued before the current one is decoded and stored
            kv0, sc0, kp0 = _fp8_chunk(Cache, CacheR, CacheS, Tables, b, stride_tb, n0 + 2 * CHUNK, end, stride_cb,
                                       stride_ct, stride_rb, stride_rt, stride_sb, PAGE)
        _fp8_store(kv_s, kp_s, stage, R0 + CHUNK, kv1, sc1, kp1)
        if CHUNKS == 4:
            kv1, sc1, kp1 = _fp8_chunk(Cache, CacheR, CacheS, Tables, b, stride_tb, n0 + 3 * CHUNK, end, stride_cb,
                                       stride_ct, stride_rb, stride_rt, stride_sb, PAGE)
            _fp8_store(kv_s, kp_s, stage, R0 + 2 * CHUNK, kv0, sc0, kp0)
            _fp8_store(kv_s, kp_s, stage, R0 + 3 * CHUNK, kv1, sc1, kp1)
        fence_async_shared()  # the generic stores visible to the consumer's wgmma (the async proxy)
        thread_barrier()  # every thread's rows stored before the stage is handed over
        mbarrier.arrive(full.index(stage), count=1)


@gluon.jit
def _fp8_loader0(ops, H: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr, DIRECT: gl.constexpr,
                 LOADERS: gl.constexpr):
    """The first FP8 loader warpgroup: every row of a tile, or its first half where there are two."""
    _fp8_rows(ops, PAGE, STAGES, 0, 4 // LOADERS)


@gluon.jit
def _fp8_loader1(ops, H: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr, DIRECT: gl.constexpr,
                 LOADERS: gl.constexpr):
    """The second FP8 loader warpgroup (LOADERS = 2): the tile's second half, so all four chunks of a tile
    are in flight at once."""
    _fp8_rows(ops, PAGE, STAGES, 2 * CHUNK, 2)


# ---------------------------------------------------------------------------------------------------------
# the consumer warpgroup
# ---------------------------------------------------------------------------------------------------------
@gluon.jit
def _softmax(s, m_i, l_i, valid, scale_log2):
    """Scores S^T [BLOCK_N, H] of one tile, `valid` its rows before the slice's end -> (P^T float32,
    m, l, alpha), down each head's column. A slice's first tile has a valid row, so m is finite from it on."""
    s = gl.where(valid[:, None], s * scale_log2, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=0))
    p = gl.exp2(s - m_new[None, :])
    alpha = gl.exp2(m_i - m_new)
    return p, m_new, l_i * alpha + gl.sum(p, axis=0), alpha


@gluon.jit
def _stage_p(p_s, p):
    """P^T rounded to bf16 (the Triton kernel's rounding) into shared memory, the values product's B
    operand: visible to the async proxy, and stored by all four warps before any issues the product."""
    p_s.store(p.to(gl.bfloat16))
    fence_async_shared()
    thread_barrier()


@gluon.jit
def _issue_scores(kv_s, kp_s, stage, q_t, qp_t, s0):
    """S^T = C_kv Q_latent^T + K_pe Q_pe^T of the tile in `stage`, in flight."""
    s = warpgroup_mma(kv_s.index(stage), q_t, s0, use_acc=False, is_async=True)
    return warpgroup_mma(kp_s.index(stage), qp_t, s, is_async=True)


@gluon.jit
def _load_queries(QL, QP, q_s, qp_s, b, hb, num_heads, stride_qlb, stride_qlh, stride_qpb, stride_qph,
                  H: gl.constexpr):
    """The program's heads' absorbed queries (zeros past num_heads) into shared memory: the scores' B operand."""
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    h = hb * H + gl.arange(0, H, layout=gl.SliceLayout(1, q_layout))
    c = gl.arange(0, KV_LORA, layout=gl.SliceLayout(0, q_layout))
    r = gl.arange(0, ROPE, layout=gl.SliceLayout(0, q_layout))
    live = h < num_heads
    q = gl.load(QL + b * stride_qlb + h[:, None] * stride_qlh + c[None, :], mask=live[:, None] & (c < KV_LORA)[None, :],
                other=0.0)
    qp = gl.load(QP + b * stride_qpb + h[:, None] * stride_qph + r[None, :], mask=live[:, None] & (r < ROPE)[None, :],
                 other=0.0)
    q_s.store(q)
    qp_s.store(qp)
    fence_async_shared()
    thread_barrier()


@gluon.jit
def _consume(q_s, qp_s, kv_s, kp_s, p_s, full, empty, start, n_tiles, end, scale_log2, H: gl.constexpr,
             STAGES: gl.constexpr):
    """Every tile of the slice -> (O^T [512, H] unnormalized, m, l), FlashAttention's online softmax over
    the transposed products. Per tile: wait for it, its scores, their softmax, O rescaled, P^T staged, its
    values product, then the stage released at once. Decode is bound by bytes, not by the tensor cores, so
    what matters is that the ring's other stage is loading while a tile is consumed: holding two stages
    (a tile's scores in flight with the previous tile's values product, FlashAttention-3's overlap) would
    start each load only once the previous one landed."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, H, 16])
    m_i = gl.full([H], float("-inf"), gl.float32, layout=gl.SliceLayout(0, s_layout))
    l_i = gl.zeros([H], gl.float32, layout=gl.SliceLayout(0, s_layout))
    s0 = gl.zeros([BLOCK_N, H], gl.float32, layout=s_layout)
    o = gl.zeros([KV_LORA, H], gl.float32, layout=s_layout)
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    q_t, qp_t = q_s.permute((1, 0)), qp_s.permute((1, 0))  # [512, H], [64, H]
    for j in range(n_tiles):
        stage = j % STAGES
        mbarrier.wait(full.index(stage), phase=(j // STAGES) & 1)
        s = _issue_scores(kv_s, kp_s, stage, q_t, qp_t, s0)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        p, m_i, l_i, alpha = _softmax(s, m_i, l_i, start + j * BLOCK_N + rows < end, scale_log2)
        o = o * alpha[None, :]  # the first tile's alpha is 0 (m was -inf), O still zeros
        _stage_p(p_s, p)  # the previous tile's values product, its reader, has completed
        o = warpgroup_mma(kv_s.index(stage).permute((1, 0)), p_s, o, is_async=True)
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o, ))
        mbarrier.arrive(empty.index(stage), count=1)
    return o, m_i, l_i


@gluon.jit
def _consumer(ops, H: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr, DIRECT: gl.constexpr,
              LOADERS: gl.constexpr):
    """The default partition (four warps): the queries, every tile, then the slice's output."""
    q_s, qp_s, kv_s, kp_s, p_s, full, empty = ops[0]
    (QL, QP, Tables, MidO, MidLse, Out, b, hb, s, start, n_tiles, end, stride_tb, stride_qlb, stride_qlh, stride_qpb,
     stride_qph, stride_mb, stride_mh, stride_ms, stride_ob, stride_oh, num_heads, num_splits, scale_log2) = ops[2]
    _load_queries(QL, QP, q_s, qp_s, b, hb, num_heads, stride_qlb, stride_qlh, stride_qpb, stride_qph, H)
    o, m_i, l_i = _consume(q_s, qp_s, kv_s, kp_s, p_s, full, empty, start, n_tiles, end, scale_log2, H, STAGES)
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, H, 16])
    has = l_i > 0
    out = o / gl.where(has, l_i, 1.0)[None, :]
    # stored from the accumulator's layout: a warp's store covers 8 latent columns (32 bytes) of 8 heads
    c = gl.arange(0, KV_LORA, layout=gl.SliceLayout(1, o_layout))
    h = hb * H + gl.arange(0, H, layout=gl.SliceLayout(0, o_layout))
    live = (h < num_heads)
    if DIRECT:  # the only slice: the output itself (zeros for an empty context)
        gl.store(Out + b.to(gl.int64) * stride_ob + h[None, :] * stride_oh + c[:, None], out.to(Out.dtype.element_ty),
                 mask=live[None, :] & (c < KV_LORA)[:, None])
    else:
        # int64: batch x heads x slices x 512 partial values may pass 2^31 at explicit slice counts
        gl.store(MidO + b.to(gl.int64) * stride_mb + h[None, :] * stride_mh + s * stride_ms + c[:, None],
                 out.to(MidO.dtype.element_ty), mask=(live & has)[None, :] & (c < KV_LORA)[:, None])
        lse = gl.where(has, m_i + gl.log2(gl.where(has, l_i, 1.0)), float("-inf"))  # base 2
        gl.store(MidLse + (b * num_heads + h) * num_splits + s, lse, mask=live)


# ---------------------------------------------------------------------------------------------------------
# the kernels: one program a (head block, slice, sequence), as `mla_decode._split_kernel`'s grid
# ---------------------------------------------------------------------------------------------------------
@gluon.jit
def _program(Lens, num_splits):
    hb, s, b = gl.program_id(0), gl.program_id(1), gl.program_id(2)
    start, end, n_tiles = _slice(gl.load(Lens + b), s, num_splits, BLOCK_N, MIN_CHUNK)
    return hb, s, b, start, end, n_tiles


@gluon.jit
def _buffers(H: gl.constexpr, STAGES: gl.constexpr, LOADERS: gl.constexpr):
    """The program's shared memory: queries, the ring of tiles, P^T, and the ring's barriers."""
    dt: gl.constexpr = gl.bfloat16
    q_s = gl.allocate_shared_memory(dt, [H, KV_LORA], gl.NVMMASharedLayout.get_default_for([H, KV_LORA], dt))
    qp_s = gl.allocate_shared_memory(dt, [H, ROPE], gl.NVMMASharedLayout.get_default_for([H, ROPE], dt))
    kv_s = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, KV_LORA],
                                     gl.NVMMASharedLayout.get_default_for([BLOCK_N, KV_LORA], dt))
    kp_s = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, ROPE],
                                     gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE], dt))
    p_s = gl.allocate_shared_memory(dt, [BLOCK_N, H], gl.NVMMASharedLayout.get_default_for([BLOCK_N, H], dt))
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=LOADERS)  # a TMA warp's expect, or each FP8 loader warpgroup's arrival
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()  # the barriers' initialisation visible to the TMA unit
    return q_s, qp_s, kv_s, kp_s, p_s, full, empty


# neither the table's width (it follows the step's longest sequence) nor the slice count makes a variant
@gluon.jit(do_not_specialize=["stride_tb", "num_splits"])
def _tma_decode_kernel(ckv_desc, kpe_desc, QL, QP, Tables, Lens, MidO, MidLse, Out, stride_qlb, stride_qlh, stride_qpb,
                       stride_qph, stride_tb, stride_mb, stride_mh, stride_ms, stride_ob, stride_oh, num_heads,
                       num_splits, scale_log2, H: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr,
                       DIRECT: gl.constexpr, LOADER_REGS: gl.constexpr, PDL: gl.constexpr):
    """bf16 rows: the consumer warpgroup (the default partition) + the TMA warp."""
    wait_for_inputs(PDL)  # the lengths and queries are the kernel ahead's
    hb, s, b, start, end, n_tiles = _program(Lens, num_splits)
    ops = (_buffers(H, STAGES, 1), (ckv_desc, kpe_desc),
           (QL, QP, Tables, MidO, MidLse, Out, b, hb, s, start, n_tiles, end, stride_tb, stride_qlb, stride_qlh,
            stride_qpb, stride_qph, stride_mb, stride_mh, stride_ms, stride_ob, stride_oh, num_heads, num_splits,
            scale_log2))
    if WS_LIST_FORM:
        gl.warp_specialize([(_consumer, (ops, H, PAGE, STAGES, DIRECT, 1)),
                            (_tma_loader, (ops, H, PAGE, STAGES, DIRECT, 1))], [1], [LOADER_REGS])
    else:
        gl.warp_specialize((ops, H, PAGE, STAGES, DIRECT, 1), _consumer, (ops, H, PAGE, STAGES, DIRECT, 1),
                           [_tma_loader], [1], [LOADER_REGS])


@gluon.jit(do_not_specialize=["stride_tb", "num_splits"])
def _fp8_decode_kernel(Cache, CacheR, CacheS, QL, QP, Tables, Lens, MidO, MidLse, Out, stride_cb, stride_ct, stride_rb,
                       stride_rt, stride_sb, stride_qlb, stride_qlh, stride_qpb, stride_qph, stride_tb, stride_mb,
                       stride_mh, stride_ms, stride_ob, stride_oh, num_heads, num_splits, scale_log2,
                       H: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr, DIRECT: gl.constexpr,
                       LOADER_REGS: gl.constexpr, PDL: gl.constexpr, LOADERS: gl.constexpr):
    """FP8 rows: the consumer warpgroup (the default partition) + one or two decoding loader warpgroups."""
    wait_for_inputs(PDL)
    hb, s, b, start, end, n_tiles = _program(Lens, num_splits)
    ops = (_buffers(H, STAGES, LOADERS), (Cache, CacheR, CacheS, stride_cb, stride_ct, stride_rb, stride_rt, stride_sb),
           (QL, QP, Tables, MidO, MidLse, Out, b, hb, s, start, n_tiles, end, stride_tb, stride_qlb, stride_qlh,
            stride_qpb, stride_qph, stride_mb, stride_mh, stride_ms, stride_ob, stride_oh, num_heads, num_splits,
            scale_log2))
    if LOADERS == 2:
        if WS_LIST_FORM:
            gl.warp_specialize([(_consumer, (ops, H, PAGE, STAGES, DIRECT, LOADERS)),
                                (_fp8_loader0, (ops, H, PAGE, STAGES, DIRECT, LOADERS)),
                                (_fp8_loader1, (ops, H, PAGE, STAGES, DIRECT, LOADERS))], [4, 4],
                               [LOADER_REGS, LOADER_REGS])
        else:
            gl.warp_specialize((ops, H, PAGE, STAGES, DIRECT, LOADERS), _consumer,
                               (ops, H, PAGE, STAGES, DIRECT, LOADERS), [_fp8_loader0, _fp8_loader1], [4, 4],
                               [LOADER_REGS, LOADER_REGS])
    else:
        if WS_LIST_FORM:
            gl.warp_specialize([(_consumer, (ops, H, PAGE, STAGES, DIRECT, LOADERS)),
                                (_fp8_loader0, (ops, H, PAGE, STAGES, DIRECT, LOADERS))], [4], [LOADER_REGS])
        else:
            gl.warp_specialize((ops, H, PAGE, STAGES, DIRECT, LOADERS), _consumer,
                               (ops, H, PAGE, STAGES, DIRECT, LOADERS), [_fp8_loader0], [4], [LOADER_REGS])


# ---------------------------------------------------------------------------------------------------------
# the host side
# ---------------------------------------------------------------------------------------------------------
def block_heads(num_heads: int) -> int:
    """Heads a program: 16, or 32 where there are more (two programs of 16 would read each tile twice)."""
    return 16 if num_heads <= 16 else 32


def default_num_splits(batch: int, num_heads: int, sms: int) -> int:
    """Slices a sequence so that this kernel's programs (one an SM) fill the chip once: `mla_decode`'s
    choice at its head blocks."""
    return mla_decode.default_num_splits(batch, num_heads, sms, block_heads(num_heads), per_sm=1)


def _pages_fit(page: int) -> bool:
    """Pages of whole tiles, or tiles of whole pages of 16 or 32 tokens (a TMA box and an FP8 chunk each)."""
    return page % int(BLOCK_N) == 0 or page in (16, 32)


def applies(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, queries_per_seq: int = 1) -> bool:
    """Whether the Gluon split kernel takes these operands: a Hopper GPU, bf16 queries, DeepSeek's latent
    widths, up to 32 heads a program (64 heads and more: the Triton kernel's 64-head tiles), pages of
    whole tiles or of 16 or 32 tokens, a cache TMA can describe (bf16 rows: contiguous, 16-byte aligned) or
    an FP8 one, and one query token a sequence. A bf16 cache's rows past a context must be finite (TMA
    reads them, a zero probability multiplies them): the engine's pool starts zeroed and holds latents."""
    t = q_latent
    if not (t.is_cuda and _capability(t.device) == 9 and queries_per_seq == 1):  # cached: asked every decode call
        return False
    fp8 = kv_cache.dtype == torch.uint8
    return (t.dtype == torch.bfloat16 and q_pe.dtype == torch.bfloat16 and t.shape[2] == int(KV_LORA)
            and q_pe.shape[2] == int(ROPE) and t.shape[1] <= MAX_HEADS and _pages_fit(kv_cache.shape[1])
            and kv_cache.is_contiguous() and kv_cache.data_ptr() % 16 == 0
            and (fp8 or (kv_cache.dtype == torch.bfloat16 and kv_cache.shape[2] == int(KV_LORA) + int(ROPE))))


def split(q_latent, q_pe, kv_cache, views, block_tables, context_lens, mid_o, mid_lse, out, num_splits,
          softmax_scale, direct: bool, pdl: bool = False, fp8_loaders: int | None = None):
    """Launch the split kernel over [B, H, 512] / [B, H, 64] queries: the slices' partial outputs into mid_o
    [B, H, S, 512] and log-sum-exps into mid_lse [B, H, S] (base 2), or with `direct` (one slice) the
    output into out [B, H, 512]. `views`: the FP8 cache's (c_kv, k_pe, scale) views, else None; pdl:
    launched with programmatic dependent launch (the kernel waits for the one ahead before any read);
    fp8_loaders: the FP8 loader warpgroups (default FP8_LOADERS)."""
    batch, num_heads, _ = q_latent.shape
    heads = block_heads(num_heads)
    page = kv_cache.shape[1]
    grid = (triton.cdiv(num_heads, heads), num_splits, batch)
    common = (q_latent, q_pe, block_tables, context_lens, mid_o, mid_lse, out)
    strides = (q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), block_tables.stride(0),
               mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), out.stride(0), out.stride(1), num_heads, num_splits,
               softmax_scale * 1.4426950408889634)
    if views is None:
        rows = kv_cache.view(-1, kv_cache.shape[2])  # [pages * page, 576]
        piece = min(page, int(BLOCK_N))  # the rows of one page a TMA box takes
        descs = (descriptor(rows, [piece, int(KV_LORA)]), descriptor(rows, [piece, int(ROPE)]))
        _tma_decode_kernel[grid](*descs, *common, *strides, H=heads, PAGE=page, STAGES=STAGES, DIRECT=direct,
                                 LOADER_REGS=TMA_REGS, PDL=pdl, launch_pdl=pdl, num_warps=4)
    else:
        c_kv, k_pe, scale = views
        loaders = 1 if heads > 16 else fp8_loaders or FP8_LOADERS
        _fp8_decode_kernel[grid](c_kv, k_pe, scale, *common, c_kv.stride(0), c_kv.stride(1), k_pe.stride(0),
                                 k_pe.stride(1), scale.stride(0), *strides, H=heads, PAGE=page, STAGES=STAGES,
                                 DIRECT=direct, LOADER_REGS=FP8_REGS[loaders], PDL=pdl, LOADERS=loaders,
                                 launch_pdl=pdl, num_warps=4)
