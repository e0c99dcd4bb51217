"""DeepSeek-V4.1: V4's attention with compressed caches shared across layers, quantized caches, the
single-pass mHC, MoE with a vision routing bias, and Engram n-gram tables.

What differs from V4 (engine.models.deepseek_v4, whose norms, rope, mHC weights, attention core and
experts this reuses):
  - Only `kv_source_layer_ids` own a compressor (no overlap, no position bias; ratio 2 pools 2 tokens
    by a gated softmax, ratio 1 takes every token) and a compressed cache; the other compressed layers
    read the cache of the nearest source at or before them.
  - Index sources score the entries with their own queries against their KV source's indexer keys;
    the other compressed layers attend the last index source's picks. Index sources after the
    candidate source score only inside its top blocks of `candidate_block_size` entries.
  - The caches are quantized as the model was trained (engine.layers.kv_quant) and stored quantized.
  - mHC: a site's `pre` collapses the NEXT site's input (layer 0's attention takes stream 0; the
    final norm the last FFN site's); no hc_head. No per-head query norm.
  - Engram (engine.layers.engram) on `engram_layer_ids`, on the streams before the attention site.
Names are DeepSeek's (layers.N.attn.compressor.wkv, layers.N.engram.embed, ffn.gate.bias_vl).
"""

import copy
import re

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import DeepseekV41Config
from engine.kv_pool import KVCacheSpec, KVPool, window_slots
from engine.layers.attention import AttentionMetadata
from engine.layers.compressed_attention import (
    NEG_INF,
    attend,
    entry_slots,
    indexer_scores,
    rows_of,
    token_slots,
    window_mask,
)
from engine.layers.engram import Engram, EngramHash, EngramRows, compressed_token_map
from engine.layers.kv_quant import COMPRESSED_FP4, INDEXER_FP4, WINDOW_FP8, BlockCodec
from engine.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from engine.layers.moe import FusedExperts
from engine.loader import materialize
from engine.models.deepseek_v4 import DeepseekV4Base, Expert, RMSNorm, Rope, _fp32, hc_weights
from engine.models.deepseek_vit import ImageEmbeds, VisionLanguageModel
from engine.parallel import SINGLE, ParallelContext, divide


class CacheCodec:
    """How one cache kind stores rows of `dim` values: quantized bytes (`store_quantized`), or the
    fake-quantized values in the model's dtype; a codec that does not apply to `dim` stores the values."""

    def __init__(self, codec: BlockCodec, dim: int, store_quantized: bool):
        self.codec = codec if codec.applies(dim) else None
        self.dim, self.packed = dim, store_quantized and self.codec is not None

    def spec_width(self, dtype: torch.dtype) -> tuple[int, torch.dtype]:
        return (self.codec.row_bytes(self.dim), torch.uint8) if self.packed else (self.dim, dtype)

    def fake(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.codec is None else self.codec.fake(x)

    def write(self, cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
        flat = cache.view(-1, cache.shape[-1])
        rows = self.codec.encode(x) if self.packed else self.fake(x).to(flat.dtype)
        flat.index_copy_(0, slots, rows)

    def read(self, cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rows = cache.view(-1, cache.shape[-1])[slots]
        return self.codec.decode(rows, self.dim, dtype) if self.packed else rows


def candidate_blocks(scores: torch.Tensor, counts: torch.Tensor, top_blocks: int, block: int) -> torch.Tensor:
    """The two-level top-k's first level: scores [t, n] (-inf where not visible), counts [t] visible
    entries -> [t, n] bool, the entries of each query's `top_blocks` blocks of `block` entries by their
    best score; the block of the newest visible entry is always kept (it is only partly filled)."""
    n = scores.shape[-1]
    best = F.pad(scores, (0, -n % block), value=NEG_INF).unflatten(-1, (-1, block)).amax(-1)  # [t, blocks]
    newest = torch.div(counts - 1, block, rounding_mode="floor")
    best = best.masked_fill(torch.arange(best.shape[-1], device=scores.device)[None] == newest[:, None], float("inf"))
    top = best.topk(min(top_blocks, best.shape[-1]), dim=-1)
    keep = torch.zeros_like(best, dtype=torch.bool).scatter_(-1, top.indices, top.values > NEG_INF)
    return keep.repeat_interleave(block, dim=-1)[:, :n]


class Compressor(nn.Module):
    """A KV source's compressor: entry w of a ratio-m layer pools tokens [w m, (w + 1) m) by a softmax of
    wgate(x) over the group per channel weighting wkv(x) (float32), then `norm`; at ratio 1 an entry is
    norm(wkv(x)) of its token. Entries are returned before RoPE (the indexer keys start from them).
    The open group's tokens (c, g) are the block's `compressor_state` row: [(m - 1) x (c | g)]."""

    def __init__(self, hidden: int, dim: int, ratio: int, eps: float):
        super().__init__()
        self.dim, self.ratio = dim, ratio
        self.wkv = Linear(hidden, dim)
        self.wgate = Linear(hidden, dim) if ratio > 1 else None
        self.norm = RMSNorm(dim, eps)

    @property
    def state_width(self) -> int:
        return 2 * (self.ratio - 1) * self.dim

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, dim] (ratio 1) or [T, 2 dim] = (c | g) float32."""
        if self.wgate is None:
            return self.wkv(x)
        xf = x.float()
        return torch.cat([F.linear(xf, self.wkv.weight.float()), F.linear(xf, self.wgate.weight.float())], -1)

    def entries(self, cg: torch.Tensor, n: int, held: torch.Tensor | None, dtype: torch.dtype
                ) -> tuple[torch.Tensor, int, torch.Tensor | None]:
        """One row's chunk: cg [q, width] of its tokens from position n, held [state_width] the open
        group's tokens before n -> (the entries it closes [k, dim], the first one's index, the state
        at the chunk's end, or None when it ends on a group boundary)."""
        m, d = self.ratio, self.dim
        if m == 1:
            return self.norm(cg), n, None
        open_before = n % m
        if open_before:
            cg = torch.cat([held.view(m - 1, 2 * d)[:open_before], cg])
        k = cg.shape[0] // m
        grouped = cg[: k * m].view(k, m, 2 * d)
        c, g = grouped[..., :d], grouped[..., d:]
        latent = (c * g.softmax(dim=1, dtype=torch.float32)).sum(dim=1)
        rest = cg[k * m:]
        state = None
        if rest.shape[0]:
            state = torch.zeros(m - 1, 2 * d, dtype=torch.float32, device=cg.device)
            state[: rest.shape[0]] = rest
            state = state.flatten()
        return self.norm(latent.to(dtype)), n // m, state


class Indexer(nn.Module):
    """An index source's scorer: queries wq_b(qr) [heads, index_head_dim] (compress RoPE, FP4), head
    weights weights_proj(x) / sqrt(heads); a KV source also makes the keys k_norm(wk(entry)) (RoPE at
    the entry's first position, FP4) that every index source of its group scores against."""

    def __init__(self, cfg: DeepseekV41Config, owns_keys: bool, rotary: Rope):
        super().__init__()
        self.num_heads, self.head_dim, self.top_k = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim)
        self.weights_proj = Linear(cfg.hidden_size, cfg.index_n_heads)
        if owns_keys:
            self.wk = Linear(cfg.head_dim, cfg.index_head_dim)
            self.k_norm = RMSNorm(cfg.index_head_dim, cfg.rms_norm_eps)
        object.__setattr__(self, "rotary", rotary)

    def keys(self, latent: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """Before quantization (the cache's codec quantizes)."""
        return self.rotary(self.k_norm(self.wk(latent)), at)

    def queries(self, qr: torch.Tensor, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = self.rotary(self.wq_b(qr).view(qr.shape[0], self.num_heads, self.head_dim), positions)
        return INDEXER_FP4.fake(q).float(), self.weights_proj(x).float() * self.num_heads**-0.5


class Attention(nn.Module):
    """Shared-KV multi-query attention over the window (every layer's own) and, in compressed layers,
    the entries of its KV source's cache picked by the indexer (its own, or the last index source's)."""

    store_quantized = True  # the caches hold the codecs' bytes; False: the same values, dequantized

    def __init__(self, cfg: DeepseekV41Config, layer: int, ropes: dict[str, Rope], par: ParallelContext = SINGLE,
                 max_position: int = 0):
        super().__init__()
        self.layer, self.ratio = layer, cfg.compress_ratios[layer]
        self.source = cfg.kv_source(layer)
        self.is_source = self.source == layer
        self.is_index = layer in cfg.index_source_layer_ids and self.ratio > 0
        self.is_candidate_source = layer == cfg.candidate_source_layer_id
        self.uses_candidates = self.is_index and 0 <= cfg.candidate_source_layer_id < layer
        self.candidate_topk_blocks, self.candidate_block_size = cfg.candidate_topk_blocks, cfg.candidate_block_size
        self.num_heads = divide(cfg.num_attention_heads, par.tp_size, "num_attention_heads")
        self.groups = divide(cfg.o_groups, par.tp_size, "o_groups")
        self.head_dim, self.window = cfg.head_dim, cfg.sliding_window
        self.wq_a = Linear(cfg.hidden_size, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = ColumnParallelLinear(cfg.q_lora_rank, cfg.num_attention_heads * cfg.head_dim, par=par)
        self.wkv = Linear(cfg.hidden_size, cfg.head_dim)
        self.kv_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.wo_a = ColumnParallelLinear(cfg.num_attention_heads * cfg.head_dim // cfg.o_groups,
                                         cfg.o_groups * cfg.o_lora_rank, par=par)
        self.wo_b = RowParallelLinear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, par=par)
        self.attn_sink = _fp32(self.num_heads)
        rank, heads = par.tp_rank, self.num_heads
        self.attn_sink.weight_loader = lambda p, t, _: p.data.copy_(materialize(t.narrow(0, rank * heads, heads)))
        rotary = ropes["compress" if self.ratio else "main"]
        object.__setattr__(self, "rotary", rotary)
        self.compressor = (Compressor(cfg.hidden_size, cfg.head_dim, self.ratio, cfg.rms_norm_eps)
                           if self.is_source else None)
        self.indexer = Indexer(cfg, self.is_source, rotary) if self.is_index else None
        q = self.store_quantized
        self.window_codec = CacheCodec(WINDOW_FP8, cfg.head_dim, q)
        self.entry_codec = CacheCodec(COMPRESSED_FP4, cfg.head_dim, q)
        self.key_codec = CacheCodec(INDEXER_FP4, cfg.index_head_dim, q)
        self.window_cache: torch.Tensor | None = None  # bound by the model runner: [pages + 1, block_size, width]
        self.window_page: torch.Tensor | None = None  # block -> its window page (KVPool), as V4's
        self.compressed_cache: torch.Tensor | None = None  # the KV source's (this layer's if it is one)
        self.indexer_cache: torch.Tensor | None = None
        self.state_cache: torch.Tensor | None = None

    def kv_cache_specs(self, dtype: torch.dtype) -> list[KVCacheSpec]:
        """The window of every layer; a KV source's entries, indexer keys and open group."""
        width, wdtype = self.window_codec.spec_width(dtype)
        specs = [KVCacheSpec("window", self.layer, width, wdtype, window=self.window)]
        if self.is_source:
            width, edtype = self.entry_codec.spec_width(dtype)
            specs.append(KVCacheSpec("compressed", self.layer, width, edtype, compress_ratio=self.ratio))
            width, kdtype = self.key_codec.spec_width(dtype)
            specs.append(KVCacheSpec("indexer_keys", self.layer, width, kdtype, compress_ratio=self.ratio))
            if self.compressor.state_width:
                specs.append(KVCacheSpec("compressor_state", self.layer, self.compressor.state_width, torch.float32,
                                         has_block_state=True))
        return specs

    def bind(self, pool: KVPool) -> None:
        self.window_cache = pool.cache(self.layer, "window")
        self.window_page = pool.window_page
        if self.source is not None:
            self.compressed_cache = pool.cache(self.source, "compressed")
            self.indexer_cache = pool.cache(self.source, "indexer_keys")
            if self.is_source and self.compressor.state_width:
                self.state_cache = pool.cache(self.layer, "compressor_state")

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens, dim = x.shape[0], self.head_dim
        qr = self.q_norm(self.wq_a(x))
        q = self.rotary(self.wq_b(qr).view(num_tokens, self.num_heads, dim), positions)
        kv = self.rotary(self.kv_norm(self.wkv(x)), positions)
        slots = window_slots(self.window_page, meta.slot_mapping, meta.block_size)
        self.window_codec.write(self.window_cache, slots, kv)
        if self.is_source:
            self._compress(x, meta)
        iq = iw = None
        if self.indexer is not None:
            iq, iw = self.indexer.queries(qr, x, positions)
        out = self._attend(positions, q, meta, iq, iw)
        out = self.rotary(out, positions, inverse=True)  # K = V carried RoPE into the output
        grouped = out.view(num_tokens, self.groups, -1).transpose(0, 1)  # [g, T, heads/g * head_dim]
        w = self.wo_a.weight.view(self.groups, -1, grouped.shape[-1])
        o = torch.bmm(grouped, w.transpose(1, 2).to(grouped.dtype)).transpose(0, 1).flatten(1)
        return self.wo_b(o)

    def _compress(self, x: torch.Tensor, meta: AttentionMetadata) -> None:
        """Write the entries (and indexer keys) this step closes, and each row's open group."""
        cg = self.compressor.project(x)
        m, bs = self.ratio, meta.block_size
        for row in rows_of(meta):
            n = row.num_cached
            held = None
            if n % m:
                held = self.state_cache[row.table[(n - 1) // bs], 0]
            latent, first, state = self.compressor.entries(cg[row.start: row.end], n, held, x.dtype)
            if latent.shape[0]:
                at = (first + torch.arange(latent.shape[0], device=x.device)) * m
                slots = entry_slots(row.table, first, latent.shape[0], m, bs)
                self.key_codec.write(self.indexer_cache, slots, self.indexer.keys(latent, at))
                self.entry_codec.write(self.compressed_cache, slots, self.rotary(latent, at))
            if state is not None:
                self.state_cache[row.table[(row.context_len - 1) // bs], 0] = state

    # queries attended at once: bounds the [queries, heads, keys] logits
    query_piece = 256

    def _attend(self, positions: torch.Tensor, q: torch.Tensor, meta: AttentionMetadata, iq, iw) -> torch.Tensor:
        """Row by row over the host's lists, in pieces of queries. The index source's picks (and the
        candidate blocks) of each piece are left in the step's shared state for the layers after it."""
        dim, bs, dev = self.head_dim, meta.block_size, q.device
        shared = meta._v41_shared
        out = torch.empty_like(q)
        for i, row in enumerate(rows_of(meta)):
            for start in range(row.start, row.end, self.query_piece):
                end = min(start + self.query_piece, row.end)
                t = positions[start:end]
                p0 = row.num_cached + start - row.start
                p1 = p0 + end - start
                first = max(0, p0 - self.window + 1)
                slots = window_slots(self.window_page, token_slots(row.table, first, p1, bs), bs)
                keys = [self.window_codec.read(self.window_cache, slots, q.dtype)]
                allowed = [window_mask(t, torch.arange(first, p1, device=dev), self.window)]
                entries = p1 // self.ratio if self.ratio else 0
                if entries:
                    slots = entry_slots(row.table, 0, entries, self.ratio, bs)
                    if self.indexer is not None:
                        shared[(i, start)] = self._pick(iq[start:end], iw[start:end], t, slots, entries, (i, start),
                                                        shared)
                    keys.append(self.entry_codec.read(self.compressed_cache, slots, q.dtype))
                    allowed.append(shared[(i, start)])
                out[start:end] = attend(q[start:end], torch.cat(keys), torch.cat(allowed, 1), self.attn_sink,
                                        dim**-0.5)
        return out

    def _pick(self, iq, iw, t, slots, entries: int, key, shared: dict) -> torch.Tensor:
        """The entries [t, entries] each query attends: the top-k visible (inside the candidate blocks
        after the candidate source) by the indexer's scores."""
        counts = (t + 1) // self.ratio
        visible = torch.arange(entries, device=t.device)[None, :] < counts[:, None]
        ikeys = self.key_codec.read(self.indexer_cache, slots, torch.float32)
        scores = indexer_scores(iq, iw, ikeys, self.indexer.head_dim**-0.5).masked_fill(~visible, NEG_INF)
        if self.is_candidate_source:
            shared[("candidates", key)] = candidate_blocks(scores, counts, self.candidate_topk_blocks,
                                                           self.candidate_block_size)
        elif self.uses_candidates and ("candidates", key) in shared:
            scores = scores.masked_fill(~shared[("candidates", key)], NEG_INF)
        top = scores.topk(min(self.indexer.top_k, entries), dim=-1)
        return torch.zeros_like(visible).scatter_(1, top.indices, top.values > NEG_INF)


class Gate(nn.Module):
    """Scores s = sqrt(softplus(W x / gate_temp)) in float32; experts: top-k of s + bias (`bias_vl` for
    image tokens); weights s[picked], normalized when more than one, times routed_scaling_factor."""

    def __init__(self, cfg: DeepseekV41Config):
        super().__init__()
        self.top_k, self.scale, self.temp = cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.gate_temp
        self.normalize = cfg.norm_topk_prob and cfg.num_experts_per_tok > 1
        self.weight = _fp32(cfg.n_routed_experts, cfg.hidden_size)
        self.bias = _fp32(cfg.n_routed_experts)
        self.bias_vl = _fp32(cfg.n_routed_experts)

    def forward(self, x: torch.Tensor, is_image: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.softplus(F.linear(x.float(), self.weight) / self.temp).sqrt()
        bias = self.bias if is_image is None else torch.where(is_image[:, None], self.bias_vl, self.bias)
        ids = (scores + bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids


class MoE(nn.Module):
    def __init__(self, cfg: DeepseekV41Config, par: ParallelContext = SINGLE):
        super().__init__()
        self.par = par
        self.gate = Gate(cfg)
        self.experts = FusedExperts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, None, par,
                                    swiglu_limit=cfg.swiglu_limit)
        self.shared_experts = Expert(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                     cfg.swiglu_limit, par)

    def forward(self, x: torch.Tensor, is_image: torch.Tensor | None) -> torch.Tensor:
        weights, ids = self.gate(x, is_image)
        return self.par.all_reduce(self.experts(x, weights, ids) + self.shared_experts(x))


class Block(nn.Module):
    """One layer over the streams [T, hc, hidden] with the single-pass mHC: the attention site collapses
    the streams by the previous site's `pre` (`pre_in`), the FFN site by the attention site's; the FFN
    site's `pre` goes on to the next layer. Each site spreads its output by its `post` and mixes the
    streams by its `comb`."""

    def __init__(self, cfg: DeepseekV41Config, layer: int, ropes: dict[str, Rope], par: ParallelContext = SINGLE,
                 max_position: int = 0):
        super().__init__()
        n = cfg.hc_mult
        self.hc = (n, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer, ropes, par, max_position)
        self.ffn = MoE(cfg, par)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", _fp32((2 + n) * n, n * cfg.hidden_size))
            setattr(self, f"hc_{site}_base", _fp32((2 + n) * n))
            setattr(self, f"hc_{site}_scale", _fp32(3))
        self.engram = None
        if layer in cfg.engram_layer_ids:
            k = cfg.engram_layer_ids.index(layer)
            self.engram = Engram(cfg.hidden_size, n, (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads,
                                 cfg.engram_head_dim, cfg.engram_num_embeddings[k], cfg.rms_norm_eps)

    def _site(self, h: torch.Tensor, pre_in: torch.Tensor, site: str, sublayer) -> tuple[torch.Tensor, torch.Tensor]:
        pre, post, comb = hc_weights(h, *(getattr(self, f"hc_{site}_{p}") for p in ("fn", "base", "scale")), *self.hc)
        y = sublayer(collapse(h, pre_in))
        out = post.unsqueeze(-1) * y.float().unsqueeze(1) + torch.einsum("tjk,tjd->tkd", comb, h.float())
        return out.to(h.dtype), pre

    def forward(self, positions: torch.Tensor, h: torch.Tensor, pre: torch.Tensor, meta: AttentionMetadata,
                engram_rows: EngramRows | None, is_image: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.engram is not None:  # rows gathered before layer 0; from host memory they may still be on their way
            h = self.engram(h, engram_rows.wait(), None if is_image is None else ~is_image)
        h, pre = self._site(h, pre, "attn", lambda x: self.attn(positions, self.attn_norm(x), meta))
        return self._site(h, pre, "ffn", lambda x: self.ffn(self.ffn_norm(x), is_image))


def collapse(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """The streams [T, n, hidden] weighted by pre [T, n] (float32) -> [T, hidden]."""
    return (pre.unsqueeze(-1) * h.float()).sum(dim=1).to(h.dtype)


class DeepseekV41ForCausalLM(DeepseekV4Base, VisionLanguageModel):
    cuda_graphs = False  # every step runs eagerly over the host's row lists (no device-only decode path yet)

    def __init__(self, cfg: DeepseekV41Config, max_position: int, par: ParallelContext = SINGLE):
        super().__init__(cfg, max_position, par, Block)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.engram_hash = None
        self._hash_cpu: EngramHash | None = None  # its copy on the host, where the tables are
        if cfg.engram_layer_ids:
            self.engram_hash = EngramHash(list(cfg.engram_layer_ids), cfg.engram_max_ngram_size, cfg.engram_n_heads,
                                          cfg.engram_vocab_size, cfg.engram_compressed_vocab_size, cfg.engram_pad_id)
        if cfg.vision is not None:
            self.init_vision(cfg.vision, cfg.hidden_size)

    @property
    def lookback(self) -> int:
        """Token ids a step needs before each row's first new token (Engram's n-grams); 0 without Engram."""
        return self.engram_hash.context if self.engram_hash is not None else 0

    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor's name as this model spells it; None for what the model does not use (the
        DSpark draft layers `mtp.*`; the vision tower `vision.*`, `aligner.*`, `image_*` where the model
        was built without one)."""
        name = name.removeprefix("model.")
        if name.startswith("mtp.") or (self.config.vision is None and name.startswith(("vision.", "aligner.", "image_"))):
            return None
        name = re.sub(r"^embed_tokens\.", "embed.", name)
        name = re.sub(r"^lm_head\.", "head.", name)
        return re.sub(r"^engram_tables\.(\d+)\.", r"layers.\1.engram.embed.", name)

    def bind_tokenizer(self, tokenizer_file: str | None) -> None:
        """Engram's compressed token map from the checkpoint's tokenizer.json; without one (random
        weights) ids fold onto the compressed range by remainder."""
        if self.engram_hash is None:
            return
        if tokenizer_file is None:
            n = self.config.engram_compressed_vocab_size or self.config.vocab_size
            self.engram_hash.bind([i % n for i in range(self.config.vocab_size)], n)
        else:
            self.engram_hash.bind(*compressed_token_map(tokenizer_file))
        self._hash_to_host()

    def place_engram_tables(self, where: str) -> None:
        for layer in self.layers:
            if layer.engram is not None:
                layer.engram.embed.place(where)
        self._hash_to_host()

    def _hash_to_host(self) -> None:
        """Tables in host memory: the hash's buffers (token map included) on the host too, for the steps
        whose tokens the host knows."""
        if self.engram_on_host:
            object.__setattr__(self, "_hash_cpu", copy.deepcopy(self.engram_hash).cpu())  # not a submodule

    @property
    def engram_on_host(self) -> bool:
        return any(layer.engram is not None and layer.engram.embed.on_host for layer in self.layers)

    def engram_ids(self, input_ids: torch.Tensor, lookback: torch.Tensor | None, query_start: torch.Tensor,
                   query_lens: list[int], is_image: torch.Tensor | None, hasher: EngramHash) -> torch.Tensor:
        """Each Engram layer's table rows [T, L, cols] of the step's tokens input_ids [T], on their device
        (query_start [B + 1] there too): the n-gram of every token reaches back into the tokens before its
        row's chunk through lookback [B, context] (None: nothing before)."""
        ctx, dev = self.lookback, input_ids.device
        lens = torch.tensor(query_lens, device=dev)
        row_of = torch.repeat_interleave(torch.arange(len(query_lens), device=dev), lens)
        idx = torch.arange(input_ids.shape[0], device=dev)
        j = idx - query_start[row_of]  # the token's index in its chunk
        if lookback is None:
            lookback = torch.full((len(query_lens), ctx), -1, device=dev)
        history = []
        for s in range(ctx, 0, -1):  # oldest first
            inside = input_ids[(idx - s).clamp(min=0)]
            before = lookback[row_of, (ctx + j - s).clamp(0, ctx - 1)]
            history.append(torch.where(j >= s, inside, before))
        history = torch.stack(history, 1)  # [T, ctx]
        if self.config.vision is not None:  # earlier image tokens end an n-gram too: every span position has its id
            history = history.masked_fill(history == self.config.vision.image_token_id, -1)
        return hasher(input_ids, history, is_image)

    def engram_rows(self, input_ids: torch.Tensor, meta: AttentionMetadata, is_image: torch.Tensor | None
                    ) -> dict[int, EngramRows]:
        """Each Engram layer's table rows for the step [T, cols, head_dim], gathered before layer 0. Tables
        in host memory: the ids hashed on the host where it knows the step's tokens (nothing waits on the
        device), else (a step launched ahead, its input drawn on the device; image tokens) hashed on the
        device and read back once here; the rows gathered into pinned memory and copied on a side stream
        while the layers before the Engram layer run."""
        layers, lens = self.config.engram_layer_ids, meta.query_lens_cpu
        tables = [self.layers[layer].engram.embed for layer in layers]
        if not self.engram_on_host:
            ids = self.engram_ids(input_ids, meta.lookback, meta.query_start_loc, lens, is_image, self.engram_hash)
            return {layer: EngramRows(table(ids[:, k])) for k, (layer, table) in enumerate(zip(layers, tables))}
        if meta.input_ids_cpu is not None and is_image is None:
            lookback = (torch.tensor(meta.lookback_cpu).view(len(lens), -1) if meta.lookback_cpu is not None
                        else None)
            ids = self.engram_ids(torch.tensor(meta.input_ids_cpu), lookback, torch.tensor(meta.query_start_loc_cpu),
                                  lens, None, self._hash_cpu)
        else:
            ids = self.engram_ids(input_ids, meta.lookback, meta.query_start_loc, lens, is_image,
                                  self.engram_hash).cpu()
        return {layer: table.fetch(ids[:, k], input_ids.device) for k, (layer, table) in enumerate(zip(layers, tables))}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                is_image: torch.Tensor | None = None, image_embeds: ImageEmbeds | None = None) -> torch.Tensor:
        """input_ids, positions: [T]; is_image [T] bool (image tokens: the routers' vision bias, dead for
        Engram) or None (text); image_embeds: the image spans' rows this step covers (their is_image wins)
        -> hidden states [T, hidden]."""
        meta._v41_shared = {}  # the index sources' picks for the layers after them, this step
        x = self.embed(input_ids)
        if image_embeds is not None:
            x, is_image = image_embeds.merge(x), image_embeds.is_image
        h = x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()  # [T, hc_mult, hidden]
        pre = torch.zeros(h.shape[:2], dtype=torch.float32, device=h.device)
        pre[:, 0] = 1.0  # layer 0's attention site reads stream 0
        rows = self.engram_rows(input_ids, meta, is_image) if self.engram_hash is not None else {}
        for i, layer in enumerate(self.layers):
            h, pre = layer(positions, h, pre, meta, rows.get(i), is_image)
        return self.norm(collapse(h, pre))
