"""The two floors of every phase: bytes it must move over measured copy bandwidth, FLOPs it must do
over the measured matmul rate; the slower of the two bounds what any implementation can reach."""

from dataclasses import asdict, dataclass

import torch

from engine.bench.timing import time_fn
from engine.config import ModelConfig


@dataclass(frozen=True)
class Ceilings:
    copy_bytes_per_s: float  # device-to-device copy, bytes read + written
    bf16_flops_per_s: float  # a large bf16 matmul (float32 on CPU)
    fp8_flops_per_s: float | None  # a large FP8 matmul (torch._scaled_mm); None where unsupported

    def as_dict(self) -> dict:
        return asdict(self)


def measure_ceilings(device: torch.device) -> Ceilings:
    """Measure once, on random data: a 2 GiB copy and 8192^3 matmuls (smaller on CPU)."""
    on_gpu = device.type == "cuda"
    n_bytes = 2 * 2**30 if on_gpu else 2**27
    src = torch.randn(n_bytes // 4, device=device)
    dst = torch.empty_like(src)
    copy = 2 * n_bytes / time_fn(lambda: dst.copy_(src), device, repeats=10, warmup=3)
    del src, dst
    n = 8192 if on_gpu else 1024
    dtype = torch.bfloat16 if on_gpu else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    mm = 2 * n**3 / time_fn(lambda: a @ b, device, repeats=10, warmup=3)
    fp8 = None
    if on_gpu:
        try:
            a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
            one = torch.ones((), device=device)
            run = lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
            fp8 = 2 * n**3 / time_fn(run, device, repeats=10, warmup=3)
        except (RuntimeError, TypeError, AttributeError):
            fp8 = None
    return Ceilings(copy, mm, fp8)


def expected_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts hit by `tokens` tokens routed uniformly at random."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def param_bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


class PhaseCosts:
    """Bytes and FLOPs of prefill and decode for one model, from its actual parameters (so FP8 blocks
    count one byte per weight) and its shape. Reads the latent cache as 576 values per token and layer, or
    kv_token_bytes (an FP8 cache's)."""

    def __init__(self, model: torch.nn.Module, cfg: ModelConfig, kv_elem_bytes: int, kv_token_bytes: float | None = None):
        self.cfg = cfg
        self.kv_row = kv_token_bytes or cfg.kv_cache_dim * kv_elem_bytes
        self.layers = []
        for layer in model.model.layers:
            experts = getattr(layer.mlp, "experts", None)
            expert_params = list(experts.parameters()) if experts is not None else []
            ids = {id(p) for p in expert_params}
            rest = [p for p in layer.parameters() if id(p) not in ids]
            per_expert_numel = sum(p.numel() for p in (experts.w13, experts.w2)) // cfg.n_routed_experts if experts else 0
            self.layers.append(dict(
                rest_bytes=param_bytes(rest), rest_numel=sum(p.numel() for p in rest),
                expert_bytes=param_bytes(expert_params) / cfg.n_routed_experts if experts else 0.0,
                expert_numel=per_expert_numel, moe=experts is not None))
        self.head_bytes = param_bytes(model.lm_head.parameters()) + param_bytes(model.model.norm.parameters())
        self.head_numel = model.lm_head.weight.numel()
        self.embed_row_bytes = cfg.hidden_size * model.model.embed_tokens.weight.element_size()

    def _layer(self, i: int, tokens: int, weight_tokens: int) -> tuple[float, float]:
        """(weight bytes touched by `weight_tokens` routed tokens, linear FLOPs for `tokens` tokens)."""
        c, layer = self.cfg, self.layers[i]
        experts = expected_experts(c.n_routed_experts, c.num_experts_per_tok, weight_tokens) if layer["moe"] else 0.0
        weight_bytes = layer["rest_bytes"] + experts * layer["expert_bytes"]
        k = c.num_experts_per_tok if layer["moe"] else 0
        flops = 2.0 * tokens * (layer["rest_numel"] + k * layer["expert_numel"])
        return weight_bytes, flops

    def decode_layer(self, i: int, batch: int, context: int) -> tuple[float, float]:
        c = self.cfg
        weight_bytes, flops = self._layer(i, batch, batch)
        attn_flops = batch * c.num_attention_heads * context * (4 * c.kv_lora_rank + 2 * c.qk_rope_head_dim)
        return weight_bytes + batch * context * self.kv_row, flops + attn_flops

    def decode(self, batch: int, context: int) -> tuple[float, float]:
        """One step of `batch` sequences at `context` tokens each (the new one included)."""
        total_bytes, total_flops = self.head_bytes + batch * self.embed_row_bytes, 2.0 * batch * self.head_numel
        for i in range(len(self.layers)):
            b, f = self.decode_layer(i, batch, context)
            total_bytes, total_flops = total_bytes + b, total_flops + f
        return total_bytes, total_flops

    def prefill(self, length: int) -> tuple[float, float]:
        """One prompt of `length` tokens, logits for its last token only."""
        c = self.cfg
        total_bytes, total_flops = self.head_bytes + length * self.embed_row_bytes, 2.0 * self.head_numel
        pairs = length * (length + 1) / 2
        per_pair = 2 * (c.qk_nope_head_dim + c.qk_rope_head_dim) + 2 * c.v_head_dim
        for i in range(len(self.layers)):
            b, f = self._layer(i, length, length)
            total_bytes += b + length * self.kv_row
            total_flops += f + c.num_attention_heads * pairs * per_pair
        return total_bytes, total_flops

    def turn(self, prefix: int, new: int) -> tuple[float, float]:
        """`new` tokens over `prefix` cached ones, logits for the last only: the new tokens' layers, their
        attention over everything before them, and the whole context's latents read and expanded to
        per-head keys and values (the un-absorbed prefill's GEMM through W_UKV)."""
        c = self.cfg
        context = prefix + new
        total_bytes, total_flops = self.head_bytes + new * self.embed_row_bytes, 2.0 * self.head_numel
        pairs = new * prefix + new * (new + 1) / 2
        per_pair = 2 * (c.qk_nope_head_dim + c.qk_rope_head_dim) + 2 * c.v_head_dim
        expand = 2.0 * context * c.kv_lora_rank * c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim)
        for i in range(len(self.layers)):
            b, f = self._layer(i, new, new)
            total_bytes += b + context * self.kv_row
            total_flops += f + c.num_attention_heads * pairs * per_pair + expand
        return total_bytes, total_flops


def fractions(seconds: float, n_bytes: float, flops: float, ceilings: Ceilings, fp8: bool) -> dict:
    """The phase's floors and the share of each ceiling the measured time reaches."""
    rate = ceilings.fp8_flops_per_s if fp8 and ceilings.fp8_flops_per_s else ceilings.bf16_flops_per_s
    bw_floor, flop_floor = n_bytes / ceilings.copy_bytes_per_s, flops / rate
    return dict(bytes=n_bytes, flops=flops, bandwidth_floor_s=bw_floor, compute_floor_s=flop_floor,
                bandwidth_fraction=bw_floor / seconds, compute_fraction=flop_floor / seconds,
                bound="memory" if bw_floor >= flop_floor else "compute")
