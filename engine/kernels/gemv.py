"""y = x W^T for a handful of rows of x: a GEMV that streams W once per row at memory bandwidth.

At decode a projection multiplies one token (or a few) by a matrix of a few to a hundred megabytes:
the time is the matrix's bytes over HBM bandwidth, and a GEMM library's tile for M = 1 leaves much of
it on the table (measured: `o_proj` of DeepSeek-V2-Lite at 1.4 TB/s of the H200's 4.2). One program
per (row of x, BLOCK_N outputs); each multiplies elementwise into a [BLOCK_N, GROUPS, GROUP_K]
accumulator and reduces it once at the end, so a K step is loads and FMAs only.

FP8 block-scaled weights (DeepSeek's 128 x 128 blocks) multiply the same math as `fp8_gemm.fp8_linear`:
activations quantized to e4m3 per group of block_k, weight blocks scaled. BLOCK_N divides the block's
rows, so a program's rows share one scale per K group, applied to the activations (GROUP_K values)
instead of every weight.
"""

import torch
import triton
import triton.language as tl

from engine.kernels._util import (check, check_float, interpreted, last_program, mma, pdl, upcast_fp8_dot,
                                  wait_for_inputs)
from engine.kernels.fp8_gemm import FP8, _round_to_e4m3, num_sms

# (BLOCK_N, K groups per step, num_warps) by weight dtype; K groups are block_k wide for FP8 weights, 128
# for bf16 and float32. Chosen on an H200 with benchmarks/gemv_configs.py at DeepSeek-V2-Lite's and V3's
# shapes (within 5 % of each shape's best, except V3's q_a + kv_a, 10.0 vs 8.8 us)
CONFIG = {"bf16": (8, 8, 4), "fp8": (8, 4, 4)}
# under programmatic dependent launch, whether a program loads its first weights before waiting for x
# (`gemv_rows`), by weight dtype (else it waits first). Measured on an H200 (benchmarks/pdl_chain.py,
# RMSNorm -> GEMV links, us): bf16 gains a little more (V2-Lite q + kv_a 7.4 without PDL, 6.3 waiting
# first, 6.0 loading first); FP8 loses badly loading first (V3 o_proj 42.7 / 40.5 / 66.0)
PREFETCH = {"bf16": True, "fp8": False}
INTERPRETED_CONFIG = (32, 2, 4)  # the interpreter pays per program: few, wide ones
# FP8 weights on the tensor cores (`_dot_kernel`): a program's DOT_BLOCK_N rows are the M of a wgmma product
# whose 16 columns are up to 16 rows of x (each K group quantized as `fp8_groups` does), so the weight is
# read once for all of them; staged by cp.async, DOT_STAGES deep; K split into slices where the tiles of
# rows are few (V3's q_a + kv_a: 33). On by default from DOT_MIN_ROWS rows: measured on an H100 in the
# engine (bench --no-projection-dot), v3-slice 2 and 4 streams +4.5 %, v4-slice +6.6 %
DOT = True
DOT_BLOCK_N, DOT_STAGES, DOT_WARPS = 64, 4, 4  # DOT_WARPS: one warpgroup, wgmma's M of 64
# K split into slices until the tiles fill the GPU this many programs an SM (`dot_splits`). Measured on an H100
# (benchmarks/gemv_configs.py): V3's o_proj 69.6 us unsplit, 49.3 in 3 slices (2 an SM), 60.6 in 5 (4 an SM:
# 560 programs, a second wave past the 528 that fit in shared memory), 54.3 in 10
DOT_PROGRAMS_PER_SM, DOT_MIN_SPLIT_GROUPS = 2, 4
# the block-diagonal weights (groups > 1: DeepSeek-V4's wo_a) on the tensor cores too, when DOT is on: one launch
# for every group instead of a GEMM a group and a concatenation. Measured on an H100 (v4-slice, 1k context):
# 2 / 4 streams 850 -> 1,085 / 1,425 -> 1,752 tokens/s, a fused speculative step (k = 1) 3.31 -> 2.67 ms, one
# stream unchanged (one row: the CUDA-core GEMV); `bench --no-grouped-dot` without
DOT_GROUPS = True
# rows of x from which `gemv` takes the tensor cores when DOT is on: for one row the CUDA-core GEMV's tile
# reads V3's large projections faster (H100, us: o_proj 44.0 against 49.3, dense down 49.9 against 54.6)
DOT_MIN_ROWS = 2


@triton.jit
def e4m3_groups(a, PRE_ROUND: tl.constexpr):
    """Activations [R, GROUP_K] float32 -> (e4m3 codes [R, GROUP_K], scales [R]): each row's group quantized
    as the FP8 GEMM quantizes it."""
    scale = tl.maximum(tl.max(tl.abs(a), axis=1), 1e-10) / 448.0
    q = a / scale[:, None]
    if PRE_ROUND:
        q = _round_to_e4m3(q)
    return q.to(tl.float8e4nv), scale


@triton.jit
def fp8_groups(a, PRE_ROUND: tl.constexpr):
    """Activations [GROUPS, GROUP_K] as the FP8 GEMM sees them: quantized to e4m3 with one scale per
    group, back to float32."""
    codes, scale = e4m3_groups(a, PRE_ROUND)
    return codes.to(tl.float32) * scale[:, None]


@triton.jit
def _gemv_step(acc, w, x_ptrs, scales, k0, K, offs_g, offs_k, USE_FP8: tl.constexpr, GROUP_K: tl.constexpr,
               PRE_ROUND: tl.constexpr):
    """acc += one K step's products: w [BLOCK_N, GROUPS, GROUP_K] (loaded, float32) times x at k0."""
    mask_k = offs_k < K - k0
    a = tl.load(x_ptrs + k0, mask=mask_k, other=0.0).to(tl.float32)
    if USE_FP8:  # each GROUP_K slice as the FP8 GEMM sees it, times its weight block's scale
        w_scale = tl.load(scales + k0 // GROUP_K + offs_g, mask=offs_g * GROUP_K < K - k0, other=0.0)
        a = fp8_groups(a, PRE_ROUND) * w_scale[:, None]
    return acc + w * a[None, :, :]


@triton.jit
def gemv_rows(w_ptrs, x_ptrs, scales, mask_n, K, USE_FP8: tl.constexpr, GROUP_K: tl.constexpr,
              GROUPS: tl.constexpr, PRE_ROUND: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr = False):
    """sum_k w[n, k] x[k] over K for a program's BLOCK_N rows -> [BLOCK_N] float32.
    w_ptrs [BLOCK_N, GROUPS, GROUP_K] and x_ptrs [GROUPS, GROUP_K] point at k = 0 (k = g * GROUP_K + j);
    FP8: scales points at the rows' scale block for k = 0 (one scale per GROUP_K columns).
    PREFETCH (under PDL): the first step's weights are loaded before `wait_for_inputs` (x is the previous kernel's
    output; the weights were written two or more launches back), so they arrive during its tail."""
    offs_g = tl.arange(0, GROUPS)
    offs_k = offs_g[:, None] * GROUP_K + tl.arange(0, GROUP_K)[None, :]
    acc = tl.zeros([BLOCK_N, GROUPS, GROUP_K], tl.float32)
    k_start = 0
    if PREFETCH:  # the first step peeled off: its weights in flight while waiting
        w = tl.load(w_ptrs, mask=mask_n[:, None, None] & (offs_k < K)[None, :, :], other=0.0).to(tl.float32)
        wait_for_inputs(PREFETCH)
        acc = _gemv_step(acc, w, x_ptrs, scales, 0, K, offs_g, offs_k, USE_FP8, GROUP_K, PRE_ROUND)
        k_start = GROUPS * GROUP_K
    for k0 in range(k_start, K, GROUPS * GROUP_K):
        mask_k = offs_k < K - k0
        w = tl.load(w_ptrs + k0, mask=mask_n[:, None, None] & mask_k[None, :, :], other=0.0).to(tl.float32)
        acc = _gemv_step(acc, w, x_ptrs, scales, k0, K, offs_g, offs_k, USE_FP8, GROUP_K, PRE_ROUND)
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def gemv_block(X, W, WS, Out, row, pid_n, N, K, rows_per_group, stride_xm, stride_xg, stride_wn, stride_wsn,
               stride_om, USE_FP8: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, GROUPS: tl.constexpr,
               PRE_ROUND: tl.constexpr, BLOCK_N: tl.constexpr, WAIT_FIRST: tl.constexpr, PREFETCH: tl.constexpr):
    """One program's outputs [pid_n * BLOCK_N, +BLOCK_N) of x's row `row`, stored to Out in its dtype (the
    body of `_gemv_kernel`, for kernels that do more in the same launch)."""
    wait_for_inputs(WAIT_FIRST)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, GROUPS)[:, None] * GROUP_K + tl.arange(0, GROUP_K)[None, :]
    w_ptrs = W + offs_n[:, None, None].to(tl.int64) * stride_wn + offs_k[None, :, :]
    scales = WS + ((pid_n * BLOCK_N) // GROUP_N) * stride_wsn
    x = X + row * stride_xm + ((pid_n * BLOCK_N) // rows_per_group) * stride_xg  # block-diagonal: the rows' group of x
    y = gemv_rows(w_ptrs, x + offs_k, scales, offs_n < N, K, USE_FP8, GROUP_K, GROUPS, PRE_ROUND, BLOCK_N, PREFETCH)
    tl.store(Out + row * stride_om + offs_n, y.to(Out.dtype.element_ty), mask=offs_n < N)


@triton.jit
def _gemv_kernel(X, W, WS, Out, N, K, rows_per_group, stride_xm, stride_xg, stride_wn, stride_wsn, stride_om,
                 USE_FP8: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, GROUPS: tl.constexpr,
                 PRE_ROUND: tl.constexpr, BLOCK_N: tl.constexpr, WAIT_FIRST: tl.constexpr, PREFETCH: tl.constexpr):
    gemv_block(X, W, WS, Out, tl.program_id(0), tl.program_id(1), N, K, rows_per_group, stride_xm, stride_xg, stride_wn,
               stride_wsn, stride_om, USE_FP8, GROUP_N, GROUP_K, GROUPS, PRE_ROUND, BLOCK_N, WAIT_FIRST, PREFETCH)


@triton.jit
def _dot_kernel(X, W, WS, Out, Partials, Tickets, M, N, K, k_per_split, rows_per_group, stride_xm, stride_xg,
                stride_wn, stride_wsn, stride_om, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
                PRE_ROUND: tl.constexpr, UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
                PDL: tl.constexpr):
    """FP8 rows on the tensor cores: BLOCK_N rows of W by 16 rows of x a program, one K group a product
    ([BLOCK_N, GROUP_K] x [GROUP_K, 16]) times the two scales, summed in float32, over one of the
    program_id(2) slices of K (each k_per_split long, a multiple of GROUP_K; K a multiple of GROUP_K too).
    More than one slice: each stores its partial sums [BLOCK_N, 16] to Partials, and the tile's last
    program adds them up in slice order (the same sums whichever program comes last) and stores Out.
    Block-diagonal (groups of rows_per_group rows, BLOCK_N dividing it): rows of group j multiply x's K
    values at j * stride_xg."""
    pid_n, pid_m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    splits = tl.num_programs(2)
    wait_for_inputs(PDL)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * 16 + tl.arange(0, 16)
    offs_k = tl.arange(0, GROUP_K)
    w_rows = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    x_rows = X + ((pid_n * BLOCK_N) // rows_per_group) * stride_xg + offs_m[:, None].to(tl.int64) * stride_xm + \
        offs_k[None, :]
    scales = WS + ((pid_n * BLOCK_N) // GROUP_N) * stride_wsn  # BLOCK_N divides GROUP_N: one scale a K group
    acc = tl.zeros([BLOCK_N, 16], tl.float32)
    k_start = split * k_per_split
    for k0 in tl.range(k_start, tl.minimum(k_start + k_per_split, K), GROUP_K, num_stages=STAGES):
        codes, a_scale = e4m3_groups(tl.load(x_rows + k0, mask=(offs_m < M)[:, None], other=0.0).to(tl.float32),
                                     PRE_ROUND)
        p = mma(tl.load(w_rows + k0, mask=(offs_n < N)[:, None], other=0.0), tl.trans(codes), UPCAST)
        acc += p * (a_scale[None, :] * tl.load(scales + k0 // GROUP_K))
    out_ptrs = Out + offs_m[None, :] * stride_om + offs_n[:, None]
    out_mask = (offs_m < M)[None, :] & (offs_n < N)[:, None]
    if splits == 1:
        tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=out_mask)
    else:
        tile = pid_n * tl.num_programs(1) + pid_m
        part = Partials + tile.to(tl.int64) * splits * (BLOCK_N * 16) + \
            tl.arange(0, BLOCK_N)[:, None] * 16 + tl.arange(0, 16)[None, :]  # [splits, BLOCK_N, 16] a tile
        tl.store(part + split * (BLOCK_N * 16), acc)
        if last_program(Tickets + tile, splits):
            acc = tl.zeros([BLOCK_N, 16], tl.float32)
            for s in range(0, splits):
                acc += tl.load(part + s * (BLOCK_N * 16), cache_modifier=".cg")  # past L1: other SMs wrote them
            tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=out_mask)


def dot_splits(tiles: int, k_groups: int, device: torch.device) -> int:
    """Slices of K for `_dot_kernel`'s `tiles` (rows of W by 16 rows of x): enough programs for
    DOT_PROGRAMS_PER_SM on every SM (a program's loop is latency-bound: one K group staged, quantized and
    multiplied in turn; V3's o_proj is 112 tiles of 128 groups), each slice DOT_MIN_SPLIT_GROUPS groups or
    more, no slice empty."""
    want = -(-DOT_PROGRAMS_PER_SM * num_sms(device) // tiles)
    per = -(-k_groups // max(1, min(want, k_groups // DOT_MIN_SPLIT_GROUPS)))
    return -(-k_groups // per)


_TICKETS: dict[torch.device, torch.Tensor] = {}


def _tickets(device: torch.device, count: int) -> torch.Tensor:
    """int32 zeros, one a tile of a split `_dot_kernel`, zero again after each launch: one buffer a device,
    shared by every launch (launches on a stream run in turn; under PDL each waits for the one before
    before it takes a ticket), grown by the first call that needs more (a warm-up, before any capture)."""
    tickets = _TICKETS.get(device)
    if tickets is None or tickets.numel() < count:
        tickets = _TICKETS[device] = torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
    return tickets


def dot_rows(x: torch.Tensor, k: int, block: tuple[int, int] | None) -> int:
    """The rows of W a tensor-core program of `_dot_kernel` (or the MoE GEMVs') takes for FP8 `block`s and K,
    0 where that path does not apply: K whole groups of 16 or more, the largest power of two up to
    DOT_BLOCK_N dividing the block's rows, e4m3 operands at wgmma's M of 64 only (float32 ones, under the
    interpreter or for groups under 32, from 16)."""
    if block is None or block[1] < 16 or k % block[1]:
        return 0
    rows = min(DOT_BLOCK_N, block[0] & -block[0])
    return rows if rows >= (16 if upcast_fp8_dot(x, block[1]) else DOT_BLOCK_N) else 0


def dot_program_rows(x: torch.Tensor, n: int, k: int, block: tuple[int, int] | None, groups: int = 1,
                     dot: bool | None = None) -> int:
    """The rows of W a `_dot_kernel` program takes for an [n, k] FP8 weight of `groups` block-diagonal
    groups, 0 where the tensor-core path does not apply: `dot` off (None: DOT, and DOT_GROUPS for groups),
    blocks `dot_rows` refuses, or a program's rows across two groups."""
    if not ((DOT and (groups == 1 or DOT_GROUPS)) if dot is None else dot):
        return 0
    rows = dot_rows(x, k, block)
    return rows if rows and (groups == 1 or (n // groups) % rows == 0) else 0


def tile(n: int, k: int, x: torch.Tensor, block: tuple[int, int] | None = None, rows_per_group: int | None = None,
         config: tuple[int, int, int] | None = None) -> tuple[int, int, int]:
    """(BLOCK_N, K groups per step, num_warps) for an [n, k] weight (FP8: `block`, its scale block) times
    rows of x, whose groups are rows_per_group rows of the weight (None: one group)."""
    block_n, k_groups, warps = config or (INTERPRETED_CONFIG if interpreted(x) else CONFIG["fp8" if block else "bf16"])
    group_k = block[1] if block else 128
    if config is None and not interpreted(x):
        # a K shorter than one step (MLA's absorptions: K = 128 and 512 a head) would leave most of the
        # tile masked: fewer K groups per step, as many more rows per program
        while k_groups > 1 and (k_groups // 2) * group_k >= k:
            k_groups, block_n = k_groups // 2, block_n * 2
        block_n = max(1, min(block_n, triton.next_power_of_2(n) // 64))  # enough programs for small N (router)
    if block:
        while block[0] % block_n:  # a program's rows must sit in one scale block
            block_n //= 2
    while rows_per_group is not None and rows_per_group % block_n:  # and in one group
        block_n //= 2
    return block_n, k_groups, warps


def gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None,
         block: tuple[int, int] | None = None, out_dtype: torch.dtype | None = None,
         config: tuple[int, int, int] | None = None, groups: int = 1, dot: bool | None = None) -> torch.Tensor:
    """x [M, K] (M small: each row streams the whole weight) times weight [N, K] -> [M, N] in out_dtype
    (default x's). The weight is x's dtype, float32 (x widened: the router's float32 logits), or FP8 with
    its [ceil(N / block_n), ceil(K / block_k)] scales and the block size.
    `config`: (BLOCK_N, K groups per step, num_warps). groups > 1: block-diagonal, x [M, groups * K] (or
    [M, groups, K], its groups at any stride: the heads of a strided view) and rows j * N / groups.. of the
    weight multiply x's slice j (DeepSeek-V4's grouped wo_a, MLA's per-head absorptions).
    Under programmatic dependent launch a program may read the weight before the previous kernel in the
    stream has finished (`PREFETCH`): the weight must not be that kernel's output (model weights never are).
    `dot` (FP8 weights; None: DOT from DOT_MIN_ROWS rows, DOT_GROUPS for groups > 1): the products on the
    tensor cores (`_dot_kernel`) where `dot_rows` allows and a program's rows sit in one group, `config` then
    unused."""
    check_float("x", x)
    if x.dim() == 3:
        check(x.shape[1] == groups and x.stride(-1) == 1,
              f"a 3-D x must be [M, {groups} groups, K] contiguous in K, got {tuple(x.shape)}")
        num_rows, _, k = x.shape
        stride_xg = x.stride(1)
    else:
        check(x.dim() == 2 and x.stride(-1) == 1, f"x must be [M, K] with contiguous rows, got {tuple(x.shape)}")
        num_rows, k = x.shape
        check(k % groups == 0, f"{groups} groups do not split x [{num_rows}, {k}]")
        k //= groups
        stride_xg = k
    n = weight.shape[0]
    check(n % groups == 0, f"{groups} groups do not split the weight's {n} rows")
    rows_per_group = n // groups
    check(weight.dim() == 2 and weight.shape[1] == k and weight.stride(-1) == 1,
          f"weight must be [N, {k}] with contiguous rows, got {tuple(weight.shape)}")
    fp8 = weight.dtype == FP8
    if fp8:
        check(block is not None and weight_scale is not None, "FP8 weights need weight_scale and the block size")
        check(block[1] & (block[1] - 1) == 0, f"block_k must be a power of two, got {block[1]}")
        check(tuple(weight_scale.shape) == (-(-n // block[0]), -(-k // block[1])) and weight_scale.stride(-1) == 1,
              f"weight_scale must be [{-(-n // block[0])}, {-(-k // block[1])}], got {tuple(weight_scale.shape)}")
    else:
        check(weight.dtype in (x.dtype, torch.float32), f"weight ({weight.dtype}) must match x ({x.dtype}) or be float32")
    out = torch.empty(num_rows, n, dtype=out_dtype or x.dtype, device=x.device)
    if num_rows == 0:
        return out
    rows = dot_program_rows(x, n, k, block, groups, dot) if fp8 and (dot or num_rows >= DOT_MIN_ROWS) else 0
    if rows:
        on = pdl(x)
        grid_n, grid_m, k_groups = triton.cdiv(n, rows), triton.cdiv(num_rows, 16), k // block[1]
        splits = dot_splits(grid_n * grid_m, k_groups, x.device)
        tiles = grid_n * grid_m if splits > 1 else 0
        partials = torch.empty(tiles * splits * rows * 16, dtype=torch.float32, device=x.device)
        _dot_kernel[(grid_n, grid_m, splits)](
            x, weight, weight_scale, out, partials, _tickets(x.device, tiles), num_rows, n, k,
            -(-k_groups // splits) * block[1], rows_per_group, x.stride(0), stride_xg, weight.stride(0),
            weight_scale.stride(0), out.stride(0), GROUP_N=block[0], GROUP_K=block[1], PRE_ROUND=interpreted(x),
            UPCAST=upcast_fp8_dot(x, block[1]), BLOCK_N=rows, STAGES=DOT_STAGES, PDL=on, launch_pdl=on,
            num_warps=DOT_WARPS)
        return out
    block_n, k_groups, warps = tile(n, k, x, block if fp8 else None, rows_per_group if groups > 1 else None, config)
    group_k = block[1] if fp8 else 128
    ws = weight_scale if fp8 else weight
    on, prefetch = pdl(x), PREFETCH["fp8" if fp8 else "bf16"]
    _gemv_kernel[(num_rows, triton.cdiv(n, block_n))](
        x, weight, ws, out, n, k, rows_per_group, x.stride(0), stride_xg, weight.stride(0), ws.stride(0) if fp8 else 0,
        out.stride(0),
        USE_FP8=fp8, GROUP_N=block[0] if fp8 else 1, GROUP_K=group_k, GROUPS=k_groups,
        PRE_ROUND=fp8 and interpreted(x), BLOCK_N=block_n, WAIT_FIRST=on and not prefetch,
        PREFETCH=on and prefetch, launch_pdl=on, num_warps=warps)
    return out
