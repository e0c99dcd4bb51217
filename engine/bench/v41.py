"""The benchmark for DeepSeek-V4.1 shapes (`bench --preset v41-slice`): prefill, decode and each layer at one
stream against its bytes and FLOPs floors, as for V4 (engine.bench.v4), and decode again with the Engram
tables in host memory. No transformers release has V4.1: there is no peer to compare with.

V4.1's floors: a decode step reads its layers' weights, each layer's window rows (stored FP8: 528 B a
row at head_dim 512), the compressed entries it attends (FP4, 288 B each), the indexer keys an index
source scores (FP4, 68 B; inside the candidate blocks after the candidate source) and the Engram rows a
token gathers ((max_ngram_size - 1) x heads rows of head_dim), never the Engram table itself.
"""

import torch

from engine.bench.ours import BlockPool, measure_decode, one_decode, time_replayed
from engine.bench.roofline import expected_experts, fractions, param_bytes
from engine.bench.v4 import V4Costs, run_v4
from engine.config import DeepseekV41Config
from engine.model_runner import ModelRunner


def layer_kind(cfg: DeepseekV41Config, i: int) -> str:
    """window | source (owns the compressed cache and indexer keys) | reindex (its own indexer over the
    source's keys) | reuse (the source's entries, the last index source's picks); +engram."""
    if not cfg.compress_ratios[i]:
        kind = "window"
    elif i in cfg.kv_source_layer_ids:
        kind = "source"
    elif i in cfg.index_source_layer_ids:
        kind = "reindex"
    else:
        kind = "reuse"
    return kind + ("+engram" if i in cfg.engram_layer_ids else "")


def _row_bytes(codec, dtype: torch.dtype) -> int:
    width, stored = codec.spec_width(dtype)
    return width * torch.empty((), dtype=stored).element_size()


class V41Costs(V4Costs):
    """Bytes and FLOPs of V4.1 phases from the model's own parameters, shape and cache rows as stored
    (a step's total over its layers: V4Costs.decode)."""

    def __init__(self, model: torch.nn.Module, cfg: DeepseekV41Config, kv_elem_bytes: int):
        self.cfg = cfg
        self.layers = []
        dtype = model.embed.weight.dtype
        for layer in model.layers:
            experts = layer.ffn.experts
            apart = {id(p) for p in experts.parameters()}
            engram_row_bytes = 0
            if layer.engram is not None:  # the table is gathered, not read: its rows count per token
                table = layer.engram.embed.weight
                apart.add(id(table))
                cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
                engram_row_bytes = cols * table.shape[1] * table.element_size()
            rest = [p for p in layer.parameters() if id(p) not in apart]
            attn = layer.attn
            self.layers.append(dict(
                rest_bytes=param_bytes(rest), rest_numel=sum(p.numel() for p in rest),
                expert_bytes=param_bytes(experts.parameters()) / experts.num_experts,
                expert_numel=(experts.w13.numel() + experts.w2.numel()) / experts.num_experts,
                engram_bytes=engram_row_bytes, window_row=_row_bytes(attn.window_codec, dtype),
                entry_row=_row_bytes(attn.entry_codec, dtype), key_row=_row_bytes(attn.key_codec, dtype),
                index=attn.is_index, candidates=attn.uses_candidates,
            ))
        self.head_bytes = param_bytes(model.head.parameters())
        self.head_numel = model.head.weight.numel()

    def kind(self, i: int) -> str:
        return layer_kind(self.cfg, i)

    def _keys(self, i: int, context: int) -> tuple[int, int, int]:
        """(window rows, compressed entries attended, indexer keys scored) of a token at `context`."""
        c, r, layer = self.cfg, self.cfg.compress_ratios[i], self.layers[i]
        window = min(c.sliding_window, context)
        if r == 0:
            return window, 0, 0
        entries = context // r
        scored = 0
        if layer["index"]:
            scored = min(entries, c.candidate_topk_blocks * c.candidate_block_size) if layer["candidates"] else entries
        return window, min(c.index_topk, entries), scored

    def _attention(self, i: int, context: int) -> tuple[float, float]:
        """(cache bytes, attention + indexer FLOPs) of one token at `context`."""
        c, layer = self.cfg, self.layers[i]
        window, entries, scored = self._keys(i, context)
        kv_bytes = window * layer["window_row"] + entries * layer["entry_row"] + scored * layer["key_row"]
        flops = 4 * c.num_attention_heads * (window + entries) * c.head_dim
        return kv_bytes, flops + 2 * c.index_n_heads * scored * c.index_head_dim

    def decode_layer(self, i: int, batch: int, context: int) -> tuple[float, float]:
        c, layer = self.cfg, self.layers[i]
        experts = expected_experts(c.n_routed_experts, c.num_experts_per_tok, batch)
        kv_bytes, attn_flops = self._attention(i, context)
        total_bytes = layer["rest_bytes"] + experts * layer["expert_bytes"] + batch * (kv_bytes + layer["engram_bytes"])
        flops = 2.0 * batch * (layer["rest_numel"] + c.num_experts_per_tok * layer["expert_numel"])
        return total_bytes, flops + batch * attn_flops

    def prefill(self, length: int) -> tuple[float, float]:
        c = self.cfg
        total_bytes, total_flops = float(self.head_bytes), 2.0 * self.head_numel
        for i, layer in enumerate(self.layers):
            experts = expected_experts(c.n_routed_experts, c.num_experts_per_tok, length)
            total_bytes += layer["rest_bytes"] + experts * layer["expert_bytes"] + length * layer["engram_bytes"]
            total_flops += 2.0 * length * (layer["rest_numel"] + c.num_experts_per_tok * layer["expert_numel"])
            total_flops += length * self._attention(i, length // 2)[1]  # the average query sits halfway
        return total_bytes, total_flops


@torch.inference_mode()
def measure_v41_layers(runner: ModelRunner, pool: BlockPool, context: int, vocab: int, repeats: int = 20
                       ) -> list[dict]:
    """Each V4.1 block alone, in order (a reuse layer reads the picks its index source just left in the
    step's shared state), one sequence at `context` tokens; the Engram rows gathered once before."""
    seq, positions, meta = one_decode(runner, pool, context, vocab)
    cfg, dev, model = runner.model_config, runner.device, runner.model
    g = torch.Generator(dev).manual_seed(0)
    h = torch.randn(1, cfg.hc_mult, cfg.hidden_size, generator=g, device=dev, dtype=runner.dtype)
    pre = torch.full((1, cfg.hc_mult), 1.0 / cfg.hc_mult, device=dev)
    ids = torch.tensor([seq.output_token_ids[-1]], device=dev)
    rows = model.engram_rows(ids, meta, None) if model.engram_hash is not None else {}
    meta._v41_shared = {}
    out = []
    for i, layer in enumerate(model.layers):
        seconds = time_replayed(runner, lambda: layer(positions, h, pre, meta, rows.get(i), None), repeats)
        out.append(dict(layer=i, kind=layer_kind(cfg, i), seconds=seconds))
    return out


def engram_on_host(runner: ModelRunner, pool: BlockPool, costs: V41Costs, ceilings, concurrency: list[int],
                   context: int, steps: int) -> dict:
    """Decode again with the Engram tables moved to (pinned) host memory: each step's rows gathered there
    before layer 0 and copied over beside it."""
    if runner.model.engram_hash is None:
        return {}
    runner.model.place_engram_tables("host")
    decode = {}
    for c in concurrency:
        m = measure_decode(runner, pool, c, context, steps, runner.model_config.vocab_size)
        m.update(fractions(m["seconds_per_step"], *costs.decode(c, m["context"]), ceilings, False))
        decode[str(c)] = m
    return dict(engram_tables="host", decode_tok_s={c: m["tok_s"] for c, m in decode.items()}, decode=decode)


def run_v41(opts, hf_config: dict, cfg: DeepseekV41Config, name: str) -> dict:
    if opts.compare_hf:
        raise ValueError("no transformers release has DeepSeek-V4.1: run the V4.1 benchmark without --compare-hf")
    variants = lambda runner, pool, costs, ceilings: {"engram_host": engram_on_host(
        runner, pool, costs, ceilings, opts.concurrency, opts.decode_context, opts.decode_steps)}
    return run_v4(opts, hf_config, cfg, name, costs_cls=V41Costs, measure_layers=measure_v41_layers,
                  variants=variants)
