"""MLA prefill: causal attention over variable-length chunks that may follow a cached prefix.

Prefill is matrix-bound, so it runs un-absorbed (per-head K = [k_nope | k_pe], V = v, expanded from
the latents by one GEMM through W_UKV): per query-key pair 2 * (nope + rope) + 2 * v FLOPs per head,
against (nope + rope + v) * 2 bytes per key and head when expanded. The shared k_pe [Tk, rope] is read
by every head as it is, never copied per head.

Sequence b's queries are the last q_len_b of its k_len_b keys (the chunk after a cached prefix), so
query i sits at position k_len_b - q_len_b + i and sees keys 0..that position. A query block's key tiles
wholly before its diagonal run unmasked, their keys and values read by the TMA unit where the layout
allows (`_descriptors`); the tiles on the diagonal are masked and read through pointers.
"""

import torch
import triton
import triton.language as tl

from engine.kernels._util import check, check_float, check_last_contiguous, gluon_available, interpreted, mma, pow2

LOG2E = 1.4426950408889634
# bf16 prefill on Hopper through the warp-specialised Gluon kernel (`mla_prefill_gluon`): 1.14-1.25x this
# one alone on an H200, and 8-15 % more prefill tokens/s at 32k-128k in the engine on an H100
# (`bench --no-gluon` measures without it)
GLUON = True


@triton.jit
def _load(ptrs, rows_ok, cols_ok, ROWS: tl.constexpr, COLS: tl.constexpr):
    """A [R, C] tile, masked only along the dimensions that need it: an exact tile loads unpredicated."""
    if ROWS and COLS:
        return tl.load(ptrs, mask=rows_ok[:, None] & cols_ok[None, :], other=0.0)
    elif ROWS:
        return tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
    elif COLS:
        return tl.load(ptrs, mask=cols_ok[None, :], other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _attend_tile(qn, qp, KN, KP, V, h, k_start, n0, k_len, q_pos, m_i, l_i, acc, scale_log2,
                 stride_knt, stride_knh, stride_kpt, stride_vt, stride_vh, offs_d, offs_r, offs_v, mask_d, mask_r,
                 mask_v, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, PAD_D: tl.constexpr, PAD_R: tl.constexpr,
                 PAD_V: tl.constexpr, UPCAST: tl.constexpr):
    """Online softmax over keys [n0, n0 + BLOCK_N) for the program's query rows -> (m_i, l_i, acc). MASKED:
    the tile may hold keys past k_len or after a row's position (the causal diagonal); otherwise every key
    is visible to every row and the tile runs without a mask."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < k_len
    krow = (k_start + offs_n).to(tl.int64)
    # keys as rows ([BLOCK_N, d], d contiguous), transposed for the product
    kn = _load(KN + krow[:, None] * stride_knt + h * stride_knh + offs_d[None, :], mask_n, mask_d, MASKED, PAD_D)
    kp = _load(KP + krow[:, None] * stride_kpt + offs_r[None, :], mask_n, mask_r, MASKED, PAD_R)
    qk = mma(qn, tl.trans(kn), UPCAST) + mma(qp, tl.trans(kp), UPCAST)  # [BLOCK_M, BLOCK_N]
    if MASKED:
        visible = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
        qk = tl.where(visible, qk * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows past q_len may see nothing
        p = tl.exp2(qk - m_safe[:, None])
    else:  # the scale folded into the exponent's operand (one FMA)
        m_new = tl.maximum(m_i, tl.max(qk, axis=1) * scale_log2)
        m_safe = m_new
        p = tl.exp2(qk * scale_log2 - m_new[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = _load(V + krow[:, None] * stride_vt + h * stride_vh + offs_v[None, :], mask_n, mask_v, MASKED, PAD_V)
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _attend_tile_tma(qn, qp, KND, KPD, VD, h, k_start, n0, m_i, l_i, acc, scale_log2, HEAD_KN: tl.constexpr,
                     HEAD_V: tl.constexpr, UPCAST: tl.constexpr):
    """`_attend_tile` over a tile wholly before the diagonal (no mask), its keys and values read by the
    TMA unit through descriptors over [T, columns] views (head h's columns start at h * HEAD_*)."""
    row = k_start + n0
    kn = KND.load([row, h * HEAD_KN])
    kp = KPD.load([row, 0])
    qk = mma(qn, tl.trans(kn), UPCAST) + mma(qp, tl.trans(kp), UPCAST)
    m_new = tl.maximum(m_i, tl.max(qk, axis=1) * scale_log2)
    p = tl.exp2(qk * scale_log2 - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = VD.load([row, h * HEAD_V])
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, UPCAST)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["num_m_blocks"])  # varies with the batch: one compiled variant
def _prefill_kernel(QN, QP, KN, KP, V, O, CuQ, CuK, KND, KPD, VD, scale_log2,
                    stride_qnt, stride_qnh, stride_qpt, stride_qph, stride_knt, stride_knh, stride_kpt,
                    stride_vt, stride_vh, stride_ot, stride_oh, num_m_blocks,
                    NOPE: tl.constexpr, ROPE: tl.constexpr, VDIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    PAD_D: tl.constexpr, PAD_R: tl.constexpr, PAD_V: tl.constexpr, SPLIT: tl.constexpr,
                    UPCAST: tl.constexpr, TMA: tl.constexpr):
    mb = num_m_blocks - 1 - tl.program_id(0)  # the longest (last) query blocks start first
    h, b = tl.program_id(1), tl.program_id(2)
    q_start = tl.load(CuQ + b)
    q_len = tl.load(CuQ + b + 1) - q_start
    if mb * BLOCK_M < q_len:
        k_start = tl.load(CuK + b)
        k_len = tl.load(CuK + b + 1) - k_start
        prefix = k_len - q_len
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < q_len
        offs_d, offs_r, offs_v = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_V)
        mask_d, mask_r, mask_v = offs_d < NOPE, offs_r < ROPE, offs_v < VDIM
        qrow = (q_start + offs_m).to(tl.int64)
        qn = _load(QN + qrow[:, None] * stride_qnt + h * stride_qnh + offs_d[None, :], mask_m, mask_d, True, PAD_D)
        qp = _load(QP + qrow[:, None] * stride_qpt + h * stride_qph + offs_r[None, :], mask_m, mask_r, True, PAD_R)
        q_pos = prefix + offs_m
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
        # keys before the block's first position are visible to all of its rows: whole tiles of them run
        # unmasked; the rest (up to the block's last position) straddle the diagonal and are masked
        lo = (prefix + mb * BLOCK_M) // BLOCK_N * BLOCK_N if SPLIT else 0
        end = tl.minimum(k_len, prefix + (mb + 1) * BLOCK_M)
        if TMA:
            for n0 in range(0, lo, BLOCK_N):
                m_i, l_i, acc = _attend_tile_tma(qn, qp, KND, KPD, VD, h, k_start, n0, m_i, l_i, acc, scale_log2,
                                                 stride_knh, stride_vh, UPCAST)
        else:
            for n0 in range(0, lo, BLOCK_N):
                m_i, l_i, acc = _attend_tile(qn, qp, KN, KP, V, h, k_start, n0, k_len, q_pos, m_i, l_i, acc,
                                             scale_log2, stride_knt, stride_knh, stride_kpt, stride_vt, stride_vh,
                                             offs_d, offs_r, offs_v, mask_d, mask_r, mask_v, BLOCK_N, False, PAD_D,
                                             PAD_R, PAD_V, UPCAST)
        for n0 in range(lo, end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(qn, qp, KN, KP, V, h, k_start, n0, k_len, q_pos, m_i, l_i, acc, scale_log2,
                                         stride_knt, stride_knh, stride_kpt, stride_vt, stride_vh, offs_d, offs_r,
                                         offs_v, mask_d, mask_r, mask_v, BLOCK_N, True, PAD_D, PAD_R, PAD_V, UPCAST)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(O + qrow[:, None] * stride_ot + h * stride_oh + offs_v[None, :], out.to(O.dtype.element_ty),
                 mask=mask_m[:, None] & mask_v[None, :])


def _tiles(qk_dim: int, on_cpu: bool) -> dict:
    """DeepSeek's heads (nope + rope = 192): 128 query rows a program (two warpgroups of 64), 64 keys a
    tile, three pipeline stages (120 KB of keys and values in flight); small heads and the interpreter:
    64 x 32, two stages. split: the key tiles wholly before a query block's diagonal run unmasked.

    Measured on an H200 (benchmarks/mla_prefill.py --sweep, docs/perf.md), 16 heads, 8k / 32k tokens:
    434 / 488 TFLOP/s, against 338 / 392 at two stages and 292 / 338 with every tile masked; 128-key
    tiles (two stages: 160 KB) 412 / 480; 64 query rows on four warps 344 / 363.

    tma: the unmasked tiles' keys and values read by the TMA unit (descriptors; where bases and strides
    allow), which frees the warps of the address arithmetic and the per-thread copies: 1-4.5 % faster
    (16 heads: 451 vs 435 TFLOP/s at 8k, 513 vs 493 at 128k; 128 heads: 494 vs 473 at 8k). Triton's
    automatic warp specialization of that loop measured the same (within 1-3 % either way)."""
    big = qk_dim > 128 and not on_cpu
    return dict(block_m=128 if big else 64, block_n=64 if big else 32, num_warps=8 if big else 4,
                num_stages=3 if big else 2, split=True, tma=big)


def mla_prefill_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor,
                          v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                          max_seqlen_q: int, softmax_scale: float, tiles: dict | None = None) -> torch.Tensor:
    """q_nope: [Tq, H, nope], q_pe: [Tq, H, rope], k_nope: [Tk, H, nope], k_pe: [Tk, rope] (shared by the
    heads), v: [Tk, H, v]; cu_seqlens_q/k: [B + 1] int32 -> [Tq, H, v]. Strided views are fine. tiles:
    override of `_tiles` (block_m, block_n, num_warps, num_stages, split, tma), for benchmarks and tests."""
    check(q_nope.dim() == 3 and q_pe.dim() == 3 and k_nope.dim() == 3 and k_pe.dim() == 2 and v.dim() == 3,
          "expected q_nope, q_pe, k_nope, v as [T, H, d] and k_pe as [T, rope]")
    num_q, num_heads, nope = q_nope.shape
    num_k, rope, vdim = k_nope.shape[0], q_pe.shape[2], v.shape[2]
    check(q_pe.shape[:2] == (num_q, num_heads), "q_pe does not match q_nope")
    check(k_nope.shape == (num_k, num_heads, nope) and k_pe.shape == (num_k, rope) and v.shape[:2] == (num_k, num_heads),
          f"key/value shapes {tuple(k_nope.shape)}, {tuple(k_pe.shape)}, {tuple(v.shape)} do not match the queries")
    for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("k_nope", k_nope), ("k_pe", k_pe), ("v", v)):
        check_float(name, t)
        check_last_contiguous(name, t)
        check(t.dtype == q_nope.dtype, f"{name} dtype {t.dtype} differs from q_nope's {q_nope.dtype}")
    check(cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32, "cu_seqlens must be int32")
    check(cu_seqlens_q.shape == cu_seqlens_k.shape, "cu_seqlens_q and cu_seqlens_k must have B + 1 entries each")
    out = torch.empty(num_q, num_heads, vdim, dtype=q_nope.dtype, device=q_nope.device)
    batch = cu_seqlens_q.shape[0] - 1
    if num_q == 0 or batch == 0:
        return out
    if GLUON and tiles is None and not interpreted(q_nope) and gluon_available():
        from engine.kernels import mla_prefill_gluon

        if mla_prefill_gluon.applies(q_nope, q_pe, k_nope, k_pe, v):
            return mla_prefill_gluon.ws_prefill(q_nope, q_pe, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                softmax_scale)
    cfg = dict(_tiles(nope + rope, interpreted(q_nope)), **(tiles or {}))
    num_m_blocks = triton.cdiv(max_seqlen_q, cfg["block_m"])
    tma = cfg.get("tma", False) and not (pow2(nope) != nope or pow2(rope) != rope or pow2(vdim) != vdim)
    descs = _descriptors(k_nope, k_pe, v, cfg["block_n"]) if tma else None
    if descs is None:
        tma, descs = False, (k_nope, k_pe, v)
    _prefill_kernel[(num_m_blocks, num_heads, batch)](
        q_nope, q_pe, k_nope, k_pe, v, out, cu_seqlens_q, cu_seqlens_k, *descs, softmax_scale * LOG2E,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), k_nope.stride(0), k_nope.stride(1),
        k_pe.stride(0), v.stride(0), v.stride(1), out.stride(0), out.stride(1), num_m_blocks,
        NOPE=nope, ROPE=rope, VDIM=vdim, BLOCK_D=pow2(nope), BLOCK_R=pow2(rope), BLOCK_V=pow2(vdim),
        BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], PAD_D=pow2(nope) != nope, PAD_R=pow2(rope) != rope,
        PAD_V=pow2(vdim) != vdim, SPLIT=cfg["split"], UPCAST=interpreted(q_nope), TMA=tma, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    return out


def _descriptors(k_nope, k_pe, v, block_n):
    """TMA descriptors over [T, columns] views of the keys and values (head h of k_nope at columns
    h * stride(1) on), or None where the layout does not allow one (16-byte aligned bases and strides)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    def desc(t):
        heads = t.shape[1] if t.dim() == 3 else 1
        cols = (heads - 1) * (t.stride(1) if t.dim() == 3 else 0) + t.shape[-1]
        size = t.element_size()
        if (t.data_ptr() % 16 or (t.stride(0) * size) % 16 or (t.dim() == 3 and (t.stride(1) * size) % 16)
                or not (16 <= t.shape[-1] * size and t.shape[-1] <= 256)):  # a TMA box row: 16 B to 256 values
            return None
        return TensorDescriptor(t, [t.shape[0], cols], [t.stride(0), 1], [block_n, t.shape[-1]])

    descs = (desc(k_nope), desc(k_pe), desc(v))
    return None if any(d is None for d in descs) else descs


def reference_mla_prefill_attention(q_nope, q_pe, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, softmax_scale):
    """Plain PyTorch, float32, one sequence at a time."""
    outs = []
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        qs, ql, ks, kl = cq[b], cq[b + 1] - cq[b], ck[b], ck[b + 1] - ck[b]
        heads = q_nope.shape[1]
        q = torch.cat([q_nope[qs:qs + ql], q_pe[qs:qs + ql]], -1).float()
        k = torch.cat([k_nope[ks:ks + kl], k_pe[ks:ks + kl, None].expand(-1, heads, -1)], -1).float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * softmax_scale
        mask = torch.arange(kl)[None, :] <= torch.arange(kl - ql, kl)[:, None]
        probs = scores.masked_fill(~mask.to(scores.device), float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, v[ks:ks + kl].float()))
    return torch.cat(outs).to(q_nope.dtype)
