"""DeepSeek MoE: the router (Gate) and the routed experts stored as stacked tensors.

Both have a reference path (plain PyTorch) and a Triton fast path (`use_kernels`, set by the model
runner): the router's scoring and top-k in one kernel, the experts as sorted-by-expert grouped GEMMs.
"""

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig, QuantConfig
from engine.layers.fp8 import MXFP4_GROUP, dequantize_fp8_block, quantize_activations_reference
from engine.loader import materialize
from engine.parallel import SINGLE, ParallelContext, divide


class Gate(nn.Module):
    """Token -> top-k experts. Scores and weights are computed in float32 (the checkpoint keeps them so)."""

    use_kernels = False
    # the router of up to this many tokens as one GEMV launch that routes too (`route_tokens`) instead of
    # a cast, a float32 GEMM and the routing kernel: the GEMV alone 1.7-2.0 vs 6-10 us on an H200 at 1-4
    # tokens (V2-Lite's router; V3's 6.1-6.3 vs 9-20 us; benchmarks/gemv_configs.py); 8 is the MoE GEMV's
    # own limit, not measured for the router
    gemv_max_tokens = 8

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.scoring_func, self.topk_method = cfg.scoring_func, cfg.topk_method
        self.norm_topk_prob = cfg.norm_topk_prob
        self.routed_scaling_factor = cfg.routed_scaling_factor
        n = cfg.n_routed_experts
        self.weight = nn.Parameter(torch.empty(n, cfg.hidden_size, dtype=torch.float32), requires_grad=False)
        if self.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(n, dtype=torch.float32), requires_grad=False)
        else:
            self.register_parameter("e_score_correction_bias", None)
        self.route_counter: torch.Tensor | None = None  # the one-launch router's, see fuse()

    def fuse(self) -> None:
        """For the fast path: the counters with which the last of a token's GEMV programs finds it may
        route the token (`kernels.moe_routing.route_tokens`)."""
        self.route_counter = torch.zeros(self.gemv_max_tokens, dtype=torch.int32, device=self.weight.device)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> (weights [T, top_k] float32, expert ids [T, top_k])."""
        counter = self.route_counter
        if (self.use_kernels and x.dim() == 2 and x.shape[0] <= self.gemv_max_tokens and x.stride(-1) == 1
                and counter is not None and counter.device == x.device):
            from engine.kernels.moe_routing import route_tokens

            # logits and top-k in one launch
            return route_tokens(x, self.weight, counter, self.e_score_correction_bias, self.top_k,
                                self.scoring_func, self.topk_method, self.n_group, self.topk_group,
                                self.norm_topk_prob, self.routed_scaling_factor)
        logits = F.linear(x.float(), self.weight)
        if self.use_kernels:
            from engine.kernels.moe_routing import route  # first use: Triton picks compiled or interpreted then

            return route(logits, self.e_score_correction_bias, self.top_k, self.scoring_func, self.topk_method,
                         self.n_group, self.topk_group, self.norm_topk_prob, self.routed_scaling_factor)
        scores = logits.sigmoid() if self.scoring_func == "sigmoid" else logits.softmax(dim=-1)
        num_tokens, num_experts = scores.shape
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        if self.n_group > 1 and self.topk_method in ("noaux_tc", "group_limited_greedy"):
            grouped = choice.view(num_tokens, self.n_group, -1)
            if self.topk_method == "noaux_tc":
                group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # sum of each group's best two
            else:
                group_scores = grouped.amax(dim=-1)
            keep = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
            choice = choice.masked_fill(~expert_mask, float("-inf"))
        ids = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)  # the uncorrected scores weight the experts
        if self.norm_topk_prob and self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids


class FusedExperts(nn.Module):
    """Routed experts: w13 [E, 2 * inter, hidden] (gate rows then up rows), w2 [E, hidden, inter].

    Expert parallelism keeps experts [ep_rank * E / ep_size, ...) on each rank (whole); otherwise
    tensor parallelism keeps every expert's intermediate slice [tp_rank * inter / tp, ...). Either way
    the output is this rank's partial sum: the MoE layer all-reduces it. With a QuantConfig the
    weights stay FP8 e4m3 with per-block scales `w13_scale_inv` / `w2_scale_inv` (one [E, rows / bn,
    cols / bk] tensor each), as the checkpoint's `weight_scale_inv` of every expert, stacked. With
    expert_dtype "fp4" (DeepSeek-V4) they stay MXFP4: w13 [E, 2 * inter, hidden / 2] and w2 [E, hidden,
    inter / 2] of e2m1 codes, two a byte (int8, as the checkpoint's I8), and `w13_scale_inv` /
    `w2_scale_inv` their E8M0 scales, one per 32 values of a row ([E, rows, cols / 32]; the checkpoint's
    `<wK>.scale`, the multiplier as `weight_scale_inv` is).
    """

    use_kernels = False

    def __init__(self, num_experts: int, hidden: int, inter: int, quant: QuantConfig | None = None,
                 par: ParallelContext = SINGLE, swiglu_limit: float | None = None, expert_dtype: str | None = None):
        super().__init__()
        # V4 clamps the pre-activations: silu(min(gate, l)) * clamp(up, -l, l)
        self.swiglu_limit = swiglu_limit
        self.num_total_experts = num_experts
        num_experts = divide(num_experts, par.ep_size, "n_routed_experts")
        self.expert_offset = par.ep_rank * num_experts  # global id of this rank's first expert
        self.tp_rank, self.tp_size = par.expert_tp_rank, par.expert_tp_size
        inter = divide(inter, self.tp_size, "moe_intermediate_size")
        self.num_experts, self.inter = num_experts, inter
        self.block = quant.weight_block_size if quant is not None else None
        self.fp4 = expert_dtype == "fp4"
        if expert_dtype not in (None, "fp4"):
            raise ValueError(f"unsupported expert_dtype {expert_dtype!r}; supported: fp4 (MXFP4)")
        if self.fp4:
            self._init_fp4(num_experts, hidden, inter, swiglu_limit)
            return
        # batches of at most this many tokens run as GEMVs without the sort by expert, the shared experts
        # folded in (kernels.moe_gemv); 0 keeps every batch on the grouped GEMM. Crossovers measured on
        # an H200 (docs/perf.md): bf16 GEMVs stream the experts at 3.3-3.6 TB/s up to 8 tokens, ahead of
        # the grouped GEMM; FP8 ones at 2.7 TB/s win at one and two tokens (148 vs 203, 267 vs 306 us)
        self.gemv_max_tokens = 2 if quant is not None else 8
        dtype = torch.float8_e4m3fn if quant is not None else None
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, inter, dtype=dtype), requires_grad=False)
        self.w13.weight_loader = self.weight_loader
        self.w2.weight_loader = self.weight_loader
        if quant is not None:
            b0, b1 = self.block
            if inter % b0 or (self.tp_size > 1 and inter % b1):
                raise ValueError(f"FP8 blocks of {b0}x{b1} do not tile moe_intermediate_size={inter * self.tp_size}"
                                 f" split over {self.tp_size} rank(s)")
            self.w13_scale_inv = nn.Parameter(torch.empty(num_experts, 2 * inter // b0, -(-hidden // b1),
                                                          dtype=torch.float32), requires_grad=False)
            self.w2_scale_inv = nn.Parameter(torch.empty(num_experts, -(-hidden // b0), -(-inter // b1),
                                                         dtype=torch.float32), requires_grad=False)
            self.w13_scale_inv.weight_loader = self.scale_loader
            self.w2_scale_inv.weight_loader = self.scale_loader

    def _init_fp4(self, num_experts: int, hidden: int, inter: int, swiglu_limit: float | None) -> None:
        group = MXFP4_GROUP
        if hidden % group or inter % group:
            raise ValueError(f"MXFP4 groups of {group} do not tile hidden={hidden} and this rank's "
                             f"moe_intermediate_size {inter}")
        self.block = None
        # up to 128 tokens the GEMV beats both grouped paths on an H200 at V4 Flash's 256 experts
        # (benchmarks/v4_quant_kernels.py --sections threshold: 8 / 32 / 64 / 128 tokens 0.41 / 1.51 / 2.88
        # / 5.41 ms, against 2.74 / 8.24 / 12.0 / 14.7 decoding MXFP4 tiles and 7.57 / 8.63 / 9.37 / 9.88
        # dequantizing to bf16 first): its cost grows with the tokens, the dequantization's does not, so
        # they cross near 250 tokens (fewer where expert parallelism leaves a rank fewer experts: not measured)
        self.gemv_max_tokens = 128
        # from this many (token, expert) pairs per expert on, batches dequantize every expert to the
        # activations' dtype (one launch) and run the bf16 grouped GEMM: measured as above, it beats the GEMM
        # that decodes its tiles from 64 tokens (1.5 pairs an expert) on, and loses at 32 (0.75)
        self.dequantize_pairs_per_expert = 1
        codes = lambda *shape: nn.Parameter(torch.empty(*shape, dtype=torch.int8), requires_grad=False)
        scales = lambda *shape: nn.Parameter(torch.empty(*shape, dtype=torch.float8_e8m0fnu), requires_grad=False)
        self.w13, self.w2 = codes(num_experts, 2 * inter, hidden // 2), codes(num_experts, hidden, inter // 2)
        self.w13_scale_inv = scales(num_experts, 2 * inter, hidden // group)
        self.w2_scale_inv = scales(num_experts, hidden, inter // group)
        self.w13.weight_loader = self.w2.weight_loader = self.weight_loader
        self.w13_scale_inv.weight_loader = self.w2_scale_inv.weight_loader = self.scale_loader

    def owns(self, expert: int) -> bool:
        """Whether this rank holds the (global) expert: the loader never reads the others."""
        return self.expert_offset <= expert < self.expert_offset + self.num_experts

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str]) -> None:
        self._load(param, loaded, shard_id, self.inter, self.inter // 2 if self.fp4 else self.inter)

    def scale_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str]) -> None:
        if self.fp4:  # a scale per 32 values of every row
            self._load(param, loaded, shard_id, self.inter, self.inter // MXFP4_GROUP)
        else:
            self._load(param, loaded, shard_id, self.inter // self.block[0], self.inter // self.block[1])

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str], rows: int,
              cols: int) -> None:
        """rows / cols: this rank's intermediate width in the tensor's units (elements or scale blocks)."""
        expert, which = shard_id  # global expert id; which: "w1" (gate), "w3" (up) or "w2" (down)
        expert -= self.expert_offset
        if which == "w2":
            dst = param.data[expert]
            if self.tp_size > 1:
                loaded = loaded.narrow(1, self.tp_rank * cols, cols)
        else:
            dst = param.data[expert].narrow(0, 0 if which == "w1" else rows, rows)
            if self.tp_size > 1:
                loaded = loaded.narrow(0, self.tp_rank * rows, rows)
        if dst.shape != loaded.shape:
            raise ValueError(f"shape mismatch: checkpoint tensor {tuple(loaded.shape)}, model expects {tuple(dst.shape)}")
        dst.copy_(materialize(loaded))

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) as float32 (for the reference path and for oracles)."""
        if self.fp4:
            from engine.kernels.mxfp4 import dequantize_experts

            return dequantize_experts(self.w13, self.w13_scale_inv), dequantize_experts(self.w2, self.w2_scale_inv)
        if self.block is None:
            return self.w13.float(), self.w2.float()
        deq = lambda w, s: torch.stack([dequantize_fp8_block(a, b, self.block) for a, b in zip(w, s)])
        return deq(self.w13, self.w13_scale_inv), deq(self.w2, self.w2_scale_inv)

    def takes_gemv(self, topk_ids: torch.Tensor) -> bool:
        return self.use_kernels and topk_ids.shape[0] <= self.gemv_max_tokens

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                shared=None, sum_slots: bool = True) -> torch.Tensor:
        """x: [T, hidden], topk_ids global expert ids. The reference path loops over this rank's experts
        that received tokens. `shared` (kernels.moe_gemv.SharedExperts, GEMV path only) adds the shared
        experts' output. sum_slots=False lets the GEMV path return each token's slots unsummed,
        [T, slots, hidden], for the next RMSNorm to sum (other paths return [T, hidden] regardless)."""
        if self.num_experts != self.num_total_experts:  # expert parallel: the pairs routed elsewhere weigh 0
            local = topk_ids - self.expert_offset
            held = (local >= 0) & (local < self.num_experts)
            topk_ids = torch.where(held, local, torch.zeros_like(local))
            topk_weights = topk_weights * held
        if self.use_kernels:
            from engine.kernels.fused_moe import fused_experts
            from engine.kernels.moe_gemv import moe_gemv

            quantized = self.block is not None or self.fp4
            scales = (self.w13_scale_inv, self.w2_scale_inv) if quantized else (None, None)
            if self.takes_gemv(topk_ids):
                return moe_gemv(x, self.w13, self.w2, topk_weights, topk_ids, *scales, block=self.block, shared=shared,
                                swiglu_limit=self.swiglu_limit, sum_slots=sum_slots)
            if shared is not None:
                raise ValueError("shared experts fold into the GEMV path only")
            if self.fp4 and topk_ids.numel() >= self.dequantize_pairs_per_expert * self.num_experts:
                from engine.kernels.mxfp4 import dequantize

                w13, w2 = dequantize(self.w13, self.w13_scale_inv, x.dtype), dequantize(self.w2, self.w2_scale_inv, x.dtype)
                return fused_experts(x, w13, w2, topk_weights, topk_ids, swiglu_limit=self.swiglu_limit)
            return fused_experts(x, self.w13, self.w2, topk_weights, topk_ids, *scales, block=self.block,
                                 swiglu_limit=self.swiglu_limit)
        if self.fp4:  # the dequantized weight (exact in bf16) and the activations' dtype, as HF runs them
            w13, w2 = (w.to(x.dtype) for w in self.dequantized())
        else:
            w13, w2 = (self.w13, self.w2) if self.block is None else self.dequantized()
        # FP8 experts: activations go through FP8 per token group too, as in the kernels
        qdq = (lambda a: a) if self.block is None else (lambda a: quantize_activations_reference(a, self.block[1]))
        out = torch.zeros_like(x)
        flat_ids = topk_ids.flatten()
        order = flat_ids.argsort(stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        token_of = order // topk_ids.shape[1]
        weight_of = topk_weights.flatten()[order]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            tok = token_of[start : start + n]
            gate, up = F.linear(qdq(x[tok]), w13[e]).to(x.dtype).chunk(2, dim=-1)
            if self.swiglu_limit is not None:
                gate, up = gate.clamp(max=self.swiglu_limit), up.clamp(-self.swiglu_limit, self.swiglu_limit)
            y = F.linear(qdq(F.silu(gate) * up), w2[e]).to(x.dtype)
            out.index_add_(0, tok, y * weight_of[start : start + n, None].to(x.dtype))
            start += n
        return out
