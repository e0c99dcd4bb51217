"""The FP8 routed experts' grouped GEMMs in Gluon on Hopper, warp-specialised as DeepGEMM builds them: the
engine's prefill expert GEMMs on sm_90 where `fused_moe.GLUON` is on (FP8 experts with 128 x 128 blocks,
bf16 activations), `fused_moe.fused_experts_tma`'s contract and its math.

The Triton TMA kernel (`fused_moe._moe_gemm_tma_kernel`) promotes each 128-K block's product into its
float32 accumulator (times the activations' and the weight block's scales), so every K step waits for its
`wgmma` before the scale FMAs, and nothing else issues meanwhile: the 128-row tile's two warpgroups run in
lockstep, and the same warps issue the TMA loads. Here a producer warp only feeds a ring of A and B tiles
by TMA, and two consumer warpgroups take 64 rows each of a 128-row block: while one waits for its product
and promotes it, the other's product runs on the tensor cores. Persistent: the programs stride over the
(128-row block, column block) work items in the engine's order (`fp8_gemm.tile_of`).

Both GEMMs read A by TMA: w2 its sorted intermediate, w13 x's rows copied into the pairs' sorted order
first (`fused_moe.sort_rows`). B is [E * rows, K] with DeepSeek's 128 x 128 scales; a tile never crosses
an expert. w13 (gated) reads the gate and the up tiles and writes SiLU(gate) * up at the pair's sorted
row; w2 multiplies by the routing weight and writes each pair's row at its id. On an H200, V3's experts:
the same outputs bit for bit, 1.17x the Triton kernels at 32k tokens, 1.02x at 8k, even at 2k
(docs/perf.md, "Measured on a card: the Gluon kernels"). Triton's interpreter runs no Gluon: compiled for
sm_90 on CPU (`engine.tools.compile_kernels`), checked on a card.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

from engine.kernels._gluon import WG_ROWS, WS_LIST_FORM, descriptor, tma_load
from engine.kernels.fp8_gemm import tile_of  # the engine's work-item order (a Triton function Gluon calls)

GROUP_N = gl.constexpr(128)  # DeepSeek's weight block: one scale per 128 x 128
# the measured best: w13's and w2's column tiles, the ring's depth; registers a thread of each consumer
# warpgroup / of the producer warp
BLOCK_N13, BLOCK_N2, STAGES = 64, 128, 5
CONSUMER_REGS, PRODUCER_REGS = 232, 40


@gluon.jit
def _producer(ops, N, K, GATED: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
              GROUP_M: gl.constexpr, STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr):
    """One warp: every work item's K steps into the ring (A as two 64-row tiles, B, and for w13 the up
    tile), a stage refilled once both consumers released it."""
    (a_desc, b_desc, a_s, b_s, u_s, full, empty, AS, BS, C, Weights, SortedIds, BlockExpert, NumPadded,
     num_pairs, top_k, stride_asm, stride_ask, stride_bse, stride_bsn, stride_cm) = ops
    num_m = gl.load(NumPadded) // (2 * WG_ROWS)
    num_n = N // BLOCK_N
    k_steps = gl.cdiv(K, BLOCK_K)
    NBYTES: gl.constexpr = 2 * a_desc.block_type.nbytes + (2 if GATED else 1) * b_desc.block_type.nbytes
    it = 0
    for tile in range(gl.program_id(0), num_m * num_n, NUM_PROGRAMS):
        pid_m, pid_n = tile_of(tile, num_m, num_n, GROUP_M)
        expert = gl.load(BlockExpert + pid_m)
        b_row = expert * (2 * N if GATED else N) + pid_n * BLOCK_N
        for kb in range(k_steps):
            stage = it % STAGES
            if it >= STAGES:
                mbarrier.wait(empty.index(stage), phase=(it // STAGES - 1) & 1)
            bar = full.index(stage)
            mbarrier.expect(bar, NBYTES)
            for w in gl.static_range(2):
                tma_load(a_desc, [pid_m * (2 * WG_ROWS) + w * WG_ROWS, kb * BLOCK_K], bar,
                         a_s.index(2 * stage + w))
            tma_load(b_desc, [b_row, kb * BLOCK_K], bar, b_s.index(stage))
            if GATED:
                tma_load(b_desc, [b_row + N, kb * BLOCK_K], bar, u_s.index(stage))
            it += 1


@gluon.jit
def _consume(ops, N, K, GATED: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
             STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr, W: gl.constexpr):
    """Warpgroup W's 64 rows of each work item: per K step wait for the stage, issue the product(s), load
    the step's scales while they run, wait, release the stage, promote into the float32 accumulator(s);
    then the epilogue."""
    (a_desc, b_desc, a_s, b_s, u_s, full, empty, AS, BS, C, Weights, SortedIds, BlockExpert, NumPadded,
     num_pairs, top_k, stride_asm, stride_ask, stride_bse, stride_bsn, stride_cm) = ops
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, BLOCK_N, 32])
    rows_l: gl.constexpr = gl.SliceLayout(1, layout)
    num_m = gl.load(NumPadded) // (2 * WG_ROWS)
    num_n = N // BLOCK_N
    k_steps = gl.cdiv(K, BLOCK_K)
    zero = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, layout=layout)
    offs_n0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    it = 0
    for tile in range(gl.program_id(0), num_m * num_n, NUM_PROGRAMS):
        pid_m, pid_n = tile_of(tile, num_m, num_n, GROUP_M)
        expert = gl.load(BlockExpert + pid_m).to(gl.int64)
        pos = pid_m * (2 * WG_ROWS) + W * WG_ROWS + gl.arange(0, WG_ROWS, layout=rows_l)
        bs_ptr = BS + expert * stride_bse + (pid_n * BLOCK_N // GROUP_N) * stride_bsn
        up_bs_ptr = BS + expert * stride_bse + ((N + pid_n * BLOCK_N) // GROUP_N) * stride_bsn
        acc = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, layout=layout)
        acc_up = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, layout=layout)
        for kb in range(k_steps):
            stage = it % STAGES
            mbarrier.wait(full.index(stage), phase=(it // STAGES) & 1)
            a = a_s.index(2 * stage + W)
            p = warpgroup_mma(a, b_s.index(stage).permute((1, 0)), zero, use_acc=False, is_async=True)
            if GATED:
                pu = warpgroup_mma(a, u_s.index(stage).permute((1, 0)), zero, use_acc=False, is_async=True)
            a_sc = gl.load(AS + pos * stride_asm + kb * stride_ask)  # the step's scales while the products run
            if GATED:
                b_sc, u_sc = gl.load(bs_ptr + kb), gl.load(up_bs_ptr + kb)
                p, pu = warpgroup_mma_wait(num_outstanding=0, deps=(p, pu))
            else:
                b_sc = gl.load(bs_ptr + kb)
                p = warpgroup_mma_wait(num_outstanding=0, deps=(p, ))
            mbarrier.arrive(empty.index(stage), count=1)
            acc += p * (a_sc * b_sc)[:, None]
            if GATED:
                acc_up += pu * (a_sc * u_sc)[:, None]
            it += 1
        offs_n = pid_n * BLOCK_N + offs_n0
        if GATED:  # SiLU(gate) * up at the pair's sorted row
            out = acc / (1.0 + gl.exp(-acc)) * acc_up
            gl.store(C + pos[:, None].to(gl.int64) * stride_cm + offs_n[None, :], out.to(C.dtype.element_ty))
        else:  # times the routing weight, at the pair's own row
            ids = gl.load(SortedIds + pos)
            mask_m = ids < num_pairs
            out = acc * gl.load(Weights + ids, mask=mask_m, other=0.0)[:, None]
            gl.store(C + ids[:, None].to(gl.int64) * stride_cm + offs_n[None, :], out.to(C.dtype.element_ty),
                     mask=mask_m[:, None])


@gluon.jit
def _consumer0(ops, N, K, GATED: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
               STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr):
    _consume(ops, N, K, GATED, BLOCK_N, BLOCK_K, GROUP_M, STAGES, NUM_PROGRAMS, 0)


@gluon.jit
def _consumer1(ops, N, K, GATED: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
               STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr):
    _consume(ops, N, K, GATED, BLOCK_N, BLOCK_K, GROUP_M, STAGES, NUM_PROGRAMS, 1)


@gluon.jit
def _ws_moe_gemm_kernel(a_desc, b_desc, AS, BS, C, Weights, SortedIds, BlockExpert, NumPadded, N, K, num_pairs,
                        top_k, stride_asm, stride_ask, stride_bse, stride_bsn, stride_cm, GATED: gl.constexpr,
                        BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                        NUM_PROGRAMS: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """Persistent: NUM_PROGRAMS programs stride over the (128-row block, column block) work items. Four
    warps (consumer 0, the default partition) + four (consumer 1) + one (the producer)."""
    dtype: gl.constexpr = a_desc.dtype
    a_s = gl.allocate_shared_memory(dtype, [2 * STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_s = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    u_s = gl.allocate_shared_memory(dtype, [STAGES if GATED else 1] + b_desc.block_type.shape, b_desc.layout)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release a stage
    fence_async_shared()  # the barriers' initialisation visible to the TMA unit
    ops = (a_desc, b_desc, a_s, b_s, u_s, full, empty, AS, BS, C, Weights, SortedIds, BlockExpert, NumPadded,
           num_pairs, top_k, stride_asm, stride_ask, stride_bse, stride_bsn, stride_cm)
    # the constexprs written out in each call: a tuple of them assigned to a name would make them runtime values
    if WS_LIST_FORM:
        gl.warp_specialize([
            (_consumer0, (ops, N, K, GATED, BLOCK_N, BLOCK_K, GROUP_M, STAGES, NUM_PROGRAMS)),
            (_consumer1, (ops, N, K, GATED, BLOCK_N, BLOCK_K, GROUP_M, STAGES, NUM_PROGRAMS)),
            (_producer, (ops, N, K, GATED, BLOCK_N, BLOCK_K, GROUP_M, STAGES, NUM_PROGRAMS)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize((ops, N, K, GATED, BLOCK_N, BLOCK_K, GROUP_M, STAGES, NUM_PROGRAMS), _consumer0,
                           (ops, N, K, GATED, BLOCK_N, BLOCK_K, GROUP_M, STAGES, NUM_PROGRAMS),
                           [_consumer1, _producer], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def _launch(a, a_s, w, w_s, out, weights, align, num_pairs, top_k, gated, block_n, stages, num_sms,
            consumer_regs=CONSUMER_REGS, producer_regs=PRODUCER_REGS):
    sorted_ids, block_expert, num_padded = align
    n = w.shape[1] // 2 if gated else w.shape[1]
    k = w.shape[2]
    block_k = 128
    a_desc = descriptor(a, [int(WG_ROWS), block_k])
    b_desc = descriptor(w.view(-1, k), [block_n, block_k])
    programs = min(num_sms, sorted_ids.shape[0] // (2 * int(WG_ROWS)) * (n // block_n))
    _ws_moe_gemm_kernel[(programs, )](a_desc, b_desc, a_s, w_s, out, weights, sorted_ids, block_expert, num_padded,
                                      n, k, num_pairs, top_k, a_s.stride(0), a_s.stride(1), w_s.stride(0),
                                      w_s.stride(1), out.stride(0), GATED=gated, BLOCK_N=block_n, BLOCK_K=block_k,
                                      GROUP_M=8, STAGES=stages, NUM_PROGRAMS=programs, CONSUMER_REGS=consumer_regs,
                                      PRODUCER_REGS=producer_regs, num_warps=4)


def ws_fused_experts(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, bn13=BLOCK_N13, bn2=BLOCK_N2,
                     stages=STAGES):
    """`fused_experts_tma`'s steps (x's rows sorted first) with the warp-specialised GEMMs: FP8 experts with
    128 x 128 blocks, x [T, H] bf16 -> [T, H]. (Each consumer issuing the next K step's products before
    it waits for this step's measured slower on an H200.)"""
    from engine.kernels.fp8_gemm import per_token_group_quant
    from engine.kernels.fused_moe import sort_rows
    from engine.kernels.moe_routing import align_by_expert

    num_tokens, hidden = x.shape
    num_experts, inter, top_k = w13.shape[0], w13.shape[1] // 2, topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    align = align_by_expert(topk_ids, num_experts, 2 * int(WG_ROWS))
    a, a_s = sort_rows(*per_token_group_quant(x, 128, k_major_scales=True), align[0], num_pairs, top_k)
    inter_out = torch.empty(align[0].shape[0], inter, dtype=x.dtype, device=x.device)
    _launch(a, a_s, w13, w13_scale, inter_out, topk_weights, align, num_pairs, top_k, True, bn13, stages, sms)
    a, a_s = per_token_group_quant(inter_out, 128, k_major_scales=True)
    pair_out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _launch(a, a_s, w2, w2_scale, pair_out, topk_weights, align, num_pairs, top_k, False, bn2, stages, sms)
    return pair_out.view(num_tokens, top_k, hidden).sum(dim=1)


def applies(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, block: tuple[int, int] | None,
            swiglu_limit: float | None) -> bool:
    """Whether `ws_fused_experts` takes these experts: a Hopper GPU, bf16 activations, FP8 experts with
    DeepSeek's 128 x 128 blocks, widths its tiles divide, no SwiGLU clamp (V4's); else the Triton kernels."""
    hidden, inter = x.shape[1], w2.shape[2]
    return (x.is_cuda and torch.cuda.get_device_capability(x.device)[0] == 9 and x.dtype == torch.bfloat16
            and w13.dtype == torch.float8_e4m3fn and w2.dtype == torch.float8_e4m3fn and tuple(block or ()) == (128, 128)
            and swiglu_limit is None and hidden % 128 == 0 and inter % 128 == 0)
