"""MLA prefill attention in Gluon on Hopper: FlashAttention-3's warp-specialised schedule, the engine's
prefill attention on sm_90 where `mla_prefill.GLUON` is on (bf16, DeepSeek's head widths: nope 128, rope
64, v 128), `mla_prefill.mla_prefill_attention`'s contract and its Triton kernel's math.

Triton's `tl.dot` waits on each product at its result's first use, so the Triton kernel's softmax of a
tile cannot run while the tensor cores work on another product. Here a producer warp feeds a ring of key
tiles (Q once, then each K/V tile by TMA into a free stage; a stage is free when both consumers released
it), and two consumer warpgroups take 64 query rows each of a 128-row block, with the registers moved to
them (`setmaxnreg`). Each consumer issues tile j's scores and tile j-1's values product back to back and
runs tile j's softmax while P V is in flight. On an H200, 64-key tiles in three stages ran 1.14-1.25x the
Triton kernel (docs/perf.md, "Measured on a card: the Gluon kernels"); 128-key tiles in two stages and
the two consumers alternating their issues (ping-pong) were slower.

Triton's interpreter runs no Gluon: the CPU tests keep to the Triton kernel, this one is compiled for
sm_90 there (`engine.tools.compile_kernels`) and checked against the reference on a card.
"""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

from engine.kernels._gluon import WG_ROWS, WS_LIST_FORM, descriptor, tma_load
from engine.kernels.mla_prefill import LOG2E
NOPE, ROPE, VDIM = 128, 64, 128  # the head widths the kernel is built for (every DeepSeek MLA model's)
BLOCK_N, STAGES = 64, 3  # key tiles and the ring's depth (the measured best)
CONSUMER_REGS, PRODUCER_REGS = 240, 24  # registers a thread of each consumer warpgroup / of the producer warp


@gluon.jit
def _load_kv(kn_desc, kp_desc, v_desc, kn_s, kp_s, v_s, bars, stage, row, h, HEAD_KN: gl.constexpr,
             HEAD_V: gl.constexpr):
    bar = bars.index(stage)
    mbarrier.expect(bar, kn_desc.block_type.nbytes + kp_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma_load(kn_desc, [row, h * HEAD_KN], bar, kn_s.index(stage))
    tma_load(kp_desc, [row, 0], bar, kp_s.index(stage))
    tma_load(v_desc, [row, h * HEAD_V], bar, v_s.index(stage))


@gluon.jit
def _softmax(s, m_i, l_i, n0, rows, cols, diag, k_len, scale_log2):
    """Scores [M, N] (s_layout) -> (p float32, m_new, l_new, alpha); `diag`: the tile reaches the
    diagonal, so keys after a row's position (or past k_len) are masked."""
    if diag:
        visible = ((n0 + cols)[None, :] <= rows[:, None]) & ((n0 + cols) < k_len)[None, :]
        s = gl.where(visible, s * scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_safe[:, None])
    else:
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * scale_log2)
        m_safe = m_new
        p = gl.exp2(s * scale_log2 - m_new[:, None])
    alpha = gl.exp2(m_i - m_safe)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_i, alpha


@gluon.jit
def _issue_scores(qn, qp, kn_s, kp_s, stage, s0):
    """The scores of the key tile in `stage`, in flight: Q_nope K_nope^T + Q_pe K_pe^T."""
    s = warpgroup_mma(qn, kn_s.index(stage).permute((1, 0)), s0, use_acc=False, is_async=True)
    return warpgroup_mma(qp, kp_s.index(stage).permute((1, 0)), s, is_async=True)


@gluon.jit
def _first_softmax(s, m_i, l_i, rows, cols, first_diag, k_len, scale_log2, dtype: gl.constexpr,
                   BLOCK_N: gl.constexpr, p_layout: gl.constexpr):
    """Tile 0: its scores waited for -> (P_0 as the values product's operand, m, l)."""
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    p, m_i, l_i, alpha = _softmax(s, m_i, l_i, 0, rows, cols, BLOCK_N > first_diag, k_len, scale_log2)
    return gl.convert_layout(p.to(dtype), p_layout), m_i, l_i


@gluon.jit
def _next_softmax(s, o, p_op, m_i, l_i, n0, rows, cols, first_diag, k_len, scale_log2, dtype: gl.constexpr,
                  BLOCK_N: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr):
    """Tile j (first key n0), its scores and P_{j-1} V_{j-1} issued: wait for the scores only, run their
    softmax while the product runs, then wait for it and rescale -> (O, P_j as an operand, m, l)."""
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
    p, m_i, l_i, alpha = _softmax(s, m_i, l_i, n0, rows, cols, n0 + BLOCK_N > first_diag, k_len, scale_log2)
    o, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(o, p_op))
    o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    return o, gl.convert_layout(p.to(dtype), p_layout), m_i, l_i


@gluon.jit
def program_block(CuQ, CuK, num_m_blocks):
    """This program's query block (the longest blocks first), head and sequence -> (block, head, the
    sequence's first query row and query count, its first key row and key count)."""
    mb = num_m_blocks - 1 - gl.program_id(0)
    h, b = gl.program_id(1), gl.program_id(2)
    q_start = gl.load(CuQ + b)
    q_len = gl.load(CuQ + b + 1) - q_start
    k_start = gl.load(CuK + b)
    k_len = gl.load(CuK + b + 1) - k_start
    return mb, h, q_start, q_len, k_start, k_len


@gluon.jit
def _store_rows(o, l_i, O, q_start, r0, q_len, h, stride_ot, stride_oh, ROWS: gl.constexpr, VDIM: gl.constexpr,
                o_layout: gl.constexpr):
    """O / l for query rows [r0, r0 + ROWS) of the sequence (rows past q_len not stored)."""
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    out = o / gl.where(l_o > 0, l_o, 1.0)[:, None]
    orow = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    ocol = gl.arange(0, VDIM, layout=gl.SliceLayout(0, o_layout))
    ptrs = O + (q_start + orow).to(gl.int64)[:, None] * stride_ot + h * stride_oh + ocol[None, :]
    gl.store(ptrs, out.to(O.dtype.element_ty), mask=(orow < q_len)[:, None])



# ---------------------------------------------------------------------------------------------------------
# FlashAttention-3's whole schedule: a producer warp, two consumer warpgroups
# ---------------------------------------------------------------------------------------------------------
@gluon.jit
def _ws_producer(ops, HEAD_QN: gl.constexpr, HEAD_QP: gl.constexpr, HEAD_KN: gl.constexpr, HEAD_V: gl.constexpr,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One warp: the block's queries once, then every key tile into the ring, a stage refilled when both
    consumers have released it (`empty`, two arrivals)."""
    (qn_desc, qp_desc, kn_desc, kp_desc, v_desc, qn_s, qp_s, kn_s, kp_s, v_s, full, empty, q_bar, O, stride_ot,
     stride_oh, q_start, q_len, k_start, k_len, m0, h, scale_log2) = ops
    mbarrier.expect(q_bar, 2 * (qn_desc.block_type.nbytes + qp_desc.block_type.nbytes))
    for w in gl.static_range(2):
        tma_load(qn_desc, [q_start + m0 + w * WG_ROWS, h * HEAD_QN], q_bar, qn_s.index(w))
        tma_load(qp_desc, [q_start + m0 + w * WG_ROWS, h * HEAD_QP], q_bar, qp_s.index(w))
    prefix = k_len - q_len
    n_tiles = gl.cdiv(gl.minimum(k_len, prefix + m0 + 2 * WG_ROWS), BLOCK_N)
    for j in range(n_tiles):
        stage = j % STAGES
        if j >= STAGES:
            mbarrier.wait(empty.index(stage), phase=(j // STAGES - 1) & 1)
        _load_kv(kn_desc, kp_desc, v_desc, kn_s, kp_s, v_s, full, stage, k_start + j * BLOCK_N, h, HEAD_KN, HEAD_V)


@gluon.jit
def _ws_consume(ops, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, W: gl.constexpr):
    """Warpgroup W's 64 rows (block rows [64 W, 64 W + 64)). Per key tile j: wait for the tile, issue
    S_j = Q K_j^T and O += P_{j-1} V_{j-1}, wait for S_j only and run its softmax while P V runs, then wait
    for P V and release tile j-1's stage. (The two warpgroups' issues made to alternate, FlashAttention-3's
    ping-pong, measured slower on an H200.)"""
    (qn_desc, qp_desc, kn_desc, kp_desc, v_desc, qn_s, qp_s, kn_s, kp_s, v_s, full, empty, q_bar, O, stride_ot,
     stride_oh, q_start, q_len, k_start, k_len, m0, h, scale_log2) = ops
    VDIM: gl.constexpr = v_desc.block_type.shape[1]
    dtype: gl.constexpr = kn_s.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, VDIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    prefix = k_len - q_len
    r0 = m0 + W * WG_ROWS
    n_tiles = gl.cdiv(gl.minimum(k_len, prefix + m0 + 2 * WG_ROWS), BLOCK_N)  # the producer's count
    first_diag = prefix + r0  # a tile ending past this position needs the causal mask
    rows = first_diag + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, s_layout))
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([WG_ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([WG_ROWS], gl.float32, layout=gl.SliceLayout(1, s_layout))
    s0 = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, layout=s_layout)
    o = gl.zeros([WG_ROWS, VDIM], gl.float32, layout=o_layout)
    qn = qn_s.index(W)
    qp = qp_s.index(W)
    mbarrier.wait(q_bar, phase=0)

    mbarrier.wait(full.index(0), phase=0)
    s = _issue_scores(qn, qp, kn_s, kp_s, 0, s0)
    p_op, m_i, l_i = _first_softmax(s, m_i, l_i, rows, cols, first_diag, k_len, scale_log2, dtype, BLOCK_N, p_layout)

    for j in range(1, n_tiles):
        stage = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(full.index(stage), phase=(j // STAGES) & 1)
        s = _issue_scores(qn, qp, kn_s, kp_s, stage, s0)
        o = warpgroup_mma(p_op, v_s.index(prev), o, is_async=True)
        o, p_op, m_i, l_i = _next_softmax(s, o, p_op, m_i, l_i, j * BLOCK_N, rows, cols, first_diag, k_len,
                                          scale_log2, dtype, BLOCK_N, o_layout, p_layout)
        mbarrier.arrive(empty.index(prev), count=1)  # tile j-1's product has landed

    last = (n_tiles - 1) % STAGES
    o = warpgroup_mma(p_op, v_s.index(last), o, is_async=True)
    o = warpgroup_mma_wait(num_outstanding=0, deps=(o, ))
    mbarrier.arrive(empty.index(last), count=1)
    _store_rows(o, l_i, O, q_start, r0, q_len, h, stride_ot, stride_oh, WG_ROWS, VDIM, o_layout)


@gluon.jit
def _ws_consumer0(ops, HEAD_QN: gl.constexpr, HEAD_QP: gl.constexpr, HEAD_KN: gl.constexpr, HEAD_V: gl.constexpr,
                  BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    _ws_consume(ops, BLOCK_N, STAGES, 0)


@gluon.jit
def _ws_consumer1(ops, HEAD_QN: gl.constexpr, HEAD_QP: gl.constexpr, HEAD_KN: gl.constexpr, HEAD_V: gl.constexpr,
                  BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    _ws_consume(ops, BLOCK_N, STAGES, 1)


@gluon.jit
def _ws_prefill_kernel(qn_desc, qp_desc, kn_desc, kp_desc, v_desc, O, CuQ, CuK, stride_ot, stride_oh, num_m_blocks,
                       scale_log2, HEAD_QN: gl.constexpr, HEAD_QP: gl.constexpr, HEAD_KN: gl.constexpr,
                       HEAD_V: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                       PRODUCER_REGS: gl.constexpr):
    """Four warps (consumer 0, the default partition) + four (consumer 1) + one (the producer)."""
    mb, h, q_start, q_len, k_start, k_len = program_block(CuQ, CuK, num_m_blocks)
    m0 = mb * (2 * WG_ROWS)
    if m0 < q_len:
        dtype: gl.constexpr = kn_desc.dtype
        qn_s = gl.allocate_shared_memory(dtype, [2] + qn_desc.block_type.shape, qn_desc.layout)
        qp_s = gl.allocate_shared_memory(dtype, [2] + qp_desc.block_type.shape, qp_desc.layout)
        kn_s = gl.allocate_shared_memory(dtype, [STAGES] + kn_desc.block_type.shape, kn_desc.layout)
        kp_s = gl.allocate_shared_memory(dtype, [STAGES] + kp_desc.block_type.shape, kp_desc.layout)
        v_s = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(full.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # both consumers release a stage
        mbarrier.init(q_bar, count=1)
        fence_async_shared()  # the barriers' initialisation visible to the TMA unit
        ops = (qn_desc, qp_desc, kn_desc, kp_desc, v_desc, qn_s, qp_s, kn_s, kp_s, v_s, full, empty, q_bar, O,
               stride_ot, stride_oh, q_start, q_len, k_start, k_len, m0, h, scale_log2)
        # the constexprs written out in each call: a tuple of them assigned to a name would make them runtime
        # values
        if WS_LIST_FORM:
            gl.warp_specialize([
                (_ws_consumer0, (ops, HEAD_QN, HEAD_QP, HEAD_KN, HEAD_V, BLOCK_N, STAGES)),
                (_ws_consumer1, (ops, HEAD_QN, HEAD_QP, HEAD_KN, HEAD_V, BLOCK_N, STAGES)),
                (_ws_producer, (ops, HEAD_QN, HEAD_QP, HEAD_KN, HEAD_V, BLOCK_N, STAGES)),
            ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize((ops, HEAD_QN, HEAD_QP, HEAD_KN, HEAD_V, BLOCK_N, STAGES), _ws_consumer0,
                               (ops, HEAD_QN, HEAD_QP, HEAD_KN, HEAD_V, BLOCK_N, STAGES),
                               [_ws_consumer1, _ws_producer], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def ws_prefill(q_nope, q_pe, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale,
               block_n=BLOCK_N, stages=STAGES, consumer_regs=CONSUMER_REGS,
               producer_regs=PRODUCER_REGS):
    """`mla_prefill_attention`'s contract where `applies` holds: q_nope [Tq, H, 128], q_pe [Tq, H, 64]
    (views of q [Tq, H, 192]), k_nope [Tk, H, 128] and v [Tk, H, 128] (views of the expanded kv), k_pe
    [Tk, 64] (a view of the latent rows is fine), cu_seqlens [B + 1] int32 -> [Tq, H, 128]; sequence b's
    queries are the last of its keys. 128-row blocks as two 64-row warpgroups; the other arguments are
    the schedule's (the benchmark times the others)."""
    tq, heads, nope = q_nope.shape
    vdim, rope = v.shape[2], q_pe.shape[2]
    out = torch.empty(tq, heads, vdim, dtype=q_nope.dtype, device=q_nope.device)
    rows = int(WG_ROWS)
    descs = (descriptor(_view2d(q_nope), [rows, nope]), descriptor(_view2d(q_pe), [rows, rope]),
             descriptor(_view2d(k_nope), [block_n, nope]), descriptor(k_pe, [block_n, rope]),
             descriptor(_view2d(v), [block_n, vdim]))
    num_m_blocks = triton.cdiv(max_seqlen_q, 2 * rows)
    grid = (num_m_blocks, heads, cu_seqlens_q.shape[0] - 1)
    _ws_prefill_kernel[grid](*descs, out, cu_seqlens_q, cu_seqlens_k, out.stride(0), out.stride(1), num_m_blocks,
                             softmax_scale * LOG2E, q_nope.stride(1), q_pe.stride(1), k_nope.stride(1), v.stride(1),
                             BLOCK_N=block_n, STAGES=stages, CONSUMER_REGS=consumer_regs,
                             PRODUCER_REGS=producer_regs, num_warps=4)
    return out


def _view2d(t):
    """[T, H, d] strided -> a 2-D [T, columns] view starting at head 0's first column."""
    cols = (t.shape[1] - 1) * t.stride(1) + t.shape[2]
    return t.as_strided((t.shape[0], cols), (t.stride(0), 1))


def _aligned(t: torch.Tensor) -> bool:
    """A TMA descriptor's global operand: 16-byte aligned start and row stride, unit last stride."""
    return t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1])


def applies(q_nope, q_pe, k_nope, k_pe, v) -> bool:
    """Whether `ws_prefill` takes these operands: a Hopper GPU (its warpgroup products and TMA), bf16, the
    head widths it is built for, and every operand a TMA descriptor can describe; else the Triton kernel."""
    t = q_nope
    return (t.is_cuda and torch.cuda.get_device_capability(t.device)[0] == 9 and t.dtype == torch.bfloat16
            and t.shape[2] == NOPE and q_pe.shape[2] == ROPE and v.shape[2] == VDIM and k_pe.shape[1] == ROPE
            and all(x.dtype == torch.bfloat16 and _aligned(x) for x in (q_nope, q_pe, k_nope, k_pe, v)))
