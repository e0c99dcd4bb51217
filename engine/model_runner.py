"""Owns the model and its KV cache on one device; turns a scheduled batch into logits."""

import logging
from pathlib import Path

import torch

from engine.config import EngineConfig, ModelConfig
from engine.layers.attention import AttentionMetadata
from engine.loader import load_weights
from engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(requested: str, checkpoint_dtype: str) -> torch.dtype:
    if requested != "auto":
        return _DTYPES[requested]
    return _DTYPES.get(checkpoint_dtype.replace("torch.", ""), torch.bfloat16)  # fp8 checkpoints run in bf16


def resolve_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, path: Path, max_model_len: int):
        self.config = config
        self.model_config = model_config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, model_config.torch_dtype)
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        torch.manual_seed(config.seed)
        default_dtype = torch.get_default_dtype()
        try:
            torch.set_default_dtype(self.dtype)
            with torch.device(self.device):
                self.model = DeepseekV3ForCausalLM(model_config, max_position=max_model_len)
        finally:
            torch.set_default_dtype(default_dtype)
        # the router's weights and bias stay in float32, as the checkpoints keep them
        for module in self.model.modules():
            if type(module).__name__ == "Gate":
                module.float()
        block = model_config.quant.weight_block_size if model_config.quant else None
        load_weights(self.model, path, model_config.num_hidden_layers, block, config.show_progress)
        self.model.eval()
        self.num_blocks = self._num_blocks()
        self._allocate_kv_cache()

    def _num_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = (self.model_config.num_hidden_layers * self.block_size * self.model_config.kv_cache_dim
                     * torch.empty((), dtype=self.dtype).element_size())
        by_memory = int(self.config.kv_cache_memory_gb * 2**30 // per_block)
        # more than every sequence at full length cannot be used (beyond keeping old prefixes cached)
        by_need = self.config.max_num_seqs * -(-self.max_model_len // self.block_size)
        return max(1, min(by_memory, by_need))

    def _allocate_kv_cache(self) -> None:
        shape = (self.num_blocks, self.block_size, self.model_config.kv_cache_dim)
        for attn in self.model.attention_layers():
            attn.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        logger.info("KV cache: %d blocks of %d tokens (%s)", self.num_blocks, self.block_size, self.dtype)

    def _prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[Sequence]]:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        query_lens, context_lens, tables = [], [], []
        sample_idx, sample_seqs = [], []
        bs = self.block_size
        for seq, n in batch.items:
            start = seq.num_computed_tokens
            input_ids += seq.token_ids(start, start + n)
            positions += range(start, start + n)
            slots += [seq.block_table[p // bs] * bs + p % bs for p in range(start, start + n)]
            query_start.append(query_start[-1] + n)
            query_lens.append(n)
            context_lens.append(start + n)
            tables.append(seq.block_table)
            if start + n == seq.num_tokens:  # the chunk reaches the end: its last token samples
                sample_idx.append(query_start[-1] - 1)
                sample_seqs.append(seq)
        max_blocks = max(len(t) for t in tables)
        dev = self.device
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=dev)
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
        return as_tensor(input_ids), as_tensor(positions), meta, sample_idx, sample_seqs

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor | None, torch.Tensor]:
        """-> (sequences that sample, their logits [S, vocab] float32, hidden states of every token)."""
        input_ids, positions, meta, sample_idx, sample_seqs = self._prepare(batch)
        hidden = self.model(input_ids, positions, meta)
        logits = self.model.compute_logits(hidden[sample_idx]) if sample_idx else None
        return sample_seqs, logits, hidden
