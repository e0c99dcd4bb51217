"""DeepSeek-V4's mHC site in one kernel: the streams' RMS norm, the projection `fn @ flat`, pre / post /
comb (Sinkhorn-Knopp in registers) and the collapse `sum_i pre_i * stream_i` into the sublayer's input.

The plain-PyTorch path (`engine.models.deepseek_v4.hc_weights`, then the collapse in `Block._site`) is
the reference; at one token it is ~80 tiny kernels (20 normalizations of a 4 x 4 matrix), this is one.

A site reads fn [(2 + n) n, n hidden] float32 (1.5 MB at V4 Flash's n = 4, hidden 4096) and, per token,
its streams (32 KB bf16); its FLOPs (2 (2 + n) n n hidden a token) are nothing. At decode the time is
fn's bytes, so the reduction over K = n hidden is split over SPLITS programs per tile of tokens: each
stores its partial sums (the projection and the sum of squares), takes a ticket, and the tile's last
program to finish sums the partials in a fixed order (deterministic), then normalizes, runs Sinkhorn and
collapses. The tickets are an int32 buffer the caller owns, zero at first; the last program sets its
tile's ticket back to zero, so a CUDA graph replays the kernel as is.

Rounding: fn @ (x rstd) is computed as (fn @ x) rstd, all float32 (the products in full float32, not
TF32), so the kernel meets the reference within float32 rounding, not bit for bit.
"""

import torch
import triton
import triton.language as tl

from engine.kernels._util import check, check_float, interpreted, mma


@triton.jit
def _hc_finalize(H, Base, Scale, X, Post, Comb, part, rows, row_ok, num_tokens, hidden, iters, eps, norm_eps,
                 N: tl.constexpr, MIX: tl.constexpr, SPLITS: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """The tile's partials [SPLITS, BLOCK_T, MIX] at `part` -> post, comb and the collapsed input x."""
    s = tl.arange(0, SPLITS)
    t = tl.arange(0, BLOCK_T)
    i = tl.arange(0, N)
    # partial columns: pre [0, N), post [N, 2N), comb [2N, 2N + N*N) row-major, sum of squares at (2+N)N
    p2 = part + s[:, None] * (BLOCK_T * MIX) + t[None, :] * MIX  # [SPLITS, BLOCK_T]
    ok2 = row_ok[None, :]
    sq = tl.sum(tl.load(p2 + (2 + N) * N, mask=ok2, other=0.0, cache_modifier=".cg"), axis=0)  # [BLOCK_T]
    pre = tl.sum(tl.load(p2[:, :, None] + i[None, None, :], mask=ok2[:, :, None], other=0.0,
                         cache_modifier=".cg"), axis=0)  # [BLOCK_T, N]
    post = tl.sum(tl.load(p2[:, :, None] + N + i[None, None, :], mask=ok2[:, :, None], other=0.0,
                          cache_modifier=".cg"), axis=0)
    ij = i[:, None] * N + i[None, :]  # [N, N]
    comb = tl.sum(tl.load(p2[:, :, None, None] + 2 * N + ij[None, None, :, :], mask=ok2[:, :, None, None],
                          other=0.0, cache_modifier=".cg"), axis=0)  # [BLOCK_T, N, N]

    rstd = tl.rsqrt(sq / (N * hidden) + norm_eps)  # the flattened streams' unweighted RMS norm
    pre = tl.sigmoid(pre * rstd[:, None] * tl.load(Scale) + tl.load(Base + i)[None, :]) + eps
    post = 2 * tl.sigmoid(post * rstd[:, None] * tl.load(Scale + 1) + tl.load(Base + N + i)[None, :])
    logits = comb * rstd[:, None, None] * tl.load(Scale + 2) + tl.load(Base + 2 * N + ij)[None, :, :]
    e = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
    comb = e / tl.sum(e, axis=2)[:, :, None] + eps  # row softmax
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)  # columns
    for _ in range(iters - 1):
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + eps)  # rows
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)  # columns

    rows64 = rows.to(tl.int64)
    tl.store(Post + rows64[:, None] * N + i[None, :], post, mask=row_ok[:, None])
    tl.store(Comb + rows64[:, None, None] * (N * N) + ij[None, :, :], comb, mask=row_ok[:, None, None])
    # the collapse: x[t] = sum_i pre[t, i] stream[t, i], in float32, rounded once to the streams' dtype
    for d0 in range(0, hidden, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        ok = row_ok[:, None] & (d < hidden)[None, :]
        h = tl.load(H + rows64[:, None, None] * (N * hidden) + i[None, :, None] * hidden + d[None, None, :],
                    mask=ok[:, None, :], other=0.0)
        x = tl.sum(pre[:, :, None] * h.to(tl.float32), axis=1)
        tl.store(X + rows64[:, None] * hidden + d[None, :], x.to(X.dtype.element_ty), mask=ok)


@triton.jit
def _hc_site_kernel(H, Fn, Base, Scale, X, Post, Comb, Partials, Tickets, num_tokens, hidden, k_per_split,
                    iters, eps, norm_eps, N: tl.constexpr, MIX: tl.constexpr, SPLITS: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    tile, split = tl.program_id(0), tl.program_id(1)
    K = N * hidden  # the flattened streams; fn is [(2 + N) N, K]
    rows = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_tokens
    h_rows = H + rows.to(tl.int64) * K
    cols = tl.arange(0, MIX)
    col_ok = cols < (2 + N) * N
    k_start = split * k_per_split
    kk = tl.arange(0, BLOCK_K)
    sq = tl.zeros([BLOCK_T], tl.float32)
    if BLOCK_T >= 16:  # tiles of tokens: fp32 dot products (tl.dot wants 16 rows)
        acc = tl.zeros([BLOCK_T, MIX], tl.float32)
    else:  # a few tokens: multiply elementwise, reduce over K once at the end (a K step is loads and FMAs)
        acc3 = tl.zeros([BLOCK_T, BLOCK_K, MIX], tl.float32)
    for k0 in tl.range(0, k_per_split, BLOCK_K, num_stages=3):  # loads a few steps ahead, dot or not
        k = k_start + k0 + kk
        k_ok = k < K
        x = tl.load(h_rows[:, None] + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        f = tl.load(Fn + cols[None, :] * K + k[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        sq += tl.sum(x * x, axis=1)
        if BLOCK_T >= 16:
            acc += mma(x, f, False)
        else:
            acc3 += x[:, :, None] * f[None, :, :]
    if BLOCK_T < 16:
        acc = tl.sum(acc3, axis=1)
    acc = tl.where(cols[None, :] == (2 + N) * N, sq[:, None], acc)  # the sum of squares in the first pad column

    part = Partials + tile * (SPLITS * BLOCK_T * MIX)
    t = tl.arange(0, BLOCK_T)
    tl.store(part + split * (BLOCK_T * MIX) + t[:, None] * MIX + cols[None, :], acc, mask=row_ok[:, None])
    tl.debug_barrier()  # every thread's partials are stored before the ticket is taken (or read back)
    if SPLITS == 1:
        _hc_finalize(H, Base, Scale, X, Post, Comb, part, rows, row_ok, num_tokens, hidden, iters, eps, norm_eps,
                     N, MIX, SPLITS, BLOCK_T, BLOCK_D)
    else:
        # acq_rel: this program's partials are visible before its ticket; the last sees every partial
        if tl.atomic_add(Tickets + tile, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
            tl.store(Tickets + tile, 0)  # ready for the next launch (no other program of the tile is left)
            _hc_finalize(H, Base, Scale, X, Post, Comb, part, rows, row_ok, num_tokens, hidden, iters, eps,
                         norm_eps, N, MIX, SPLITS, BLOCK_T, BLOCK_D)


MAX_TILE_SPLITS = 64  # splits x tokens per tile: the partials the last program sums at once ([SPLITS, BLOCK_T, ...])


def hc_site(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
            eps: float, norm_eps: float, tickets: torch.Tensor, num_splits: int | None = None,
            block_t: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, n, hidden] -> (x [T, hidden] in the streams' dtype: the sublayer's input, post [T, n],
    comb [T, n, n] float32). tickets: int32, zero at first, one per tile of tokens that is split.
    num_splits, block_t: chosen from the shape and the GPU unless given (tests pick them)."""
    check_float("streams", streams)
    check(streams.dim() == 3 and streams.is_contiguous(), f"streams must be [T, n, hidden] contiguous, "
          f"got shape {tuple(streams.shape)} strides {tuple(streams.stride())}")
    num_tokens, n, hidden = streams.shape
    num_mix = (2 + n) * n
    check(n >= 1 and n & (n - 1) == 0, f"the number of streams must be a power of two, got {n}")
    check(fn.dtype == base.dtype == scale.dtype == torch.float32, "fn, base and scale must be float32")
    check(fn.shape == (num_mix, n * hidden) and fn.is_contiguous(),
          f"fn must be [{num_mix}, {n * hidden}] contiguous, got {tuple(fn.shape)}")
    check(base.shape == (num_mix,) and scale.shape == (3,), f"base must be [{num_mix}] and scale [3], "
          f"got {tuple(base.shape)} and {tuple(scale.shape)}")
    check(iters >= 1, f"Sinkhorn needs at least one normalization, got iters={iters}")
    dev = streams.device
    x = torch.empty(num_tokens, hidden, dtype=streams.dtype, device=dev)
    post = torch.empty(num_tokens, n, dtype=torch.float32, device=dev)
    comb = torch.empty(num_tokens, n, n, dtype=torch.float32, device=dev)
    if num_tokens == 0:
        return x, post, comb

    mix = triton.next_power_of_2(num_mix + 1)  # the projection's columns and the sum of squares
    # decode-sized batches: a token per program, its K split wide; larger: tiles of 16 through tl.dot
    block_t = block_t or (1 if num_tokens <= 16 else 16)
    check(block_t & (block_t - 1) == 0, f"block_t must be a power of two, got {block_t}")
    # [BLOCK_T, BLOCK_K, MIX] accumulates elementwise below 16 rows; a tl.dot step of 64 from 16
    block_k = 64 if block_t >= 16 else max(16, 4096 // (block_t * mix))
    num_k = n * hidden
    tiles = triton.cdiv(num_tokens, block_t)
    if num_splits is None:
        # enough programs to fill the GPU, each a few K steps long
        sms = 4 if interpreted(streams) else torch.cuda.get_device_properties(dev).multi_processor_count
        num_splits = max(1, min(sms // tiles, MAX_TILE_SPLITS // block_t, triton.cdiv(num_k, 2 * block_k)))
        num_splits = 1 << (num_splits.bit_length() - 1)  # a power of two at most that
        if tiles > tickets.numel():
            num_splits = 1
    check(num_splits & (num_splits - 1) == 0, f"num_splits must be a power of two, got {num_splits}")
    if num_splits > 1:
        check(tickets.dtype == torch.int32 and tickets.is_contiguous() and tickets.numel() >= tiles
              and tickets.device == dev, f"tickets must be int32 on {dev} with at least {tiles} entries")
    k_per_split = triton.cdiv(triton.cdiv(num_k, num_splits), block_k) * block_k
    partials = torch.empty(tiles, num_splits, block_t, mix, dtype=torch.float32, device=dev)
    block_d = min(triton.next_power_of_2(hidden), max(16, 8192 // (block_t * n)))
    _hc_site_kernel[(tiles, num_splits)](
        streams, fn, base, scale, x, post, comb, partials, tickets, num_tokens, hidden, k_per_split, iters, eps,
        norm_eps, N=n, MIX=mix, SPLITS=num_splits, BLOCK_T=block_t, BLOCK_K=block_k, BLOCK_D=block_d,
        num_warps=4)
    return x, post, comb


@triton.jit
def _hc_mix_kernel(H, Y, Post, Comb, Out, stride_ht, stride_hn, stride_yt, stride_ot, stride_on, hidden,
                   N: tl.constexpr, BLOCK_D: tl.constexpr):
    # one program per (token, BLOCK_D channels): out_k = post_k y + sum_j comb[j, k] h_j
    t, db = tl.program_id(0).to(tl.int64), tl.program_id(1)  # t * 4 streams * 4096 passes 2^31 at 131k tokens
    i = tl.arange(0, N)
    offs = db * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < hidden
    dt = Out.dtype.element_ty
    # post and comb rounded to the streams' dtype first, as the PyTorch path multiplies them
    post = tl.load(Post + t * N + i).to(dt).to(tl.float32)  # [N]
    comb = tl.load(Comb + t * N * N + i[:, None] * N + i[None, :]).to(dt).to(tl.float32)  # [j, k]
    h = tl.load(H + t * stride_ht + i[:, None] * stride_hn + offs[None, :], mask=mask[None, :], other=0.0)
    y = tl.load(Y + t * stride_yt + offs, mask=mask, other=0.0).to(tl.float32)
    mixed = tl.sum(comb[:, :, None] * h.to(tl.float32)[:, None, :], axis=0)  # [k, BLOCK_D]
    out = post[:, None] * y[None, :] + mixed
    tl.store(Out + t * stride_ot + i[:, None] * stride_on + offs[None, :], out.to(dt), mask=mask[None, :])


def hc_mix(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """After a sublayer: streams [T, n, hidden], its output y [T, hidden], post [T, n], comb [T, n, n]
    (float32) -> the new streams [T, n, hidden], stream_k = post_k y + sum_j comb[j, k] stream_j, in one
    launch (the PyTorch path in `Block._site` is five kernels), rounded once."""
    check(streams.dim() == 3 and streams.stride(-1) == 1 and y.dim() == 2 and y.stride(-1) == 1,
          "streams must be [T, n, hidden] and y [T, hidden], contiguous in hidden")
    num_tokens, n, hidden = streams.shape
    check(y.shape == (num_tokens, hidden) and y.dtype == streams.dtype, "y must be [T, hidden] in the streams' dtype")
    check(post.shape == (num_tokens, n) and comb.shape == (num_tokens, n, n) and post.dtype == torch.float32
          and comb.dtype == torch.float32 and post.is_contiguous() and comb.is_contiguous(),
          "post [T, n] and comb [T, n, n] must be float32 and contiguous")
    check(n & (n - 1) == 0, "the stream count must be a power of two")
    check_float("streams", streams)
    out = torch.empty_like(streams)
    if num_tokens:
        block_d = min(512, triton.next_power_of_2(hidden))
        _hc_mix_kernel[(num_tokens, triton.cdiv(hidden, block_d))](
            streams, y, post, comb, out, streams.stride(0), streams.stride(1), y.stride(0), out.stride(0),
            out.stride(1), hidden, N=n, BLOCK_D=block_d, num_warps=4)
    return out
