"""DeepSeek-V3 (also V2, R1, V3.1): MLA attention over a latent cache, MoE with shared experts.

Module and parameter names follow the released checkpoints (model.layers.N.self_attn.kv_a_proj_with_mqa,
mlp.experts.E.gate_proj, ...), so loading is a name map (see `stacked_params`).
"""

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig, QuantConfig
from engine.kv_pool import KVCacheSpec, KVPool
from engine.layers.attention import (
    AbsorbWeights,
    AttentionMetadata,
    mla_decode,
    mla_decode_fast,
    mla_prefill,
    mla_prefill_fast,
    write_kv_cache,
)
from engine.layers.fp8_latent import FP8LatentLayout
from engine.layers.linear import (
    ColumnParallelLinear,
    Linear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    fuse_linears,
)
from engine.layers.moe import FusedExperts, Gate
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, yarn_softmax_scale
from engine.parallel import SINGLE, ParallelContext


class MLA(nn.Module):
    """Multi-head Latent Attention: queries through an optional low-rank (q LoRA), keys and values
    through one shared compressed latent c_kv (kv_lora_rank) plus a shared rotary key k_pe.

    kv_b_proj stays in the activation dtype even in FP8 checkpoints: decode folds it into the query
    and the output (weight absorption) per head."""

    use_kernels = False  # the model runner switches the Triton attention kernels on per instance

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, par: ParallelContext = SINGLE):
        super().__init__()
        self.num_heads = cfg.num_attention_heads // par.tp_size
        self.qk_nope_head_dim, self.qk_rope_head_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = cfg.v_head_dim, cfg.kv_lora_rank
        self.q_lora_rank = cfg.q_lora_rank
        q_out = cfg.num_attention_heads * cfg.qk_head_dim
        quant = cfg.quant
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, q_out, par=par, quant=quant)
        else:
            self.q_a_proj = Linear(cfg.hidden_size, self.q_lora_rank, quant=quant)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, q_out, par=par, quant=quant)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, cfg.kv_cache_dim, quant=quant)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank, cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), par=par
        )
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.v_head_dim, cfg.hidden_size, par=par, quant=quant)
        self.rotary = rotary
        self.softmax_scale = yarn_softmax_scale(cfg.qk_head_dim, cfg.rope_scaling)
        self.kv_cache: torch.Tensor | None = None  # set by the model runner
        self.fused_input_proj: Linear | None = None  # (q_proj or q_a_proj) + kv_a_proj_with_mqa, see fuse()
        self.absorb: AbsorbWeights | None = None  # kv_b_proj for one token's absorptions, see fuse()

    def _apply(self, fn, *args, **kwargs):
        module = super()._apply(fn, *args, **kwargs)
        if self.fused_input_proj is not None:
            self.fuse()  # .to() and casts copy the layers' weights apart: fuse the new copies again
        return module

    def fuse(self) -> None:
        """After loading, for the fast path: the two projections of the layer input as one GEMM."""
        first = self.q_proj if self.q_lora_rank is None else self.q_a_proj
        # not registered as a submodule: its parameters are the two layers', seen once in parameters()
        object.__setattr__(self, "fused_input_proj", fuse_linears(first, self.kv_a_proj_with_mqa))
        self.absorb = AbsorbWeights.of(self.kv_b_proj.weight.detach(), self.qk_nope_head_dim, self.v_head_dim)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.output(self.attend(*self.project(positions, x, meta), meta))

    def project(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Everything before attention: the queries, and the new tokens' latents written to the cache (at
        meta.slot_mapping, the only metadata read unless one decoding token's query is absorbed here too)
        -> (q_nope [T, H, nope], q_pe [T, H, rope] rotated, q_latent [1, H, kv_lora] or None)."""
        num_tokens = x.shape[0]
        if self.fused_input_proj is not None and self.use_kernels:
            q, kv = self.fused_input_proj(x).split(
                [self.fused_input_proj.out_features - self.kv_a_proj_with_mqa.out_features,
                 self.kv_a_proj_with_mqa.out_features], dim=-1)
        else:
            q, kv = (self.q_proj if self.q_lora_rank is None else self.q_a_proj)(x), self.kv_a_proj_with_mqa(x)
        if self.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(num_tokens, self.num_heads, -1)  # [T, H, nope + rope]
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        # kv: [T, kv_lora + rope]
        # one token's absorptions as GEMVs on the GPU; Triton's interpreter (tests on CPU) pays ~100 ms a
        # layer for them against 0.05 for the batched GEMMs
        absorb = self.absorb if self.use_kernels and x.is_cuda else None
        q_latent = None
        if self.use_kernels:
            from engine.kernels.latent_cache import write_latent_, write_latent_absorbed_

            # kv norm, rope on q_pe and k_pe, cache write: one launch (rotates q_pe in place); one decoding
            # token's query absorption in the same launch
            kv_norm = (self.kv_a_layernorm.weight, self.kv_a_layernorm.eps)
            rope = (self.rotary.cos_cache, self.rotary.sin_cache, meta.slot_mapping)
            if absorb is not None and num_tokens == 1 and not meta.num_prefills:
                q_latent = write_latent_absorbed_(self.kv_cache, kv, *kv_norm, q_nope, q_pe, positions, *rope,
                                                  absorb.w_uk_t)
            else:
                write_latent_(self.kv_cache, kv, *kv_norm, q_pe, positions, *rope)
        else:
            c_kv, k_pe = kv.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
            c_kv = self.kv_a_layernorm(c_kv)
            q_pe, k_pe = self.rotary(positions, q_pe), self.rotary(positions, k_pe)
            write_kv_cache(self.kv_cache, torch.cat([c_kv, k_pe], dim=-1), meta.slot_mapping, self.kv_lora_rank)
        return q_nope, q_pe, q_latent

    def attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, q_latent: torch.Tensor | None,
               meta: AttentionMetadata) -> torch.Tensor:
        """The queries over the cache (prefill chunks first, then decode rows) -> [T, H, v]."""
        num_tokens = q_nope.shape[0]
        absorb = self.absorb if self.use_kernels and q_nope.is_cuda else None
        n = meta.num_prefill_tokens
        args = (self.kv_cache, meta, self.kv_b_proj.weight, self.kv_lora_rank, self.v_head_dim, self.softmax_scale)
        prefill, decode = (mla_prefill_fast, mla_decode_fast) if self.use_kernels else (mla_prefill, mla_decode)
        kw = {"absorb": absorb} if self.use_kernels else {}
        if not meta.num_prefills:  # decode-only steps (every CUDA-graph step) skip the copy into `out`
            out = decode(q_nope, q_pe, *args, **(kw if q_latent is None else dict(kw, q_latent=q_latent)))
        elif not meta.num_decodes:
            out = prefill(q_nope, q_pe, *args, **kw)
        else:
            out = torch.empty(num_tokens, self.num_heads, self.v_head_dim, dtype=q_nope.dtype, device=q_nope.device)
            out[:n] = prefill(q_nope[:n], q_pe[:n], *args, **kw)
            out[n:] = decode(q_nope[n:], q_pe[n:], *args, **kw)
        return out

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """[T, H, v] -> [T, hidden]."""
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    """SwiGLU feed-forward (dense layers and shared experts)."""

    use_kernels = False  # the model runner switches the one-pass activation (kernels.activation) on

    def __init__(self, hidden: int, inter: int, par: ParallelContext = SINGLE, quant: QuantConfig | None = None,
                 reduce_results: bool = True):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], par=par, quant=quant)
        self.down_proj = RowParallelLinear(inter, hidden, par=par, quant=quant, reduce_results=reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)  # [T, gate | up]
        if self.use_kernels and h.dim() == 2 and h.stride(-1) == 1:
            from engine.kernels.activation import silu_and_mul

            return self.down_proj(silu_and_mul(h))
        gate, up = h.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def foldable(self) -> bool:
        """Whole on this rank (no tensor-parallel split to reduce), so the MoE GEMVs can run it."""
        return self.down_proj.par.tp_size == 1 and self.gate_up_proj.bias is None and self.down_proj.bias is None

    def as_shared_experts(self):
        from engine.kernels.moe_gemv import SharedExperts

        up, down = self.gate_up_proj, self.down_proj
        return SharedExperts(up.weight, down.weight, getattr(up, "weight_scale_inv", None),
                             getattr(down, "weight_scale_inv", None))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, par: ParallelContext = SINGLE):
        super().__init__()
        self.par = par
        self.gate = Gate(cfg)
        self.experts = FusedExperts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.quant, par)
        # under tensor parallelism the shared experts' partial sums join the routed ones' in one all-reduce
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, par, cfg.quant, reduce_results=False)
            if cfg.n_shared_experts else None
        )
        # the shared experts run inside the small-batch MoE GEMVs as pieces of the routed width: whole on
        # this rank, and (FP8) on the routed experts' block grid
        block = self.experts.block
        self.fold_shared = (self.shared_experts is not None and self.shared_experts.foldable()
                            and par.ep_size == 1 and (block is None or cfg.moe_intermediate_size % block[1] == 0))

    def forward(self, x: torch.Tensor, sum_slots: bool = True) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; sum_slots=False: a few tokens' output may come as their unsummed
        slots [T, slots, hidden], which the next RMSNorm sums as it reads them (one launch fewer)."""
        weights, ids = self.gate(x)
        if self.fold_shared and self.experts.takes_gemv(ids):
            # a few tokens: routed and shared experts in the same two GEMV launches
            return self.experts(x, weights, ids, shared=self.shared_experts.as_shared_experts(), sum_slots=sum_slots)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.par.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, par: ParallelContext = SINGLE):
        super().__init__()
        self.self_attn = MLA(cfg, rotary, par)
        self.mlp = (MoE(cfg, par) if cfg.is_moe_layer(layer_idx)
                    else MLP(cfg.hidden_size, cfg.intermediate_size, par, cfg.quant))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (this layer's MLP output, the residual stream before it); the next norm adds the two, and
        sums a MoE layer's slots: at decode its experts hand them on unsummed ([T, slots, hidden])."""
        queries, residual = self.before_attention(positions, h, residual, meta)
        return self.after_attention(self.self_attn.attend(*queries, meta), residual)

    def before_attention(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None,
                         meta: AttentionMetadata) -> tuple[tuple, torch.Tensor]:
        """The input norm and `MLA.project` -> (its queries, the residual stream)."""
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        return self.self_attn.project(positions, h, meta), residual

    def after_attention(self, out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention's output [T, H, v] -> (the MLP's output, the residual stream before it)."""
        h, residual = self.post_attention_layernorm(self.self_attn.output(out), residual)
        return (self.mlp(h, sum_slots=False) if isinstance(self.mlp, MoE) else self.mlp(h)), residual


class MultiTokenPredictor(DecoderLayer):
    """DeepSeek-V3's multi-token-prediction (MTP) module, the speculative draft: position i joins the
    target's final hidden state h_i (after its last norm) with the embedding of token i+1 and predicts
    token i+2:
        logits_i = head(shared_head.norm(block(eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]))))
    Its block is a decoder layer with a latent cache of its own; embedding and head are the target's
    (shared in the paper; checkpoints store copies under the layer's prefix, which are not read)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, par: ParallelContext = SINGLE):
        super().__init__(cfg, layer_idx, rotary, par)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """embeds: [T, hidden] of tokens i+1; hidden: [T, hidden] the target's (or this layer's own, when
        drafting further ahead) at i -> [T, hidden] normed, the head's input for tokens i+2."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        h, residual = super().forward(positions, x, None, meta)
        return self.shared_head.norm(h, residual)[0]


class DeepseekV3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, max_position: int, par: ParallelContext = SINGLE):
        super().__init__()
        if par.tp_size == 1:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.embed_tokens.weight.requires_grad_(False)
        else:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, par)
        # one rope table shared by every layer: [max_position, qk_rope_head_dim // 2]
        rotary = RotaryEmbedding(cfg.qk_rope_head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        self.rotary = rotary
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary, par) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        for layer in self.layers:
            h, residual = layer(positions, h, residual, meta)
        return self.norm(h, residual)[0]


class DeepseekV3ForCausalLM(nn.Module):
    # checkpoint name fragment -> (our parameter fragment, shard id)
    stacked_params = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # a fresh prompt's prefill reads only device tensors and the host lists' bounds, so a padded one
    # replays from a CUDA graph (`model_runner.PrefillGraphs`)
    graph_prefills = True
    expert_params = {"gate_proj": ("w13", "w1"), "up_proj": ("w13", "w3"), "down_proj": ("w2", "w2")}

    def __init__(self, cfg: ModelConfig, max_position: int, par: ParallelContext = SINGLE, num_draft_layers: int = 0):
        """num_draft_layers: the checkpoint's MTP layers to load as speculative drafts (0: none)."""
        super().__init__()
        self.config = cfg
        self.par = par
        self.model = DeepseekV3Model(cfg, max_position, par)
        if num_draft_layers > cfg.num_nextn_predict_layers:
            raise ValueError(f"speculative decoding with MTP needs the checkpoint's multi-token-prediction layer, "
                             f"but its config has num_nextn_predict_layers={cfg.num_nextn_predict_layers}")
        # checkpoint `model.layers.{num_hidden_layers + j}.*` -> `mtp.{j}.*` (engine.loader)
        self.mtp = nn.ModuleList(MultiTokenPredictor(cfg, cfg.num_hidden_layers + j, self.model.rotary, par)
                                 for j in range(num_draft_layers))
        # one rank: a plain projection (its GEMV fast path at a token); several: vocabulary-parallel
        self.lm_head = (Linear(cfg.hidden_size, cfg.vocab_size) if par.tp_size == 1
                        else ParallelLMHead(cfg.vocab_size, cfg.hidden_size, par))
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] (the batch's new tokens, flattened) -> hidden states [T, hidden]."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def draft(self, next_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
              meta: AttentionMetadata) -> torch.Tensor:
        """The MTP layer over rows at `positions`: next_ids [T] (tokens i+1), hidden [T, hidden] (at i)
        -> [T, hidden], whose logits (`compute_logits`) draft tokens i+2."""
        return self.mtp[0](positions, self.model.embed_tokens(next_ids), hidden, meta)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The MTP layer's output (normed by its shared_head) -> logits of the drafts: the target's head."""
        return self.compute_logits(hidden)

    def attention_layers(self) -> list[MLA]:
        """Every cached attention layer, the target's then the MTP draft's (layer index order)."""
        return [layer.self_attn for layer in (*self.model.layers, *self.mtp)]

    def kv_cache_specs(self, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> list[KVCacheSpec]:
        """One latent cache per layer (MLA's cache is shared by all heads: every rank holds it whole);
        kv_cache_dtype fp8: blocks of bytes in sections (`fp8_latent`), k_pe in the activation dtype."""
        if kv_cache_dtype == "fp8":
            c = self.config
            width, cache_dtype = FP8LatentLayout(c.kv_lora_rank, c.qk_rope_head_dim, dtype).token_bytes, torch.uint8
        else:
            width, cache_dtype = self.config.kv_cache_dim, torch.bfloat16 if kv_cache_dtype == "bf16" else dtype
        return [KVCacheSpec("latent", i, width, cache_dtype) for i in range(len(self.attention_layers()))]

    def bind_kv_caches(self, pool: KVPool) -> None:
        for i, attn in enumerate(self.attention_layers()):
            attn.kv_cache = pool.cache(i, "latent")
