"""MLA decode attention's split kernel in Gluon on Hopper, for up to 32 heads a program (V2-Lite's 16; V3's
128 heads over four or eight GPUs): `mla_decode`'s contract and outputs, each slice's tile work split
over warps that run at once (after FlashMLA's design: loads and conversions beside the warpgroup that
runs the products), for DeepSeek's latent widths (kv_lora 512, rope 64).

Why: at 16 heads a program the Triton split kernel is bound by its own latency (docs/perf.md, "Where the
16-head kernel's time goes": one eight-warp program an SM, no eligible warp in 67-79 % of cycles), and
over the FP8 cache it executes twice the instructions, so it is slower than over bf16 rows although it
reads half the bytes. Here a program is

- a loader: bf16 rows by TMA (one warp: a tile's c_kv and k_pe boxes, one page's 64 rows or four
  16-token pages' pieces, into a free stage of a two-tile ring); or FP8 rows (one or two warpgroups): a
  tile's e4m3 c_kv, k_pe and scales loaded and stored to the stage, either as codes (each widened to
  float16, exact, one conversion a pair; the scales beside them, applied by the consumer to each row's
  score and probability) or decoded (each row times its scale rounded to bf16, the rows the prefill path
  and the reference decode read), so the conversions run beside the products instead of before them;
- a consumer warpgroup: per tile the scores transposed, S^T [64 tokens, H] = K Q^T (M = the tile's 64
  tokens, so 16 heads fill a wgmma without padding), the online softmax down each head's column, P^T
  [64, H] to shared memory, and O^T [512, H] += V^T P^T (M = the 512 latent columns, the tile read
  transposed from shared memory: the Triton kernel's ACC_T products, on wgmma in both). A tile's stage
  is released as soon as its values product is done, so the loader fills one stage while the consumer
  works on the other (decode is bound by bytes: the ring's depth, not the products' overlap, is what
  counts).

Under programmatic dependent launch a program asks L2 for its slice's first tiles before it waits for the
kernel ahead (`_ask_l2`, as the Triton kernel does), so the first tile's bytes are on their way while the
new token's latent write ends.

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
from engine.kernels._gluon import (WS_LIST_FORM, descriptor, reinterpret, thread_barrier, tma_load,
                                  wait_for_inputs)
from engine.kernels._util import PREFETCH_L2_ASM, _capability, pow2

KV_LORA, ROPE = gl.constexpr(512), gl.constexpr(64)  # the latent widths it is built for (every DeepSeek MLA model's)
BLOCK_N = gl.constexpr(64)  # tokens a tile: the scores' M
MIN_CHUNK = gl.constexpr(64)  # a slice is at least one tile
CHUNK = gl.constexpr(16)  # FP8 rows decoded at a time (a [16, 512] e4m3 chunk: 64 bytes a loader thread)
STAGES = 2  # tiles in the ring (72 KB each as bf16)
MAX_HEADS = 32  # heads a program: O^T [512, H] takes 4 H registers a consumer thread
# FP8 loader warpgroups: one (a tile's four chunks two at a time) or two (each a half: all four in flight);
# two measured as fast or faster everywhere on an H100 (7-22 % at 16k-32k, batch 1-64)
FP8_LOADERS = 2
# FP8 rows staged as their codes (`_fp8_codes`: each e4m3 code widened to float16, one conversion a pair,
# exact; each row's scale applied to its score and probability instead of to its 512 values) at 32 heads
# a program, and at 16 from this many sequences a launch; else decoded to bf16 rows in the loaders
# (`_fp8_rows`, three instructions a value). Measured on an H100 (docs/perf.md, "FP8 codes in the decode
# stage"): the codes 2-7 % faster where a program reads 16 tiles or more (8 sequences at 8k, 4 at 32k,
# 64: 6-7 %; 32 heads at one sequence: 6 %), the decoded rows 2-8 % faster where it reads 1-4 (one
# stream of 16 heads at 8k-32k); the launch knows the batch, not the contexts, so the batch decides.
CODES_FROM_BATCH = 8
# registers a thread of the TMA warp and of each FP8 loader warpgroup (by staging and their number), the
# fewest without spills (ptxas for sm_90): the TMA warp 40 (four pieces' rows looked up ahead at 16-token
# pages); decoding rows, one warpgroup 208 (with four chunks in flight it spilled even at 256), two 168
# each, which leaves the consumer 168, too few for 32 heads' O^T (it spilled): there one loader warpgroup
# serves; staging codes (a tile's four chunks in flight), one 208, two 152, which leaves the consumer (two
# score accumulators) 184.
TMA_REGS, FP8_REGS = 40, {(False, 1): 208, (False, 2): 168, (True, 1): 208, (True, 2): 152}
# a sequence's query tokens folded into one program's heads where all R x H fit (`applies`): two tokens of
# 16 heads, one verified draft or a two-token chunk, read the cache once instead of as two rows. Wherever
# the engine folds two tokens this is 1.3-2.2x faster than the Triton kernel's fold it replaces (an H100,
# docs/perf.md "Two query tokens in one Gluon program: measured"); off: those folds run on the Triton kernel
FOLDS = True
# the queries' largest |value| in float16 once scaled by a power of two: 2^14, below 65504
Q_RANGE = gl.constexpr(16384.0)


@gluon.jit
def _slice(ctx, s, num_splits, BLOCK_N: gl.constexpr, MIN_CHUNK: gl.constexpr):
    """`mla_decode._slice`: slice s of a context of ctx tokens -> (start, end, its number of tiles)."""
    chunk = gl.maximum(gl.cdiv(gl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N, MIN_CHUNK)
    start = s * chunk
    end = gl.minimum(start + chunk, ctx)
    return start, end, gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)


@gluon.jit
def _prefetch_l2(Base, nbytes, LINES: gl.constexpr):
    """`_util.prefetch_l2` in Gluon: one `prefetch.global.L2` a 128-byte line of the first nbytes (at most
    LINES x 128) at Base, spread over the program's four warps; nothing waits for it."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs = gl.arange(0, LINES, layout=layout) * 128
    gl.inline_asm_elementwise(PREFETCH_L2_ASM, "=r,l,r", [Base.to(gl.pointer_type(gl.int8), bitcast=True) + offs,
                                                         (offs < nbytes).to(gl.int32)],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _ask_l2(Lens, Tables, C, R, b, s, num_splits, stride_tb, table_width, num_pages, stride_cb, stride_ct, stride_rb,
            stride_rt, C_BYTES: gl.constexpr, R_BYTES: gl.constexpr, TILES: gl.constexpr, PAGE: gl.constexpr,
            LINES_C: gl.constexpr, LINES_R: gl.constexpr, QROWS: gl.constexpr):
    """The slice's first TILES tiles asked of L2 before the program waits for the kernel ahead (the new
    token's latent write), as the Triton kernel does (`mla_decode._split_kernel`): in a decode graph the
    lengths, the tables and every cache row but the new token's were written launches back, and L2 is where
    memory is coherent, so a line asked for before the new row lands is still read as written. The length
    and table read here only aim the prefetch (an eager step's lengths come from a cast launched just ahead,
    so they may be stale): the table read within its width, the page clamped into the cache; the program's
    work is sliced by the length read after the wait. A tile's rows a page at a time (C's: c_kv, or bf16
    rows whole; R's: an FP8 cache's k_pe, R_BYTES 0 where none)."""
    ROWS: gl.constexpr = PAGE if PAGE < BLOCK_N else BLOCK_N  # a tile's rows within one page
    start, end, n_tiles = _slice(gl.load(Lens + b * QROWS), s, num_splits, BLOCK_N, MIN_CHUNK)
    for i in gl.static_range(TILES * (BLOCK_N // ROWS)):
        n0 = start + i * ROWS
        page = gl.load(Tables + b * stride_tb + n0 // PAGE, mask=(n0 < end) & (n0 // PAGE < table_width), other=0)
        page = gl.minimum(gl.maximum(page, 0), num_pages - 1).to(gl.int64)
        rows = gl.minimum(end - n0, ROWS)  # none past the slice's end
        _prefetch_l2(C + page * stride_cb + (n0 % PAGE) * stride_ct, rows * stride_ct * C_BYTES, LINES_C)
        if R_BYTES > 0:
            _prefetch_l2(R + page * stride_rb + (n0 % PAGE) * stride_rt, rows * stride_rt * R_BYTES, LINES_R)


# ---------------------------------------------------------------------------------------------------------
# the loaders: bf16 rows by TMA, FP8 rows decoded into the stage
# ---------------------------------------------------------------------------------------------------------
@gluon.jit
def _tma_loader(ops, H: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr, DIRECT: gl.constexpr,
                LOADERS: gl.constexpr, CODES: gl.constexpr):
    """One warp: each tile's c_kv and k_pe boxes into the next stage, once the consumer released it. A
    tile is one page's rows, or (pages of 16 or 32 tokens) several pages' pieces; a piece past the
    slice's end loads the last piece's rows again (finite rows, masked by the consumer), so every stage
    receives the same bytes."""
    q_s, qp_s, kv_s, kp_s, p_s, sc_s, full, empty = ops[0]
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
               stride_sb, PAGE: gl.constexpr, WORDS: gl.constexpr):
    """Tokens [n0, n0 + CHUNK) of sequence b (one page's rows: PAGE is a multiple of CHUNK), those before
    `end`: c_kv e4m3 [CHUNK, 512] (WORDS: as int32 words of four codes, [CHUNK, 128], so a thread's 16
    bytes stay in four registers: unpacked, a code a register, a tile held in flight spilled), k_pe
    [CHUNK, 64], scales [CHUNK], loaded, not yet decoded."""
    PER: gl.constexpr = 4 if WORDS else 1  # codes an element
    c_layout: gl.constexpr = gl.BlockedLayout([1, 16 // PER], [1, 32], [4, 1], [1, 0])  # 16 B a thread, a warp a row
    r_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    codes = Cache
    if WORDS:
        codes = Cache.to(gl.pointer_type(gl.int32), bitcast=True)
    page = gl.load(Tables + b * stride_tb + n0 // PAGE, mask=n0 < end, other=0).to(gl.int64)
    tok0 = n0 % PAGE
    rc = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, c_layout))
    cc = gl.arange(0, KV_LORA // PER, layout=gl.SliceLayout(0, c_layout))
    live_c = n0 + rc < end
    kv = gl.load(codes + page * (stride_cb // PER) + (tok0 + rc)[:, None] * (stride_ct // PER) + cc[None, :],
                 mask=live_c[:, None] & (cc < KV_LORA // PER)[None, :], other=0.0)
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
    q_s, qp_s, kv_s, kp_s, p_s, sc_s, full, empty = ops[0]
    Cache, CacheR, CacheS, stride_cb, stride_ct, stride_rb, stride_rt, stride_sb = ops[1]
    (QL, QP, Tables, MidO, MidLse, Out, b, hb, s, start, n_tiles, end, stride_tb, stride_qlb, stride_qlh, stride_qpb,
     stride_qph, stride_mb, stride_mh, stride_ms, stride_ob, stride_oh, num_heads, num_splits, scale_log2) = ops[2]
    for j in range(n_tiles):
        stage = j % STAGES
        n0 = start + j * BLOCK_N + R0
        kv0, sc0, kp0 = _fp8_chunk(Cache, CacheR, CacheS, Tables, b, stride_tb, n0, end, stride_cb, stride_ct,
                                   stride_rb, stride_rt, stride_sb, PAGE, False)
        kv1, sc1, kp1 = _fp8_chunk(Cache, CacheR, CacheS, Tables, b, stride_tb, n0 + CHUNK, end, stride_cb, stride_ct,
                                   stride_rb, stride_rt, stride_sb, PAGE, False)
        if j >= STAGES:
            mbarrier.wait(empty.index(stage), phase=(j // STAGES - 1) & 1)
        _fp8_store(kv_s, kp_s, stage, R0, kv0, sc0, kp0)
        if CHUNKS == 4:  # the next chunk's loads issued before the current one is decoded and stored
            kv0, sc0, kp0 = _fp8_chunk(Cache, CacheR, CacheS, Tables, b, stride_tb, n0 + 2 * CHUNK, end, stride_cb,
                                       stride_ct, stride_rb, stride_rt, stride_sb, PAGE, False)
        _fp8_store(kv_s, kp_s, stage, R0 + CHUNK, kv1, sc1, kp1)
        if CHUNKS == 4:
            kv1, sc1, kp1 = _fp8_chunk(Cache, CacheR, CacheS, Tables, b, stride_tb, n0 + 3 * CHUNK, end, stride_cb,
                                       stride_ct, stride_rb, stride_rt, stride_sb, PAGE, False)
            _fp8_store(kv_s, kp_s, stage, R0 + 2 * CHUNK, kv0, sc0, kp0)
            _fp8_store(kv_s, kp_s, stage, R0 + 3 * CHUNK, kv1, sc1, kp1)
        fence_async_shared()  # the generic stores visible to the consumer's wgmma (the async proxy)
        thread_barrier()  # every thread's rows stored before the stage is handed over
        mbarrier.arrive(full.index(stage), count=1)


@gluon.jit
def _fp8_loader0(ops, H: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr, DIRECT: gl.constexpr,
                 LOADERS: gl.constexpr, CODES: gl.constexpr):
    """The first FP8 loader warpgroup: every tile, or (two, codes) the even ones, or (two, decoded rows)
    every tile's first half."""
    if CODES:
        _fp8_codes(ops, PAGE, STAGES, 0, LOADERS)
    else:
        _fp8_rows(ops, PAGE, STAGES, 0, 4 // LOADERS)


@gluon.jit
def _fp8_loader1(ops, H: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr, DIRECT: gl.constexpr,
                 LOADERS: gl.constexpr, CODES: gl.constexpr):
    """The second FP8 loader warpgroup (LOADERS = 2): the odd tiles (codes), or every tile's second half
    (decoded rows: all four chunks of a tile in flight at once)."""
    if CODES:
        _fp8_codes(ops, PAGE, STAGES, 1, LOADERS)
    else:
        _fp8_rows(ops, PAGE, STAGES, 2 * CHUNK, 2)


@gluon.jit
def _codes_store(kv_s, kp_s, sc_s, stage, r0, kv, sc, kp):
    """A loaded chunk into the stage as it is: the codes widened to float16 (exact: every e4m3 value is
    one; a word's four codes by two conversions of a pair, stored as two words of float16 pairs through
    the stage viewed as words), k_pe, and the rows' scales for the consumer."""
    lo, hi = gl.inline_asm_elementwise(
        "{ .reg .b16 a, b; mov.b32 {a, b}, $2; cvt.rn.f16x2.e4m3x2 $0, a; cvt.rn.f16x2.e4m3x2 $1, b; }",
        "=r,=r,r", [kv], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
    halves = gl.reshape(gl.join(lo, hi), [CHUNK, KV_LORA // 2])  # codes (4w, 4w + 1) then (4w + 2, 4w + 3)
    words: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, KV_LORA // 2], gl.int32)
    reinterpret(kv_s.index(stage), gl.int32, [BLOCK_N, KV_LORA // 2], words).slice(r0, CHUNK, dim=0).store(halves)
    kp_s.index(stage).slice(r0, CHUNK, dim=0).store(kp)
    sc_s.index(stage).slice(r0, CHUNK, dim=0).store(sc)


@gluon.jit
def _fp8_codes(ops, PAGE: gl.constexpr, STAGES: gl.constexpr, W: gl.constexpr, LOADERS: gl.constexpr):
    """Loader warpgroup W's tiles (every LOADERS-th from tile W: with two, each fills one stage of the
    ring), as codes: a tile's four chunks loaded at once, stored once the consumer released the stage,
    and the stage's barrier arrived at when every thread's stores are done. The tiles split between the
    loaders rather than their rows: a loader's fence before its arrival waits for its own loads in
    flight, so loads of a next tile issued before it (a chunk pipeline inside one warpgroup) would wait
    there too, while the other loader's next tile is in flight through it."""
    q_s, qp_s, kv_s, kp_s, p_s, sc_s, full, empty = ops[0]
    Cache, CacheR, CacheS, stride_cb, stride_ct, stride_rb, stride_rt, stride_sb = ops[1]
    (QL, QP, Tables, MidO, MidLse, Out, b, hb, s, start, n_tiles, end, stride_tb, stride_qlb, stride_qlh, stride_qpb,
     stride_qph, stride_mb, stride_mh, stride_ms, stride_ob, stride_oh, num_heads, num_splits, scale_log2) = ops[2]
    for j in range(W, n_tiles, LOADERS):
        stage = j % STAGES
        n0 = start + j * BLOCK_N
        kv0, sc0, kp0 = _fp8_chunk(Cache, CacheR, CacheS, Tables, b, stride_tb, n0, end, stride_cb, stride_ct,
                                     stride_rb, stride_rt, stride_sb, PAGE, True)
        kv1, sc1, kp1 = _fp8_chunk(Cache, CacheR, CacheS, Tables, b, stride_tb, n0 + CHUNK, end, stride_cb,
                                     stride_ct, stride_rb, stride_rt, stride_sb, PAGE, True)
        kv2, sc2, kp2 = _fp8_chunk(Cache, CacheR, CacheS, Tables, b, stride_tb, n0 + 2 * CHUNK, end, stride_cb,
                                     stride_ct, stride_rb, stride_rt, stride_sb, PAGE, True)
        kv3, sc3, kp3 = _fp8_chunk(Cache, CacheR, CacheS, Tables, b, stride_tb, n0 + 3 * CHUNK, end, stride_cb,
                                     stride_ct, stride_rb, stride_rt, stride_sb, PAGE, True)
        if j >= STAGES:
            mbarrier.wait(empty.index(stage), phase=(j // STAGES - 1) & 1)
        _codes_store(kv_s, kp_s, sc_s, stage, 0, kv0, sc0, kp0)
        _codes_store(kv_s, kp_s, sc_s, stage, CHUNK, kv1, sc1, kp1)
        _codes_store(kv_s, kp_s, sc_s, stage, 2 * CHUNK, kv2, sc2, kp2)
        _codes_store(kv_s, kp_s, sc_s, stage, 3 * CHUNK, kv3, sc3, kp3)
        fence_async_shared()  # the generic stores visible to the consumer's wgmma (the async proxy)
        thread_barrier()  # every thread's rows stored before the stage is handed over
        mbarrier.arrive(full.index(stage), count=1)


# ---------------------------------------------------------------------------------------------------------
# the consumer warpgroup
# ---------------------------------------------------------------------------------------------------------
@gluon.jit
def _softmax(s, m_i, l_i, valid, scale_log2, FOLD: gl.constexpr):
    """Scores S^T [BLOCK_N, H] of one tile, `valid` its rows before the slice's end ([BLOCK_N, 1]; folded
    query tokens: [BLOCK_N, H], each head's row seeing its own length) -> (P^T float32, m, l, alpha), down
    each head's column. A slice's first tile has a valid row, so m is finite from it on; folded, a head
    may see no row of a tile while m is still -inf (its token ends before the slice starts): then the max
    subtracted is 0, so P and alpha are 0, not NaN."""
    s = gl.where(valid, s * scale_log2, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=0))
    m_use = m_new
    if FOLD:
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s - m_use[None, :])
    alpha = gl.exp2(m_i - m_use)
    return p, m_new, l_i * alpha + gl.sum(p, axis=0), alpha


@gluon.jit
def _stage_p(p_s, p):
    """P^T rounded to the operands' 16 bits (bf16: the Triton kernel's rounding) into shared memory, the
    values product's B operand: visible to the async proxy, and stored by all four warps before any issues
    the product."""
    p_s.store(p.to(p_s.dtype))
    fence_async_shared()
    thread_barrier()


@gluon.jit
def _issue_scores(kv_s, kp_s, stage, q_t, qp_t, s0):
    """S^T = C_kv Q_latent^T + K_pe Q_pe^T of the tile in `stage`, in flight."""
    s = warpgroup_mma(kv_s.index(stage), q_t, s0, use_acc=False, is_async=True)
    return warpgroup_mma(kp_s.index(stage), qp_t, s, is_async=True)


@gluon.jit
def _load_queries(QL, QP, q_s, qp_s, b, hb, num_heads, stride_qlb, stride_qlh, stride_qpb, stride_qph,
                  H: gl.constexpr, CODES: gl.constexpr):
    """The program's heads' absorbed queries (zeros past num_heads) into shared memory, the scores' B
    operand -> the factor they were scaled by. Beside FP8 codes (float16 operands) the latent queries are
    scaled by the power of two that brings their largest |value| into [2^14, 2^15): exact (bf16's 8
    significant bits fit float16's 11), out of float16's overflow, and dividing the scores back is exact."""
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    h = hb * H + gl.arange(0, H, layout=gl.SliceLayout(1, q_layout))
    c = gl.arange(0, KV_LORA, layout=gl.SliceLayout(0, q_layout))
    r = gl.arange(0, ROPE, layout=gl.SliceLayout(0, q_layout))
    live = h < num_heads
    q = gl.load(QL + b * stride_qlb + h[:, None] * stride_qlh + c[None, :], mask=live[:, None] & (c < KV_LORA)[None, :],
                other=0.0)
    qp = gl.load(QP + b * stride_qpb + h[:, None] * stride_qph + r[None, :], mask=live[:, None] & (r < ROPE)[None, :],
                 other=0.0)
    if CODES:
        q = q.to(gl.float32)
        amax = gl.max(gl.max(gl.abs(q), axis=1), axis=0)
        q_mult = gl.exp2(gl.floor(gl.log2(Q_RANGE / gl.maximum(amax, 1e-30))))
        q_s.store((q * q_mult).to(gl.float16))
    else:
        q_mult = 1.0
        q_s.store(q)
    qp_s.store(qp)
    fence_async_shared()
    thread_barrier()
    return q_mult


@gluon.jit
def _consume(q_s, qp_s, kv_s, kp_s, p_s, sc_s, full, empty, start, n_tiles, end, ctx, hb, scale_log2, q_mult,
             H: gl.constexpr, STAGES: gl.constexpr, CODES: gl.constexpr, QROWS: gl.constexpr,
             ROW_HEADS: gl.constexpr):
    """Every tile of the slice -> (O^T [512, H] unnormalized, m, l, the factor O is in units of),
    FlashAttention's online softmax over the transposed products. Per tile: wait for it, its scores, their
    softmax, O rescaled, P^T staged, its values product, then the stage released at once. Decode is bound
    by bytes, not by the tensor cores, so what matters is that the ring's other stage is loading while a
    tile is consumed: holding two stages (a tile's scores in flight with the previous tile's values
    product, FlashAttention-3's overlap) would start each load only once the previous one landed. Over
    FP8 codes, whose loaders hold the next tile in registers before they wait for a stage, that overlap
    was built and measured 2-8 % slower at every batch (docs/perf.md, "FP8 codes in the decode stage").

    Over FP8 codes (CODES) row n of the tile is its codes c_n times its scale d_n, so its score is d_n (c_n .
    q) and its values' share of O is (p_n d_n) c_n: the latent product over the codes and the k_pe product
    (bf16) in two accumulators, the first scaled by d_n / q_mult, and P^T times d_n / d_ref in float16
    (d_ref the slice's first tile's largest scale, so the factors stay near 1 where float16 is exact to
    11 bits; O comes out in units of d_ref).

    QROWS > 1: a sequence's last QROWS query tokens folded into the heads (head m is token m // ROW_HEADS's
    head m % ROW_HEADS; ctx the last token's length): token r sees QROWS - 1 - r rows fewer."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, H, 16])
    m_i = gl.full([H], float("-inf"), gl.float32, layout=gl.SliceLayout(0, s_layout))
    l_i = gl.zeros([H], gl.float32, layout=gl.SliceLayout(0, s_layout))
    s0 = gl.zeros([BLOCK_N, H], gl.float32, layout=s_layout)
    o = gl.zeros([KV_LORA, H], gl.float32, layout=s_layout)
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    if QROWS > 1:  # the rows each head's token sees in the slice, [1, H]
        heads = hb * H + gl.arange(0, H, layout=gl.SliceLayout(0, s_layout))
        seen = gl.minimum(ctx - (QROWS - 1 - heads // ROW_HEADS), end)[None, :]
    q_t, qp_t = q_s.permute((1, 0)), qp_s.permute((1, 0))  # [512, H], [64, H]
    d_ref = scale_log2 * 0.0 + 1.0  # a float32 scalar
    if CODES:
        if n_tiles > 0:  # the first tile's largest scale, taken before O is live (in the loop, 32 heads spilled)
            mbarrier.wait(full.index(0), phase=0)
            d_ref = gl.max(sc_s.index(0).load(gl.SliceLayout(1, s_layout)), axis=0)
    for j in range(n_tiles):
        stage = j % STAGES
        mbarrier.wait(full.index(stage), phase=(j // STAGES) & 1)
        if CODES:
            d = sc_s.index(stage).load(gl.SliceLayout(1, s_layout))
            s_c = warpgroup_mma(kv_s.index(stage), q_t, s0, use_acc=False, is_async=True)
            s_r = warpgroup_mma(kp_s.index(stage), qp_t, s0, use_acc=False, is_async=True)
            s_c, s_r = warpgroup_mma_wait(num_outstanding=0, deps=(s_c, s_r))
            s = s_c * (d / q_mult)[:, None] + s_r
        else:
            s = _issue_scores(kv_s, kp_s, stage, q_t, qp_t, s0)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        n = start + j * BLOCK_N + rows
        if QROWS > 1:
            valid = n[:, None] < seen
        else:
            valid = (n < end)[:, None]
        p, m_i, l_i, alpha = _softmax(s, m_i, l_i, valid, scale_log2, QROWS > 1)
        o = o * alpha[None, :]  # the first tile's alpha is 0 (m was -inf), O still zeros
        if CODES:  # rows past the end: p = 0 and d = 0 (their loads masked)
            p = p * (d / d_ref)[:, None]
        _stage_p(p_s, p)  # the previous tile's values product, its reader, has completed
        o = warpgroup_mma(kv_s.index(stage).permute((1, 0)), p_s, o, is_async=True)
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o, ))
        mbarrier.arrive(empty.index(stage), count=1)
    return o, m_i, l_i, d_ref


@gluon.jit
def _consumer(ops, ctx, H: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr, DIRECT: gl.constexpr,
              LOADERS: gl.constexpr, CODES: gl.constexpr, QROWS: gl.constexpr, ROW_HEADS: gl.constexpr):
    """The default partition (four warps): the queries, every tile, then the slice's output (ctx: the
    sequence's length, its last token's where QROWS tokens are folded into the heads)."""
    q_s, qp_s, kv_s, kp_s, p_s, sc_s, full, empty = ops[0]
    (QL, QP, Tables, MidO, MidLse, Out, b, hb, s, start, n_tiles, end, stride_tb, stride_qlb, stride_qlh, stride_qpb,
     stride_qph, stride_mb, stride_mh, stride_ms, stride_ob, stride_oh, num_heads, num_splits, scale_log2) = ops[2]
    q_mult = _load_queries(QL, QP, q_s, qp_s, b, hb, num_heads, stride_qlb, stride_qlh, stride_qpb, stride_qph, H,
                           CODES)
    o, m_i, l_i, d_ref = _consume(q_s, qp_s, kv_s, kp_s, p_s, sc_s, full, empty, start, n_tiles, end, ctx, hb,
                                  scale_log2, q_mult, H, STAGES, CODES, QROWS, ROW_HEADS)
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, H, 16])
    has = l_i > 0
    out = o * (d_ref / gl.where(has, l_i, 1.0))[None, :]
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
def _program(Lens, num_splits, QROWS: gl.constexpr):
    """(head block, slice, sequence, the slice's start, end and tiles, the context); folded query tokens:
    the lengths are each token's, the context its last's."""
    hb, s, b = gl.program_id(0), gl.program_id(1), gl.program_id(2)
    ctx = gl.load(Lens + b * QROWS)
    start, end, n_tiles = _slice(ctx, s, num_splits, BLOCK_N, MIN_CHUNK)
    return hb, s, b, start, end, n_tiles, ctx


@gluon.jit
def _buffers(H: gl.constexpr, STAGES: gl.constexpr, LOADERS: gl.constexpr, CODES: gl.constexpr):
    """The program's shared memory: queries, the ring of tiles (and of their rows' scales: FP8 codes), P^T,
    and the ring's barriers. The latent operands in float16 beside FP8 codes, else bf16."""
    dt: gl.constexpr = gl.float16 if CODES else gl.bfloat16
    bf: gl.constexpr = gl.bfloat16
    q_s = gl.allocate_shared_memory(dt, [H, KV_LORA], gl.NVMMASharedLayout.get_default_for([H, KV_LORA], dt))
    qp_s = gl.allocate_shared_memory(bf, [H, ROPE], gl.NVMMASharedLayout.get_default_for([H, ROPE], bf))
    kv_s = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, KV_LORA],
                                     gl.NVMMASharedLayout.get_default_for([BLOCK_N, KV_LORA], dt))
    kp_s = gl.allocate_shared_memory(bf, [STAGES, BLOCK_N, ROPE],
                                     gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE], bf))
    p_s = gl.allocate_shared_memory(dt, [BLOCK_N, H], gl.NVMMASharedLayout.get_default_for([BLOCK_N, H], dt))
    sc_s = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        # a TMA warp's expect, an FP8 codes loader's arrival, or each decoding loader warpgroup's
        mbarrier.init(full.index(i), count=1 if CODES else LOADERS)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()  # the barriers' initialisation visible to the TMA unit
    return q_s, qp_s, kv_s, kp_s, p_s, sc_s, full, empty


# neither the table's width (it follows the step's longest sequence) nor the slice count makes a variant
@gluon.jit(do_not_specialize=["stride_tb", "table_width", "num_splits"])
def _tma_decode_kernel(ckv_desc, kpe_desc, Rows, QL, QP, Tables, Lens, MidO, MidLse, Out, stride_qlb, stride_qlh,
                       stride_qpb, stride_qph, stride_tb, table_width, num_pages, stride_mb, stride_mh, stride_ms,
                       stride_ob, stride_oh, num_heads, num_splits, scale_log2, H: gl.constexpr, PAGE: gl.constexpr,
                       STAGES: gl.constexpr, DIRECT: gl.constexpr, LOADER_REGS: gl.constexpr, PDL: gl.constexpr,
                       L2_TILES: gl.constexpr, LINES_C: gl.constexpr, QROWS: gl.constexpr = 1,
                       ROW_HEADS: gl.constexpr = 1):
    """bf16 rows: the consumer warpgroup (the default partition) + the TMA warp. Rows: the cache's rows
    [pages x PAGE, 576], which the descriptors describe (the prefetch's addresses). QROWS > 1: each
    sequence's last QROWS query tokens folded into the heads, ROW_HEADS heads a token, the lengths a
    token's (`mla_decode._split_kernel`'s fold)."""
    if L2_TILES > 0:
        W: gl.constexpr = KV_LORA + ROPE
        _ask_l2(Lens, Tables, Rows, Rows, gl.program_id(2), gl.program_id(1), num_splits, stride_tb, table_width,
                num_pages, PAGE * W, W, 0, 0, 2, 0, L2_TILES, PAGE, LINES_C, 1, QROWS)
    wait_for_inputs(PDL)  # the lengths and queries are the kernel ahead's
    hb, s, b, start, end, n_tiles, ctx = _program(Lens, num_splits, QROWS)
    ops = (_buffers(H, STAGES, 1, False), (ckv_desc, kpe_desc),
           (QL, QP, Tables, MidO, MidLse, Out, b, hb, s, start, n_tiles, end, stride_tb, stride_qlb, stride_qlh,
            stride_qpb, stride_qph, stride_mb, stride_mh, stride_ms, stride_ob, stride_oh, num_heads, num_splits,
            scale_log2))
    if WS_LIST_FORM:
        gl.warp_specialize([(_consumer, (ops, ctx, H, PAGE, STAGES, DIRECT, 1, False, QROWS, ROW_HEADS)),
                            (_tma_loader, (ops, H, PAGE, STAGES, DIRECT, 1, False))], [1], [LOADER_REGS])
    else:
        gl.warp_specialize((ops, ctx, H, PAGE, STAGES, DIRECT, 1, False, QROWS, ROW_HEADS), _consumer,
                           (ops, H, PAGE, STAGES, DIRECT, 1, False),
                           [_tma_loader], [1], [LOADER_REGS])


@gluon.jit(do_not_specialize=["stride_tb", "table_width", "num_splits"])
def _fp8_decode_kernel(Cache, CacheR, CacheS, QL, QP, Tables, Lens, MidO, MidLse, Out, stride_cb, stride_ct, stride_rb,
                       stride_rt, stride_sb, stride_qlb, stride_qlh, stride_qpb, stride_qph, stride_tb, table_width,
                       num_pages, stride_mb, stride_mh, stride_ms, stride_ob, stride_oh, num_heads, num_splits,
                       scale_log2, H: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr, DIRECT: gl.constexpr,
                       LOADER_REGS: gl.constexpr, PDL: gl.constexpr, LOADERS: gl.constexpr, CODES: gl.constexpr,
                       L2_TILES: gl.constexpr, LINES_C: gl.constexpr, LINES_R: gl.constexpr,
                       QROWS: gl.constexpr = 1, ROW_HEADS: gl.constexpr = 1):
    """FP8 rows: the consumer warpgroup (the default partition) + one or two loader warpgroups (staging the
    codes with CODES, else decoded rows); QROWS and ROW_HEADS as `_tma_decode_kernel`'s."""
    if L2_TILES > 0:
        _ask_l2(Lens, Tables, Cache, CacheR, gl.program_id(2), gl.program_id(1), num_splits, stride_tb, table_width,
                num_pages, stride_cb, stride_ct, stride_rb, stride_rt, 1, 2, L2_TILES, PAGE, LINES_C, LINES_R, QROWS)
    wait_for_inputs(PDL)
    hb, s, b, start, end, n_tiles, ctx = _program(Lens, num_splits, QROWS)
    ops = (_buffers(H, STAGES, LOADERS, CODES),
           (Cache, CacheR, CacheS, stride_cb, stride_ct, stride_rb, stride_rt, stride_sb),
           (QL, QP, Tables, MidO, MidLse, Out, b, hb, s, start, n_tiles, end, stride_tb, stride_qlb, stride_qlh,
            stride_qpb, stride_qph, stride_mb, stride_mh, stride_ms, stride_ob, stride_oh, num_heads, num_splits,
            scale_log2))
    if LOADERS == 2:
        if WS_LIST_FORM:
            gl.warp_specialize([(_consumer, (ops, ctx, H, PAGE, STAGES, DIRECT, LOADERS, CODES, QROWS, ROW_HEADS)),
                                (_fp8_loader0, (ops, H, PAGE, STAGES, DIRECT, LOADERS, CODES)),
                                (_fp8_loader1, (ops, H, PAGE, STAGES, DIRECT, LOADERS, CODES))], [4, 4],
                               [LOADER_REGS, LOADER_REGS])
        else:
            gl.warp_specialize((ops, ctx, H, PAGE, STAGES, DIRECT, LOADERS, CODES, QROWS, ROW_HEADS), _consumer,
                               (ops, H, PAGE, STAGES, DIRECT, LOADERS, CODES), [_fp8_loader0, _fp8_loader1], [4, 4],
                               [LOADER_REGS, LOADER_REGS])
    else:
        if WS_LIST_FORM:
            gl.warp_specialize([(_consumer, (ops, ctx, H, PAGE, STAGES, DIRECT, LOADERS, CODES, QROWS, ROW_HEADS)),
                                (_fp8_loader0, (ops, H, PAGE, STAGES, DIRECT, LOADERS, CODES))], [4], [LOADER_REGS])
        else:
            gl.warp_specialize((ops, ctx, H, PAGE, STAGES, DIRECT, LOADERS, CODES, QROWS, ROW_HEADS), _consumer,
                               (ops, H, PAGE, STAGES, DIRECT, LOADERS, CODES), [_fp8_loader0], [4], [LOADER_REGS])


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


def prefetch_lines(page: int, row_bytes: int) -> int:
    """The 128-byte lines `_ask_l2` asks for a tile's rows within one page (a power of two, its LINES)."""
    return pow2(triton.cdiv(min(page, int(BLOCK_N)) * row_bytes, 128), 1)


def _pages_fit(page: int) -> bool:
    """Pages of whole tiles, or tiles of whole pages of 16 or 32 tokens (a TMA box and an FP8 chunk each)."""
    return page % int(BLOCK_N) == 0 or page in (16, 32)


def applies(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, queries_per_seq: int = 1) -> bool:
    """Whether the Gluon split kernel takes these operands: a Hopper GPU, bf16 queries, DeepSeek's latent
    widths, up to 32 heads a program (64 heads and more: the Triton kernel's 64-head tiles), pages of
    whole tiles or of 16 or 32 tokens, a cache TMA can describe (bf16 rows: contiguous, 16-byte aligned) or
    an FP8 one. Query tokens folded into the heads (q_latent [B, R x H, 512] as `mla_decode` folds them)
    only where all R x H fit one program (R = 2 at 16 heads: one verified draft), so that the cache is
    read once a sequence. A bf16 cache's rows past a context must be finite (TMA reads them, a zero
    probability multiplies them): the engine's pool starts zeroed and holds latents."""
    t = q_latent
    if not (t.is_cuda and _capability(t.device) == 9):  # cached: asked every decode call
        return False
    if queries_per_seq > 1 and not FOLDS:  # folded heads count against MAX_HEADS below
        return False
    fp8 = kv_cache.dtype == torch.uint8
    return (t.dtype == torch.bfloat16 and q_pe.dtype == torch.bfloat16 and t.shape[2] == int(KV_LORA)
            and q_pe.shape[2] == int(ROPE) and t.shape[1] <= MAX_HEADS and _pages_fit(kv_cache.shape[1])
            and kv_cache.is_contiguous() and kv_cache.data_ptr() % 16 == 0
            and (fp8 or (kv_cache.dtype == torch.bfloat16 and kv_cache.shape[2] == int(KV_LORA) + int(ROPE))))


def split(q_latent, q_pe, kv_cache, views, block_tables, context_lens, mid_o, mid_lse, out, num_splits,
          softmax_scale, direct: bool, pdl: bool = False, fp8_loaders: int | None = None,
          fp8_codes: bool | None = None, l2_tiles: int | None = None, queries_per_seq: int = 1):
    """Launch the split kernel over [B, H, 512] / [B, H, 64] queries: the slices' partial outputs into mid_o
    [B, H, S, 512] and log-sum-exps into mid_lse [B, H, S] (base 2), or with `direct` (one slice) the
    output into out [B, H, 512]. queries_per_seq R > 1: the H heads are R tokens' H / R each (folded as
    `mla_decode_attention` folds them), context_lens each token's (a sequence's last at a stride of R).
    `views`: the FP8 cache's (c_kv, k_pe, scale) views, else None; pdl:
    launched with programmatic dependent launch (the kernel waits for the one ahead before any read);
    fp8_loaders: the FP8 loader warpgroups (default FP8_LOADERS); fp8_codes: the FP8 rows staged as their
    codes or decoded (default: codes at 32 heads a program or from CODES_FROM_BATCH sequences); l2_tiles:
    tiles of its slice a program asks of L2 before it waits (under PDL; default
    `mla_decode.L2_PREFETCH_TILES`)."""
    batch, num_heads, _ = q_latent.shape
    heads = block_heads(num_heads)
    page = kv_cache.shape[1]
    grid = (triton.cdiv(num_heads, heads), num_splits, batch)
    common = (q_latent, q_pe, block_tables, context_lens, mid_o, mid_lse, out)
    strides = (q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), block_tables.stride(0),
               block_tables.shape[1], kv_cache.shape[0], mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
               out.stride(0), out.stride(1), num_heads, num_splits, softmax_scale * 1.4426950408889634)
    piece = min(page, int(BLOCK_N))  # a tile's rows within one page (a TMA box, a prefetch)
    l2 = (mla_decode.L2_PREFETCH_TILES if l2_tiles is None else l2_tiles) if pdl else 0
    fold = dict(QROWS=queries_per_seq, ROW_HEADS=num_heads // queries_per_seq) if queries_per_seq > 1 else {}
    if views is None:
        rows = kv_cache.view(-1, kv_cache.shape[2])  # [pages * page, 576]
        descs = (descriptor(rows, [piece, int(KV_LORA)]), descriptor(rows, [piece, int(ROPE)]))
        _tma_decode_kernel[grid](*descs, rows, *common, *strides, H=heads, PAGE=page, STAGES=STAGES, DIRECT=direct,
                                 LOADER_REGS=TMA_REGS, PDL=pdl, L2_TILES=l2,
                                 LINES_C=prefetch_lines(page, rows.stride(0) * rows.element_size()), **fold,
                                 launch_pdl=pdl, num_warps=4)
    else:
        c_kv, k_pe, scale = views
        loaders = 1 if heads > 16 else fp8_loaders or FP8_LOADERS
        codes = (heads > 16 or batch >= CODES_FROM_BATCH) if fp8_codes is None else fp8_codes
        _fp8_decode_kernel[grid](c_kv, k_pe, scale, *common, c_kv.stride(0), c_kv.stride(1), k_pe.stride(0),
                                 k_pe.stride(1), scale.stride(0), *strides, H=heads, PAGE=page, STAGES=STAGES,
                                 DIRECT=direct, LOADER_REGS=FP8_REGS[codes, loaders], PDL=pdl, LOADERS=loaders,
                                 CODES=codes, L2_TILES=l2, LINES_C=prefetch_lines(page, c_kv.stride(1)),
                                 LINES_R=prefetch_lines(page, k_pe.stride(1) * k_pe.element_size()), **fold,
                                 launch_pdl=pdl, num_warps=4)
