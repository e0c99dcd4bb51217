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

A verification runs a sequence's last token and its drafts as consecutive rows (`query_index` 0, 1, ...):
row j must start from the state row j - 1 leaves, so the program at a sequence's first row folds its
rows one after another (each reads the state row the one before wrote, behind a barrier) and the
programs of its other rows do nothing. Each row's state after its token can also be kept (`kept`):
the candidates a rollback after the verification picks from (`Compressor.candidates`).

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
def _fold_row(C, G, Ape, Pos, Tables, State, Cache, NormW, Cos, Sin, KeptStates, KeptBlocks, b, stride_cb, stride_gb,
              stride_tb, stride_sb, stride_kb, stride_kt, stride_cos, stride_ks, offset, eps, DIM: tl.constexpr,
              BLOCK_D: tl.constexpr, RATIO: tl.constexpr, OVERLAP: tl.constexpr, ROPE: tl.constexpr,
              PAGE: tl.constexpr, KEEP: tl.constexpr):
    """Row b's token into the state its block of t - 1 holds: the state after it to the block of t (and,
    KEEP, to row b of the kept states), the entry it closes to the cache."""
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
        _store_state(out, tl.where(closing, nm, m), tl.where(closing, ns, s), tl.where(closing, nw, w), offs, mask, DIM)
        _store_state(out + 3 * DIM, tl.where(closing, float("-inf"), nm), tl.where(closing, 0.0, ns),
                     tl.where(closing, 0.0, nw), offs, mask, DIM)
        if KEEP:
            kept = KeptStates + b * stride_ks
            _store_state(kept, tl.where(closing, nm, m), tl.where(closing, ns, s), tl.where(closing, nw, w), offs,
                         mask, DIM)
            _store_state(kept + 3 * DIM, tl.where(closing, float("-inf"), nm), tl.where(closing, 0.0, ns),
                         tl.where(closing, 0.0, nw), offs, mask, DIM)
    else:  # closing: empty; open: cur
        _store_state(out, tl.where(closing, float("-inf"), m), tl.where(closing, 0.0, s), tl.where(closing, 0.0, w),
                     offs, mask, DIM)
        if KEEP:
            _store_state(KeptStates + b * stride_ks, tl.where(closing, float("-inf"), m), tl.where(closing, 0.0, s),
                         tl.where(closing, 0.0, w), offs, mask, DIM)
    if KEEP:
        tl.store(KeptBlocks + b, here)
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


@triton.jit
def _store_state(Out, m, s, w, offs, mask, DIM: tl.constexpr):
    tl.store(Out + offs, m, mask=mask)
    tl.store(Out + DIM + offs, s, mask=mask)
    tl.store(Out + 2 * DIM + offs, w, mask=mask)


@triton.jit(do_not_specialize=["batch"])
def _compress_decode_kernel(C, G, Ape, Pos, QueryIndex, Tables, State, Cache, NormW, Cos, Sin, KeptStates, KeptBlocks,
                            batch, stride_cb, stride_gb, stride_tb, stride_sb, stride_kb, stride_kt, stride_cos,
                            stride_ks, offset, eps, DIM: tl.constexpr, BLOCK_D: tl.constexpr, RATIO: tl.constexpr,
                            OVERLAP: tl.constexpr, ROPE: tl.constexpr, PAGE: tl.constexpr, ROWS: tl.constexpr,
                            KEEP: tl.constexpr):
    # a program per row; with ROWS > 1 the one at a sequence's first row (query index 0) folds its next
    # ROWS - 1 rows too, in order, and the others do nothing
    b = tl.program_id(0)
    lead = True
    if ROWS > 1:
        lead = tl.load(QueryIndex + b) == 0
    for r in tl.static_range(ROWS):
        row = b + r
        active = lead
        if r > 0:
            active = lead & (row < batch)
            active = active & (tl.load(QueryIndex + row, mask=row < batch, other=0) == r)
        if active:
            _fold_row(C, G, Ape, Pos, Tables, State, Cache, NormW, Cos, Sin, KeptStates, KeptBlocks, row, stride_cb,
                      stride_gb, stride_tb, stride_sb, stride_kb, stride_kt, stride_cos, stride_ks, offset, eps, DIM,
                      BLOCK_D, RATIO, OVERLAP, ROPE, PAGE, KEEP)
        if ROWS > 1:
            tl.debug_barrier()  # the next row reads the state row this one wrote


def compress_decode(c: torch.Tensor, g: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor,
                    block_tables: torch.Tensor, state: torch.Tensor, offset: int, cache: torch.Tensor,
                    norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, ratio: int,
                    overlap: bool, query_index: torch.Tensor | None = None, max_rows: int = 1,
                    kept: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """c, g [B, width] (wkv(x), wgate(x) of a token a row; width 2d with overlap, else d); ape [ratio, width]
    float32; positions [B]; block_tables [B, width_t] int32; state [blocks, 1, row] float32 (this
    compressor's accumulators at state[:, 0, offset : offset + 3 * width]); cache [blocks, page / ratio, d];
    norm_weight [d] float32; cos, sin [max_position, rope / 2] float32. Updates state and cache in place.
    query_index [B]: each row's index among its sequence's consecutive rows (at most max_rows of them),
    folded in that order (None: a sequence a row); kept: (states [>= B, 3 * width] float32, blocks [>= B]
    int64) that get each row's state after its token and the block it belongs to."""
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
    rows = max_rows if query_index is not None else 1
    if query_index is not None:
        check(query_index.shape == (batch,) and not query_index.is_floating_point() and rows >= 1,
              "query_index must be integer [B], with max_rows >= 1")
    if kept is not None:
        states, blocks = kept
        check(states.dtype == torch.float32 and states.dim() == 2 and states.shape[0] >= batch
              and states.shape[1] == 3 * width and states.stride(1) == 1 and blocks.dtype == torch.int64
              and blocks.shape[0] >= batch, "kept must be (float32 [>= B, 3 * width], int64 [>= B])")
    if batch == 0:
        return
    states, blocks = kept if kept is not None else (state, positions)  # unread without KEEP
    _compress_decode_kernel[(batch,)](c, g, ape, positions, query_index if query_index is not None else positions,
                                      block_tables, state, cache, norm_weight, cos, sin, states, blocks, batch,
                                      c.stride(0), g.stride(0), block_tables.stride(0), state.stride(0),
                                      cache.stride(0), cache.stride(1), cos.stride(0), states.stride(0), offset, eps,
                                      DIM=d, BLOCK_D=pow2(d), RATIO=ratio, OVERLAP=overlap, ROPE=rope,
                                      PAGE=cache.shape[1] * ratio, ROWS=rows, KEEP=kept is not None, num_warps=4)


def reference_compress_decode(c, g, ape, positions, block_tables, state, offset, cache, norm_weight, eps, cos, sin,
                              ratio, overlap, query_index=None, max_rows=1, kept=None) -> None:
    """The model's PyTorch path (`decode_pool`, the norm, RoPE at the window's first position), float32;
    only closing rows write an entry. With query_index, every sequence's row j after all rows j - 1."""
    if query_index is None:
        query_index = torch.zeros_like(positions)
    for j in range(max_rows):
        rows = (query_index == j).nonzero()[:, 0]
        after, here = _reference_rows(c[rows], g[rows], ape, positions[rows], block_tables[rows], state, offset, cache,
                                      norm_weight, eps, cos, sin, ratio, overlap)
        if kept is not None:
            kept[0][rows], kept[1][rows] = after, here


def _reference_rows(c, g, ape, positions, block_tables, state, offset, cache, norm_weight, eps, cos, sin, ratio,
                    overlap) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence a row -> (each row's state after its token, the block it is written to)."""
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
    here = tables.gather(1, (t // bs)[:, None])[:, 0]
    state[here, 0, offset: offset + width] = after
    slots = table_entry_slots(tables, (t // ratio)[:, None], ratio, bs)[:, 0]
    cache.view(-1, d)[slots[closing]] = y[closing].to(cache.dtype)
    return after, here
