"""DeepSeek MoE: the router (Gate) and the routed experts stored as stacked tensors."""

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig


class Gate(nn.Module):
    """Token -> top-k experts. Scores and weights are computed in float32 (the checkpoint keeps them so)."""

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

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> (weights [T, top_k] float32, expert ids [T, top_k])."""
        logits = F.linear(x.float(), self.weight)
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

    Expert parallelism keeps experts [ep_rank * E / ep_size, ...) on each rank; a fused MoE kernel
    replaces `forward` on GPU.
    """

    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.num_experts, self.inter = num_experts, inter
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, inter), requires_grad=False)
        self.w13.weight_loader = self.weight_loader
        self.w2.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str]) -> None:
        expert, which = shard_id  # which: "w1" (gate), "w3" (up) or "w2" (down)
        if which == "w2":
            dst = param.data[expert]
        else:
            dst = param.data[expert].narrow(0, 0 if which == "w1" else self.inter, self.inter)
        if dst.shape != loaded.shape:
            raise ValueError(f"shape mismatch: checkpoint tensor {tuple(loaded.shape)}, model expects {tuple(dst.shape)}")
        dst.copy_(loaded)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """Reference path: loop over the experts that received tokens. x: [T, hidden]."""
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
            gate, up = F.linear(x[tok], self.w13[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2[e])
            out.index_add_(0, tok, y * weight_of[start : start + n, None].to(x.dtype))
            start += n
        return out
