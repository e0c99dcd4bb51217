"""FP8 e4m3 block-scaled linear layers, as DeepSeek-V3 ships its weights.

Activations are quantized per token and group of K columns (one float32 scale per [1, block_k]),
weights carry one scale per [block_n, block_k] block; the GEMM accumulates each K block's FP8 product
in float32 times the two scales. Bytes: M*K + N*K (+ scales) + 2*M*N; FLOPs: 2*M*N*K.
"""

import functools
import logging

import torch
import triton
import triton.language as tl

from engine.kernels._util import check, check_float, interpreted, mma, pow2, upcast_fp8_dot

logger = logging.getLogger(__name__)

try:  # Triton >= 3.4: host-side TMA descriptors (the interpreter reads them as plain tiles)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # older Triton keeps the pointer kernels
    TensorDescriptor = None

FP8_MAX = 448.0
FP8 = torch.float8_e4m3fn
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _round_to_e4m3(v):
    """Round half to even onto the e4m3 grid (3 mantissa bits; subnormal spacing 2^-9), in float32."""
    a = tl.abs(v)
    step = tl.exp2(tl.floor(tl.log2(tl.maximum(a, 0.015625))) - 3.0)
    r = a / step
    n = tl.floor(r + 0.5)
    n = tl.where((n - r == 0.5) & (n - 2.0 * tl.floor(n * 0.5) == 1.0), n - 1.0, n)
    return tl.where(v < 0, -n * step, n * step)


@triton.jit(do_not_specialize=["M"])  # varies with the batch: one compiled variant
def _group_quant_kernel(X, Q, S, M, stride_x, stride_q, stride_sm, stride_sk, K, GROUP: tl.constexpr,
                        BLOCK: tl.constexpr, ROWS: tl.constexpr, PRE_ROUND: tl.constexpr):
    """One program per (ROWS rows, one group of K): a [ROWS, GROUP] tile, one scale per row."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = tl.program_id(1) * GROUP + tl.arange(0, BLOCK)
    mask = (rows < M)[:, None] & ((tl.arange(0, BLOCK) < GROUP) & (offs < K))[None, :]
    x = tl.load(X + rows[:, None].to(tl.int64) * stride_x + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10) / 448.0
    y = x / scale[:, None]
    if PRE_ROUND:
        # the interpreter's float -> fp8 cast drops the carry of a rounded-up mantissa (31.6 -> 16);
        # values already on the e4m3 grid convert exactly
        y = _round_to_e4m3(y)
    tl.store(Q + rows[:, None].to(tl.int64) * stride_q + offs[None, :], y.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + rows * stride_sm + tl.program_id(1) * stride_sk, scale, mask=rows < M)


def per_token_group_quant(x: torch.Tensor, group: int, k_major_scales: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] float -> (FP8 [M, K], float32 scales [M, ceil(K / group)]), x ~ q * scale.
    `k_major_scales`: the scales' storage is [ceil(K / group), M] (a transposed view is returned), so a
    tile of rows reads one K step's scales as one contiguous run (the persistent GEMMs' layout)."""
    check_float("x", x)
    check(x.dim() == 2 and x.stride(-1) == 1, f"x must be [M, K] contiguous in K, got {tuple(x.shape)}")
    num_rows, k = x.shape
    num_groups = triton.cdiv(k, group)
    q = torch.empty(num_rows, k, dtype=FP8, device=x.device)
    if k_major_scales:
        s = torch.empty(num_groups, num_rows, dtype=torch.float32, device=x.device).T
    else:
        s = torch.empty(num_rows, num_groups, dtype=torch.float32, device=x.device)
    if num_rows:
        rows = 32 if not interpreted(x) else 4  # 32 rows of one group: 8 KB of bf16 per program
        _group_quant_kernel[(triton.cdiv(num_rows, rows), num_groups)](
            x, q, s, num_rows, x.stride(0), q.stride(0), s.stride(0), s.stride(1), k, GROUP=group,
            BLOCK=pow2(group, 1), ROWS=rows, PRE_ROUND=interpreted(x))
    return q, s


@triton.jit(do_not_specialize=["M"])  # varies with the batch: one compiled variant
def _block_gemm_kernel(A, AS, W, WS, C, M, N, K, stride_am, stride_asm, stride_wn, stride_wsn, stride_cm,
                       GROUP_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, UPCAST: tl.constexpr):
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    # grouped order: GROUP_M row blocks sweep the columns together, so W tiles stay in L2
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < M, offs_n < N
    a_ptr = A + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    w_ptr = W + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    as_ptr = AS + offs_m * stride_asm
    ws_ptr = WS + (offs_n // GROUP_N) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        mask_k = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptr, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptr, mask=mask_n[None, :] & mask_k[:, None], other=0.0)
        a_s = tl.load(as_ptr + kb, mask=mask_m, other=0.0)
        w_s = tl.load(ws_ptr + kb, mask=mask_n, other=0.0)
        acc += mma(a, w, UPCAST) * a_s[:, None] * w_s[None, :]
        a_ptr += BLOCK_K
        w_ptr += BLOCK_K
    tl.store(C + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :], acc.to(C.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def tile_of(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """Work item -> (row block, column block): GROUP_M row blocks sweep the columns together, so the
    weight tiles in flight are shared through L2."""
    group = tile // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile % (GROUP_M * num_n)) % size_m, (tile % (GROUP_M * num_n)) // size_m


@triton.jit(do_not_specialize=["M"])  # varies with the batch: one compiled variant
def _block_gemm_tma_kernel(a_desc, AS, w_desc, WS, c_desc, M, N, K, stride_asm, stride_ask, stride_wsn,
                           NUM_PROGRAMS: tl.constexpr, GROUP_N: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                           UPCAST: tl.constexpr, FLATTEN: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """Persistent: NUM_PROGRAMS programs stride over the [BLOCK_M, BLOCK_N] output tiles. A and W tiles
    arrive by TMA (the copy engine, out-of-range rows and columns read as zeros); each K step's FP8
    product is scaled in float32 by the rows' activation scales (K-major: one contiguous run) and the
    tile's one weight scale (BLOCK_N divides the weight block), DeepSeek-V3's promotion per 128 K."""
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_PROGRAMS, flatten=FLATTEN):
        pid_m, pid_n = tile_of(tile, num_m, num_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        as_ptr = AS + offs_m * stride_asm
        ws_ptr = WS + (pid_n * BLOCK_N // GROUP_N) * stride_wsn
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for kb in range(k_steps):
            a = a_desc.load([pid_m * BLOCK_M, kb * BLOCK_K])
            w = w_desc.load([pid_n * BLOCK_N, kb * BLOCK_K])
            a_s = tl.load(as_ptr + kb * stride_ask, mask=offs_m < M, other=0.0)
            w_s = tl.load(ws_ptr + kb)
            acc += mma(a, w.T, UPCAST) * (a_s * w_s)[:, None]
        c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(OUT_DTYPE))


@functools.cache
def num_sms(device: torch.device) -> int:
    """Programs of a persistent launch: one per multiprocessor (a few under the interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 3


def tma_capable(device: torch.device) -> bool:
    """A GPU with the tensor copy engine (sm_90+) and a Triton that builds TMA descriptors."""
    return TensorDescriptor is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


# below this many rows the pointer kernel's narrower tiles win (decode, short chunks)
TMA_MIN_ROWS = 256
# (device index, N, K) -> False where PyTorch's block-scaled GEMM refused that weight's shape (tensor-parallel
# slices give K and N it was not measured on): that weight takes our kernel from then on, the others keep it
_SCALED_MM_WORKS: dict[tuple[int, int, int], bool] = {}


def prefill_gemm(m: int, n: int, k: int, block: tuple[int, int], out_dtype: torch.dtype, device: torch.device) -> str:
    """Which GEMM an FP8 block-scaled linear of M rows runs: "scaled_mm" (PyTorch's own 1 x 128 by
    128 x 128 block-scaled GEMM, cuBLAS on sm_90: 70-90 % of the FP8 rate on the H200), "tma" (the
    persistent TMA kernel here: 56-69 %, where PyTorch has none), or "pointer" (decode-sized M, other
    blocks or GPUs; TMA needs 16-byte row strides)."""
    if (m < TMA_MIN_ROWS or block != (128, 128) or k % 16 or (n * out_dtype.itemsize) % 16
            or not tma_capable(device)):
        return "pointer"
    if (out_dtype == torch.bfloat16 and k % 128 == 0 and n % 16 == 0 and hasattr(torch.nn.functional, "scaled_mm")
            and torch.cuda.get_device_capability(device) == (9, 0)
            and _SCALED_MM_WORKS.get((device.index or 0, n, k), True)):
        return "scaled_mm"
    return "tma"


def fp8_block_gemm_scaled_mm(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor,
                             weight_scale: torch.Tensor) -> torch.Tensor:
    """PyTorch's block-scaled GEMM -> bf16 [M, N]; a_scale K-major (its "outer-dim-major" 1 x 128
    layout), B = W^T with its 128 x 128 scales transposed alike (views, no copies)."""
    from torch.nn.functional import ScalingType, scaled_mm

    return scaled_mm(a, weight.T, a_scale, ScalingType.BlockWise1x128, weight_scale.T, ScalingType.BlockWise128x128,
                     output_dtype=torch.bfloat16)


def _tma_config(on_gpu: bool, block: tuple[int, int]) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, programs per multiprocessor); BLOCK_N within the block."""
    if not on_gpu:
        return 16, min(block[0], 32), 4, 1, 1
    bm, bn, warps, stages, per_sm = TMA_TILE
    return bm, min(bn, block[0]), warps, stages, per_sm


# 128 x 128 x 128 FP8 tiles, two consumer warpgroups (64 rows each), four TMA stages, one program an SM,
# the loop not flattened (on the H200: 64-row tiles two to an SM within 4 % either way, 3 stages or 4
# warps slower, flattening 1-22 % slower on all but one shape)
TMA_TILE = (128, 128, 8, 4, 1)


def fp8_block_gemm_tma(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       block: tuple[int, int], out_dtype: torch.dtype, config=None, flatten: bool = False
                       ) -> torch.Tensor:
    """`fp8_block_gemm` through the persistent TMA kernel; a_scale may be K-major
    (`per_token_group_quant(..., k_major_scales=True)`), and block_n a multiple of BLOCK_N."""
    (m, k), n = a.shape, weight.shape[0]
    c = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return c
    bm, bn, warps, stages, per_sm = config or _tma_config(not interpreted(a), block)
    check(block[0] % bn == 0, f"block_n {block[0]} must be a multiple of BLOCK_N {bn}")
    bk = block[1]
    programs = min(per_sm * num_sms(a.device), triton.cdiv(m, bm) * triton.cdiv(n, bn))
    _block_gemm_tma_kernel[(programs,)](
        TensorDescriptor.from_tensor(a, [bm, bk]), a_scale, TensorDescriptor.from_tensor(weight, [bn, bk]),
        weight_scale, TensorDescriptor.from_tensor(c, [bm, bn]), m, n, k, a_scale.stride(0), a_scale.stride(1),
        weight_scale.stride(0), NUM_PROGRAMS=programs, GROUP_N=block[0], BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        GROUP_M=8, UPCAST=upcast_fp8_dot(a, bk), FLATTEN=flatten, OUT_DTYPE=_TL_DTYPES[out_dtype],
        num_warps=warps, num_stages=stages)
    return c


def _gemm_config(m: int, on_gpu: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): skinny tiles for decode, square ones for prefill."""
    if not on_gpu:
        return 16, 32, 4, 1
    if m <= 16:
        return 16, 64, 4, 4
    if m <= 64:
        return 64, 64, 4, 4
    return 128, 128, 8, 3


def fp8_block_gemm(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   block: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    """a: [M, K] FP8, a_scale: [M, ceil(K / block_k)], weight: [N, K] FP8, weight_scale:
    [ceil(N / block_n), ceil(K / block_k)] -> [M, N] out_dtype."""
    (m, k), n = a.shape, weight.shape[0]
    check(a.dtype == FP8 and weight.dtype == FP8, f"a and weight must be float8_e4m3fn, got {a.dtype}, {weight.dtype}")
    check(weight.shape[1] == k, f"weight {tuple(weight.shape)} does not match K={k}")
    check(a.stride(-1) == 1 and weight.stride(-1) == 1, "a and weight must be contiguous in K")
    kb = triton.cdiv(k, block[1])
    check(a_scale.shape == (m, kb) and a_scale.dtype == torch.float32, f"a_scale must be float32 [{m}, {kb}]")
    check(tuple(weight_scale.shape) == (triton.cdiv(n, block[0]), kb) and weight_scale.dtype == torch.float32,
          f"weight_scale {tuple(weight_scale.shape)} must be float32 [{triton.cdiv(n, block[0])}, {kb}]")
    check(a_scale.stride(-1) == 1 and weight_scale.stride(-1) == 1, "scales must be contiguous in K")
    check(block[1] >= 16 and block[1] & (block[1] - 1) == 0, f"block_k must be a power of two >= 16, got {block[1]}")
    c = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return c
    bm, bn, warps, stages = _gemm_config(m, not interpreted(a))
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _block_gemm_kernel[grid](a, a_scale, weight, weight_scale, c, m, n, k, a.stride(0), a_scale.stride(0),
                             weight.stride(0), weight_scale.stride(0), c.stride(0), GROUP_N=block[0],
                             BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=block[1], GROUP_M=8,
                             UPCAST=upcast_fp8_dot(a, block[1]), num_warps=warps, num_stages=stages)
    return c


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int],
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T for FP8 block-scaled W; x: [..., K] float, quantized on the fly per token group."""
    check_float("x", x)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    path = prefill_gemm(x2.shape[0], weight.shape[0], x2.shape[1], block, x.dtype, x.device)
    if path != "pointer":
        m = x2.shape[0]
        if path == "scaled_mm":
            # rows padded to a multiple of 128, the row counts cuBLAS's block-scaled GEMM was measured on:
            # its K-major scales need an aligned leading dimension, and a refusal below switches it off for
            # good, so one odd-sized prefill chunk must not be what decides. Only then: a pad of nothing
            # still copies the rows (a device copy before every FP8 GEMM of a prefill, 1.3 % of v3-slice's 8k)
            if m % 128:
                x2 = torch.nn.functional.pad(x2, (0, 0, 0, -m % 128))
        q, s = per_token_group_quant(x2, block[1], k_major_scales=True)
        y = None
        if path == "scaled_mm":
            try:
                y = fp8_block_gemm_scaled_mm(q, s, weight, weight_scale)[:m]
            except torch.OutOfMemoryError:
                raise
            except (RuntimeError, ValueError, NotImplementedError) as e:  # refused: ours for this shape from now on
                _SCALED_MM_WORKS[(x.device.index or 0, weight.shape[0], x2.shape[1])] = False
                logger.warning("PyTorch's block-scaled GEMM refused a %d x %d FP8 weight (%s); it runs the TMA "
                               "kernel from now on", weight.shape[0], x2.shape[1], str(e).splitlines()[0][:200])
        if y is None:
            y = fp8_block_gemm_tma(q, s, weight, weight_scale, block, x.dtype)[:m]
    else:
        q, s = per_token_group_quant(x2, block[1])
        y = fp8_block_gemm(q, s, weight, weight_scale, block, x.dtype)
    y = y.view(*lead, weight.shape[0])
    return y if bias is None else y + bias


def reference_fp8_linear(x, weight, weight_scale, block):
    """The same math in PyTorch: quantize activations per token group, dequantize both, matmul in float32."""
    k = x.shape[-1]
    xf = x.reshape(-1, k).float()
    g = block[1]
    pad = (-k) % g
    groups = torch.nn.functional.pad(xf, (0, pad)).view(xf.shape[0], -1, g)
    scale = groups.abs().amax(-1, keepdim=True).clamp(min=1e-10) / FP8_MAX
    xq = (groups / scale).to(FP8).float() * scale
    xd = xq.view(xf.shape[0], -1)[:, :k]
    ws = weight_scale.repeat_interleave(block[0], 0)[: weight.shape[0]].repeat_interleave(block[1], 1)[:, :k]
    return (xd @ (weight.float() * ws).T).to(x.dtype).view(*x.shape[:-1], weight.shape[0])
