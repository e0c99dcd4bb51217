"""Owns the model and its KV cache on one device; turns a scheduled batch into logits.

Two paths: the reference (plain PyTorch) and the fast one (Triton kernels, FP8 weights kept as
blocks, decode steps replayed from CUDA graphs). `attention_backend` picks: "torch", "triton", or
"auto" (triton on a GPU, torch elsewhere).
"""

import dataclasses
import logging
import os
from pathlib import Path

import torch

from engine.config import EngineConfig, ModelConfig
from engine.copies import to_device
from engine.layers.attention import AttentionMetadata
from engine.layers.fp8 import quantize_fp8_block
from engine.loader import load_weights
from engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BACKENDS = ("auto", "torch", "triton")


def resolve_dtype(requested: str, checkpoint_dtype: str) -> torch.dtype:
    if requested != "auto":
        return _DTYPES[requested]
    return _DTYPES.get(checkpoint_dtype.replace("torch.", ""), torch.bfloat16)  # fp8 checkpoints run in bf16


def resolve_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def resolve_backend(requested: str, device: torch.device) -> str:
    if requested not in BACKENDS:
        raise ValueError(f"invalid attention_backend {requested!r}; choose one of {', '.join(BACKENDS)}")
    if requested == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if requested == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention_backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1, set before "
                         "Triton is imported, to run its kernels in Triton's interpreter, slowly)")
    return requested


def enable_kernels(model: torch.nn.Module) -> None:
    """Switch every layer that has a Triton fast path onto it, then fuse what runs fused (after loading:
    fusing moves weights; second: a fused layer takes its parts' switch)."""
    for module in model.modules():
        if hasattr(type(module), "use_kernels"):
            module.use_kernels = True
    for module in model.modules():
        if hasattr(module, "fuse"):
            module.fuse()


@torch.no_grad()
def init_random_weights(model: DeepseekV3ForCausalLM, seed: int, std: float = 0.02) -> None:
    """Random weights in place (for benchmarks of a shape without its checkpoint): N(0, std) matrices,
    norms 1, no routing bias; FP8 weights are quantized from such draws block by block."""
    params = dict(model.named_parameters())
    device = next(iter(params.values())).device
    gen = torch.Generator(device).manual_seed(seed)
    quant = model.config.quant
    for name, param in params.items():
        if name.endswith("_scale_inv"):
            continue  # written with its weight
        if param.dtype == torch.float8_e4m3fn:
            scale = params[name + "_scale_inv"]  # w13 -> w13_scale_inv, weight -> weight_scale_inv
            mats, scales = (param.data, scale.data) if param.dim() == 3 else (param.data[None], scale.data[None])
            for w, s in zip(mats, scales):
                q, si = quantize_fp8_block(torch.randn(w.shape, generator=gen, device=device) * std,
                                           quant.weight_block_size)
                w.copy_(q)
                s.copy_(si)
        elif name.endswith("norm.weight"):
            param.data.fill_(1.0)
        elif name.endswith("e_score_correction_bias"):
            param.data.zero_()
        else:
            param.data.normal_(0.0, std, generator=gen)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, path: Path | None, max_model_len: int):
        """path=None: random weights (config.seed) instead of a checkpoint."""
        self.config = config
        self.model_config = model_config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, model_config.torch_dtype)
        self.backend = resolve_backend(config.attention_backend, self.device)
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        torch.manual_seed(config.seed)
        # FP8 checkpoints keep their blocks only for the FP8 kernels; the reference path dequantizes at load
        keep_fp8 = self.backend == "triton" and model_config.quant is not None
        built = model_config if keep_fp8 else dataclasses.replace(model_config, quant=None)
        default_dtype = torch.get_default_dtype()
        try:
            torch.set_default_dtype(self.dtype)
            with torch.device(self.device):
                self.model = DeepseekV3ForCausalLM(built, max_position=max_model_len)
        finally:
            torch.set_default_dtype(default_dtype)
        # the router's weights and bias stay in float32, as the checkpoints keep them
        for module in self.model.modules():
            if type(module).__name__ == "Gate":
                module.float()
        block = model_config.quant.weight_block_size if model_config.quant else None
        if path is None:
            init_random_weights(self.model, config.seed)
        else:
            load_weights(self.model, path, model_config.num_hidden_layers, block, config.show_progress)
        self.model.eval()
        if self.backend == "triton":
            enable_kernels(self.model)
        self.num_blocks = self._num_blocks()
        self.use_cuda_graphs = (self.backend == "triton" and self.device.type == "cuda"
                                and not config.extra.get("enforce_eager", False))
        self._allocate_kv_cache()
        self.graphs = DecodeGraphs(self) if self.use_cuda_graphs else None
        if self.graphs is not None and config.extra.get("capture_graphs_at_start", True):
            from engine.kernels._util import on_compile

            on_compile(None)  # the hook is process-wide: another runner's must not count this one's warm-up
            self.warm_up()
            self.graphs.capture_all()
            # anything built from here on stalls a serving step: name it, so warm_up can learn it
            on_compile(lambda variant: logger.warning("Triton built a kernel variant after warm-up "
                                                      "(this step stalls until it is ready): %s", variant))

    def _num_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = (self.model_config.num_hidden_layers * self.block_size * self.model_config.kv_cache_dim
                     * torch.empty((), dtype=self.dtype).element_size())
        by_memory = int(self.config.kv_cache_memory_gb * 2**30 // per_block)
        # more than every sequence at full length cannot be used (beyond keeping old prefixes cached)
        by_need = self.config.max_num_seqs * -(-self.max_model_len // self.block_size)
        return max(1, min(by_memory, by_need))

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run prefill steps of 1, 2, 4, ... tokens up to the step budget (fresh and over a cached prefix)
        into the scratch block, so Triton compiles every kernel variant serving meets now: a variant
        compiled on first use stalls every request in that step for about a second (seen as late
        first tokens in the server benchmark). Tile choices depend on the step's size only in powers of
        two, and the kernels do not specialize on batch-dependent integers; the decode attention's slice
        count (a power of two) is warmed directly."""
        from engine.kernels.mla_decode import SPLIT_CHOICES, mla_decode_attention
        from engine.sampling_params import SamplingParams

        scratch, bs = self.num_blocks, self.block_size
        budget = max(1, min(self.config.max_num_batched_tokens, self.max_model_len - 1 - bs))
        sizes = sorted({min(1 << i, budget) for i in range(budget.bit_length() + 1)})
        for n in sizes:
            for prefix in (0, bs):
                if prefix + n > self.max_model_len - 1:
                    continue  # positions past the rope table
                seq = Sequence("warm-up", [0] * (prefix + n), SamplingParams(max_tokens=1), None, None)
                seq.block_table = [scratch] * -(-(prefix + n) // bs)  # every row lands in the scratch block
                seq.num_computed_tokens = prefix
                self._run_eager(ScheduledBatch(prefills=[(seq, n)]))  # what the graphs do not take
        if self.backend == "triton":  # every slice count the decode attention may take
            attn = self.model.attention_layers()[0]
            cache, dev = attn.kv_cache, attn.kv_cache.device
            q = torch.zeros(1, attn.num_heads, attn.kv_lora_rank, dtype=cache.dtype, device=dev)
            q_pe = torch.zeros(1, attn.num_heads, attn.qk_rope_head_dim, dtype=cache.dtype, device=dev)
            table = torch.full((1, 1), scratch, dtype=torch.int32, device=dev)
            for splits in SPLIT_CHOICES:
                mla_decode_attention(q, q_pe, cache, table, torch.ones(1, dtype=torch.int32, device=dev),
                                     attn.softmax_scale, num_splits=splits)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        logger.info("warmed up the prefill kernels for steps of %d to %d tokens", sizes[0], sizes[-1])

    def _allocate_kv_cache(self) -> None:
        # with CUDA graphs, one extra block past num_blocks takes the writes of padded batch rows
        extra = 1 if self.use_cuda_graphs else 0
        shape = (self.num_blocks + extra, self.block_size, self.model_config.kv_cache_dim)
        for attn in self.model.attention_layers():
            attn.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        logger.info("KV cache: %d blocks of %d tokens (%s)", self.num_blocks, self.block_size, self.dtype)

    def _prepare(self, batch: ScheduledBatch, inputs: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[Sequence]]:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        query_lens, context_lens, tables = [], [], []
        sample_idx, sample_seqs = [], []
        bs = self.block_size
        for seq, n in batch.items:
            start = seq.num_computed_tokens
            if inputs is None:
                input_ids += seq.token_ids(start, start + n)
            positions += range(start, start + n)
            slots += [seq.block_table[p // bs] * bs + p % bs for p in range(start, start + n)]
            query_start.append(query_start[-1] + n)
            query_lens.append(n)
            context_lens.append(start + n)
            tables.append(seq.block_table)
            if start + n == seq.num_drawn_tokens:  # the chunk reaches the end: it samples
                sample_idx.append(query_start[-1] - 1)
                sample_seqs.append(seq)
        max_blocks = max(len(t) for t in tables)
        dev = self.device
        as_tensor = lambda x: to_device(x, torch.long, dev)  # noqa: E731
        meta = AttentionMetadata(
            slot_mapping=as_tensor(slots),
            query_start_loc=as_tensor(query_start),
            context_lens=as_tensor(context_lens),
            block_tables=as_tensor([t + [0] * (max_blocks - len(t)) for t in tables]),
            num_prefills=len(batch.prefills),
            num_prefill_tokens=sum(n for _, n in batch.prefills),
            block_size=bs,
            query_start_loc_cpu=query_start,
            query_lens_cpu=query_lens,
            context_lens_cpu=context_lens,
        )
        input_ids = as_tensor(input_ids) if inputs is None else inputs
        return input_ids, as_tensor(positions), meta, sample_idx, sample_seqs

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, inputs: torch.Tensor | None = None
            ) -> tuple[list[Sequence], torch.Tensor | None, torch.Tensor]:
        """-> (sequences that sample, their logits [S, vocab] float32, hidden states of every token).
        inputs: the token ids of a decode batch on the device (drawn by a step the host has not read
        yet), instead of the sequences' own."""
        counts = [n for _, n in batch.items]
        if (self.graphs is not None and sum(counts) <= self.graphs.max_batch
                and not any(seq.collect_logits for seq, _ in batch.items)):
            return self._replay(batch, counts, inputs)
        return self._run_eager(batch, inputs)

    def _run_eager(self, batch: ScheduledBatch, inputs: torch.Tensor | None = None
                   ) -> tuple[list[Sequence], torch.Tensor | None, torch.Tensor]:
        input_ids, positions, meta, sample_idx, sample_seqs = self._prepare(batch, inputs)
        hidden = self.model(input_ids, positions, meta)
        logits = self.model.compute_logits(hidden[sample_idx]) if sample_idx else None
        return sample_seqs, logits, hidden

    def _replay(self, batch: ScheduledBatch, counts: list[int], inputs: torch.Tensor | None
                ) -> tuple[list[Sequence], torch.Tensor | None, torch.Tensor]:
        """A step of at most `graphs.max_batch` tokens through a decode graph: a prefill chunk's tokens
        are rows of their own (the eager step they replace costs ~75 PyTorch operations a layer)."""
        seqs = [seq for seq, _ in batch.items]
        self.graphs.load(seqs, inputs, counts)
        hidden, logits, _ = self.graphs.replay(sum(counts))
        rows, sample_seqs, end = [], [], 0
        for seq, n in batch.items:
            end += n
            if seq.num_computed_tokens + n == seq.num_drawn_tokens:  # reaches the end
                rows.append(end - 1)
                sample_seqs.append(seq)
        if not rows:
            return [], None, hidden
        if len(rows) == end:  # every row samples (a decode step)
            return sample_seqs, logits.clone(), hidden
        return sample_seqs, logits.index_select(0, to_device(rows, torch.long, self.device)), hidden


class DecodeGraphs:
    """Decode steps as CUDA graphs, one per padded batch size, over static device buffers.

    A step derives everything on the device: cache slots from (positions, block tables), context
    lengths = positions + 1, then model -> logits -> sampled tokens, and finally feeds the tokens back
    as the next step's inputs (positions + 1). Replayed back to back it decodes with no host work at
    all; the engine instead loads its batch into the buffers before each replay (`load`).

    A short prefill chunk runs through the same graphs, its tokens as rows at consecutive positions
    of one block table: every layer writes all rows' latents to the cache before attending, so each
    row sees the rows before it, as causal attention does (the absorbed path of a chunk over its
    context, which the eager step takes for short chunks too).
    """

    SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        # buffers hold the padded size of the largest batch, so every padded() row count fits
        self.max_batch = self.padded(min(runner.config.max_num_seqs, self.SIZES[-1]))
        self.width = -(-runner.max_model_len // runner.block_size)  # block-table columns
        self.scratch_block = runner.num_blocks  # the cache's extra block
        dev, n = runner.device, self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.block_tables = torch.full((n, self.width), self.scratch_block, dtype=torch.int32, device=dev)
        self.temperature = torch.zeros(n, dtype=torch.float32, device=dev)  # 0: greedy
        self.seeds = torch.arange(n, dtype=torch.long, device=dev)
        self.step = torch.zeros(1, dtype=torch.long, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.pool = None

    def padded(self, batch: int) -> int:
        return next(s for s in self.SIZES if s >= batch)

    def load(self, seqs: list[Sequence], inputs: torch.Tensor | None = None,
             counts: list[int] | None = None) -> None:
        """Copy the engine's batch into the static buffers; rows past it decode into the scratch block.
        inputs: the batch's token ids already on the device (else the sequences' own). counts: rows per
        sequence, its next tokens from num_computed_tokens on (default: one each, a decode)."""
        counts = counts or [1] * len(seqs)
        n = sum(counts)
        padded = self.padded(n)
        widest = max(len(seq.block_table) for seq in seqs)
        # one host tensor per buffer, built from lists (a tensor write per row cost ~20 us a sequence).
        # Every row is its table followed by the scratch block (graphs replayed back to back walk
        # positions past a table's end): the rows are reset on the device, then the tables written
        pos, ids, tables = [], [], []
        for seq, count in zip(seqs, counts):
            start = seq.num_computed_tokens
            pos += range(start, start + count)
            if inputs is None:
                ids += seq.token_ids(start, start + count)
            tables += [seq.block_table + [self.scratch_block] * (widest - len(seq.block_table))] * count
        dev = self.input_ids.device
        if inputs is None:
            inputs = to_device(ids, torch.long, dev)
        self.input_ids[:n].copy_(inputs)
        self.positions[:n].copy_(to_device(pos, torch.long, dev))
        self.block_tables[:padded].fill_(self.scratch_block)
        self.block_tables[:n, :widest].copy_(to_device(tables, torch.int32, dev))
        if n < padded:  # padding rows decode token 0 at position 0 into the scratch block
            self.input_ids[n:padded].zero_()
            self.positions[n:padded].zero_()
            self.temperature[n:padded].zero_()

    def metadata(self, batch: int) -> tuple[AttentionMetadata, torch.Tensor]:
        """Attention metadata of the first `batch` rows, derived on the device -> (metadata, positions)."""
        bs = self.runner.block_size
        pos = self.positions[:batch]
        table = self.block_tables[:batch]
        page = table.gather(1, (pos // bs).clamp(max=self.width - 1)[:, None])[:, 0]
        return AttentionMetadata(
            slot_mapping=page.long() * bs + pos % bs,
            query_start_loc=torch.arange(batch + 1, device=pos.device),
            context_lens=(pos + 1).int(),
            block_tables=table,
            num_prefills=0,
            num_prefill_tokens=0,
            block_size=bs,
            # host copies are never read on the fast decode path; only their count matters
            query_start_loc_cpu=list(range(batch + 1)),
            query_lens_cpu=[1] * batch,
            context_lens_cpu=[0] * batch,
        ), pos

    def _step(self, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from engine.kernels.sampling import sample

        meta, pos = self.metadata(batch)
        hidden = self.runner.model(self.input_ids[:batch], pos, meta)
        logits = self.runner.model.compute_logits(hidden)
        tokens = sample(logits, self.temperature[:batch], self.seeds[:batch], self.step)
        self.input_ids[:batch].copy_(tokens)
        self.positions[:batch].add_(1)
        self.step.add_(1)
        return hidden, logits, tokens

    def _capture(self, batch: int) -> None:
        state = [t.clone() for t in (self.input_ids, self.positions, self.step)]

        def restore():
            for t, saved in zip((self.input_ids, self.positions, self.step), state):
                t.copy_(saved)

        # a warm-up run compiles the Triton kernels and lets cuBLAS choose, outside the capture
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._step(batch)
            restore()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[batch] = self._step(batch)
        restore()
        self.pool = graph.pool()
        self.graphs[batch] = graph
        logger.info("captured a CUDA graph for decode batches of %d", batch)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every batch size up front, largest first (smaller graphs reuse its memory pool), so
        requests arriving one by one never pay a capture in the middle of serving."""
        for size in sorted((s for s in self.SIZES if s <= self.max_batch), reverse=True):
            if size not in self.graphs:
                self._capture(size)

    @torch.inference_mode()
    def replay(self, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decode step for the first `batch` rows -> (hidden, logits, sampled tokens), sliced to batch."""
        padded = self.padded(batch)
        if padded not in self.graphs:
            self._capture(padded)
        self.graphs[padded].replay()
        hidden, logits, tokens = self.outputs[padded]
        return hidden[:batch], logits[:batch], tokens[:batch]
