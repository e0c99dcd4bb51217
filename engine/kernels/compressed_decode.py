"""DeepSeek-V4 decode attention over its two paged pools, and the CSA indexer's decode scores.

A V4 layer's query (one token per row at position t) attends to one shared K = V head of head_dim:
first the sliding window's raw-token rows (positions t - window + 1 .. t, those >= 0; the `window`
cache, a row per token), then compressed entries (the `compressed` cache, a row per `ratio` tokens;
entry w is visible iff w < (t + 1) // ratio): every visible entry in HCA layers, the indexer's top-k
picks in CSA layers (all of a row's entries while it has no more than k). One softmax over both with a learned sink per head: one more logit in the
denominator, with no value.

`dual_pool_decode` reads only the rows a query sees, by its own counts on the device (never
max_model_len's padding): row i of its key list is window position t + 1 - n_win + i for i < n_win,
else entry picks[i - n_win] (or i - n_win without picks). The window lives in pages of its own, fewer
than the blocks (engine.kv_pool): a window row's block, from the table, names its page through
`window_pages[block]` (one more int load per row; the entries are paged by the blocks themselves). The grid is (head blocks, slices, rows) as
in `mla_decode`: at one stream the key list (128 + 512 rows at most at V4 Flash's shapes, 640 KB)
is split over slices so that more than four programs read it, each slice keeps an online softmax,
and a merge kernel adds the sink and combines them. No host reads: a CUDA graph replays it.

`indexer_decode_scores` scores the visible entries of the indexer's keys only, a tile of entries a
program (tiles past a row's count store -inf and read nothing), for torch.topk on the device:
score[w] = sum_h weight[h] * ReLU(q[h] . key[w]) * scale.

Bytes: a row's visible keys, head_dim values each (the indexer: n_vis * index_head_dim); FLOPs:
4 * heads * keys * head_dim (the indexer: 2 * index_heads * n_vis * index_head_dim).
"""

import torch
import triton
import triton.language as tl

from engine.kernels._util import check, check_float, check_last_contiguous, interpreted, mma, pow2
from engine.kernels.mla_decode import num_sms

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)  # what a kernel may read of a module global
MAX_SPLITS = 64


@triton.jit
def _attend_rows(q, keys, mask_n, m_i, l_i, acc, scale_log2, UPCAST: tl.constexpr):
    """Online softmax over one tile of K = V rows [BLOCK_N, BLOCK_D] for the program's heads."""
    qk = mma(q.to(keys.dtype), tl.trans(keys), UPCAST)  # [BLOCK_H, BLOCK_N]
    qk = tl.where(mask_n[None, :], qk * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + mma(p.to(keys.dtype), keys, UPCAST)
    return m_new, l_i, acc


# the table's width, the slice count and the pick count follow the batch and max_model_len: no
# compiled variant of their own
@triton.jit(do_not_specialize=["stride_tb", "stride_pb", "num_splits", "num_picks"])
def _dual_pool_kernel(Q, Window, Entries, Tables, WinPages, Pos, Picks, Sinks, MidO, MidLse, Out,
                      stride_qb, stride_qh, stride_wb, stride_wt, stride_eb, stride_et, stride_tb, stride_pb,
                      stride_mb, stride_mh, stride_ms, stride_ob, stride_oh, num_heads, num_splits, num_picks,
                      scale_log2, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                      BLOCK_N: tl.constexpr, PAGE: tl.constexpr, WINDOW: tl.constexpr, RATIO: tl.constexpr,
                      PICKED: tl.constexpr, DIRECT: tl.constexpr, PAGED: tl.constexpr, UPCAST: tl.constexpr):
    hb, s, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = tl.load(Pos + b).to(tl.int32)
    n_win = tl.minimum(t + 1, WINDOW)
    first = t + 1 - n_win  # the window's first position
    if RATIO > 0:
        n_vis = (t + 1) // RATIO
        n_ent = tl.minimum(n_vis, num_picks) if PICKED else n_vis
    else:
        n_vis = t * 0
        n_ent = t * 0
    total = n_win + n_ent
    # this slice of the key list: whole tiles, at least one
    chunk = tl.maximum(tl.cdiv(tl.cdiv(total, num_splits), BLOCK_N) * BLOCK_N, BLOCK_N)
    start = s * chunk
    end = tl.minimum(start + chunk, total)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_heads
    read_h = offs_h < tl.where(start < end, num_heads, 0)  # an empty slice reads nothing
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(Q + b * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=read_h[:, None] & mask_d[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    win_end = tl.minimum(end, n_win)
    for n0 in range(start, win_end, BLOCK_N):  # raw-token rows of the window
        i = n0 + offs_n
        mask_n = i < win_end
        pos = first + i
        page = tl.load(Tables + b * stride_tb + pos // PAGE, mask=mask_n, other=0)
        if PAGED:  # the block's window page
            page = tl.load(WinPages + page, mask=mask_n, other=0)
        row = page.to(tl.int64) * stride_wb + (pos % PAGE) * stride_wt
        keys = tl.load(Window + row[:, None] + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        m_i, l_i, acc = _attend_rows(q, keys, mask_n, m_i, l_i, acc, scale_log2, UPCAST)
    if RATIO > 0:
        for n0 in range(tl.maximum(start, n_win), end, BLOCK_N):  # compressed entries
            j = n0 - n_win + offs_n
            mask_n = (n0 + offs_n) < end
            if PICKED:  # k picks of more than k visible entries are all visible; else every entry is picked
                many = (j * 0 + n_vis) > num_picks
                w = tl.load(Picks + b * stride_pb + j, mask=mask_n & many, other=0).to(tl.int32)
                w = tl.where(many, w, j)
                mask_n = mask_n & (w >= 0) & (w < n_vis)
            else:
                w = j
            page = tl.load(Tables + b * stride_tb + (w * RATIO) // PAGE, mask=mask_n, other=0).to(tl.int64)
            row = page * stride_eb + (w % (PAGE // RATIO)) * stride_et
            keys = tl.load(Entries + row[:, None] + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :],
                           other=0.0)
            m_i, l_i, acc = _attend_rows(q, keys, mask_n, m_i, l_i, acc, scale_log2, UPCAST)
    if DIRECT:  # the only slice: add the sink, normalize, write the output
        sink = tl.load(Sinks + offs_h, mask=mask_h, other=0.0) * _LOG2E
        m_tot = tl.maximum(m_i, sink)
        kept = tl.exp2(m_i - m_tot)
        denom = l_i * kept + tl.exp2(sink - m_tot)
        out = acc * (kept / denom)[:, None]
        tl.store(Out + b * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :], out.to(Out.dtype.element_ty),
                 mask=mask_h[:, None] & mask_d[None, :])
    else:
        has = l_i > 0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))  # base 2
        mid = MidO + b * stride_mb + offs_h[:, None] * stride_mh + s * stride_ms + offs_d[None, :]
        tl.store(mid, out, mask=has[:, None] & mask_h[:, None] & mask_d[None, :])
        tl.store(MidLse + (b * num_heads + offs_h) * num_splits + s, lse, mask=mask_h)


@triton.jit(do_not_specialize=["num_splits"])
def _sink_merge_kernel(MidO, MidLse, Sinks, Out, stride_mb, stride_mh, stride_ms, stride_ob, stride_oh, num_heads,
                       num_splits, HEAD_DIM: tl.constexpr, BLOCK_CM: tl.constexpr, BLOCK_S: tl.constexpr):
    # one program per (row, head, BLOCK_CM columns): out = sum_s 2^lse_s o_s / (sum_s 2^lse_s + 2^sink)
    b, h, cb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_s = tl.arange(0, BLOCK_S)
    offs_c = cb * BLOCK_CM + tl.arange(0, BLOCK_CM)
    mask_c = offs_c < HEAD_DIM
    lse = tl.load(MidLse + (b * num_heads + h) * num_splits + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    live = lse > float("-inf")  # slices past the key list wrote no partial output
    sink = tl.load(Sinks + h) * _LOG2E
    m = tl.maximum(tl.max(lse, axis=0), sink)
    w = tl.where(live, tl.exp2(lse - m), 0.0)
    o = tl.load(MidO + b * stride_mb + h * stride_mh + offs_s[:, None] * stride_ms + offs_c[None, :],
                mask=live[:, None] & mask_c[None, :], other=0.0)
    res = tl.sum(o * w[:, None], axis=0) / (tl.sum(w, axis=0) + tl.exp2(sink - m))
    tl.store(Out + b * stride_ob + h * stride_oh + offs_c, res.to(Out.dtype.element_ty), mask=mask_c)


def default_num_splits(batch: int, num_heads: int, block_h: int, sms: int = 132) -> int:
    """Slices per row so that (row, head block, slice) programs cover every SM once, a power of two (a
    merge variant each) at most MAX_SPLITS; the programs size their slices from the row's counts."""
    fill = max(1, sms // (batch * triton.cdiv(num_heads, block_h)))
    return min(MAX_SPLITS, 1 << (fill.bit_length() - 1))


def _tiles(block_d: int) -> dict:
    """16 heads a program (the M of its products; a [16, 512] float32 accumulator is 64 registers a
    thread over 4 warps), 32 rows a tile (32 KB of 512-wide bf16 rows): slices of 32 rows, so a 640-row
    key list spreads over 80 programs at one stream."""
    return dict(block_h=16, block_n=32 if block_d >= 256 else 16, num_warps=4, num_stages=2)


def dual_pool_decode(q: torch.Tensor, window_cache: torch.Tensor, entry_cache: torch.Tensor | None,
                     block_tables: torch.Tensor, positions: torch.Tensor, sinks: torch.Tensor, softmax_scale: float,
                     window: int, ratio: int, picks: torch.Tensor | None = None, num_splits: int | None = None,
                     tiles: dict | None = None, window_pages: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D]; window_cache [pages, page, D] (a row per token); entry_cache [blocks, page / ratio, D]
    (a row per `ratio` tokens; None with ratio 0: window only); block_tables [B, width] int32 (the
    entries page by them, the window through window_pages [blocks] int32, each block's window page; None:
    the window pages by the blocks too); positions [B] (each row's query position t); sinks [H] float32; picks [B, k]
    int (CSA: a top-k of -inf-masked scores, in any order: a row with more than k visible entries reads
    its k picks, all visible then; one with k or fewer reads every visible entry without them) or None
    (every visible entry) -> [B, H, D] in q's dtype.

    num_splits: slices per row (default from the batch and the SM count); tiles: override of `_tiles`
    (block_h, block_n, num_warps, num_stages), for benchmarks and tests."""
    check(q.dim() == 3 and window_cache.dim() == 3, "q and window_cache must be 3-D")
    batch, num_heads, dim = q.shape
    check(window_cache.shape[2] == dim, f"window rows hold {window_cache.shape[2]} values, q {dim}")
    check(window >= 1, "window must be >= 1")
    page = window_cache.shape[1]
    if ratio:
        check(entry_cache is not None and entry_cache.dim() == 3 and entry_cache.shape[2] == dim,
              "a compressed layer needs entry_cache [blocks, page / ratio, D]")
        check(page % ratio == 0 and entry_cache.shape[1] == page // ratio,
              f"entry pages hold page / ratio = {page // max(ratio, 1)} rows, got {entry_cache.shape[1]}")
        check_float("entry_cache", entry_cache)
        check_last_contiguous("entry_cache", entry_cache)
        check(entry_cache.dtype == window_cache.dtype, "both pools must share a dtype")
    else:
        check(picks is None, "picks need compressed entries (ratio > 0)")
        entry_cache = window_cache  # never read
    for name, t in (("q", q), ("window_cache", window_cache)):
        check_float(name, t)
        check_last_contiguous(name, t)
    check(block_tables.dtype == torch.int32 and block_tables.shape[0] == batch and block_tables.stride(-1) == 1,
          "block_tables must be int32 [B, width], contiguous in its last dimension")
    check(positions.shape == (batch,) and not positions.is_floating_point(), "positions must be integer [B]")
    check(sinks.shape == (num_heads,) and sinks.dtype == torch.float32, "sinks must be float32 [H]")
    check(window_pages is None or (window_pages.dtype == torch.int32 and window_pages.dim() == 1
                                   and window_pages.stride(0) == 1), "window_pages must be int32 [blocks], contiguous")
    if picks is not None:
        check(picks.dim() == 2 and picks.shape[0] == batch and picks.stride(-1) == 1 and not picks.is_floating_point(),
              "picks must be integer [B, k], contiguous in its last dimension")
    cfg = dict(_tiles(pow2(dim)), **(tiles or {}))
    block_h = cfg["block_h"]
    if num_splits is None:
        num_splits = default_num_splits(batch, num_heads, block_h, num_sms(q.device))
    check(num_splits >= 1, "num_splits must be >= 1")
    out = torch.empty_like(q)
    if batch == 0:
        return out
    direct = num_splits == 1
    shape = (0,) * 4 if direct else (batch, num_heads, num_splits, dim)
    mid_o = torch.empty(shape, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(shape[:3], dtype=torch.float32, device=q.device)
    picks_arg = picks if picks is not None else positions
    grid = (triton.cdiv(num_heads, block_h), num_splits, batch)
    pages_arg = window_pages if window_pages is not None else block_tables
    _dual_pool_kernel[grid](q, window_cache, entry_cache, block_tables, pages_arg, positions, picks_arg, sinks, mid_o,
                            mid_lse, out,
                            q.stride(0), q.stride(1), window_cache.stride(0), window_cache.stride(1),
                            entry_cache.stride(0), entry_cache.stride(1), block_tables.stride(0),
                            picks.stride(0) if picks is not None else 0,
                            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), out.stride(0), out.stride(1),
                            num_heads, num_splits, picks.shape[1] if picks is not None else 0,
                            softmax_scale * LOG2E, HEAD_DIM=dim, BLOCK_D=pow2(dim), BLOCK_H=block_h,
                            BLOCK_N=cfg["block_n"], PAGE=page, WINDOW=window, RATIO=ratio, PICKED=picks is not None,
                            DIRECT=direct, PAGED=window_pages is not None, UPCAST=interpreted(q),
                            num_warps=cfg["num_warps"],
                            num_stages=cfg["num_stages"])
    if not direct:
        block_s = pow2(num_splits, 2)
        block_cm = max(16, min(pow2(dim), 2048 // block_s))
        _sink_merge_kernel[(batch, num_heads, triton.cdiv(dim, block_cm))](
            mid_o, mid_lse, sinks, out, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), out.stride(0), out.stride(1),
            num_heads, num_splits, HEAD_DIM=dim, BLOCK_CM=block_cm, BLOCK_S=block_s)
    return out


@triton.jit(do_not_specialize=["stride_tb", "num_entries"])
def _indexer_kernel(Q, W, Keys, Tables, Pos, Scores, stride_qb, stride_qh, stride_wb, stride_kb, stride_kt,
                    stride_tb, stride_sb, num_heads, num_entries, scale, HEAD_DIM: tl.constexpr, BLOCK_C: tl.constexpr,
                    BLOCK_IH: tl.constexpr, BLOCK_E: tl.constexpr, PAGE: tl.constexpr, RATIO: tl.constexpr,
                    UPCAST: tl.constexpr):
    eb, b = tl.program_id(0), tl.program_id(1)
    n_vis = (tl.load(Pos + b).to(tl.int32) + 1) // RATIO
    offs_e = eb * BLOCK_E + tl.arange(0, BLOCK_E)
    vis = offs_e < n_vis
    if eb * BLOCK_E < n_vis:
        offs_h = tl.arange(0, BLOCK_IH)
        offs_c = tl.arange(0, BLOCK_C)
        mask_h, mask_c = offs_h < num_heads, offs_c < HEAD_DIM
        q = tl.load(Q + b * stride_qb + offs_h[:, None] * stride_qh + offs_c[None, :],
                    mask=mask_h[:, None] & mask_c[None, :], other=0.0)
        w = tl.load(W + b * stride_wb + offs_h, mask=mask_h, other=0.0)  # heads past the count weigh 0
        page = tl.load(Tables + b * stride_tb + (offs_e * RATIO) // PAGE, mask=vis, other=0).to(tl.int64)
        row = page * stride_kb + (offs_e % (PAGE // RATIO)) * stride_kt
        keys = tl.load(Keys + row[:, None] + offs_c[None, :], mask=vis[:, None] & mask_c[None, :], other=0.0)
        dots = mma(q.to(keys.dtype), tl.trans(keys), UPCAST)  # [BLOCK_IH, BLOCK_E]
        score = tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0) * scale
        score = tl.where(vis, score, float("-inf"))
    else:  # past the row's entries: nothing to read
        score = tl.full([BLOCK_E], float("-inf"), tl.float32)
    tl.store(Scores + b * stride_sb + offs_e, score, mask=offs_e < num_entries)


def indexer_decode_scores(q: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor, block_tables: torch.Tensor,
                          positions: torch.Tensor, ratio: int, num_entries: int, scale: float) -> torch.Tensor:
    """q [B, h, c] (one query a row), weights [B, h] float32, key_cache [blocks, page / ratio, c] (a key
    per `ratio` tokens), block_tables [B, width] int32, positions [B] -> scores [B, num_entries] float32:
    sum_h weights[h] * ReLU(q[h] . key[w]) * scale for the row's visible entries w < (t + 1) // ratio,
    -inf past them."""
    check(q.dim() == 3 and key_cache.dim() == 3 and weights.dim() == 2, "q, key_cache must be 3-D, weights 2-D")
    batch, heads, dim = q.shape
    check(key_cache.shape[2] == dim, f"key rows hold {key_cache.shape[2]} values, q {dim}")
    check(ratio >= 1, "ratio must be >= 1")
    check(weights.shape == (batch, heads) and weights.dtype == torch.float32, "weights must be float32 [B, h]")
    for name, t in (("q", q), ("key_cache", key_cache)):
        check_float(name, t)
        check_last_contiguous(name, t)
    check(block_tables.dtype == torch.int32 and block_tables.shape[0] == batch and block_tables.stride(-1) == 1,
          "block_tables must be int32 [B, width], contiguous in its last dimension")
    check(positions.shape == (batch,) and not positions.is_floating_point(), "positions must be integer [B]")
    scores = torch.empty(batch, num_entries, dtype=torch.float32, device=q.device)
    if batch == 0 or num_entries == 0:
        return scores
    page = key_cache.shape[1] * ratio
    block_e = 64 if dim >= 64 else 16
    _indexer_kernel[(triton.cdiv(num_entries, block_e), batch)](
        q, weights, key_cache, block_tables, positions, scores, q.stride(0), q.stride(1), weights.stride(0),
        key_cache.stride(0), key_cache.stride(1), block_tables.stride(0), scores.stride(0), heads, num_entries, scale,
        HEAD_DIM=dim, BLOCK_C=pow2(dim), BLOCK_IH=pow2(heads), BLOCK_E=block_e, PAGE=page, RATIO=ratio,
        UPCAST=interpreted(q), num_warps=4)
    return scores


# -- plain PyTorch references: each row's keys gathered by its counts, float32 --------------------------
def _rows(cache: torch.Tensor, table: torch.Tensor, index: torch.Tensor, ratio: int) -> torch.Tensor:
    """Rows [n, D] of a cache paged by `table` holding a row per `ratio` tokens, at row indices `index`."""
    per_page = cache.shape[1]
    page = cache.shape[1] * ratio
    return cache[table[index * ratio // page].long(), index % per_page]


def reference_dual_pool_decode(q, window_cache, entry_cache, block_tables, positions, sinks, softmax_scale, window,
                               ratio, picks=None, window_pages=None):
    """One row at a time: its window rows (through window_pages where given) and its entries (picks'
    visible ones, or all), softmax with the sink, float32 -> [B, H, D] in q's dtype."""
    outs = []
    for b, t in enumerate(positions.tolist()):
        first = max(0, t - window + 1)
        table = block_tables[b] if window_pages is None else window_pages[block_tables[b].long()]
        keys = [_rows(window_cache, table, torch.arange(first, t + 1, device=q.device), 1)]
        if ratio:
            n_vis = (t + 1) // ratio
            if picks is None:
                w = torch.arange(n_vis, device=q.device)
            elif n_vis > picks.shape[1]:  # k of them, all visible
                w = picks[b]
            else:  # every visible entry is among the picks
                w = torch.arange(n_vis, device=q.device)
            keys.append(_rows(entry_cache, block_tables[b], w.long(), ratio))
        kv = torch.cat(keys).float()  # [n, D]
        logits = torch.cat([q[b].float() @ kv.T * softmax_scale, sinks.float()[:, None]], 1)
        outs.append(logits.softmax(-1)[:, :-1] @ kv)
    return torch.stack(outs).to(q.dtype)


def reference_indexer_decode_scores(q, weights, key_cache, block_tables, positions, ratio, num_entries, scale):
    """-> [B, num_entries] float32, -inf past each row's visible entries."""
    scores = torch.full((q.shape[0], num_entries), float("-inf"), dtype=torch.float32, device=q.device)
    for b, t in enumerate(positions.tolist()):
        n_vis = (t + 1) // ratio
        keys = _rows(key_cache, block_tables[b], torch.arange(n_vis, device=q.device), ratio).float()
        scores[b, :n_vis] = (torch.relu(q[b].float() @ keys.T) * weights[b, :, None]).sum(0) * scale
    return scores
