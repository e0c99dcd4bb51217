"""Each Triton kernel alone at the preset's real shapes: measured time against its two floors.

Launches are replayed from CUDA graphs, so a kernel is timed on the device, not by its launch cost.
Expert and linear weights are the model's own (no second copy); caches and activations are random."""

import torch

from engine.bench.roofline import Ceilings, expected_experts, fractions
from engine.bench.timing import time_replayed
from engine.model_runner import ModelRunner


def _entry(name: str, shape: str, seconds: float, n_bytes: float, flops: float, ceilings: Ceilings,
           fp8: bool = False) -> dict:
    return dict(kernel=name, shape=shape, seconds=seconds, **fractions(seconds, n_bytes, flops, ceilings, fp8))


@torch.inference_mode()
def measure_kernels(runner: ModelRunner, ceilings: Ceilings, prefill_len: int, decode_context: int) -> list[dict]:
    from engine.kernels.fused_moe import fused_experts
    from engine.kernels.mla_decode import mla_decode_attention
    from engine.kernels.mla_prefill import mla_prefill_attention
    from engine.kernels.moe_gemv import moe_gemv
    from engine.kernels.rms_norm import rms_norm
    from engine.kernels.sampling import sample

    cfg, dev, dt = runner.model_config, runner.device, runner.dtype
    el = torch.empty((), dtype=dt).element_size()
    g = torch.Generator(dev).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=g, device=dev).to(dt)
    heads, c, r = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
    t = lambda fn: time_replayed(fn, dev)
    out = []

    # MLA decode over a paged cache (64-token pages, shuffled), one long sequence and a full batch
    for batch, ctx in ((1, 4 * decode_context), (64, decode_context)):
        page = 64
        per_seq = -(-ctx // page)
        cache = rnd(batch * per_seq, page, c + r)
        tables = torch.randperm(batch * per_seq, device=dev).view(batch, per_seq).int()
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        q_lat, q_pe = rnd(batch, heads, c), rnd(batch, heads, r)
        sec = t(lambda: mla_decode_attention(q_lat, q_pe, cache, tables, lens, 0.1))
        out.append(_entry("mla_decode", f"B={batch} ctx={ctx} H={heads}", sec, batch * ctx * (c + r) * el,
                          batch * heads * ctx * (4 * c + 2 * r), ceilings))
        del cache

    # MLA prefill: one prompt, keys expanded per head, shared rope key
    n = prefill_len
    q, kv, kpe = rnd(n, heads, nope + r), rnd(n, heads, nope + v), rnd(n, r)
    cu = torch.tensor([0, n], dtype=torch.int32, device=dev)
    sec = t(lambda: mla_prefill_attention(q[..., :nope], q[..., nope:], kv[..., :nope], kpe, kv[..., nope:], cu, cu,
                                          n, 0.1))
    pairs = n * (n + 1) / 2
    out.append(_entry("mla_prefill", f"L={n} H={heads}", sec, (q.numel() + kv.numel() + kpe.numel() + n * heads * v) * el,
                      heads * pairs * (2 * (nope + r) + 2 * v), ceilings))
    del q, kv, kpe

    # fused MoE with the first MoE layer's experts (FP8 blocks when the model keeps them)
    moe = next((layer.mlp for layer in runner.model.model.layers if hasattr(layer.mlp, "experts")), None)
    if moe is not None:
        ex = moe.experts
        fp8 = ex.block is not None
        scales = (ex.w13_scale_inv, ex.w2_scale_inv) if fp8 else (None, None)
        e, k, hid, inter = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
        per_expert = sum(p.numel() * p.element_size() for p in ex.parameters()) / e
        for tokens in (1, 8, 64, n):
            x = rnd(tokens, hid)
            ids = torch.rand(tokens, e, generator=g, device=dev).topk(k, dim=-1).indices.int()
            w = torch.rand(tokens, k, generator=g, device=dev)
            sec = t(lambda: fused_experts(x, ex.w13, ex.w2, w, ids, *scales, block=ex.block))
            touched = expected_experts(e, k, tokens) * per_expert
            out.append(_entry("fused_moe" + ("_fp8" if fp8 else ""), f"T={tokens} E={e} k={k} H={hid} I={inter}", sec,
                              touched + 2 * tokens * hid * el, 6.0 * tokens * k * hid * inter, ceilings, fp8))
            if tokens * k <= 64:
                sec = t(lambda: moe_gemv(x, ex.w13, ex.w2, w, ids, *scales, block=ex.block))
                out.append(_entry("moe_gemv" + ("_fp8" if fp8 else ""), f"T={tokens} E={e} k={k} H={hid} I={inter}",
                                  sec, tokens * k * per_expert + 2 * tokens * hid * el, 6.0 * tokens * k * hid * inter,
                                  ceilings, fp8))

    # FP8 block-scaled linear, o_proj's shape
    o_proj = runner.model.model.layers[0].self_attn.o_proj
    if o_proj.block is not None:
        from engine.kernels.fp8_gemm import fp8_linear

        for tokens in (1, n):
            x = rnd(tokens, o_proj.in_features)
            sec = t(lambda: fp8_linear(x, o_proj.weight, o_proj.weight_scale_inv, o_proj.block))
            out.append(_entry("fp8_linear", f"M={tokens} N={o_proj.out_features} K={o_proj.in_features}", sec,
                              o_proj.weight.numel() + tokens * (o_proj.in_features + o_proj.out_features) * el,
                              2.0 * tokens * o_proj.weight.numel(), ceilings, True))

    x, res, w = rnd(n, cfg.hidden_size), rnd(n, cfg.hidden_size), rnd(cfg.hidden_size)
    sec = t(lambda: rms_norm(x, w, 1e-6, res))
    out.append(_entry("rms_norm_add", f"T={n} D={cfg.hidden_size}", sec, 4 * x.numel() * el, 0, ceilings))

    logits = torch.randn(64, cfg.vocab_size, generator=g, device=dev)
    temp, seeds = torch.ones(64, device=dev), torch.arange(64, device=dev)
    step = torch.zeros(1, dtype=torch.long, device=dev)
    sec = t(lambda: sample(logits, temp, seeds, step))
    out.append(_entry("sample", f"B=64 V={cfg.vocab_size}", sec, logits.numel() * 4, 0, ceilings))
    return out
