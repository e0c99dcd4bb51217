"""DeepSeek-V4's compressor at decode: one token per row into its open window, in one launch.

A compressor pools each window of `ratio` tokens into one entry by a per-channel softmax over the
window's slots (gate logits wgate(x) + ape[slot], values wkv(x)); the open window lives in the block's
`compressor_state` row as online-softmax accumulators (max, sum of exponentials, weighted sum: [3, d]
each; CSA's overlapping compressor keeps two, the open entry `cur` and the next one's series A `nxt`).
The PyTorch path (`Compressor._decode`: `decode_pool`, then the norm and RoPE of the entry, the cache
and state writes) is ~60 small kernels a compressor; this is one program per row: it reads the held
state (the block of t - 1), adds the token, writes the state after it (the block of t), and where t
closes its window writes the entry: RMSNorm(weighted sum / sum) * weight, RoPE on its last `rope`
channels at the window's first position, in the cache's dtype. Rows that close nothing write no entry.

Bytes a row: the token's c and g (width each), the state read and written (3 * width float32 each),
the entry (d); nothing worth splitting: at V4 Flash's shapes one row is ~26 KB.
"""

import torch
import triton
import triton.language as tl

from engine.kernels._util import check, check_last_contiguous, pow2
from engine.layers.compressed_attention import decode_pool, empty_state, pooled, table_entry_slots


@triton.jit
def _add_slot(m, s, w, g, c):
    """merge(accumulator (m, s, w), one slot (g, 1, c)); g is finite, so the new max is too."""
    m_new = tl.maximum(m, g)
    wa = tl.exp(m - m_new)  # 0 for an empty accumulator (m = -inf)
    wb = tl.exp(g - m_new)
    return m_new, s * wa + wb, w * wa + c * wb


@triton.jit
def _token_into(Held, G, C, Ape, idx, mask, held_mask, DIM: tl.constexpr):
    """The held accumulator [3, DIM] at Held (read where held_mask, else empty) with the token's slot
    added, at channels idx."""
    m = tl.load(Held + idx, mask=held_mask, other=float("-inf"))
    s = tl.load(Held + DIM + idx, mask=held_mask, other=0.0)
    w = tl.load(Held + 2 * DIM + idx, mask=held_mask, other=0.0)
    g = tl.load(G + idx, mask=mask, other=0.0).to(tl.float32) + tl.load(Ape + idx, mask=mask, other=0.0)
    c = tl.load(C + idx, mask=mask, other=0.0).to(tl.float32)
    return _add_slot(m, s, w, g, c)


@triton.jit
def _compress_decode_kernel(C, G, Ape, Pos, Tables, State, Cache, NormW, Cos, Sin, stride_cb, stride_gb, stride_tb,
                            stride_sb, stride_kb, stride_kt, stride_cos, offset, eps, DIM: tl.constexpr,
                            BLOCK_D: tl.constexpr, RATIO: tl.constexpr, OVERLAP: tl.constexpr, ROPE: tl.constexpr,
                            PAGE: tl.constexpr):
    b = tl.program_id(0)
    t = tl.load(Pos + b).to(tl.int32)
    closing = (t + 1) % RATIO == 0
    width: tl.constexpr = 2 * DIM if OVERLAP else DIM
    col_b: tl.constexpr = DIM if OVERLAP else 0  # series B: the open entry's own slots
    offs = tl.arange(0, BLOCK_D)
    mask = offs < DIM
    pair = offs ^ 1  # the other channel of each rotary pair: the open entry is also computed there
    before = tl.load(Tables + b * stride_tb + tl.maximum(t - 1, 0) // PAGE).to(tl.int64)
    here = tl.load(Tables + b * stride_tb + t // PAGE).to(tl.int64)
    held = State + before * stride_sb + offset
    held_mask = mask & (offs * 0 + t > 0)  # a sequence's first token holds nothing: empty accumulators
    g_row, c_row, ape = G + b * stride_gb, C + b * stride_cb, Ape + (t % RATIO) * width
    # every load before any store: the state row read may be the row written (same block)
    m, s, w = _token_into(held, g_row + col_b, c_row + col_b, ape + col_b, offs, mask, held_mask, DIM)
    m_p, s_p, w_p = _token_into(held, g_row + col_b, c_row + col_b, ape + col_b, pair, mask, held_mask, DIM)
    if OVERLAP:  # series A of this window: the next entry's first half
        nm, ns, nw = _token_into(held + 3 * DIM, g_row, c_row, ape, offs, mask, held_mask, DIM)
    norm_w = tl.load(NormW + offs, mask=mask, other=0.0)
    norm_wp = tl.load(NormW + pair, mask=mask, other=0.0)
    first = t // RATIO * RATIO  # the window's first position: the entry's rotation
    k = (offs - (DIM - ROPE)) // 2
    rot = mask & (offs >= DIM - ROPE)
    cos = tl.load(Cos + first * stride_cos + k, mask=rot, other=1.0)
    sin = tl.load(Sin + first * stride_cos + k, mask=rot, other=0.0)
    tl.debug_barrier()
    out = State + here * stride_sb + offset
    if OVERLAP:  # closing: (nxt, empty); open: (cur, nxt)
        tl.store(out + offs, tl.where(closing, nm, m), mask=mask)
        tl.store(out + DIM + offs, tl.where(closing, ns, s), mask=mask)
        tl.store(out + 2 * DIM + offs, tl.where(closing, nw, w), mask=mask)
        tl.store(out + 3 * DIM + offs, tl.where(closing, float("-inf"), nm), mask=mask)
        tl.store(out + 4 * DIM + offs, tl.where(closing, 0.0, ns), mask=mask)
        tl.store(out + 5 * DIM + offs, tl.where(closing, 0.0, nw), mask=mask)
    else:  # closing: empty; open: cur
        tl.store(out + offs, tl.where(closing, float("-inf"), m), mask=mask)
        tl.store(out + DIM + offs, tl.where(closing, 0.0, s), mask=mask)
        tl.store(out + 2 * DIM + offs, tl.where(closing, 0.0, w), mask=mask)
    if closing:
        x = w / s
        x_p = w_p / s_p
        inv = tl.rsqrt(tl.sum(tl.where(mask, x * x, 0.0), axis=0) / DIM + eps)
        y = norm_w * (x * inv)
        y_p = norm_wp * (x_p * inv)
        # interleaved pairs (2i, 2i + 1): even = y cos - y' sin, odd = y cos + y' sin
        entry = y * cos + tl.where(offs % 2 == 0, -y_p, y_p) * sin
        e = t // RATIO
        page = tl.load(Tables + b * stride_tb + (e * RATIO) // PAGE).to(tl.int64)
        row = Cache + page * stride_kb + (e % (PAGE // RATIO)) * stride_kt
        tl.store(row + offs, entry.to(Cache.dtype.element_ty), mask=mask)


def compress_decode(c: torch.Tensor, g: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor,
                    block_tables: torch.Tensor, state: torch.Tensor, offset: int, cache: torch.Tensor,
                    norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, ratio: int,
                    overlap: bool) -> None:
    """c, g [B, width] (wkv(x), wgate(x) of a token a row; width 2d with overlap, else d); ape [ratio, width]
    float32; positions [B]; block_tables [B, width_t] int32; state [blocks, 1, row] float32 (this
    compressor's accumulators at state[:, 0, offset : offset + 3 * width]); cache [blocks, page / ratio, d];
    norm_weight [d] float32; cos, sin [max_position, rope / 2] float32. Updates state and cache in place."""
    check(c.dim() == 2 and g.shape == c.shape and c.stride(-1) == 1 and g.stride(-1) == 1,
          "c and g must be [B, width], contiguous in their last dimension")
    batch, width = c.shape
    d = cache.shape[2]
    check(width == (2 * d if overlap else d), f"width {width} does not match d {d} (overlap {overlap})")
    check(ape.shape == (ratio, width) and ape.dtype == torch.float32 and ape.is_contiguous(),
          "ape must be float32 [ratio, width], contiguous")
    check(state.dtype == torch.float32 and state.dim() == 3 and state.stride(-1) == 1, "state must be float32 [blocks, 1, row]")
    check(offset + 3 * width <= state.shape[2], "the state row is too short for this compressor")
    check(cache.dim() == 3 and cache.shape[0] == state.shape[0], "cache must be [blocks, page / ratio, d]")
    check_last_contiguous("cache", cache)
    check(norm_weight.shape == (d,) and norm_weight.dtype == torch.float32, "norm_weight must be float32 [d]")
    rope = 2 * cos.shape[1]
    check(d % 2 == 0 and rope <= d and cos.shape == sin.shape and cos.dtype == torch.float32 and cos.is_contiguous()
          and sin.is_contiguous(), "cos and sin must be float32 [max_position, rope / 2], contiguous, rope <= d")
    check(block_tables.dtype == torch.int32 and block_tables.shape[0] == batch and block_tables.stride(-1) == 1,
          "block_tables must be int32 [B, width], contiguous in its last dimension")
    check(positions.shape == (batch,) and not positions.is_floating_point(), "positions must be integer [B]")
    if batch == 0:
        return
    _compress_decode_kernel[(batch,)](c, g, ape, positions, block_tables, state, cache, norm_weight, cos, sin,
                                      c.stride(0), g.stride(0), block_tables.stride(0), state.stride(0),
                                      cache.stride(0), cache.stride(1), cos.stride(0), offset, eps, DIM=d,
                                      BLOCK_D=pow2(d), RATIO=ratio, OVERLAP=overlap, ROPE=rope,
                                      PAGE=cache.shape[1] * ratio, num_warps=4)


def reference_compress_decode(c, g, ape, positions, block_tables, state, offset, cache, norm_weight, eps, cos, sin,
                              ratio, overlap) -> None:
    """The model's PyTorch path (`decode_pool`, the norm, RoPE at the window's first position), float32;
    only closing rows write an entry."""
    from engine.layers.compressed_attention import WindowPooler

    d = cache.shape[2]
    pooler = WindowPooler(d, ratio, overlap)
    width, bs = pooler.state_width, cache.shape[1] * ratio
    t, tables = positions.long(), block_tables.long()
    g = g.float() + ape[t % ratio]
    before = tables.gather(1, ((t - 1).clamp(min=0) // bs)[:, None])[:, 0]
    held = torch.where((t > 0)[:, None], state[before, 0, offset: offset + width], empty_state(width, d, c.device))
    cur, closing, after = decode_pool(pooler, c.float(), g, t, held)
    x = pooled(cur)
    y = norm_weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    first = t // ratio * ratio
    co, si = cos[first], sin[first]
    rope = y[:, d - 2 * cos.shape[1]:]
    x1, x2 = rope[:, 0::2], rope[:, 1::2]
    y = torch.cat([y[:, : d - rope.shape[1]], torch.stack((x1 * co - x2 * si, x2 * co + x1 * si), -1).flatten(1)], 1)
    state[tables.gather(1, (t // bs)[:, None])[:, 0], 0, offset: offset + width] = after
    slots = table_entry_slots(tables, (t // ratio)[:, None], ratio, bs)[:, 0]
    cache.view(-1, d)[slots[closing]] = y[closing].to(cache.dtype)
