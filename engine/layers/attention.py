"""MLA attention over the paged latent KV cache (reference PyTorch backend).

Cache layout per layer: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]; one row holds a
token's normalized compressed KV (c_kv) followed by its rotated shared key (k_pe); an FP8 cache (uint8)
holds each block as sections instead (`fp8_latent`), read through `gather_kv_cache` / `latent_rows` (the
fast prefill path: the `gather_latent` kernel). A batch is laid
out prefills first, then decodes (one query token each). `mla_prefill` / `mla_decode` are the
reference; `mla_prefill_fast` / `mla_decode_fast` take the same arguments and run the Triton kernels
(the decode one reads only device tensors, so a CUDA graph can capture it).
"""

import functools
import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from engine.copies import to_device
from engine.layers.fp8_latent import FP8LatentLayout, dequantized, is_fp8, latent_rows


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache slot (block * block_size + offset) for each new token
    query_start_loc: torch.Tensor  # [B + 1] cumulative query lengths, batch order
    context_lens: torch.Tensor  # [B] tokens in the cache after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] physical block ids, padded with 0
    num_prefills: int  # the first num_prefills sequences are prefill chunks
    num_prefill_tokens: int
    block_size: int
    # host copies, so the reference path never synchronizes on device tensors
    query_start_loc_cpu: list[int]
    query_lens_cpu: list[int]
    context_lens_cpu: list[int]
    lookback: torch.Tensor | None = None  # [B, n] the n token ids before each row's first new one (-1: none)
    # the same two on the host where it knows them (None: a step launched ahead, its input drawn on the device)
    input_ids_cpu: list[int] | None = None
    lookback_cpu: list[int] | None = None  # [B * n], flat
    # decode rows only (a row a token): [B] each token's index among its sequence's tokens of the step
    # (0: its first), where several tokens of one sequence run as consecutive rows; None: a token each
    query_index: torch.Tensor | None = None
    # decode rows only: R > 1 where every sequence's rows are R consecutive tokens, each seeing one more
    # than the one before (a verification's k + 1 rows, as the graphs that run them know), which
    # FOLD_VERIFICATIONS folds into the decode kernel's heads; 1: nothing promised
    queries_per_seq: int = 1

    @property
    def num_decodes(self) -> int:
        return len(self.context_lens_cpu) - self.num_prefills

    # Per-step tensors of the fast prefill paths, built on the first layer's call and shared by the
    # others: built per layer (and per sequence) they cost more host time than the layer's kernels.
    def set_prefill_context(self, slots: torch.Tensor, cu_lens: torch.Tensor) -> None:
        """`prefill_context` given rather than built from the host lists (a step derived on the device,
        whose host lists are bounds only: `model_runner.PrefillGraphs`)."""
        self.__dict__["prefill_context"] = (slots, cu_lens)  # where the cached property keeps its value

    @functools.cached_property
    def prefill_context(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the cache slot of every context row of the prefill chunks, chunk after chunk [sum ctx] int64,
        their cumulative lengths [P + 1] int32)."""
        ctx = self.context_lens_cpu[: self.num_prefills]
        dev, bs, total = self.block_tables.device, self.block_size, sum(ctx)
        lens = to_device(ctx, torch.long, dev)
        seq = torch.repeat_interleave(torch.arange(len(ctx), device=dev), lens, output_size=total)
        pos = torch.arange(total, device=dev) - (lens.cumsum(0) - lens)[seq]
        slots = self.block_tables[seq, pos // bs].long() * bs + pos % bs
        return slots, to_device([0, *itertools.accumulate(ctx)], torch.int32, dev)

    @functools.cached_property
    def prefill_as_decode_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each prefill query token as a decode row over the context it may see: (block tables
        [Tp, max_blocks] int32, context lengths [Tp] int32)."""
        ctx, q_lens = self.context_lens_cpu[: self.num_prefills], self.query_lens_cpu[: self.num_prefills]
        dev = self.block_tables.device
        # query j of a chunk of q tokens over a context of c sees the first c - q + j + 1 rows
        lens = [c - q + j + 1 for c, q in zip(ctx, q_lens) for j in range(q)]
        rows = [i for i, q in enumerate(q_lens) for _ in range(q)]
        tables = self.block_tables[: self.num_prefills][to_device(rows, torch.long, dev)].int()
        return tables, to_device(lens, torch.int32, dev)


def write_kv_cache(kv_cache: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor,
                   kv_lora_rank: int | None = None) -> None:
    """latent: [T, kv_cache_dim] -> kv_cache rows at slot_mapping; an FP8 latent cache (uint8) takes
    them quantized (`fp8_latent`), which needs kv_lora_rank."""
    if is_fp8(kv_cache):
        FP8LatentLayout(kv_lora_rank, latent.shape[-1] - kv_lora_rank, latent.dtype).write(kv_cache, slot_mapping, latent)
        return
    kv_cache.view(-1, kv_cache.shape[-1]).index_copy_(0, slot_mapping, latent.to(kv_cache.dtype))


def gather_kv_cache(kv_cache: torch.Tensor, block_table: torch.Tensor, length: int, block_size: int, kv_lora_rank: int,
                    rope: int, dtype: torch.dtype) -> torch.Tensor:
    """One sequence's first `length` latents in `dtype`: [length, kv_lora_rank + rope] (an FP8 cache's pages
    decoded whole, then cut)."""
    num_blocks = (length + block_size - 1) // block_size
    return dequantized(kv_cache[block_table[:num_blocks]], kv_lora_rank, rope, dtype).flatten(0, 1)[:length]


def mla_prefill(
    q_nope: torch.Tensor,  # [Tp, H, nope]
    q_pe: torch.Tensor,  # [Tp, H, rope]
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    w_kv_b: torch.Tensor,  # [H * (nope + v), kv_lora]
    kv_lora_rank: int,
    v_head_dim: int,
    softmax_scale: float,
) -> torch.Tensor:
    """Plain (un-absorbed) MLA: expand the cached latents to per-head K and V, causal attention.

    Each chunk attends to the cached prefix plus itself; returns [Tp, H, v].
    """
    num_heads, nope = q_nope.shape[1], q_nope.shape[2]
    outs = []
    for i in range(meta.num_prefills):
        q_start, q_len = int(meta.query_start_loc_cpu[i]), meta.query_lens_cpu[i]
        ctx = meta.context_lens_cpu[i]
        latent = gather_kv_cache(kv_cache, meta.block_tables[i], ctx, meta.block_size, kv_lora_rank, q_pe.shape[-1],
                                 q_pe.dtype)
        c_kv, k_pe = latent.split([kv_lora_rank, latent.shape[-1] - kv_lora_rank], dim=-1)
        kv = F.linear(c_kv.to(w_kv_b.dtype), w_kv_b).view(ctx, num_heads, nope + v_head_dim)
        k_nope, v = kv.split([nope, v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.to(k_nope.dtype).unsqueeze(1).expand(-1, num_heads, -1)], dim=-1)
        q = torch.cat([q_nope[q_start : q_start + q_len], q_pe[q_start : q_start + q_len]], dim=-1)
        # query j sits at position ctx - q_len + j and sees keys 0..that position
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, ctx]
        scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * softmax_scale
        probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1).to(q.dtype)
        outs.append(torch.einsum("hqk,khd->qhd", probs, v))
    return torch.cat(outs, dim=0)


def mla_decode(
    q_nope: torch.Tensor,  # [B, H, nope]
    q_pe: torch.Tensor,  # [B, H, rope]
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    w_kv_b: torch.Tensor,  # [H * (nope + v), kv_lora]
    kv_lora_rank: int,
    v_head_dim: int,
    softmax_scale: float,
) -> torch.Tensor:
    """Weight-absorbed MLA for one new token per sequence: attend over the latent cache directly.

    q_nope is folded through W_UK into latent space, so the cache is read once as 576-wide rows shared
    by all heads, and the latent output is lifted through W_UV. Returns [B, H, v].
    """
    num_decodes, num_heads, nope = q_nope.shape
    w = w_kv_b.view(num_heads, nope + v_head_dim, kv_lora_rank)
    w_uk, w_uv = w[:, :nope], w[:, nope:]  # [H, nope, kv_lora], [H, v, kv_lora]
    q_latent = torch.einsum("bhn,hnc->bhc", q_nope.float(), w_uk.float())  # [B, H, kv_lora]
    first = meta.num_prefills
    lens = meta.context_lens_cpu[first:]
    max_len = max(lens)
    latent = torch.stack(
        [
            F.pad(gather_kv_cache(kv_cache, meta.block_tables[first + b], n, meta.block_size, kv_lora_rank,
                                  q_pe.shape[-1], q_pe.dtype), (0, 0, 0, max_len - n))
            for b, n in enumerate(lens)
        ]
    ).float()  # [B, L, kv_lora + rope]
    c_kv, k_pe = latent[..., :kv_lora_rank], latent[..., kv_lora_rank:]
    scores = torch.einsum("bhc,blc->bhl", q_latent, c_kv) + torch.einsum("bhr,blr->bhl", q_pe.float(), k_pe)
    valid = torch.arange(max_len, device=scores.device)[None, :] < torch.tensor(lens, device=scores.device)[:, None]
    probs = (scores * softmax_scale).masked_fill(~valid[:, None, :], float("-inf")).softmax(dim=-1)
    out_latent = torch.einsum("bhl,blc->bhc", probs, c_kv)  # [B, H, kv_lora]
    return torch.einsum("bhc,hvc->bhv", out_latent, w_uv.float()).to(q_nope.dtype)


class AbsorbWeights(NamedTuple):
    """kv_b_proj's two halves laid out for per-head GEMVs (`kernels.gemv` with one group a head): W_UK^T
    [H * kv_lora, nope] (head h's rows h * kv_lora..) and W_UV [H * v, kv_lora]. At one token the cuBLAS
    batched GEMMs spend ~3 us each on 2 MB (DeepSeek-V2-Lite) and break the chain of kernels that start
    early (`kernels._util.PDL`); these copies cost 2 x H x kv_lora x 128 values a layer."""

    w_uk_t: torch.Tensor
    w_uv: torch.Tensor

    @classmethod
    def of(cls, w_kv_b: torch.Tensor, nope: int, v_head_dim: int) -> "AbsorbWeights":
        kv_lora = w_kv_b.shape[1]
        w = w_kv_b.view(-1, nope + v_head_dim, kv_lora)
        return cls(w[:, :nope].transpose(1, 2).reshape(-1, nope).contiguous(),
                   w[:, nope:].reshape(-1, kv_lora).contiguous())


# Prefill chunks of at most this many tokens take the weight-absorbed path: expanding a long cached
# context through W_UKV costs 2 * kv_lora * H * (nope + v) FLOPs per context token whatever the chunk,
# while absorbed attention costs about 2 * H * (2 * kv_lora + rope) per (query, context) pair, so
# short chunks over long prefixes (a conversation's next turn) are far cheaper absorbed.
ABSORBED_MAX_QUERY = 16
# ... and at most this many query tokens in the step: each is a row of the decode kernel with its own
# float32 partial results (H x slices x kv_lora), which a step of many short fresh prompts would inflate
ABSORBED_MAX_TOKENS = 256
# a step's absorbed chunks, where all have the same length R > 1 (a conversation's next turn, say), folded
# into the decode kernel's heads (`mla_decode_attention(queries_per_seq=R)`): each sequence's cache read
# once for its R tokens instead of once a token (a next turn of 9 tokens over 32k on an H100: 590 -> 611
# tokens/s; `bench --no-fold-chunks` without)
FOLD_CHUNKS = True
# the same for a fused speculative step's verifications (k + 1 rows a sequence, as its graphs tell the
# metadata: `AttentionMetadata.queries_per_seq`); off: on the Triton kernel the fold measured slower (one
# stream of V2-Lite on an H200, k = 1 and 3: a fused step 2.5-3.9 % longer at 1k, 4.7-7.3 % at 32k), and
# on the Gluon kernel (k = 1 at 16 heads) no faster over bf16 rows (H100, 32k: 4.42 -> 4.45 ms; the second
# row's cost is its experts' weights, not attention); `benchmarks/spec_decode.py --presets`
FOLD_VERIFICATIONS = False


def mla_prefill_fast(q_nope, q_pe, kv_cache, meta: AttentionMetadata, w_kv_b, kv_lora_rank, v_head_dim,
                     softmax_scale, absorb: AbsorbWeights | None = None) -> torch.Tensor:
    """`mla_prefill` through the Triton kernels. Chunks of up to ABSORBED_MAX_QUERY tokens: each query
    token attends as its own sequence over the context it may see, through the absorbed decode kernel.
    Longer ones: gather each chunk's whole context (cached prefix + chunk) from the cache, expand it
    through W_UKV in one GEMM, then causal variable-length attention."""
    from engine.kernels.mla_prefill import mla_prefill_attention  # first use: Triton picks compiled or interpreted

    num_heads, nope = q_nope.shape[1], q_nope.shape[2]
    q_lens = meta.query_lens_cpu[: meta.num_prefills]
    if max(q_lens) <= ABSORBED_MAX_QUERY and sum(q_lens) <= ABSORBED_MAX_TOKENS:
        tables, lens = meta.prefill_as_decode_rows
        # every chunk R tokens: a sequence's R rows are consecutive, each seeing one token more than the last
        fold = q_lens[0] if FOLD_CHUNKS and q_lens[0] > 1 and all(q == q_lens[0] for q in q_lens) else 1
        return _absorbed_attention(q_nope, q_pe, kv_cache, tables, lens, w_kv_b, v_head_dim, softmax_scale, absorb,
                                   queries_per_seq=fold)
    slots, cu_k = meta.prefill_context
    # [Tk, kv_lora + rope]; an FP8 cache's rows decoded as they are gathered, in one launch (the expansion
    # GEMM and the attention after it run in the activation dtype)
    if is_fp8(kv_cache):
        from engine.kernels.latent_cache import gather_latent

        latent = gather_latent(kv_cache, slots, kv_lora_rank, q_pe.shape[-1], q_pe.dtype)
    else:
        latent = latent_rows(kv_cache, slots, kv_lora_rank, q_pe.shape[-1], q_pe.dtype)
    kv = F.linear(latent[:, :kv_lora_rank], w_kv_b).view(latent.shape[0], num_heads, nope + v_head_dim)
    cu_q = meta.query_start_loc[: meta.num_prefills + 1].int()
    max_q = max(meta.query_lens_cpu[: meta.num_prefills])
    k_pe = latent[:, kv_lora_rank:].to(q_pe.dtype)
    return mla_prefill_attention(q_nope, q_pe, kv[..., :nope], k_pe, kv[..., nope:], cu_q, cu_k, max_q, softmax_scale)


def mla_decode_fast(q_nope, q_pe, kv_cache, meta: AttentionMetadata, w_kv_b, kv_lora_rank, v_head_dim,
                    softmax_scale, absorb: AbsorbWeights | None = None, q_latent: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """`mla_decode` through the Triton split-KV kernel; the absorptions are batched GEMMs per head (GEMVs
    for one token, given `absorb`; q_latent: one token's query absorption already made, by the latent
    write's launch)."""
    first = meta.num_prefills
    fold = meta.queries_per_seq if FOLD_VERIFICATIONS and not first else 1
    return _absorbed_attention(q_nope, q_pe, kv_cache, meta.block_tables[first:], meta.context_lens[first:], w_kv_b,
                               v_head_dim, softmax_scale, absorb, q_latent, queries_per_seq=fold)


def _absorbed_attention(q_nope, q_pe, kv_cache, block_tables, context_lens, w_kv_b, v_head_dim,
                        softmax_scale, absorb: AbsorbWeights | None = None,
                        q_latent: torch.Tensor | None = None, queries_per_seq: int = 1) -> torch.Tensor:
    """One query token per row of block_tables / context_lens, weight-absorbed -> [B, H, v];
    queries_per_seq R > 1: the rows are sequences' R consecutive tokens, folded into the kernel's heads."""
    from engine.kernels.mla_decode import mla_decode_attention

    batch, num_heads, nope = q_nope.shape
    kv_lora_rank = w_kv_b.shape[1]
    if absorb is not None and batch == 1:  # one token: the absorptions as GEMVs, one group a head
        from engine.kernels.gemv import gemv

        if q_latent is None:
            q_latent = gemv(q_nope, absorb.w_uk_t, groups=num_heads).view(1, num_heads, kv_lora_rank)
        out = mla_decode_attention(q_latent, q_pe.to(q_latent.dtype), kv_cache, block_tables.int(),
                                   context_lens.int(), softmax_scale)
        return gemv(out.view(1, -1), absorb.w_uv, groups=num_heads).view(1, num_heads, v_head_dim)
    w = w_kv_b.view(num_heads, nope + v_head_dim, kv_lora_rank)
    if queries_per_seq > 1:  # folded rows are views of [B, H, kv_lora] with a row's heads together
        q_latent = torch.empty(batch, num_heads, kv_lora_rank, dtype=q_nope.dtype, device=q_nope.device)
        torch.bmm(q_nope.transpose(0, 1), w[:, :nope], out=q_latent.transpose(0, 1))
        q_pe = q_pe.contiguous()
    else:
        q_latent = torch.bmm(q_nope.transpose(0, 1), w[:, :nope]).transpose(0, 1)  # [B, H, kv_lora]
    out = mla_decode_attention(q_latent, q_pe.to(q_latent.dtype), kv_cache, block_tables.int(), context_lens.int(),
                               softmax_scale, queries_per_seq=queries_per_seq)
    # [B, H, v] written head by head through a transposed view (a strided batched GEMM), so o_proj
    # reads it flat without another copy
    result = torch.empty(out.shape[0], num_heads, v_head_dim, dtype=out.dtype, device=out.device)
    torch.bmm(out.transpose(0, 1), w[:, nope:].transpose(1, 2), out=result.transpose(0, 1))
    return result
