"""MLA prefill attention in Gluon with FlashAttention-3's intra-warpgroup overlap: measured, not kept.

Tile j's scores (Q K_j^T) and tile j-1's values product (P_{j-1} V_{j-1}) are issued as async wgmmas back
to back, and tile j's softmax runs while P_{j-1} V_{j-1} is on the tensor cores. Triton's `tl.dot` cannot
express this (its waits sit at each result's first use). On an H200 this schedule alone ran 5-10 % below
`engine.kernels.mla_prefill` (`benchmarks/results/mla_prefill_gluon.json`, docs/perf.md): the next step
from here is FlashAttention-3's other two parts, a producer warp feeding the ring by TMA and two consumer
warpgroups taking turns on the tensor cores.

Same contract as `engine.kernels.mla_prefill.mla_prefill_attention`, bf16, DeepSeek's head widths (nope
128, rope 64, v 128). One program per (128-row query block, head, sequence); eight warps,
warps_per_cta [8, 1] (each warpgroup 64 rows); K/V in a ring of STAGES stages filled by TMA, one
mbarrier a stage.

    python benchmarks/mla_prefill_gluon.py [--out FILE]   # Hopper: check, then time beside the Triton kernel
    python benchmarks/mla_prefill_gluon.py --compile      # no GPU: compile for sm_90, print smem and op counts
"""

import json
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

LOG2E = 1.4426950408889634
# Gluon's TMA load is `async_load` in newer Triton, `async_copy_global_to_shared` before (kept there as a
# deprecated alias that raises)
tma_load = tma.async_copy_global_to_shared
if hasattr(tma, "async_load"):
    tma_load = tma.async_load


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
def _fa3_prefill_kernel(qn_desc, qp_desc, kn_desc, kp_desc, v_desc, O, CuQ, CuK, stride_ot, stride_oh, num_m_blocks,
                        scale_log2, HEAD_QN: gl.constexpr, HEAD_QP: gl.constexpr, HEAD_KN: gl.constexpr,
                        HEAD_V: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                        num_warps: gl.constexpr):
    mb = num_m_blocks - 1 - gl.program_id(0)  # the longest query blocks first
    h, b = gl.program_id(1), gl.program_id(2)
    q_start = gl.load(CuQ + b)
    q_len = gl.load(CuQ + b + 1) - q_start
    k_start = gl.load(CuK + b)
    k_len = gl.load(CuK + b + 1) - k_start
    prefix = k_len - q_len
    m0 = mb * BLOCK_M
    if m0 < q_len:
        _attend_block(qn_desc, qp_desc, kn_desc, kp_desc, v_desc, O, stride_ot, stride_oh, q_start, q_len, k_start,
                      k_len, prefix, m0, h, scale_log2, HEAD_QN, HEAD_QP, HEAD_KN, HEAD_V, BLOCK_M, BLOCK_N, STAGES,
                      num_warps)


@gluon.jit
def _attend_block(qn_desc, qp_desc, kn_desc, kp_desc, v_desc, O, stride_ot, stride_oh, q_start, q_len, k_start, k_len,
                  prefix, m0, h, scale_log2, HEAD_QN: gl.constexpr, HEAD_QP: gl.constexpr, HEAD_KN: gl.constexpr,
                  HEAD_V: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  num_warps: gl.constexpr):
    VDIM: gl.constexpr = v_desc.block_type.shape[1]
    dtype: gl.constexpr = kn_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, VDIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)

    qn_s = gl.allocate_shared_memory(dtype, qn_desc.block_type.shape, qn_desc.layout)
    qp_s = gl.allocate_shared_memory(dtype, qp_desc.block_type.shape, qp_desc.layout)
    kn_s = gl.allocate_shared_memory(dtype, [STAGES] + kn_desc.block_type.shape, kn_desc.layout)
    kp_s = gl.allocate_shared_memory(dtype, [STAGES] + kp_desc.block_type.shape, kp_desc.layout)
    v_s = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    mbarrier.init(q_bar, count=1)

    mbarrier.expect(q_bar, qn_desc.block_type.nbytes + qp_desc.block_type.nbytes)
    tma_load(qn_desc, [q_start + m0, h * HEAD_QN], q_bar, qn_s)
    tma_load(qp_desc, [q_start + m0, h * HEAD_QP], q_bar, qp_s)

    end = gl.minimum(k_len, prefix + m0 + BLOCK_M)  # keys up to the block's last position
    n_tiles = gl.cdiv(end, BLOCK_N)
    first_diag = prefix + m0  # a tile ending past this position needs the causal mask
    for i in gl.static_range(STAGES):
        if i < n_tiles:
            _load_kv(kn_desc, kp_desc, v_desc, kn_s, kp_s, v_s, bars, i, k_start + i * BLOCK_N, h, HEAD_KN, HEAD_V)

    rows = prefix + m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))  # key positions of the rows
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
    s0 = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    o = gl.zeros([BLOCK_M, VDIM], gl.float32, layout=o_layout)
    mbarrier.wait(q_bar, phase=0)

    # tile 0: scores, softmax
    mbarrier.wait(bars.index(0), phase=0)
    s = warpgroup_mma(qn_s, kn_s.index(0).permute((1, 0)), s0, use_acc=False, is_async=True)
    s = warpgroup_mma(qp_s, kp_s.index(0).permute((1, 0)), s, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    p, m_i, l_i, alpha = _softmax(s, m_i, l_i, 0, rows, cols, BLOCK_N > first_diag, k_len, scale_log2)
    p_op = gl.convert_layout(p.to(dtype), p_layout)

    for j in range(1, n_tiles):
        stage = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(bars.index(stage), phase=(j // STAGES) & 1)
        # tile j's scores, then tile j-1's values product, both in flight
        s = warpgroup_mma(qn_s, kn_s.index(stage).permute((1, 0)), s0, use_acc=False, is_async=True)
        s = warpgroup_mma(qp_s, kp_s.index(stage).permute((1, 0)), s, is_async=True)
        o = warpgroup_mma(p_op, v_s.index(prev), o, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))  # the scores are done; the product may run
        n0 = j * BLOCK_N
        p, m_i, l_i, alpha = _softmax(s, m_i, l_i, n0, rows, cols, n0 + BLOCK_N > first_diag, k_len, scale_log2)
        o, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(o, p_op))
        o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        nxt = j - 1 + STAGES  # the stage tile j-1 used is free: fill it with tile j-1+STAGES
        if nxt < n_tiles:
            _load_kv(kn_desc, kp_desc, v_desc, kn_s, kp_s, v_s, bars, prev, k_start + nxt * BLOCK_N, h, HEAD_KN,
                     HEAD_V)

    last = (n_tiles - 1) % STAGES
    o = warpgroup_mma(p_op, v_s.index(last), o, is_async=True)
    o = warpgroup_mma_wait(num_outstanding=0, deps=(o, ))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    mbarrier.invalidate(q_bar)

    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    out = o / gl.where(l_o > 0, l_o, 1.0)[:, None]
    orow = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    ocol = gl.arange(0, VDIM, layout=gl.SliceLayout(0, o_layout))
    ptrs = O + (q_start + orow).to(gl.int64)[:, None] * stride_ot + h * stride_oh + ocol[None, :]
    gl.store(ptrs, out.to(O.dtype.element_ty), mask=(orow < q_len)[:, None])


def _desc(t2d, block):
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    return TensorDescriptor(t2d, list(t2d.shape), list(t2d.stride()), block, layout)


def fa3_prefill(q_nope, q_pe, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale,
                block_m=128, block_n=64, stages=2, num_warps=8):
    """`engine.kernels.mla_prefill.mla_prefill_attention`'s contract: q_nope [Tq, H, 128], q_pe [Tq, H, 64]
    (views of q [Tq, H, 192]), k_nope [Tk, H, 128] and v [Tk, H, 128] (views of the expanded kv), k_pe [Tk, 64],
    cu_seqlens [B + 1] int32 -> [Tq, H, 128]; sequence b's queries are the last of its keys."""
    tq, heads, nope = q_nope.shape
    vdim, rope = v.shape[2], q_pe.shape[2]
    out = torch.empty(tq, heads, vdim, dtype=q_nope.dtype, device=q_nope.device)

    def view2d(t):  # [T, H, d] strided -> a 2-D [T, columns] view starting at head 0's first column
        cols = (t.shape[1] - 1) * t.stride(1) + t.shape[2]
        return t.as_strided((t.shape[0], cols), (t.stride(0), 1))

    descs = (_desc(view2d(q_nope), [block_m, nope]), _desc(view2d(q_pe), [block_m, rope]),
             _desc(view2d(k_nope), [block_n, nope]), _desc(k_pe, [block_n, rope]), _desc(view2d(v), [block_n, vdim]))
    num_m_blocks = triton.cdiv(max_seqlen_q, block_m)
    grid = (num_m_blocks, heads, cu_seqlens_q.shape[0] - 1)
    _fa3_prefill_kernel[grid](*descs, out, cu_seqlens_q, cu_seqlens_k, out.stride(0), out.stride(1), num_m_blocks,
                              softmax_scale * LOG2E, q_nope.stride(1), q_pe.stride(1), k_nope.stride(1), v.stride(1),
                              BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, num_warps=num_warps)
    return out


def _case(q_len, k_len, heads, device):
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(q_len, heads, 192, generator=g, device=device).to(torch.bfloat16)
    kv = torch.randn(k_len, heads, 256, generator=g, device=device).to(torch.bfloat16)
    k_pe = torch.randn(k_len, 64, generator=g, device=device).to(torch.bfloat16)
    return q[..., :128], q[..., 128:], kv[..., :128], k_pe, kv[..., 128:]


def compile_only():
    """sm_90 compile through GluonASTSource, CPU tensors standing in (no GPU needed)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    qn, qp, kn, kp, v = _case(256, 256, 2, "cpu")
    descs = {"qn_desc": _desc(qn.reshape(256, -1)[:, :128], [128, 128])}
    sig = {}
    names = ["qn_desc", "qp_desc", "kn_desc", "kp_desc", "v_desc"]
    blocks = [[128, 128], [128, 64], [64, 128], [64, 64], [64, 128]]
    for name, block in zip(names, blocks):
        t = torch.empty(256, 512, dtype=torch.bfloat16)
        sig[name] = _desc(t, block).__mangle__()
    sig.update(O="*bf16", CuQ="*i32", CuK="*i32", stride_ot="i32", stride_oh="i32", num_m_blocks="i32",
               scale_log2="fp32")
    constexprs = dict(HEAD_QN=192, HEAD_QP=192, HEAD_KN=256, HEAD_V=256, BLOCK_M=128, BLOCK_N=64, STAGES=2,
                      num_warps=8)
    for c in constexprs:
        sig[c] = "constexpr"
    del descs
    src = GluonASTSource(_fa3_prefill_kernel, sig, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8))
    ptx = compiled.asm["ptx"]
    print("compiled: shared", compiled.metadata.shared, "bytes; wgmma", ptx.count("wgmma.mma_async"),
          "wait_group", ptx.count("wgmma.wait_group"), "tma", ptx.count("cp.async.bulk.tensor"))


def main():
    if "--compile" in sys.argv:
        compile_only()
        return
    sys.path.insert(0, ".")
    from engine.bench.timing import time_replayed
    from engine.kernels.mla_prefill import mla_prefill_attention, reference_mla_prefill_attention

    variants = [(2, 64), (3, 64), (2, 128)]  # (stages, key-tile rows)
    scale = 192 ** -0.5
    dev = torch.device("cuda")
    # two sequences, the second a chunk after a cached prefix (as the engine's GPU test)
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(1300, 16, 192, generator=g, device="cuda").to(torch.bfloat16)
    kv = torch.randn(3348, 16, 256, generator=g, device="cuda").to(torch.bfloat16)
    k_pe = torch.randn(3348, 64, generator=g, device="cuda").to(torch.bfloat16)
    cq = torch.tensor([0, 1000, 1300], dtype=torch.int32, device="cuda")
    ck = torch.tensor([0, 1000, 3348], dtype=torch.int32, device="cuda")
    args = (q[..., :128], q[..., 128:], kv[..., :128], k_pe, kv[..., 128:], cq, ck)
    ref = reference_mla_prefill_attention(*args, scale).float()
    failed = False
    for stages, block_n in variants:
        err = ((fa3_prefill(*args, 1000, scale, block_n=block_n, stages=stages).float() - ref).norm()
               / ref.norm()).item()
        failed |= not err < 1e-2
        print(f"varlen check, {stages} stages, {block_n}-key tiles: rel err {err:.1e}", flush=True)

    rows = []
    cu = lambda n: torch.tensor([0, n], dtype=torch.int32, device="cuda")
    for q_len, k_len, heads in [(8192, 8192, 16), (8192, 8192, 128), (4096, 32768, 16), (32768, 32768, 16)]:
        args = _case(q_len, k_len, heads, "cuda")
        cq, ck = cu(q_len), cu(k_len)
        ours = mla_prefill_attention(*args, cq, ck, q_len, scale)
        pairs = q_len * (k_len - q_len) + q_len * (q_len + 1) / 2
        flops = heads * pairs * (2 * 192 + 2 * 128)
        t = time_replayed(lambda: mla_prefill_attention(*args, cq, ck, q_len, scale), dev, calls=5, repeats=5)
        rows.append(dict(variant="triton (engine)", heads=heads, q_len=q_len, k_len=k_len, tflops=flops / t / 1e12))
        for stages, block_n in variants:
            fn = lambda: fa3_prefill(*args, cq, ck, q_len, scale, block_n=block_n, stages=stages)
            err = ((fn().float() - ours.float()).norm() / ours.float().norm()).item()
            failed |= not err < 1e-2
            t = time_replayed(fn, dev, calls=5, repeats=5)
            rows.append(dict(variant=f"gluon, {stages} stages, {block_n}-key tiles", heads=heads, q_len=q_len,
                             k_len=k_len, tflops=flops / t / 1e12, rel_err_to_triton=err))
        print(" | ".join(f"{r['variant']} {r['tflops']:.0f}" for r in rows[-1 - len(variants):]),
              f"TFLOP/s (H={heads} {q_len}@{k_len})", flush=True)
    if "--out" in sys.argv:
        out = sys.argv[sys.argv.index("--out") + 1]
        with open(out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           rows=rows), f, indent=1)
    if failed:
        sys.exit("a variant's output differs")


if __name__ == "__main__":
    main()
