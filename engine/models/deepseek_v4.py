"""DeepSeek-V4: hybrid compressed attention (sliding window + CSA / HCA), mHC residual streams, MoE with
sqrt-softplus routing and hash-routed first layers.

Module and parameter names are DeepSeek's (layers.N.attn.wq_a, layers.N.hc_attn_fn, ffn.experts.E.w1,
embed, head); `checkpoint_name` maps the transformers 5 spellings of a saved checkpoint onto them.
Shapes below for V4 Flash: hidden 4096, 64 heads of 512 (the last 64 rotary), q LoRA 1024, 8 output
groups of LoRA 1024, 4 residual streams, 256 experts top-6 of width 2048 plus one shared.

Speculative decoding drafts with the checkpoint's MTP block (`mtp.0`, `MultiTokenPredictor`). A
verification (a sequence's last token and its k drafts, k + 1 rows at consecutive positions) runs through
the decode path, a row per token, in the decode CUDA graphs (`graph_chunk_tokens`: chunks of up to k + 1
tokens take them; longer chunks run eagerly, row by row, `Attention._prefill`). Within a step every
layer writes all rows' window rows, then its compressors write the entries the rows close, then the
attention reads: each row sees the window rows and entries of the rows before it, as causal attention
does, and the indexer and the dual-pool attention take each row's own counts from its position. What
is not a row per position is the compressors' open state (one row per block): a sequence's rows are
folded into it in order (`AttentionMetadata.query_index`: the kernel's program at the sequence's first
row folds its rows one after another, the PyTorch path runs pass j over every sequence's row j), so row
j starts from the state row j - 1 left, as a decode step after it would. The MTP draft over the rows and
the drafts after it replay graphs of their own (`DraftGraphs`), and a greedy step of verifications runs
verification, acceptance, rollback and drafts in one (`SpecGraphs`). What its rejected rows leave
behind, and why the next steps read only what the accepted tokens alone would have written:
  - Window rows and compressed / indexer entries: a row per position, and an entry closed at position
    p is visible only to queries at t >= p. In the step itself the rows at or past a rejected position
    are rejected too (their draws are dropped). The next step's first row is the first rejected
    position, and each step writes its positions' window rows and the entries its tokens close before
    its attention reads them (the compressors run first); a step that does not reach p has no query
    that sees p. The prefix cache registers only full blocks of accepted tokens.
  - The compressors' open state (float32, one row per block, updated in place) is not derivable from
    the entries: the step leaves the state after its last row, rejected drafts folded in, in the row of
    the last block it reaches. So each compressor also keeps the state after each token of a
    verification (`Compressor.candidates`: through the decode path, each row's state as it folds it,
    into buffers that outlive the step so a graph's replay writes them; eagerly, each chunk's first
    k + 1 tokens folded one at a time from the state its block held before the step), and once the
    accepted counts are known on the device (`keep_accepted`, before the MTP pass, or inside the fused
    graph) the state after the last accepted token is written to the row of the block holding that
    token: the state a step ending at that token leaves, which the next step reads (the row of the block
    holding the token before its first). It is exact:
    a function of the accepted tokens only, the same fold plain decoding runs. Rows of blocks past it
    (reached by rejected rows only) are rewritten by the next step that reaches them before anyone
    reads them (a step writes the state row of every block it reaches); a full block's row, the state at
    its end, depends on its own tokens only, so a rollback never changes it but to the same value.
  - The MTP block attends its sliding window only: its window rows are the target's case above.
"""

import dataclasses
import re

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import DeepseekV4Config, QuantConfig
from engine.copies import to_device
from engine.kv_pool import KVCacheSpec, KVPool, window_slots
from engine.layers.attention import AttentionMetadata, write_kv_cache
from engine.layers.compressed_attention import (
    WindowPooler,
    attend,
    decode_pool,
    empty_state,
    entry_slots,
    indexer_picks,
    indexer_topk,
    pooled,
    rows_of,
    table_entry_slots,
    table_slots,
    token_slots,
    window_mask,
)
from engine.layers.linear import (
    ColumnParallelLinear,
    Linear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from engine.layers.moe import FusedExperts
from engine.layers.rotary import rope_inv_freq
from engine.loader import materialize
from engine.parallel import SINGLE, ParallelContext, divide


def _fp32(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=torch.float32), requires_grad=False)


class RMSNorm(nn.Module):
    """V4 keeps norm weights in float32 and applies them in float32, casting once at the end."""

    use_kernels = False  # one Triton launch a call (engine.kernels.norm_rope); set by the model runner

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernels and x.dim() >= 2 and x.is_contiguous():
            from engine.kernels.norm_rope import norm_rope

            return norm_rope(x, self.weight, self.eps)
        y = x.float()
        return (self.weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class Rope(nn.Module):
    """Interleaved pairs (2i, 2i + 1) on the last `dim` features, rotated in float32; V4 does not scale
    cos/sin by YaRN's mscale. inverse=True rotates by -theta (the attention output's rope part)."""

    use_kernels = False  # one Triton launch a call (engine.kernels.norm_rope); set by the model runner

    def __init__(self, dim: int, max_position: int, theta: float, scaling):
        super().__init__()
        inv_freq, _ = rope_inv_freq(dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)  # [max_position, dim // 2]
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)
        self.dim = dim

    def forward(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """x: [N, ..., D], positions: [N]."""
        if self.use_kernels and x.dim() >= 2 and x.is_contiguous():
            from engine.kernels.norm_rope import norm_rope

            return norm_rope(x, positions=positions, cos=self.cos_cache, sin=self.sin_cache, inverse=inverse)
        cos, sin = self.cos_cache[positions], self.sin_cache[positions]
        if inverse:
            sin = -sin
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
        cos, sin = cos.view(shape), sin.view(shape)
        rope = x[..., -self.dim:].float()
        x1, x2 = rope[..., 0::2], rope[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        return torch.cat([x[..., : -self.dim], rotated.to(x.dtype)], dim=-1)


def kept_tokens(meta: AttentionMetadata, count: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's first `count` tokens as flat indices of the step [R, count] (past the row's end, its last
    token again) and whether each is the row's own [R, count] bool; built once a step, shared by the layers."""
    kept = getattr(meta, "_v4_kept", None)
    if kept is None:
        qs = meta.query_start_loc_cpu
        index = [[min(qs[i] + j, qs[i + 1] - 1) for j in range(count)] for i in range(len(qs) - 1)]
        valid = [[int(qs[i] + j < qs[i + 1]) for j in range(count)] for i in range(len(qs) - 1)]
        both = to_device([index, valid], torch.long, device)  # one copy for both
        kept = meta._v4_kept = (both[0], both[1] > 0)
    return kept


class Compressor(nn.Module):
    """Pools each closed window of `ratio` tokens into one entry: per channel a softmax over the window's
    slots of wgate(x) + ape (position in the window) weighting wkv(x), then `norm` and RoPE at the window's
    first position. With overlap (CSA) wkv/wgate give 2 * dim: entry w pools series A of window w-1
    with series B of window w."""

    # rows of at most this many tokens (a verification: its last token and the drafts) keep the state
    # after each of their first tokens in `candidates`, for `Attention.keep_accepted`; 0: none (no
    # speculative decoding). Set by `keep_states`.
    kept_rows = 0

    def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, eps: float, rotary: Rope):
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.ratio = dim, ratio
        # the last step's states after its tokens [N, state_width], the block each belongs to [N], and where
        # each of the step's tokens finds its own among them [T] (None: N is the step's tokens); None once
        # committed
        self.candidates: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
        # decode steps keep each row's state here ([rows, state_width] float32, [rows] int64): buffers that
        # outlive the step, so a CUDA graph's replay writes where `candidates` points
        self.kept: tuple[torch.Tensor, torch.Tensor] | None = None
        self.wkv = Linear(hidden, width)
        self.wgate = Linear(hidden, width)
        self.ape = _fp32(ratio, width)
        self.norm = RMSNorm(dim, eps)
        self.pooler = WindowPooler(dim, ratio, overlap)
        object.__setattr__(self, "rotary", rotary)  # shared with the layer, not a submodule of each

    @property
    def state_width(self) -> int:
        return self.pooler.state_width

    def keep_states(self, num_rows: int, max_decode_rows: int) -> None:
        """Keep the state after each of a row's first num_rows tokens (eager chunks) and after each decode
        row of steps of up to max_decode_rows rows."""
        self.kept_rows = num_rows
        dev = self.ape.device
        self.kept = (torch.empty(max_decode_rows, self.state_width, dtype=torch.float32, device=dev),
                     torch.zeros(max_decode_rows, dtype=torch.long, device=dev)) if num_rows else None

    def decode_rows_kept(self, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decode step of n rows keeps each row's state in the first n rows of `kept`; `candidates` points
        there. Called by the step's forward, and after a CUDA graph's replay of it (which runs no Python)."""
        kept = (self.kept[0][:n], self.kept[1][:n]) if self.kept is not None and n <= self.kept[0].shape[0] else None
        # (a step past the buffers is one of plain decodes: nothing of it is ever rolled back)
        self.candidates = (*kept, None) if kept is not None else None
        return kept

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, cache: torch.Tensor,
                state: torch.Tensor, offset: int, decode: bool, kernel: bool = False) -> None:
        """Write the entries this step closes into `cache` and each touched block's open state into
        state[:, 0, offset : offset + state_width]; decode: a token per row, from device tensors only
        (kernel: in one Triton launch after the two projections), a sequence's rows (`meta.query_index`)
        folded in order."""
        if decode:
            kept = self.decode_rows_kept(x.shape[0])
            rows = max(1, self.kept_rows)
            if kernel:
                from engine.kernels.compressor import compress_decode

                compress_decode(self.wkv(x), self.wgate(x), self.ape, positions, meta.block_tables, state, offset,
                                cache, self.norm.weight, self.norm.eps, self.rotary.cos_cache, self.rotary.sin_cache,
                                self.ratio, self.pooler.overlap, meta.query_index, rows, kept)
                return
        c = self.wkv(x).float()
        g = self.wgate(x).float() + self.ape[positions % self.ratio]
        if decode:
            self._decode(c, g, positions, meta.block_tables.long(), meta.block_size, cache, state, offset,
                         meta.query_index, rows, kept)
        else:
            # before _prefill writes the state each row starts from; steps of longer chunks only verify nothing
            if self.kept_rows and min(meta.query_lens_cpu) <= self.kept_rows:
                self.candidates = self._candidates(c, g, positions, meta, state, offset)
            else:
                self.candidates = None
            self._prefill(c, g, meta, cache, state, offset)

    def _candidates(self, c: torch.Tensor, g: torch.Tensor, t: torch.Tensor, meta: AttentionMetadata,
                    state: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's state after each of its first kept_rows tokens, folded in one token at a time as a
        decode step does (`decode_pool`), from the state its block holds before the step -> (states [R *
        kept_rows, state_width], their blocks [R * kept_rows], each token's index among them [T]). Past a
        row's end the last state repeats."""
        index, valid = kept_tokens(meta, self.kept_rows, c.device)  # [R, kept_rows]
        width, bs = self.state_width, meta.block_size
        tables = meta.block_tables.long()
        pos = t[index]
        before = tables.gather(1, ((pos[:, 0] - 1).clamp(min=0) // bs)[:, None])[:, 0]
        held = torch.where((pos[:, :1] > 0), state[before, 0, offset: offset + width],
                           empty_state(width, self.dim, c.device))
        states = []
        for j in range(self.kept_rows):
            _, _, after = decode_pool(self.pooler, c[index[:, j]], g[index[:, j]], pos[:, j], held)
            held = torch.where(valid[:, j, None], after, held)
            states.append(held)
        # a token past its row's kept ones is never a verification's: any index does; past a row's end
        # `index` repeats its last token, whose states are all alike
        at = torch.zeros(t.shape[0], dtype=torch.long, device=c.device)
        at.scatter_(0, index.flatten(), torch.arange(index.numel(), device=c.device))
        return torch.stack(states, 1).flatten(0, 1), tables.gather(1, pos // bs).flatten(), at

    def _prefill(self, c: torch.Tensor, g: torch.Tensor, meta: AttentionMetadata, cache: torch.Tensor,
                 state: torch.Tensor, offset: int) -> None:
        """Row by row over the host's lists."""
        bs, width = meta.block_size, self.state_width
        flat = cache.view(-1, self.dim)
        for row in rows_of(meta):
            n = row.num_cached
            held = state[row.table[(n - 1) // bs], 0, offset: offset + width] if n else None
            acc, first, states = self.pooler.run(c[row.start: row.end], g[row.start: row.end], n, held, bs)
            if acc.shape[0]:
                entries = self.norm(pooled(acc))
                at = (first + torch.arange(acc.shape[0], device=c.device)) * self.ratio
                entries = self.rotary(entries, at)
                flat.index_copy_(0, entry_slots(row.table, first, acc.shape[0], self.ratio, bs), entries.to(flat.dtype))
            for block, row_state in states:
                state[row.table[block], 0, offset: offset + width] = row_state

    def _decode(self, c: torch.Tensor, g: torch.Tensor, t: torch.Tensor, tables: torch.Tensor, block_size: int,
                cache: torch.Tensor, state: torch.Tensor, offset: int, query_index: torch.Tensor | None = None,
                max_rows: int = 1, kept: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """An entry closed by a row's token is written, the other rows' go to the scratch block's rows. With
        query_index (each row's index among its sequence's consecutive rows, < max_rows), pass j folds
        every sequence's row j from the state its row j - 1 wrote in pass j - 1; the rows of other passes
        write to the scratch block. kept: gets each row's state after its token and its block."""
        width, m = self.state_width, self.ratio
        scratch_block = cache.shape[0] - 1
        scratch = scratch_block * cache.shape[1]  # the scratch block's first row
        flat = cache.view(-1, self.dim)
        before = tables.gather(1, ((t - 1).clamp(min=0) // block_size)[:, None])[:, 0]
        here = tables.gather(1, (t // block_size)[:, None])[:, 0]
        entry_at = table_entry_slots(tables, (t // m)[:, None], m, block_size)[:, 0]
        if kept is not None:
            kept[1].copy_(here)
        for j in range(max_rows if query_index is not None else 1):
            now = None if query_index is None else query_index == j
            held = torch.where((t > 0)[:, None], state[before, 0, offset: offset + width],
                               empty_state(width, self.dim, c.device))
            cur, closing, after = decode_pool(self.pooler, c, g, t, held)
            entries = self.rotary(self.norm(pooled(cur)), t // m * m)
            writes = closing if now is None else closing & now
            flat.index_copy_(0, torch.where(writes, entry_at, scratch), entries.to(flat.dtype))
            state[here if now is None else torch.where(now, here, scratch_block), 0, offset: offset + width] = after
            if kept is not None:
                kept[0].copy_(after if now is None else torch.where(now[:, None], after, kept[0]))


class Indexer(nn.Module):
    """The lightning indexer of CSA layers: its own compressor at index_head_dim (the keys), queries
    from the q LoRA, per-head weights from the layer input."""

    def __init__(self, cfg: DeepseekV4Config, rotary: Rope):
        super().__init__()
        self.num_heads, self.head_dim, self.top_k = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, quant=cfg.quant)
        self.weights_proj = Linear(cfg.hidden_size, cfg.index_n_heads)  # bf16, as are the compressors'
        self.compressor = Compressor(cfg.hidden_size, cfg.index_head_dim, cfg.csa_ratio, True, cfg.rms_norm_eps, rotary)
        object.__setattr__(self, "rotary", rotary)

    def queries(self, qr: torch.Tensor, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (queries [T, h, c] after RoPE, head weights [T, h] float32)."""
        q = self.rotary(self.wq_b(qr).view(qr.shape[0], self.num_heads, self.head_dim), positions)
        return q, self.weights_proj(x).float() * self.num_heads**-0.5


class Attention(nn.Module):
    """Shared-KV multi-query attention (one K = V head of head_dim) over the window and the compressed
    entries, a learned sink per head, and the grouped low-rank output projection."""

    use_kernels = False  # decode steps without host lists (CUDA-graph safe); set by the model runner
    # those steps' compressors, indexer and attention as Triton kernels (False: the PyTorch paths,
    # `Compressor._decode` and `_decode_gathered`)
    pool_kernels = True

    def __init__(self, cfg: DeepseekV4Config, layer: int, ropes: dict[str, Rope], par: ParallelContext = SINGLE,
                 max_position: int = 0):
        super().__init__()
        self.layer, self.kind = layer, cfg.layer_kind(layer)
        # the most entries a sequence may have: what a decode step gathers (and masks) per row
        self.max_entries = max_position // cfg.compress_ratios[layer] if cfg.compress_ratios[layer] else 0
        self.ratio = cfg.compress_ratios[layer]
        self.num_heads = divide(cfg.num_attention_heads, par.tp_size, "num_attention_heads")
        self.groups = divide(cfg.o_groups, par.tp_size, "o_groups")
        self.head_dim, self.window, self.eps = cfg.head_dim, cfg.sliding_window, cfg.rms_norm_eps
        quant = cfg.quant  # FP8 128x128 blocks as V4 ships its dense projections (None: dequantized at load)
        self.wq_a = Linear(cfg.hidden_size, cfg.q_lora_rank, quant=quant)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = ColumnParallelLinear(cfg.q_lora_rank, cfg.num_attention_heads * cfg.head_dim, par=par, quant=quant)
        self.wkv = Linear(cfg.hidden_size, cfg.head_dim, quant=quant)
        self.norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)  # the kv norm
        # block-diagonal: group j maps its heads' outputs [heads/g * head_dim] to o_lora_rank
        self.wo_a = ColumnParallelLinear(cfg.num_attention_heads * cfg.head_dim // cfg.o_groups,
                                         cfg.o_groups * cfg.o_lora_rank, par=par, quant=quant)
        self.wo_b = RowParallelLinear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, par=par, quant=quant)
        self.attn_sink = _fp32(self.num_heads)
        rank, heads = par.tp_rank, self.num_heads
        self.attn_sink.weight_loader = lambda p, t, _: p.data.copy_(materialize(t.narrow(0, rank * heads, heads)))
        rotary = ropes["main" if self.kind == "window" else "compress"]
        object.__setattr__(self, "rotary", rotary)
        self.compressor = (Compressor(cfg.hidden_size, cfg.head_dim, self.ratio, self.kind == "csa", cfg.rms_norm_eps,
                                      rotary) if self.kind != "window" else None)
        self.indexer = Indexer(cfg, rotary) if self.kind == "csa" else None
        self.window_cache: torch.Tensor | None = None  # bound by the model runner: [pages + 1, block_size, D]
        self.window_page: torch.Tensor | None = None  # block -> its window page [blocks + 1] int32 (KVPool)
        self.compressed_cache: torch.Tensor | None = None
        self.indexer_cache: torch.Tensor | None = None
        self.state_cache: torch.Tensor | None = None

    def kv_cache_specs(self, dtype: torch.dtype) -> list[KVCacheSpec]:
        # the window: read for the last `window` tokens only, so kept in pages of its own (KVPool)
        specs = [KVCacheSpec("window", self.layer, self.head_dim, dtype, window=self.window)]
        if self.compressor is not None:
            specs.append(KVCacheSpec("compressed", self.layer, self.head_dim, dtype, compress_ratio=self.ratio))
            state = self.compressor.state_width
            if self.indexer is not None:
                specs.append(KVCacheSpec("indexer_keys", self.layer, self.indexer.head_dim, dtype,
                                         compress_ratio=self.ratio))
                state += self.indexer.compressor.state_width
            specs.append(KVCacheSpec("compressor_state", self.layer, state, torch.float32, has_block_state=True))
        return specs

    def keep_accepted(self, tokens: torch.Tensor) -> None:
        """After a verification: tokens [V] (indices among the step's tokens) each verification's last
        accepted one; each compressor's state row of the block that holds it becomes the state after it
        (the step left the state after its last row there)."""
        parts = [(self.compressor, 0)]
        if self.indexer is not None:
            parts.append((self.indexer.compressor, self.compressor.state_width))
        for compressor, offset in parts:
            states, blocks, index = compressor.candidates
            compressor.candidates = None
            at = tokens if index is None else index[tokens]
            self.state_cache[blocks[at], 0, offset: offset + compressor.state_width] = states[at]

    def bind(self, pool: KVPool) -> None:
        self.window_cache = pool.cache(self.layer, "window")
        self.window_page = pool.window_page
        if self.compressor is not None:
            self.compressed_cache = pool.cache(self.layer, "compressed")
            self.state_cache = pool.cache(self.layer, "compressor_state")
        if self.indexer is not None:
            self.indexer_cache = pool.cache(self.layer, "indexer_keys")

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens, dim = x.shape[0], self.head_dim
        qr = self.q_norm(self.wq_a(x))
        q = unweighted_rms_norm(self.wq_b(qr).view(num_tokens, self.num_heads, dim), self.eps)
        q = self.rotary(q, positions)
        kv = self.rotary(self.norm(self.wkv(x)), positions)  # [T, head_dim]
        write_kv_cache(self.window_cache, kv, window_slots(self.window_page, meta.slot_mapping, meta.block_size))
        decode = self.use_kernels and not meta.num_prefills
        pools = self._pools(x)
        iq = iw = None
        if self.compressor is not None:
            self.compressor(x, positions, meta, self.compressed_cache, self.state_cache, 0, decode, pools)
        if self.indexer is not None:
            self.indexer.compressor(x, positions, meta, self.indexer_cache, self.state_cache,
                                    self.compressor.state_width, decode, pools)
            iq, iw = self.indexer.queries(qr, x, positions)
        path = (self._decode if pools else self._decode_gathered) if decode else self._prefill
        out = path(positions, q, meta, iq, iw)
        out = self.rotary(out, positions, inverse=True)  # K = V carried RoPE into the output
        o = self.wo_a.forward_grouped(out.view(num_tokens, -1), self.groups)  # [T, g * o_lora]
        return self.wo_b(o)

    # queries attended at once in a prefill chunk: bounds the [queries, heads, keys] logits (keys: the
    # piece's window plus the entries visible to its last query)
    query_piece = 256

    def _prefill(self, positions: torch.Tensor, q: torch.Tensor, meta: AttentionMetadata, iq, iw) -> torch.Tensor:
        """Row by row over the host's lists (any mix of prefill chunks and decodes), in pieces of queries."""
        dim, bs, dev = self.head_dim, meta.block_size, q.device
        out = torch.empty_like(q)
        window = self.window_cache.view(-1, dim)
        for row in rows_of(meta):
            for start in range(row.start, row.end, self.query_piece):
                end = min(start + self.query_piece, row.end)
                t = positions[start:end]
                p0 = row.num_cached + start - row.start  # the piece's first position
                p1 = p0 + end - start
                first = max(0, p0 - self.window + 1)
                keys = [window[window_slots(self.window_page, token_slots(row.table, first, p1, bs), bs)]]
                allowed = [window_mask(t, torch.arange(first, p1, device=dev), self.window)]
                entries = p1 // self.ratio if self.ratio else 0  # those its last query may see
                if entries:
                    slots = entry_slots(row.table, 0, entries, self.ratio, bs)
                    keys.append(self.compressed_cache.view(-1, dim)[slots])
                    visible = torch.arange(entries, device=dev)[None, :] < ((t + 1) // self.ratio)[:, None]
                    if self.indexer is not None:
                        ikeys = self.indexer_cache.view(-1, self.indexer.head_dim)[slots]
                        visible = indexer_topk(iq[start:end], iw[start:end], ikeys, visible, self.indexer.top_k,
                                               self.indexer.head_dim**-0.5)
                    allowed.append(visible)
                out[start:end] = attend(q[start:end], torch.cat(keys), torch.cat(allowed, 1), self.attn_sink,
                                        dim**-0.5)
        return out

    def _pools(self, x: torch.Tensor) -> bool:
        """Whether decode steps take the pool kernels: asked for, and Triton can run them (CUDA tensors, or
        its interpreter, chosen before its first import); else the PyTorch paths, their reference."""
        from engine.kernels import runs_here

        return self.pool_kernels and runs_here(x)

    def _decode(self, t: torch.Tensor, q: torch.Tensor, meta: AttentionMetadata, iq, iw) -> torch.Tensor:
        """A token per row from device tensors only: the dual-pool kernel reads each row's window rows and
        its visible entries (HCA) or the indexer's top-k of them (CSA), by the row's own counts; the
        indexer scores only the visible entries. `_decode_gathered` is the PyTorch path it replaces."""
        from engine.kernels.compressed_decode import dual_pool_decode, indexer_decode_scores

        picks = None
        if self.indexer is not None:
            scores = indexer_decode_scores(iq, iw, self.indexer_cache, meta.block_tables, t, self.ratio,
                                           self.max_entries, self.indexer.head_dim**-0.5)  # [B, max_entries]
            # unsorted (sorting the k picks costs as much as choosing them): the kernel takes them in any
            # order, and a row with no more than k entries reads them all without the picks
            picks = scores.topk(min(self.indexer.top_k, self.max_entries), dim=-1, sorted=False).indices
        return dual_pool_decode(q, self.window_cache, self.compressed_cache, meta.block_tables, t, self.attn_sink,
                                self.head_dim**-0.5, self.window, self.ratio, picks, window_pages=self.window_page)

    def _decode_gathered(self, t: torch.Tensor, q: torch.Tensor, meta: AttentionMetadata, iq, iw) -> torch.Tensor:
        """The PyTorch decode path: the window's last `window` rows, and every entry up to max_entries
        (HCA) or the indexer's top-k of them (CSA), gathered and masked by what each row may see."""
        dim, bs, dev = self.head_dim, meta.block_size, q.device
        tables = meta.block_tables.long()
        pos = t[:, None] - self.window + 1 + torch.arange(self.window, device=dev)  # [B, window]
        slots = window_slots(self.window_page, table_slots(tables, pos.clamp(min=0), bs), bs)
        keys = [self.window_cache.view(-1, dim)[slots]]
        allowed = [pos >= 0]
        if self.compressor is not None:
            w = torch.arange(self.max_entries, device=dev).expand(t.shape[0], -1)
            slots = table_entry_slots(tables, w, self.ratio, bs)  # [B, max_entries]
            visible = w < ((t + 1) // self.ratio)[:, None]
            if self.indexer is not None:
                ikeys = self.indexer_cache.view(-1, self.indexer.head_dim)[slots]
                picks = indexer_picks(iq, iw, ikeys, visible, self.indexer.top_k, self.indexer.head_dim**-0.5)
                slots, visible = slots.gather(1, picks), visible.gather(1, picks)
            keys.append(self.compressed_cache.view(-1, dim)[slots])
            allowed.append(visible)
        return attend(q, torch.cat(keys, 1), torch.cat(allowed, 1), self.attn_sink, dim**-0.5)


class Expert(nn.Module):
    """SwiGLU with clamped pre-activations (the shared expert): w2(silu(min(w1 x, l)) * clamp(w3 x, -l, l))."""

    def __init__(self, hidden: int, inter: int, limit: float, par: ParallelContext = SINGLE,
                 quant: QuantConfig | None = None):
        super().__init__()
        self.limit = limit
        self.w1 = ColumnParallelLinear(hidden, inter, par=par, quant=quant)
        self.w3 = ColumnParallelLinear(hidden, inter, par=par, quant=quant)
        self.w2 = RowParallelLinear(inter, hidden, par=par, quant=quant, reduce_results=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x).clamp(max=self.limit)
        up = self.w3(x).clamp(min=-self.limit, max=self.limit)
        return self.w2(F.silu(gate) * up)


class Gate(nn.Module):
    """Scores s = sqrt(softplus(W x)) in float32; experts: top-k of s + bias, or (hash layers) a fixed
    table by token id; weights s[picked], normalized, times routed_scaling_factor."""

    def __init__(self, cfg: DeepseekV4Config, hashed: bool):
        super().__init__()
        self.top_k, self.scale, self.hashed = cfg.num_experts_per_tok, cfg.routed_scaling_factor, hashed
        self.scoring_func = cfg.scoring_func
        self.weight = _fp32(cfg.n_routed_experts, cfg.hidden_size)
        if hashed:
            self.tid2eid = nn.Parameter(torch.empty(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.long),
                                        requires_grad=False)
        else:
            self.bias = _fp32(cfg.n_routed_experts)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight)
        if self.scoring_func == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        elif self.scoring_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = logits.softmax(dim=-1)
        if self.hashed:
            ids = self.tid2eid[input_ids]
        else:
            ids = (scores + self.bias).topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scale, ids


class MoE(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, layer: int, par: ParallelContext = SINGLE):
        super().__init__()
        self.par = par
        self.gate = Gate(cfg, cfg.hash_layers[layer])
        # kept as shipped where the model keeps quantized weights (cfg.quant): MXFP4 (expert_dtype "fp4")
        # or FP8 blocks; the shared expert FP8 blocks
        fp4 = cfg.quant is not None and cfg.expert_dtype == "fp4"
        self.experts = FusedExperts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                    None if fp4 else cfg.quant, par, swiglu_limit=cfg.swiglu_limit,
                                    expert_dtype="fp4" if fp4 else None)
        self.shared_experts = Expert(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                     cfg.swiglu_limit, par, cfg.quant)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, input_ids)
        return self.par.all_reduce(self.experts(x, weights, ids) + self.shared_experts(x))


def hc_weights(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int,
               iters: int, eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC at one site: streams [T, n, hidden] -> (pre [T, n], post [T, n], comb [T, n, n]).

    comb is projected onto the doubly stochastic matrices by Sinkhorn-Knopp (iters normalizations)."""
    flat = unweighted_rms_norm(streams.flatten(1).float(), norm_eps)
    mix = F.linear(flat, fn)  # [T, (2 + n) * n]
    pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * scale[2] + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


def hc_head(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
            norm_eps: float) -> torch.Tensor:
    """The streams' final collapse: h [T, n, hidden] -> sum_k pre_k h_k [T, hidden], pre = sigmoid(...) + eps."""
    flat = unweighted_rms_norm(h.flatten(1).float(), norm_eps)
    pre = torch.sigmoid(F.linear(flat, fn) * scale + base) + hc_eps
    return (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)


class Block(nn.Module):
    """One layer over the residual streams [T, hc_mult, hidden]: at each site (attention, then MoE) the
    streams collapse by `pre` into the sublayer's input; its output y spreads back by `post` and the
    streams mix by `comb`: stream_k = post_k * y + sum_j comb[j, k] * stream_j."""

    # each site's weights and collapse, and its mix after the sublayer, as Triton kernels; set by the model runner
    use_kernels = False
    # tiles of tokens whose K the site kernel splits (more tiles fill the GPU unsplit): the tickets it keeps
    hc_split_tiles = 256

    def __init__(self, cfg: DeepseekV4Config, layer: int, ropes: dict[str, Rope], par: ParallelContext = SINGLE,
                 max_position: int = 0):
        super().__init__()
        n = cfg.hc_mult
        self.hc = (n, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer, ropes, par, max_position)
        self.ffn = MoE(cfg, layer, par)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", _fp32((2 + n) * n, n * cfg.hidden_size))
            setattr(self, f"hc_{site}_base", _fp32((2 + n) * n))
            setattr(self, f"hc_{site}_scale", _fp32(3))
        # the site kernel's split-K tickets (zero between launches; both sites run in turn, so they share)
        self.register_buffer("hc_tickets", torch.zeros(self.hc_split_tiles, dtype=torch.int32), persistent=False)

    def collapse(self, h: torch.Tensor, site: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The site's mHC weights and the sublayer's input: h [T, n, hidden] -> (x = sum_i pre_i h_i
        [T, hidden], post [T, n], comb [T, n, n])."""
        fn, base, scale = (getattr(self, f"hc_{site}_{p}") for p in ("fn", "base", "scale"))
        if self.use_kernels:
            from engine.kernels.mhc import hc_site  # first use: Triton picks compiled or interpreted then

            return hc_site(h, fn, base, scale, *self.hc[1:], self.hc_tickets)
        pre, post, comb = hc_weights(h, fn, base, scale, *self.hc)
        return (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype), post, comb

    def _site(self, h: torch.Tensor, site: str, sublayer) -> torch.Tensor:
        x, post, comb = self.collapse(h, site)
        y = sublayer(x)
        if self.use_kernels and h.is_contiguous() and y.is_contiguous():
            from engine.kernels.mhc import hc_mix

            return hc_mix(h, y, post.contiguous(), comb.contiguous())
        return post.to(h.dtype).unsqueeze(-1) * y.unsqueeze(1) + torch.einsum("tjk,tjd->tkd", comb.to(h.dtype), h)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, input_ids: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        h = self._site(h, "attn", lambda x: self.attn(positions, self.attn_norm(x), meta))
        return self._site(h, "ffn", lambda x: self.ffn(self.ffn_norm(x), input_ids))


class DeepseekV4Base(nn.Module):
    """What V4 and V4.1 share around their blocks: the main and compress ropes, embedding and head
    (vocab-parallel under TP), the blocks, their attention layers' cache specs, the expert names."""

    # the routed experts' checkpoint tensors (ffn.experts.E.w1/w3/w2, and where kept quantized their
    # scales, which the loader names after the weight) -> FusedExperts' stacks
    expert_pattern = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w1|w2|w3)\.weight(_scale_inv)?$")
    expert_params = {"w1": ("w13", "w1"), "w3": ("w13", "w3"), "w2": ("w2", "w2")}
    stacked_params: dict = {}
    # decode steps run as CUDA graphs (Attention.use_kernels: no host lists); chunks of up to this many
    # tokens too, as consecutive decode rows whose compressor states are folded in order (verifications,
    # once `keep_verification_states` sizes the buffers for them); longer chunks run eagerly, row by row
    graph_chunk_tokens = 0
    fp8_kernels = False  # FP8 / FP4 weights are dequantized at load (V4.1; V4 keeps them)

    def __init__(self, cfg: DeepseekV4Config, max_position: int, par: ParallelContext, block: type[nn.Module]):
        super().__init__()
        self.config, self.par = cfg, par
        rope_dim = cfg.qk_rope_head_dim
        self.ropes = nn.ModuleDict({
            "main": Rope(rope_dim, max_position, cfg.rope_theta, None),
            "compress": Rope(rope_dim, max_position, cfg.compress_rope_theta, cfg.compress_rope_scaling),
        })
        if par.tp_size == 1:
            self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.embed.weight.requires_grad_(False)
            self.head = Linear(cfg.hidden_size, cfg.vocab_size)
        else:
            self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, par)
            self.head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, par)
        self.layers = nn.ModuleList(block(cfg, i, self.ropes, par, max_position) for i in range(cfg.num_hidden_layers))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()

    def attention_layers(self) -> list[nn.Module]:
        return [layer.attn for layer in self.layers]

    def kv_cache_specs(self, dtype: torch.dtype) -> list[KVCacheSpec]:
        """Per layer: the window (a row per token, K = V; read for the last sliding_window tokens only, so
        the pool may keep it in pages of its own), and in compressed layers the entries, the indexer's keys
        and the compressors' open state (float32, a row per block)."""
        return [spec for attn in self.attention_layers() for spec in attn.kv_cache_specs(dtype)]

    def bind_kv_caches(self, pool: KVPool) -> None:
        for attn in self.attention_layers():
            attn.bind(pool)


class MultiTokenPredictor(Block):
    """DeepSeek-V4's multi-token-prediction layer (`mtp.0`), the speculative draft: position i joins the
    target's residual streams at i (before its hc_head) with the embedding of token i+1, per stream
        h_k = e_proj(enorm(embed(t_{i+1}))) + h_proj(hnorm(stream_k)),
    runs one mHC block over them (sliding-window attention only, its MoE routed by score and bias, never
    by hash) and predicts token i+2 through its own hc_head and norm and the target's head. Embedding and
    head are the target's. Its window cache is a layer of its own (index num_hidden_layers)."""

    def __init__(self, cfg: DeepseekV4Config, layer: int, ropes: dict[str, Rope], par: ParallelContext = SINGLE,
                 max_position: int = 0):
        n = layer + 1 - len(cfg.compress_ratios)  # the block's layer past the target's: window only, no hash
        block = dataclasses.replace(cfg, compress_ratios=cfg.compress_ratios + (0,) * n,
                                    hash_layers=cfg.hash_layers + (False,) * n)
        super().__init__(block, layer, ropes, par, max_position)
        hidden = cfg.hidden_size
        self.enorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.e_proj = Linear(hidden, hidden)
        self.h_proj = Linear(hidden, hidden)
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hc_head_fn = _fp32(cfg.hc_mult, cfg.hc_mult * hidden)
        self.hc_head_base = _fp32(cfg.hc_mult)
        self.hc_head_scale = _fp32(1)
        self.eps = (cfg.hc_eps, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, streams: torch.Tensor, input_ids: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """embeds [T, hidden] of tokens i+1, streams [T, hc_mult, hidden] the target's at i (or this layer's
        own, drafting further ahead) -> this layer's streams [T, hc_mult, hidden] (`collapse_head` reads them)."""
        h = self.e_proj(self.enorm(embeds)).unsqueeze(1) + self.h_proj(self.hnorm(streams))
        return super().forward(positions, h, input_ids, meta)

    def collapse_head(self, h: torch.Tensor) -> torch.Tensor:
        """Its streams [T, hc_mult, hidden] -> the head's input [T, hidden]."""
        return self.norm(hc_head(h, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, *self.eps))


class DeepseekV4ForCausalLM(DeepseekV4Base):
    fp8_kernels = True  # FP8 blocks and MXFP4 experts kept as shipped on the fast path
    def __init__(self, cfg: DeepseekV4Config, max_position: int, par: ParallelContext = SINGLE,
                 num_draft_layers: int = 0):
        """num_draft_layers: the checkpoint's MTP layers to load as speculative drafts (0: none)."""
        super().__init__(cfg, max_position, par, Block)
        n = cfg.hc_mult
        self.hc_head_fn = _fp32(n, n * cfg.hidden_size)
        self.hc_head_base = _fp32(n)
        self.hc_head_scale = _fp32(1)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if num_draft_layers > cfg.num_nextn_predict_layers:
            raise ValueError(f"speculative decoding with MTP needs the checkpoint's multi-token-prediction layer, "
                             f"but its config has num_nextn_predict_layers={cfg.num_nextn_predict_layers}")
        self.mtp = nn.ModuleList(MultiTokenPredictor(cfg, cfg.num_hidden_layers + j, self.ropes, par, max_position)
                                 for j in range(num_draft_layers))

    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor's name as this model spells it; None for tensors it does not use (the MTP
        block `mtp.*` where it does not draft)."""
        name = name.removeprefix("model.")
        m = re.match(r"^mtp\.(\d+)\.", name)
        if m and int(m.group(1)) >= len(self.mtp):
            return None
        name = re.sub(r"\.attn\.kv_norm\.", ".attn.norm.", name)  # DeepSeek's release spells the kv norm so
        name = re.sub(r"^embed_tokens\.", "embed.", name)
        name = re.sub(r"^lm_head\.", "head.", name)
        return re.sub(r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1", name)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] -> the residual streams [T, hc_mult, hidden] after the last layer (the MTP
        layer reads them; `compute_logits` collapses them, as DeepSeek's head does)."""
        x = self.embed(input_ids)
        h = x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()  # [T, hc_mult, hidden]
        for layer in self.layers:
            h = layer(positions, h, input_ids, meta)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Streams [T, hc_mult, hidden] -> collapsed by hc_head, normed, the head's logits [T, vocab] float32."""
        c = self.config
        return self.head(self.norm(hc_head(hidden, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, c.hc_eps,
                                           c.rms_norm_eps))).float()

    # -- speculative decoding ---------------------------------------------------------------------------
    def attention_layers(self) -> list[nn.Module]:
        """The target's attention layers, then the MTP draft's (its window cache)."""
        return [layer.attn for layer in (*self.layers, *self.mtp)]

    def draft(self, next_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
              meta: AttentionMetadata) -> torch.Tensor:
        """The MTP layer over rows at `positions`: next_ids [T] (tokens i+1), hidden [T, hc_mult, hidden] (the
        streams at i) -> its streams [T, hc_mult, hidden], whose `draft_logits` draft tokens i+2."""
        return self.mtp[0](positions, self.embed(next_ids), hidden, next_ids, meta)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The MTP layer's streams -> its hc_head and norm, then the shared head: logits [T, vocab] float32."""
        return self.head(self.mtp[0].collapse_head(hidden)).float()

    def keep_verification_states(self, num_rows: int, max_decode_rows: int) -> None:
        """Steps keep their compressors' state after each of a row's first num_rows tokens (1 + the drafts a
        verification checks), and decode steps of up to max_decode_rows rows after each row, for
        `keep_accepted`; verifications may then run as decode rows (`graph_chunk_tokens`)."""
        self.graph_chunk_tokens = num_rows
        for attn in self.attention_layers():
            for compressor in (attn.compressor, attn.indexer.compressor if attn.indexer is not None else None):
                if compressor is not None:
                    compressor.keep_states(num_rows, max_decode_rows)

    def replayed(self, num_rows: int) -> None:
        """A decode graph of num_rows rows was replayed: its compressors' kept states are where its capture
        put them (`candidates` was last set by whichever step ran in Python)."""
        for attn in self.attention_layers():
            for compressor in (attn.compressor, attn.indexer.compressor if attn.indexer is not None else None):
                if compressor is not None:
                    compressor.decode_rows_kept(num_rows)

    def keep_accepted(self, tokens: torch.Tensor) -> None:
        """After the step just run verified drafts: tokens [V] (indices among the step's tokens) the last
        accepted token of each verification. Every compressor's open state goes back to the one after it
        (window rows and entries at rejected positions are rewritten before anything reads them)."""
        for attn in self.attention_layers():
            if attn.compressor is not None:
                attn.keep_accepted(tokens)
