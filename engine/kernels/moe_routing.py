"""MoE token routing on the GPU: the router's top-k in one kernel (for a few tokens, in the router's
own GEMV launch: `route_tokens`), then the sort of (token, expert) pairs by expert that the grouped
GEMMs consume. Neither reads anything back to the host, so both run
inside a CUDA graph.
"""

import torch
import triton
import triton.language as tl

from engine.kernels._util import check, last_program, pdl, pow2, wait_for_inputs
from engine.kernels.gemv import PREFETCH, gemv_block, tile

SCORING = {"sigmoid": 0, "softmax": 1}
GROUPING = {"none": 0, "noaux_tc": 1, "group_limited_greedy": 2}  # group score: best two summed | best one


@triton.jit
def _route_row(logits, offs, mask, Bias, WeightsOut, IdsOut, row, num_experts, scaling,
               SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, GROUPING: tl.constexpr, N_GROUP: tl.constexpr,
               TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, NORM: tl.constexpr, BLOCK_E: tl.constexpr,
               BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr):
    """One token's float32 logits [BLOCK_E] (-inf past num_experts) -> its top-k weights and ids, stored."""
    if SCORING == 0:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    else:
        e = tl.exp(logits - tl.max(logits, axis=0))
        scores = e / tl.sum(e, axis=0)
    scores = tl.where(mask, scores, 0.0)
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(Bias + offs, mask=mask, other=0.0)
    choice = tl.where(mask, choice, float("-inf"))
    if GROUPING != 0:
        group_of = offs // (num_experts // N_GROUP)
        offs_g = tl.arange(0, BLOCK_G)
        group_scores = tl.full([BLOCK_G], float("-inf"), tl.float32)
        for g in tl.static_range(N_GROUP):
            member = tl.where(group_of == g, choice, float("-inf"))
            best = tl.max(member, axis=0)
            if GROUPING == 1:
                first = tl.argmax(member, axis=0)
                best = best + tl.max(tl.where(offs == first, float("-inf"), member), axis=0)
            group_scores = tl.where(offs_g == g, best, group_scores)
        keep = tl.zeros([BLOCK_E], tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            g = tl.argmax(group_scores, axis=0)
            keep = keep | (group_of == g)
            group_scores = tl.where(offs_g == g, float("-inf"), group_scores)
        choice = tl.where(keep, choice, float("-inf"))
    offs_k = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], tl.int32)
    weights = tl.zeros([BLOCK_K], tl.float32)
    for k in tl.static_range(TOP_K):
        idx = tl.argmax(choice, axis=0)
        ids = tl.where(offs_k == k, idx, ids)
        weights = tl.where(offs_k == k, tl.sum(tl.where(offs == idx, scores, 0.0), axis=0), weights)
        choice = tl.where(offs == idx, float("-inf"), choice)
    if NORM:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    mk = offs_k < TOP_K
    tl.store(WeightsOut + row * TOP_K + offs_k, weights * scaling, mask=mk)
    tl.store(IdsOut + row * TOP_K + offs_k, ids, mask=mk)


@triton.jit
def _route_kernel(Logits, Bias, WeightsOut, IdsOut, stride_l, num_experts, scaling,
                  SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, GROUPING: tl.constexpr, N_GROUP: tl.constexpr,
                  TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, NORM: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    wait_for_inputs(PDL)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < num_experts
    logits = tl.load(Logits + row * stride_l + offs, mask=mask, other=float("-inf")).to(tl.float32)
    _route_row(logits, offs, mask, Bias, WeightsOut, IdsOut, row, num_experts, scaling, SCORING, HAS_BIAS, GROUPING,
               N_GROUP, TOPK_GROUP, TOP_K, NORM, BLOCK_E, BLOCK_G, BLOCK_K)


@triton.jit
def _router_kernel(X, W, Logits, Counter, Bias, WeightsOut, IdsOut, num_experts, K, stride_x, stride_w, scaling,
                   num_blocks, SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, GROUPING: tl.constexpr,
                   N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, NORM: tl.constexpr,
                   BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_K: tl.constexpr,
                   GROUPS: tl.constexpr, BLOCK_N: tl.constexpr, WAIT_FIRST: tl.constexpr, PREFETCH: tl.constexpr):
    # one program per (token, BLOCK_N experts): the router's GEMV; the last of a token's programs to
    # finish routes the token (no second launch)
    row = tl.program_id(0)
    gemv_block(X, W, W, Logits, row, tl.program_id(1), num_experts, K, num_experts, stride_x, 0, stride_w, 0,
               num_experts, False, 1, GROUP_K, GROUPS, False, BLOCK_N, WAIT_FIRST, PREFETCH)
    if last_program(Counter + row, num_blocks):
        offs = tl.arange(0, BLOCK_E)
        mask = offs < num_experts
        logits = tl.load(Logits + row * num_experts + offs, mask=mask, other=float("-inf"), cache_modifier=".cg")
        _route_row(logits, offs, mask, Bias, WeightsOut, IdsOut, row, num_experts, scaling, SCORING, HAS_BIAS,
                   GROUPING, N_GROUP, TOPK_GROUP, TOP_K, NORM, BLOCK_E, BLOCK_G, BLOCK_K)


def _rule(num_experts: int, bias: torch.Tensor | None, top_k: int, scoring_func: str, topk_method: str, n_group: int,
          topk_group: int, norm_topk_prob: bool) -> dict:
    """The routing rule's checks and its kernels' constants."""
    check(scoring_func in SCORING, f"unsupported scoring_func {scoring_func!r}")
    grouping = topk_method if n_group > 1 and topk_method in GROUPING else "none"
    check(num_experts % n_group == 0, f"{num_experts} experts do not split into {n_group} groups")
    check(0 < top_k <= num_experts, f"top_k={top_k} must be in [1, {num_experts}]")
    if bias is not None:
        check(bias.shape == (num_experts,) and bias.dtype == torch.float32, "bias must be float32 [E]")
    return dict(SCORING=SCORING[scoring_func], HAS_BIAS=bias is not None, GROUPING=GROUPING[grouping], N_GROUP=n_group,
                TOPK_GROUP=topk_group, TOP_K=top_k, NORM=norm_topk_prob and top_k > 1, BLOCK_E=pow2(num_experts),
                BLOCK_G=pow2(n_group, 2), BLOCK_K=pow2(top_k, 2))


def route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, scoring_func: str, topk_method: str,
          n_group: int, topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] float32 router outputs -> (weights [T, top_k] float32, expert ids [T, top_k] int32),
    with the same rule as the reference Gate (biased choice, unbiased weights, optional group limit)."""
    check(logits.dim() == 2 and logits.dtype == torch.float32 and logits.stride(-1) == 1,
          "router logits must be [T, E] float32, contiguous in E")
    num_tokens, num_experts = logits.shape
    rule = _rule(num_experts, bias, top_k, scoring_func, topk_method, n_group, topk_group, norm_topk_prob)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    if num_tokens:
        on = pdl(logits)
        _route_kernel[(num_tokens,)](
            logits, bias if bias is not None else logits, weights, ids, logits.stride(0), num_experts,
            routed_scaling_factor, **rule, PDL=on, launch_pdl=on)
    return weights, ids


def route_tokens(x: torch.Tensor, weight: torch.Tensor, counter: torch.Tensor, bias: torch.Tensor | None, top_k: int,
                 scoring_func: str, topk_method: str, n_group: int, topk_group: int, norm_topk_prob: bool,
                 routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The router of a few tokens in one launch: logits = x [T, hidden] times weight [E, hidden] float32
    (x widened in the kernel, a GEMV per token), then `route`'s rule, run by the last of each token's
    programs to finish (`_util.last_program`): one launch a MoE layer fewer than `gemv` then `route`.
    counter: int32 zeros, one a token at least, this router's own (each launch leaves them zero)."""
    check(x.dim() == 2 and x.stride(-1) == 1 and x.dtype in (torch.float32, torch.bfloat16, torch.float16),
          "x must be float [T, hidden] with contiguous rows")
    num_tokens, hidden = x.shape
    num_experts = weight.shape[0]
    check(weight.dtype == torch.float32 and weight.shape == (num_experts, hidden) and weight.is_contiguous(),
          f"the router's weight must be float32 [E, {hidden}], contiguous")
    check(counter.dtype == torch.int32 and counter.numel() >= num_tokens, f"counter must be int32 of >= {num_tokens}")
    rule = _rule(num_experts, bias, top_k, scoring_func, topk_method, n_group, topk_group, norm_topk_prob)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=x.device)
    logits = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=x.device)
    if num_tokens:
        block_n, k_groups, warps = tile(num_experts, hidden, x)
        on = pdl(x)
        blocks = triton.cdiv(num_experts, block_n)
        _router_kernel[(num_tokens, blocks)](
            x, weight, logits, counter, bias if bias is not None else weight, weights, ids, num_experts, hidden,
            x.stride(0), weight.stride(0), routed_scaling_factor, blocks, **rule, GROUP_K=128, GROUPS=k_groups,
            BLOCK_N=block_n, WAIT_FIRST=on and not PREFETCH["bf16"], PREFETCH=on and PREFETCH["bf16"], launch_pdl=on,
            num_warps=warps)
    return weights, ids


# One program aligns up to this many pairs (a decode step, a short prefill); larger steps split the
# pairs into chunks, a program each, in two launches (`_chunk_count_kernel`, `_chunk_place_kernel`).
ALIGN_KERNEL_MAX_PAIRS = 4096
# at most this many chunks, so that each placing program's read of every chunk's counts stays small
# (V3 at 32k tokens: 256 chunks x 256 experts)
ALIGN_MAX_CHUNKS = 256


@triton.jit
def _count_pairs(Ids, start, end, offs_e, offs_p, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr):
    """How many of pairs [start, end) each expert has -> [BLOCK_E]."""
    counts = tl.zeros([BLOCK_E], tl.int32)
    for p0 in range(start, end, BLOCK_P):
        ids = tl.load(Ids + p0 + offs_p, mask=p0 + offs_p < end, other=-1)
        counts += tl.sum((ids[:, None] == offs_e[None, :]).to(tl.int32), axis=0)
    return counts


@triton.jit
def _fill_padding(SortedIds, start, end, num_pairs, offs_p, BLOCK_P: tl.constexpr):
    """Rows [start, end) point past the last pair (num_pairs): the padding the placement overwrites."""
    for r0 in range(start, end, BLOCK_P):
        tl.store(SortedIds + r0 + offs_p, tl.zeros([BLOCK_P], tl.int32) + num_pairs, mask=r0 + offs_p < end)


@triton.jit
def _place_pairs(Ids, SortedIds, start, end, placed, offs_e, offs_p, BLOCK_P: tl.constexpr):
    """Each of pairs [start, end) to row placed[its expert] plus its rank among that expert's pairs
    here (pair order: the placement of a stable sort); placed [BLOCK_E] advances past them."""
    for p0 in range(start, end, BLOCK_P):
        valid = p0 + offs_p < end
        ids = tl.load(Ids + p0 + offs_p, mask=valid, other=-1)
        onehot = (ids[:, None] == offs_e[None, :]).to(tl.int32)  # [P, E]
        base = tl.sum(onehot * placed[None, :], axis=1)
        before = (ids[:, None] == ids[None, :]) & (offs_p[None, :] < offs_p[:, None])  # same expert, earlier
        rank = tl.sum(before.to(tl.int32), axis=1)
        tl.store(SortedIds + base + rank, p0 + offs_p, mask=valid)
        placed += tl.sum(onehot, axis=0)


@triton.jit
def _block_experts(BlockExpert, start, end, ends, num_experts, offs_p, BLOCK_M: tl.constexpr,
                   BLOCK_P: tl.constexpr):
    """Blocks [start, end) of BLOCK_M rows: each one's expert is the number of runs ending at or before
    its first row (ends [BLOCK_E]: each expert's padded run's end)."""
    for b0 in range(start, end, BLOCK_P):
        first_row = (b0 + offs_p) * BLOCK_M
        expert = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
        tl.store(BlockExpert + b0 + offs_p, tl.minimum(expert, num_experts - 1), mask=b0 + offs_p < end)


@triton.jit(do_not_specialize=["num_pairs", "max_padded"])  # both vary with the batch: one variant
def _align_kernel(Ids, SortedIds, BlockExpert, NumPadded, num_pairs, num_experts, max_padded,
                  BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr):
    offs_e = tl.arange(0, BLOCK_E)
    offs_p = tl.arange(0, BLOCK_P)
    # pairs per expert, each expert's run padded to BLOCK_M rows
    counts = _count_pairs(Ids, 0, num_pairs, offs_e, offs_p, BLOCK_E, BLOCK_P)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    _fill_padding(SortedIds, 0, max_padded, num_pairs, offs_p, BLOCK_P)
    tl.debug_barrier()
    _place_pairs(Ids, SortedIds, 0, num_pairs, ends - padded, offs_e, offs_p, BLOCK_P)
    _block_experts(BlockExpert, 0, max_padded // BLOCK_M, ends, num_experts, offs_p, BLOCK_M, BLOCK_P)
    tl.store(NumPadded, tl.sum(padded, axis=0))


@triton.jit(do_not_specialize=["num_pairs", "chunk", "max_padded", "fill"])
def _chunk_count_kernel(Ids, ChunkCounts, SortedIds, num_pairs, chunk, max_padded, fill,
                        BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr):
    """Program c: how many of pairs [c * chunk, (c + 1) * chunk) each expert has -> ChunkCounts[c]; and
    its share of SortedIds (`fill` rows) set to the padding value."""
    c = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    offs_p = tl.arange(0, BLOCK_P)
    counts = _count_pairs(Ids, c * chunk, tl.minimum((c + 1) * chunk, num_pairs), offs_e, offs_p, BLOCK_E, BLOCK_P)
    tl.store(ChunkCounts + c * BLOCK_E + offs_e, counts)
    _fill_padding(SortedIds, c * fill, tl.minimum((c + 1) * fill, max_padded), num_pairs, offs_p, BLOCK_P)


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "chunk", "max_padded", "blocks_per"])
def _chunk_place_kernel(Ids, ChunkCounts, SortedIds, BlockExpert, NumPadded, num_pairs, num_experts, num_chunks,
                        chunk, max_padded, blocks_per, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                        BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program c places pairs [c * chunk, (c + 1) * chunk): each at its expert's start, plus the pairs of
    that expert in earlier chunks, plus its rank in this chunk (the placement of a stable sort); and
    writes the experts of its share of the BLOCK_M-row blocks."""
    c = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    offs_p = tl.arange(0, BLOCK_P)
    totals = tl.zeros([BLOCK_E], tl.int32)
    earlier = tl.zeros([BLOCK_E], tl.int32)  # this expert's pairs in chunks before c
    for c0 in range(0, num_chunks, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        counts = tl.load(ChunkCounts + offs_c[:, None] * BLOCK_E + offs_e[None, :],
                         mask=(offs_c < num_chunks)[:, None], other=0)  # [BLOCK_C, BLOCK_E]
        totals += tl.sum(counts, axis=0)
        earlier += tl.sum(tl.where((offs_c < c)[:, None], counts, 0), axis=0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    _place_pairs(Ids, SortedIds, c * chunk, tl.minimum((c + 1) * chunk, num_pairs), ends - padded + earlier, offs_e,
                 offs_p, BLOCK_P)
    _block_experts(BlockExpert, c * blocks_per, tl.minimum((c + 1) * blocks_per, max_padded // BLOCK_M), ends,
                   num_experts, offs_p, BLOCK_M, BLOCK_P)
    if c == 0:
        tl.store(NumPadded, tl.sum(padded, axis=0))


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows the expert-sorted pairs can take: each expert's run padded to block_m, a whole number of
    blocks. From shapes alone, so a CUDA graph's buffers fit every routing."""
    rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-rows // block_m) * block_m


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the T * top_k (token, expert) pairs by expert, each expert's run padded to block_m.

    -> sorted_ids [P_max] int32 (pair id = token * top_k + k; padding holds T * top_k),
       block_expert [P_max / block_m] int32 (the expert of each block of block_m rows),
       num_padded [1] int32 (rows in use). Sizes depend on shapes only (CUDA-graph safe). Up to
    ALIGN_KERNEL_MAX_PAIRS pairs in one launch, more in two (`align_by_expert_chunked`); the same result
    as `sort_by_expert` (PyTorch's stable sort, ~25 launches), the reference."""
    num_pairs = topk_ids.numel()
    max_padded = max_padded_rows(num_pairs, num_experts, block_m)
    if num_pairs == 0:
        return sort_by_expert(topk_ids, num_experts, block_m, max_padded)
    if num_pairs > ALIGN_KERNEL_MAX_PAIRS:
        return align_by_expert_chunked(topk_ids, num_experts, block_m)
    dev = topk_ids.device
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_padded // block_m, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    _align_kernel[(1,)](topk_ids.reshape(-1).int(), sorted_ids, block_expert, num_padded, num_pairs, num_experts,
                        max_padded, BLOCK_M=block_m, BLOCK_E=pow2(num_experts, 16), BLOCK_P=64, num_warps=8)
    return sorted_ids, block_expert, num_padded


def align_by_expert_chunked(topk_ids: torch.Tensor, num_experts: int, block_m: int, chunk: int | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`align_by_expert` for large steps in two launches: the pairs cut into chunks (`chunk` pairs each,
    a multiple of 64; default: at least 1,024, at most ALIGN_MAX_CHUNKS chunks), one program a chunk that
    counts its pairs per expert, then one a chunk that places them."""
    num_pairs = topk_ids.numel()
    max_padded = max_padded_rows(num_pairs, num_experts, block_m)
    block_p, block_e = 64, pow2(num_experts, 16)
    if chunk is None:
        chunk = max(1024, -(-num_pairs // ALIGN_MAX_CHUNKS))
    chunk = -(-chunk // block_p) * block_p
    num_chunks = -(-num_pairs // chunk)
    dev = topk_ids.device
    ids = topk_ids.reshape(-1).int()
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_padded // block_m, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    chunk_counts = torch.empty(num_chunks, block_e, dtype=torch.int32, device=dev)
    fill = -(-max_padded // num_chunks)
    _chunk_count_kernel[(num_chunks,)](ids, chunk_counts, sorted_ids, num_pairs, chunk, max_padded, fill,
                                       BLOCK_E=block_e, BLOCK_P=block_p, num_warps=4)
    _chunk_place_kernel[(num_chunks,)](ids, chunk_counts, sorted_ids, block_expert, num_padded, num_pairs, num_experts,
                                       num_chunks, chunk, max_padded, -(-(max_padded // block_m) // num_chunks),
                                       BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_P=block_p, BLOCK_C=16, num_warps=8)
    return sorted_ids, block_expert, num_padded


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int, max_padded: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`align_by_expert` in PyTorch operations (a stable sort): the kernels' reference, and steps without
    pairs."""
    num_pairs = topk_ids.numel()
    dev = topk_ids.device
    flat = topk_ids.flatten().long()
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = flat.argsort(stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=dev) - (counts.cumsum(0) - counts)[sorted_experts]
    sorted_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=dev)
    sorted_ids[(ends - padded)[sorted_experts] + rank] = order.int()
    block_starts = torch.arange(0, max_padded, block_m, device=dev)
    block_expert = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1).int()
    return sorted_ids, block_expert, ends[-1:].int()
