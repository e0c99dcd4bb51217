"""MLA prefill attention in Gluon, FlashAttention-3's schedules, beside the engine's Triton kernel.

Triton's `tl.dot` waits on each product at its result's first use, so the softmax of a tile cannot run
while the tensor cores work on another product. Gluon issues `warpgroup_mma` asynchronously and waits
where told. Two kernels, both with `engine.kernels.mla_prefill.mla_prefill_attention`'s contract (varlen,
a cached prefix; bf16; DeepSeek's head widths: nope 128, rope 64, v 128):

- `fa3_prefill` (here): the intra-warpgroup overlap alone. Tile j's scores (Q K_j^T) and tile j-1's values
  product (P_{j-1} V_{j-1}) are issued back to back and tile j's softmax runs while P V is in flight.
  128-row blocks over eight warps; the same warps wait for and issue the K/V ring's TMA loads. On an H200
  it ran 5-10 % below the Triton kernel (`benchmarks/results/mla_prefill_gluon.json`, docs/perf.md): not
  kept.
- `ws_prefill` (`engine.kernels.mla_prefill_gluon`): FlashAttention-3's whole schedule, a producer warp
  feeding two consumer warpgroups. Timed here in four schedules; 64-key tiles in three stages, without
  ping-pong, ran 1.14-1.25x the Triton kernel on an H200 and is the engine's choice where
  `mla_prefill.GLUON` is on.

    python benchmarks/mla_prefill_gluon.py [--out FILE] [--only TEXT]  # Hopper: check against the float32
                                                                        # reference, time beside the Triton kernel
    python benchmarks/mla_prefill_gluon.py --compile [--ptx DIR]       # no GPU: compile for sm_90
"""

import json
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_wait

from engine.kernels._gluon import descriptor, signature_of, tma_load
from engine.kernels.mla_prefill import LOG2E
from engine.kernels.mla_prefill_gluon import (_first_softmax, _issue_scores, _load_kv, _next_softmax, _store_rows, _view2d,
                                              _ws_prefill_kernel, program_block, ws_prefill)


@gluon.jit
def _fa3_prefill_kernel(qn_desc, qp_desc, kn_desc, kp_desc, v_desc, O, CuQ, CuK, stride_ot, stride_oh, num_m_blocks,
                        scale_log2, HEAD_QN: gl.constexpr, HEAD_QP: gl.constexpr, HEAD_KN: gl.constexpr,
                        HEAD_V: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                        num_warps: gl.constexpr):
    mb, h, q_start, q_len, k_start, k_len = program_block(CuQ, CuK, num_m_blocks)
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

    mbarrier.wait(bars.index(0), phase=0)
    p_op, m_i, l_i = _first_softmax(_issue_scores(qn_s, qp_s, kn_s, kp_s, 0, s0), m_i, l_i, rows, cols, first_diag,
                                    k_len, scale_log2, dtype, BLOCK_N, p_layout)

    for j in range(1, n_tiles):
        stage = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(bars.index(stage), phase=(j // STAGES) & 1)
        # tile j's scores, then tile j-1's values product, both in flight
        s = _issue_scores(qn_s, qp_s, kn_s, kp_s, stage, s0)
        o = warpgroup_mma(p_op, v_s.index(prev), o, is_async=True)
        o, p_op, m_i, l_i = _next_softmax(s, o, p_op, m_i, l_i, j * BLOCK_N, rows, cols, first_diag, k_len,
                                          scale_log2, dtype, BLOCK_N, o_layout, p_layout)
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
    _store_rows(o, l_i, O, q_start, m0, q_len, h, stride_ot, stride_oh, BLOCK_M, VDIM, o_layout)


# ---------------------------------------------------------------------------------------------------------
# FlashAttention-3's whole schedule: a producer warp, two consumer warpgroups taking turns
# ---------------------------------------------------------------------------------------------------------
def fa3_prefill(q_nope, q_pe, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale,
                block_m=128, block_n=64, stages=2, num_warps=8):
    """`engine.kernels.mla_prefill.mla_prefill_attention`'s contract: q_nope [Tq, H, 128], q_pe [Tq, H, 64]
    (views of q [Tq, H, 192]), k_nope [Tk, H, 128] and v [Tk, H, 128] (views of the expanded kv), k_pe [Tk, 64],
    cu_seqlens [B + 1] int32 -> [Tq, H, 128]; sequence b's queries are the last of its keys."""
    tq, heads, nope = q_nope.shape
    vdim, rope = v.shape[2], q_pe.shape[2]
    out = torch.empty(tq, heads, vdim, dtype=q_nope.dtype, device=q_nope.device)

    descs = (descriptor(_view2d(q_nope), [block_m, nope]), descriptor(_view2d(q_pe), [block_m, rope]),
             descriptor(_view2d(k_nope), [block_n, nope]), descriptor(k_pe, [block_n, rope]),
             descriptor(_view2d(v), [block_n, vdim]))
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
    """sm_90 compile through GluonASTSource (no GPU needed): shared memory, op counts, and the PTX for ptxas."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    def compile_kernel(kernel, q_rows, block_n, constexprs, num_warps):
        sig = {}
        names = ["qn_desc", "qp_desc", "kn_desc", "kp_desc", "v_desc"]
        blocks = [[q_rows, 128], [q_rows, 64], [block_n, 128], [block_n, 64], [block_n, 128]]
        for name, block in zip(names, blocks):
            sig[name] = signature_of(descriptor(torch.empty(256, 512, dtype=torch.bfloat16), block))
        sig.update(O="*bf16", CuQ="*i32", CuK="*i32", stride_ot="i32", stride_oh="i32", num_m_blocks="i32",
                   scale_log2="fp32")
        constexprs = dict(HEAD_QN=192, HEAD_QP=192, HEAD_KN=256, HEAD_V=256, BLOCK_N=block_n, **constexprs)
        for c in constexprs:
            sig[c] = "constexpr"
        sig = {name: sig[name] for name in kernel.arg_names}  # in the signature's order
        src = GluonASTSource(kernel, sig, constexprs=constexprs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))

    builds = [("fa3 s2 n64", _fa3_prefill_kernel, 128, 64, dict(BLOCK_M=128, STAGES=2, num_warps=8), 8)]
    for block_n, stages in [(128, 2), (64, 3)]:
        for pingpong in (True, False):
            builds.append((f"ws s{stages} n{block_n}{' pingpong' if pingpong else ''}", _ws_prefill_kernel, 64,
                           block_n, dict(STAGES=stages, PINGPONG=pingpong, CONSUMER_REGS=240, PRODUCER_REGS=24), 4))
    for name, kernel, q_rows, block_n, constexprs, num_warps in builds:
        report_compiled(name, compile_kernel(kernel, q_rows, block_n, constexprs, num_warps))


def report_compiled(name, compiled):
    """One line of what an sm_90 build holds (shared memory, async products and their waits, TMA copies,
    register moves between partitions); with --ptx DIR its PTX written there, for ptxas -v."""
    ptx = compiled.asm["ptx"]
    print(f"{name}: shared {compiled.metadata.shared} bytes; wgmma {ptx.count('wgmma.mma_async')}, wait_group "
          f"{ptx.count('wgmma.wait_group')}, tma {ptx.count('cp.async.bulk.tensor')}, setmaxnreg "
          f"{ptx.count('setmaxnreg')}", flush=True)
    if "--ptx" in sys.argv:
        with open(f"{sys.argv[sys.argv.index('--ptx') + 1]}/{name.replace(' ', '_')}.ptx", "w") as f:
            f.write(ptx)


VARIANTS = {  # name -> (function, keyword arguments)
    "fa3 overlap, 3 stages, 64-key tiles": ("fa3", dict(stages=3, block_n=64)),
    "fa3 overlap, 2 stages, 128-key tiles": ("fa3", dict(stages=2, block_n=128)),
    "warp-specialised, ping-pong, 2 stages, 128-key tiles": ("ws", dict(stages=2, block_n=128, pingpong=True)),
    "warp-specialised, 2 stages, 128-key tiles": ("ws", dict(stages=2, block_n=128, pingpong=False)),
    "warp-specialised, ping-pong, 3 stages, 64-key tiles": ("ws", dict(stages=3, block_n=64, pingpong=True)),
    "warp-specialised, 3 stages, 64-key tiles": ("ws", dict(stages=3, block_n=64, pingpong=False)),
}


def _run(name, *args):
    fn, kwargs = VARIANTS[name]
    return (fa3_prefill if fn == "fa3" else ws_prefill)(*args, **kwargs)


def main():
    if "--compile" in sys.argv:
        compile_only()
        return
    sys.path.insert(0, ".")
    from engine.bench.timing import time_replayed
    from engine.kernels.mla_prefill import mla_prefill_attention, reference_mla_prefill_attention

    scale = 192 ** -0.5
    dev = torch.device("cuda")
    # three sequences, the second a chunk after a cached prefix, the third shorter than a block
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(1350, 16, 192, generator=g, device="cuda").to(torch.bfloat16)
    kv = torch.randn(3398, 16, 256, generator=g, device="cuda").to(torch.bfloat16)
    k_pe = torch.randn(3398, 64, generator=g, device="cuda").to(torch.bfloat16)
    cq = torch.tensor([0, 1000, 1300, 1350], dtype=torch.int32, device="cuda")
    ck = torch.tensor([0, 1000, 3348, 3398], dtype=torch.int32, device="cuda")
    args = (q[..., :128], q[..., 128:], kv[..., :128], k_pe, kv[..., 128:], cq, ck)
    ref = reference_mla_prefill_attention(*args, scale).float()
    working = []
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else ""
    for name in [n for n in VARIANTS if only in n]:
        try:
            err = ((_run(name, *args, 1000, scale).float() - ref).norm() / ref.norm()).item()
            torch.cuda.synchronize()
        except Exception as e:  # a variant the installed Triton cannot build: report it, time the rest
            print(f"varlen check, {name}: failed: {str(e)[:400]}", flush=True)
            continue
        print(f"varlen check, {name}: rel err {err:.1e}", flush=True)
        if err < 1e-2:
            working.append(name)

    rows = []
    cu = lambda n: torch.tensor([0, n], dtype=torch.int32, device="cuda")
    for q_len, k_len, heads in [(8192, 8192, 16), (8192, 8192, 128), (4096, 32768, 16), (32768, 32768, 16)]:
        args = _case(q_len, k_len, heads, "cuda")
        cq, ck = cu(q_len), cu(k_len)
        ours = mla_prefill_attention(*args, cq, ck, q_len, scale, tiles={})  # tiles given: the Triton kernel
        pairs = q_len * (k_len - q_len) + q_len * (q_len + 1) / 2
        flops = heads * pairs * (2 * 192 + 2 * 128)
        t = time_replayed(lambda: mla_prefill_attention(*args, cq, ck, q_len, scale, tiles={}), dev, calls=5, repeats=5)
        rows.append(dict(variant="triton (engine)", heads=heads, q_len=q_len, k_len=k_len, tflops=flops / t / 1e12))
        line = f"H={heads} {q_len}@{k_len}: triton {rows[-1]['tflops']:.0f}"
        for name in working:
            fn = lambda: _run(name, *args, cq, ck, q_len, scale)
            err = ((fn().float() - ours.float()).norm() / ours.float().norm()).item()
            t = time_replayed(fn, dev, calls=5, repeats=5)
            rows.append(dict(variant=name, heads=heads, q_len=q_len, k_len=k_len, tflops=flops / t / 1e12,
                             rel_err_to_triton=err))
            line += f" | {name} {rows[-1]['tflops']:.0f} ({err:.0e})"
        print(line + " TFLOP/s", flush=True)
    if "--out" in sys.argv:
        out = sys.argv[sys.argv.index("--out") + 1]
        with open(out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           rows=rows), f, indent=1)
    if len(working) < len([n for n in VARIANTS if only in n]):
        sys.exit("a variant failed or differs from the reference")


if __name__ == "__main__":
    main()
