"""Weight-absorbed MLA decode over the paged latent cache (flash-decoding).

All heads share one latent row per token: [c_kv (kv_lora) | k_pe (rope)], 576 values for V3. With
q_nope already folded through W_UK, a head's score is q_latent . c_kv + q_pe . k_pe and its output is
the softmax-weighted sum of c_kv rows (W_UV is applied afterwards). A program owns BLOCK_H heads of one
sequence and one of NUM_SPLITS slices of its context, so the cache is read once per head block even
for a single long sequence; a second kernel merges the slices by their log-sum-exp.

Bytes: context_len * 576 * elem per sequence and head block; FLOPs: 4 * heads * context_len * 544.
"""

import torch
import triton
import triton.language as tl

from engine.kernels._util import check, check_float, check_last_contiguous, interpreted, mma, pow2

LOG2E = 1.4426950408889634


# the block table's width follows the step's longest sequence (1, a multiple of 16 or neither: three
# compiled variants per slice count, one met only mid-serving); one variant for all
@triton.jit(do_not_specialize=["stride_tb"])
def _split_kernel(QL, QP, Cache, Tables, Lens, MidO, MidLse,
                  stride_qlb, stride_qlh, stride_qpb, stride_qph, stride_cb, stride_ct, stride_tb,
                  stride_mb, stride_mh, stride_ms, num_heads, scale_log2,
                  KV_LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr,
                  UPCAST: tl.constexpr):
    b, hb, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(Lens + b)
    split_len = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = s * split_len
    end = tl.minimum(start + split_len, ctx)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_heads
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    mask_c, mask_r = offs_c < KV_LORA, offs_r < ROPE
    q = tl.load(QL + b * stride_qlb + offs_h[:, None] * stride_qlh + offs_c[None, :],
                mask=mask_h[:, None] & mask_c[None, :], other=0.0)
    qp = tl.load(QP + b * stride_qpb + offs_h[:, None] * stride_qph + offs_r[None, :],
                 mask=mask_h[:, None] & mask_r[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        page = tl.load(Tables + b * stride_tb + offs_n // PAGE, mask=mask_n, other=0)
        row = page.to(tl.int64) * stride_cb + (offs_n % PAGE) * stride_ct
        kv = tl.load(Cache + row[:, None] + offs_c[None, :], mask=mask_n[:, None] & mask_c[None, :], other=0.0)
        kp = tl.load(Cache + row[:, None] + KV_LORA + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :],
                     other=0.0)
        qk = mma(q.to(kv.dtype), tl.trans(kv), UPCAST) + mma(qp.to(kp.dtype), tl.trans(kp), UPCAST)  # [BLOCK_H, BLOCK_N]
        qk = tl.where(mask_n[None, :], qk * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + mma(p.to(kv.dtype), kv, UPCAST)
        m_i = m_new
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))  # base 2
    mid = MidO + b * stride_mb + offs_h[:, None] * stride_mh + s * stride_ms + offs_c[None, :]
    tl.store(mid, out, mask=mask_h[:, None] & mask_c[None, :])
    tl.store(MidLse + (b * num_heads + offs_h) * NUM_SPLITS + s, lse, mask=mask_h)


@triton.jit
def _merge_kernel(MidO, MidLse, Out, stride_mb, stride_mh, stride_ms, stride_ob, stride_oh, num_heads,
                  KV_LORA: tl.constexpr, BLOCK_C: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_c = tl.arange(0, BLOCK_C)
    mask_s, mask_c = offs_s < NUM_SPLITS, offs_c < KV_LORA
    lse = tl.load(MidLse + (b * num_heads + h) * NUM_SPLITS + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # [BLOCK_S], 0 for empty slices
    o = tl.load(MidO + b * stride_mb + h * stride_mh + offs_s[:, None] * stride_ms + offs_c[None, :],
                mask=mask_s[:, None] & mask_c[None, :], other=0.0)
    total = tl.sum(w, axis=0)
    res = tl.sum(o * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_c, res.to(Out.dtype.element_ty), mask=mask_c)


SPLIT_CHOICES = (1, 2, 4, 8, 16, 32)  # powers of two: the slice count is a compile-time constant


def default_num_splits(batch: int, num_heads: int, num_sms: int = 132, block_h: int = 16) -> int:
    """Enough (sequence, head block, slice) programs to fill the GPU twice over, at most 32 slices,
    rounded up to a power of two so that serving meets six compiled variants, not one per batch size."""
    programs = batch * triton.cdiv(num_heads, block_h)
    return min(32, triton.next_power_of_2(max(1, triton.cdiv(2 * num_sms, programs))))


def mla_decode_attention(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor, softmax_scale: float,
                         num_splits: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """q_latent: [B, H, kv_lora], q_pe: [B, H, rope], kv_cache: [num_blocks, page, kv_lora + rope],
    block_tables: [B, max_blocks] int32, context_lens: [B] int32 -> latent output [B, H, kv_lora].

    Never reads context_lens on the host, so a CUDA graph can replay it with new lengths."""
    check(q_latent.dim() == 3 and q_pe.dim() == 3 and kv_cache.dim() == 3, "q_latent, q_pe, kv_cache must be 3-D")
    batch, num_heads, kv_lora = q_latent.shape
    rope = q_pe.shape[2]
    check(q_pe.shape[:2] == (batch, num_heads), f"q_pe {tuple(q_pe.shape)} does not match q_latent {tuple(q_latent.shape)}")
    check(kv_cache.shape[2] == kv_lora + rope, f"cache rows hold {kv_cache.shape[2]} values, expected {kv_lora + rope}")
    for name, t in (("q_latent", q_latent), ("q_pe", q_pe), ("kv_cache", kv_cache)):
        check_float(name, t)
        check_last_contiguous(name, t)
    check(block_tables.dtype == torch.int32 and context_lens.dtype == torch.int32,
          "block_tables and context_lens must be int32")
    check(block_tables.shape[0] == batch and context_lens.shape == (batch,), "one block table and length per sequence")
    check(block_tables.stride(-1) == 1, "block_tables must be contiguous in its last dimension")
    if num_splits is None:
        num_splits = default_num_splits(batch, num_heads)
    check(num_splits >= 1, "num_splits must be >= 1")
    block_h = min(16, pow2(num_heads))
    mid_o = torch.empty(batch, num_heads, num_splits, kv_lora, dtype=torch.float32, device=q_latent.device)
    mid_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q_latent.device)
    if out is None:
        out = torch.empty(batch, num_heads, kv_lora, dtype=q_latent.dtype, device=q_latent.device)
    if batch == 0:
        return out
    block_c = pow2(kv_lora)
    grid = (batch, triton.cdiv(num_heads, block_h), num_splits)
    _split_kernel[grid](q_latent, q_pe, kv_cache, block_tables, context_lens, mid_o, mid_lse,
                        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
                        kv_cache.stride(0), kv_cache.stride(1), block_tables.stride(0),
                        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), num_heads, softmax_scale * LOG2E,
                        KV_LORA=kv_lora, ROPE=rope, BLOCK_C=block_c, BLOCK_R=pow2(rope), BLOCK_H=block_h,
                        BLOCK_N=32 if block_c <= 512 else 16, PAGE=kv_cache.shape[1], NUM_SPLITS=num_splits,
                        UPCAST=interpreted(kv_cache), num_warps=4, num_stages=2)
    _merge_kernel[(batch, num_heads)](mid_o, mid_lse, out, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
                                      out.stride(0), out.stride(1), num_heads, KV_LORA=kv_lora, BLOCK_C=block_c,
                                      NUM_SPLITS=num_splits, BLOCK_S=pow2(num_splits, 2))
    return out


def reference_mla_decode_attention(q_latent, q_pe, kv_cache, block_tables, context_lens, softmax_scale):
    """Plain PyTorch, float32, one sequence at a time."""
    page, kv_lora = kv_cache.shape[1], q_latent.shape[2]
    outs = []
    for b, n in enumerate(context_lens.tolist()):
        rows = kv_cache[block_tables[b, : -(-n // page)].long()].flatten(0, 1)[:n].float()  # [n, kv_lora + rope]
        scores = (q_latent[b].float() @ rows[:, :kv_lora].T + q_pe[b].float() @ rows[:, kv_lora:].T) * softmax_scale
        outs.append(scores.softmax(-1) @ rows[:, :kv_lora])
    return torch.stack(outs).to(q_latent.dtype)
