"""Owns the model and its KV cache on one device; turns a scheduled batch into logits.

Two paths: the reference (plain PyTorch) and the fast one (Triton kernels, FP8 weights kept as
blocks, decode steps replayed from CUDA graphs). `attention_backend` picks: "torch", "triton", or
"auto" (triton on a GPU, torch elsewhere).
"""

import dataclasses
import itertools
import logging
import os
import time
from pathlib import Path

import torch

from engine.config import DEFAULT_PREFILL_GRAPH_TOKENS, EngineConfig, ModelConfig
from engine.copies import HostSpan, index_to_device, to_device
from engine.kv_pool import KVPool, block_bytes, window_of
from engine.layers.attention import ABSORBED_MAX_QUERY, AttentionMetadata
from engine.layers.fp8 import quantize_fp8_block, quantize_mxfp4
from engine.loader import load_weights
from engine.models import model_class
from engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from engine.models.deepseek_vit import ImageEmbeds
from engine.parallel import SINGLE, ParallelContext
from engine.step_plan import DraftPlan, FusedSampling, FusedVerify, StepPlan, StepResult

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BACKENDS = ("auto", "torch", "triton")
DEFAULT_CPU_KV_MEMORY = 2**30  # bytes of KV cache on a CPU when nothing else is said


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
        if param.dtype == torch.int8 and name + "_scale_inv" in params:  # MXFP4 experts: codes and scales
            for w, s in zip(param.data, params[name + "_scale_inv"].data):
                codes, scale = quantize_mxfp4(torch.randn(w.shape[0], 2 * w.shape[1], generator=gen, device=device) * std)
                w.copy_(codes.view(torch.int8))
                s.copy_(scale)
        elif param.dtype == torch.float8_e4m3fn:
            scale = params[name + "_scale_inv"]  # w13 -> w13_scale_inv, weight -> weight_scale_inv
            mats, scales = (param.data, scale.data) if param.dim() == 3 else (param.data[None], scale.data[None])
            for w, s in zip(mats, scales):
                q, si = quantize_fp8_block(torch.randn(w.shape, generator=gen, device=device) * std,
                                           quant.weight_block_size)
                w.copy_(q)
                s.copy_(si)
        elif name.endswith("norm.weight"):
            param.data.fill_(1.0)
        elif name.endswith(("e_score_correction_bias", "gate.bias")):
            param.data.zero_()
        elif name.endswith("tid2eid"):  # hash routing: a random expert table
            param.data.random_(0, model.config.n_routed_experts, generator=gen)
        else:
            param.data.normal_(0.0, std, generator=gen)



class BlockTables:
    """Every running sequence's block table, persistent on the device: [num_slots + 1, max_blocks] int32,
    updated by the plans' deltas. The last row is the scratch slot (every entry the scratch block), and
    entries past a table's end hold the scratch block too."""

    def __init__(self, num_slots: int, max_blocks: int, scratch_block: int, device: torch.device):
        self.scratch_slot, self.scratch_block = num_slots, scratch_block
        self.width = max_blocks
        self.table = torch.full((num_slots + 1, max_blocks), scratch_block, dtype=torch.int32, device=device)

    def apply(self, deltas: list[tuple[int, int, list[int]]]) -> None:
        if not deltas:
            return
        dev = self.table.device
        resets = [slot for slot, first, _ in deltas if first == 0]
        if resets:  # a slot taken by another sequence: nothing of the last one's table stays
            self.table.index_fill_(0, to_device(resets, torch.long, dev), self.scratch_block)
        index = [slot * self.width + first + j for slot, first, ids in deltas for j in range(len(ids))]
        values = [b for _, _, ids in deltas for b in ids]
        self.table.view(-1).index_copy_(0, to_device(index, torch.long, dev), to_device(values, torch.int32, dev))

    def rows(self, slots: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """[len(slots), max_blocks] int32: the tables of these slots (into `out` where given)."""
        return torch.index_select(self.table, 0, index_to_device(tuple(slots), self.table.device), out=out)


class ModelRunner:
    """One rank's model, KV pool, block tables and CUDA graphs; turns a StepPlan into logits."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, path: Path | None, max_model_len: int,
                 par: ParallelContext = SINGLE, device: torch.device | None = None):
        """path=None: random weights (config.seed) instead of a checkpoint. Call `init_cache` before `run`."""
        self.config = config
        self.model_config = model_config
        self.par = par
        self.device = device or resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, model_config.torch_dtype)
        self.backend = resolve_backend(config.attention_backend, self.device)
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        torch.manual_seed(config.seed)
        M = model_class(model_config.architecture)
        self.num_speculative_tokens = config.num_speculative_tokens
        draft_args = {}
        if self.num_speculative_tokens:
            if not hasattr(M, "draft"):
                raise ValueError(f"speculative decoding with MTP is not implemented for {model_config.architecture} "
                                 "yet (the DeepSeek-V3 family has it)")
            draft_args["num_draft_layers"] = 1  # one MTP layer, reused for every draft token
        # FP8 checkpoints keep their blocks only for the FP8 kernels; the reference path dequantizes at load
        keep_fp8 = self.backend == "triton" and model_config.quant is not None and getattr(M, "fp8_kernels", True)
        built = model_config if keep_fp8 else dataclasses.replace(model_config, quant=None)
        default_dtype = torch.get_default_dtype()
        try:
            torch.set_default_dtype(self.dtype)
            with torch.device(self.device):
                self.model = M(built, max_position=max_model_len, par=par, **draft_args)
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
            load_weights(self.model, path, model_config.num_hidden_layers, block,
                         config.show_progress and par.tp_rank == 0)
        if hasattr(self.model, "bind_tokenizer"):  # Engram: ids from the tokenizer's normalized tokens
            tok = path / "tokenizer.json" if path is not None else None
            self.model.bind_tokenizer(str(tok) if tok is not None and tok.is_file() else None)
            self.model.place_engram_tables(config.engram_tables)
        self.model.eval()
        if self.num_speculative_tokens and hasattr(self.model, "keep_verification_states"):
            # V4: a verification's compressor states, one per row, so rejected drafts can be undone (for the
            # decode steps' rows too: up to the decode graphs' rows)
            self.model.keep_verification_states(1 + self.num_speculative_tokens,
                                                DecodeGraphs.num_rows(config.max_num_seqs, self.num_speculative_tokens))
        if self.backend == "triton":
            enable_kernels(self.model)
        self.kv_specs = self._kv_cache_specs(config.kv_cache_dtype)
        self.use_cuda_graphs = (self.backend == "triton" and self.device.type == "cuda"
                                and getattr(M, "cuda_graphs", True)  # V4.1: no device-only decode path yet
                                and not config.extra.get("enforce_eager", False))
        # steps of up to config.prefill_graph_tokens tokens replayed from graphs of their padded length: a
        # fresh prompt's whole (`PrefillGraphs`; not with the MTP draft, which reads the eager step's
        # metadata), others in pieces around attention (`PiecewiseGraphs`); V3-family models, whose layers
        # read device tensors only outside attention; these lengths ([]: none)
        self.prefill_graph_sizes = self._prefill_graph_sizes(config.prefill_graph_tokens, M)
        self.kv_pool: KVPool | None = None
        self.tables: BlockTables | None = None
        self.graphs: DecodeGraphs | None = None
        self.draft_graphs: DraftGraphs | None = None
        self.draw_graphs: DrawGraphs | None = None  # plain decode steps' draws, after the decode graph
        self.spec_graphs: SpecGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        self.warmed_up = False
        # the last step's rows for the MTP draft after it: (plan, positions [T], block tables [T, width], its
        # metadata, hidden [T, hidden]); after a replayed step only plan and hidden (the rest is in the
        # decode graph's buffers)
        self.last_step: tuple | None = None
        # image key -> its span's embeddings [span, hidden], kept from the step that reaches the image to
        # the one that reaches its end (engine.step_plan.PlanImage)
        self.image_embeds: dict[str, torch.Tensor] = {}

    def _prefill_graph_sizes(self, wanted: int | None, model_type: type) -> list[int]:
        """The prefill and piecewise graphs' padded lengths for steps of up to `wanted` tokens ([]: none,
        said in a warning where some were asked for; None: DEFAULT_PREFILL_GRAPH_TOKENS, quietly none
        where there can be none)."""
        asked = wanted is not None
        wanted = DEFAULT_PREFILL_GRAPH_TOKENS if wanted is None else wanted
        if not wanted:
            return []
        why = ("CUDA graphs are off" if not self.use_cuda_graphs
               else f"{model_type.__name__} has no prefill graphs" if not getattr(model_type, "graph_prefills", False)
               else None)
        c = self.config
        sizes = [] if why else LongStepGraphs.lengths(
            DecodeGraphs.num_rows(c.max_num_seqs, self.num_speculative_tokens) + 1,
            min(wanted, c.max_num_batched_tokens, self.max_model_len - 1))
        if not sizes and asked:
            logger.warning("prefill_graph_tokens=%d: no prefill graphs (%s)", wanted, why or
                           "no padded length fits between the decode graphs' rows and the step budget")
        return sizes

    # -- the KV pool ---------------------------------------------------------------------------------
    def _kv_cache_specs(self, kv_cache_dtype: str) -> list:
        if kv_cache_dtype == "auto":
            return self.model.kv_cache_specs(self.dtype)
        if not isinstance(self.model, DeepseekV3ForCausalLM):  # V4 and V4.1 have their own cache codecs
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype} is for the V3-family MLA latent cache; "
                             f"{type(self.model).__name__} sets its caches' dtypes itself (use auto)")
        return self.model.kv_cache_specs(self.dtype, kv_cache_dtype)

    @property
    def num_blocks(self) -> int:
        return self.kv_pool.num_blocks

    @property
    def block_bytes(self) -> int:
        return block_bytes(self.kv_specs, self.block_size)

    def num_blocks_that_fit(self) -> int:
        """How many KV blocks this rank can hold: `num_kv_blocks` if set; else `kv_cache_memory` bytes;
        else, on a GPU, `gpu_memory_utilization` of the card less what is in use once the weights are
        loaded and less the activation peak of the largest step (measured by running the warm-up over a
        one-block pool, as vLLM's profiling step does); else (CPU) 1 GiB. The last two are capped at
        what max_num_seqs sequences of max_model_len tokens can use: a small model on a large card
        would otherwise get millions of blocks, each a bookkeeping entry on the host. Where the window
        kinds have pages of their own (`window_pages_needed`), those are taken first and the blocks, which
        no longer carry the window, share the rest."""
        c = self.config
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        if c.kv_cache_memory is not None:
            return max(1, self._blocks_in(c.kv_cache_memory))
        by_need = c.max_num_seqs * -(-self.max_model_len // self.block_size)
        if self.device.type != "cuda":
            return max(1, min(self._blocks_in(DEFAULT_CPU_KV_MEMORY), by_need))
        self._allocate(1)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self.warm_up()
        activations = torch.cuda.max_memory_allocated(self.device) - before
        self.kv_pool = self.tables = None
        for attn in self.model.attention_layers():
            attn.kv_cache = None
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        # not in the profile: the decode graphs' pools and the sampler's [max_num_seqs, vocab] float32
        # rows (logits, their softmax, the filtered copy): a reserve for both; the graphs of long steps:
        # their pool holds a step's activations of their largest length for good (the profile's largest
        # step, scaled), and the pieces' static buffers
        sampler = 4 * c.max_num_seqs * self.model_config.vocab_size * 4
        long_steps = 0
        if self.prefill_graph_sizes:
            rows = self.prefill_graph_sizes[-1]
            profiled = max(1, min(c.max_num_batched_tokens, self.max_model_len - 1 - self.block_size))  # warm_up's
            heads = self.model_config.num_attention_heads // self.par.tp_size
            long_steps = (activations * min(1.0, rows / profiled)
                          + PiecewiseGraphs.buffer_bytes(rows, heads, self.model_config, self.dtype))
        reserve = 0.01 * total + sampler + long_steps
        budget = total * c.gpu_memory_utilization - (total - free) - activations - reserve
        blocks = self._blocks_in(budget)
        logger.info("KV memory: %.1f GiB of %.1f GiB (gpu_memory_utilization %.2f; in use %.1f GiB, activation "
                    "peak %.2f GiB, graphs of long steps %.2f GiB)", max(budget, 0) / 2**30, total / 2**30,
                    c.gpu_memory_utilization, (total - free) / 2**30, activations / 2**30, long_steps / 2**30)
        if blocks < 1:
            raise MemoryError(f"no room for the KV cache: gpu_memory_utilization {c.gpu_memory_utilization} of "
                              f"{total / 2**30:.1f} GiB leaves {budget / 2**30:.2f} GiB after the weights and "
                              "activations; raise it, lower max_num_batched_tokens, or use more GPUs")
        if blocks > by_need:
            logger.info("KV memory for %d blocks; %d hold max_num_seqs (%d) sequences of max_model_len (%d) "
                        "tokens, and no more are taken", blocks, by_need, c.max_num_seqs, self.max_model_len)
        return min(blocks, by_need)

    def window_pages_needed(self) -> int | None:
        """Pages for the window kinds apart from the blocks (None: the model has none, or
        `num_window_pages` 0): `num_window_pages` if set, else what the running sequences hold between
        steps (each its window's blocks before its next query, the block it writes, one more where a
        step crosses into the next, and the draft's lookahead) plus one step's chunks, and as many again
        for the prefix cache (the pages before a cut that a later prompt's hit needs)."""
        window, c, bs = window_of(self.kv_specs), self.config, self.block_size
        if window is None or c.num_window_pages == 0:
            return None
        tail, lookahead = -(-(window - 1) // bs), -(-max(0, self.num_speculative_tokens - 1) // bs)
        if c.num_window_pages is not None:
            # one sequence's step: its window's blocks, a chunk of the whole budget from inside a block
            least = tail + -(-c.max_num_batched_tokens // bs) + 1 + lookahead
            if c.num_window_pages < least:
                raise ValueError(f"num_window_pages {c.num_window_pages} cannot hold one sequence's step: a window "
                                 f"of {window} tokens and a chunk of max_num_batched_tokens "
                                 f"({c.max_num_batched_tokens}) take up to {least} pages of {bs} tokens")
            return c.num_window_pages
        return 2 * (c.max_num_seqs * (tail + 2 + lookahead) + -(-c.max_num_batched_tokens // bs))

    def window_pages_for(self, num_blocks: int) -> int | None:
        """The window pages to allocate beside num_blocks blocks: None (a page per block) where pages of
        their own would be as many as the blocks."""
        pages = self.window_pages_needed()
        return pages if pages is not None and pages < num_blocks else None

    def _blocks_in(self, budget: float) -> int:
        """Blocks that fit `budget` bytes with the window pages `window_pages_needed` (or a page per block
        where the split saves nothing)."""
        pages = self.window_pages_needed()
        if pages is not None:
            rest = block_bytes(self.kv_specs, self.block_size, windowed=False)
            blocks = int((budget - pages * block_bytes(self.kv_specs, self.block_size, windowed=True)) // rest)
            if blocks > pages:
                return blocks
        return int(budget // self.block_bytes)

    def _allocate(self, num_blocks: int, num_window_pages: int | None = None) -> None:
        self.kv_pool = KVPool(self.kv_specs, num_blocks, self.block_size, self.device, num_window_pages)
        self.model.bind_kv_caches(self.kv_pool)
        width = -(-self.max_model_len // self.block_size)
        self.tables = BlockTables(self.config.max_num_seqs, width, self.kv_pool.scratch_block, self.device)

    def init_cache(self, num_blocks: int, num_window_pages: int | None = None) -> None:
        """Allocate the KV pool (the same block and page counts on every rank), then, on a GPU, warm the
        kernels up and capture the decode graphs. num_window_pages: the window kinds' own pages (None: a
        page per block)."""
        self._allocate(num_blocks, num_window_pages)
        pool = self.kv_pool
        if pool.has_window_pages:
            rest = block_bytes(self.kv_specs, self.block_size, windowed=False)
            gib = (num_blocks * rest + num_window_pages * pool.window_page_bytes) / 2**30
            logger.info("KV cache: %d blocks of %d tokens = %d tokens (%d bytes a token without the window), and %d "
                        "window pages (%d bytes a token of the last %d), %.2f GiB per rank (%s): %d tokens a GiB",
                        num_blocks, self.block_size, num_blocks * self.block_size, rest // self.block_size,
                        num_window_pages, pool.window_page_bytes // self.block_size, window_of(self.kv_specs), gib,
                        self.dtype, num_blocks * self.block_size / gib)
        else:
            logger.info("KV cache: %d blocks of %d tokens = %d tokens, %.2f GiB per rank (%s): %d tokens a GiB",
                        num_blocks, self.block_size, num_blocks * self.block_size, num_blocks * self.block_bytes / 2**30,
                        self.dtype, 2**30 // (self.block_bytes // self.block_size))
        if self.use_cuda_graphs:
            self.graphs = DecodeGraphs(self)
            self.draw_graphs = DrawGraphs(self)
            # verifications replay the decode graphs where the model takes their rows as decode rows
            limit = getattr(self.model, "graph_chunk_tokens", None)
            verifies_in_graphs = limit is None or limit > self.num_speculative_tokens
            self.draft_graphs = DraftGraphs(self) if self.num_speculative_tokens and verifies_in_graphs else None
            if self.num_speculative_tokens and verifies_in_graphs and self.par.tp_size == 1:
                self.spec_graphs = SpecGraphs(self)
            # one pool for both: neither's replays leave anything in it that the other's could overwrite
            # but the prefill graphs' logits, which stay allocated
            pool = torch.cuda.graph_pool_handle() if self.prefill_graph_sizes else None
            args = (self.prefill_graph_sizes, pool, self.graphs.max_batch + 1)
            if self.prefill_graph_sizes and not self.num_speculative_tokens:
                self.prefill_graphs = PrefillGraphs(self, *args)
            if self.prefill_graph_sizes:
                self.piecewise = PiecewiseGraphs(self, *args)
            if self.config.extra.get("capture_graphs_at_start", True):
                from engine.kernels._util import on_compile

                on_compile(None)  # the hook is process-wide: another runner's must not count this one's warm-up
                if not self.warmed_up:
                    self.warm_up()
                self.graphs.capture_all()
                self.draw_graphs.capture_all()
                if self.draft_graphs is not None:
                    self.draft_graphs.capture_all()
                if self.spec_graphs is not None:
                    self.spec_graphs.capture_all()
                if self.prefill_graphs is not None:
                    self.prefill_graphs.capture_all()
                if self.piecewise is not None:
                    self.piecewise.capture_all()
                # anything built from here on stalls a serving step: name it, so warm_up can learn it
                on_compile(lambda variant: logger.warning("Triton built a kernel variant after warm-up "
                                                          "(this step stalls until it is ready): %s", variant))

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run prefill steps of 1, 2, 4, ... tokens up to the step budget (fresh and over a cached prefix)
        into the scratch block, so Triton compiles every kernel variant serving meets now: a variant
        compiled on first use stalls every request in that step for about a second (seen as late
        first tokens in the server benchmark). Tile choices depend on the step's size only in powers of
        two, and the kernels do not specialize on batch-dependent integers; the decode attention's slice
        count (a power of two) is warmed directly. Every rank runs the same steps (their collectives)."""
        from engine.kernels.mla_decode import SPLIT_CHOICES, mla_decode_attention

        scratch, bs = self.tables.scratch_slot, self.block_size
        budget = max(1, min(self.config.max_num_batched_tokens, self.max_model_len - 1 - bs))
        sizes = sorted({min(1 << i, budget) for i in range(budget.bit_length() + 1)})
        for n in sizes:
            for prefix in (0, bs):
                if prefix + n > self.max_model_len - 1:
                    continue  # positions past the rope table
                # every row lands in the scratch block (the scratch slot's table)
                plan = StepPlan([scratch], [prefix], [n], 1, [0] * n, [n - 1])
                self._run_eager(plan, pieces=False)  # what the graphs do not take
                # and the MTP draft after it (eager after a prefill), where its positions fit the rope table
                if self.num_speculative_tokens and prefix + n + self.num_speculative_tokens <= self.max_model_len:
                    self.propose(DraftPlan(self.num_speculative_tokens, [n - 1], [scratch]),
                                 torch.zeros(n, dtype=torch.long, device=self.device), None)
        if self.backend == "triton" and isinstance(self.model, DeepseekV3ForCausalLM):
            # every slice count the decode attention may take
            attn = self.model.attention_layers()[0]
            cache, dev = attn.kv_cache, attn.kv_cache.device
            # and both tile choices: one long sequence's (deeply pipelined) and a full batch's (nothing
            # compiles under the interpreter)
            for batch in (1, 64) if dev.type == "cuda" else (1,):
                q = torch.zeros(batch, attn.num_heads, attn.kv_lora_rank, dtype=self.dtype, device=dev)
                q_pe = torch.zeros(batch, attn.num_heads, attn.qk_rope_head_dim, dtype=self.dtype, device=dev)
                table = torch.full((batch, 1), self.kv_pool.scratch_block, dtype=torch.int32, device=dev)
                lens = torch.ones(batch, dtype=torch.int32, device=dev)
                for splits in SPLIT_CHOICES:
                    mla_decode_attention(q, q_pe, cache, table, lens, attn.softmax_scale, num_splits=splits)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.warmed_up = True
        logger.info("warmed up the prefill kernels for steps of %d to %d tokens", sizes[0], sizes[-1])

    # -- a step --------------------------------------------------------------------------------------
    def takes_graph(self, plan: StepPlan) -> bool:
        """Rank 0 decides, the plan carries it: a step of at most the largest decode graph's rows, unless it
        scores a prompt (every position's logits), and of chunks no longer than the model's graphs take;
        or one fresh prompt that a prefill graph takes."""
        limit = getattr(self.model, "graph_chunk_tokens", None)  # None: chunks of any length
        if limit is not None and any(n > limit for n in plan.query_lens[: plan.num_prefills]):
            return False
        if plan.images:
            return False  # the graphs embed token ids only
        if self.prefill_graphs is not None and self.prefill_graphs.takes(plan):
            return True
        return self.graphs is not None and plan.num_tokens <= self.graphs.max_batch and not plan.collect_logits

    def _prepare(self, plan: StepPlan, inputs: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The plan's device tensors; block tables and cache slots come from the persistent tables on the
        device, so nothing here grows with context length."""
        dev, bs = self.device, self.block_size
        positions = to_device(plan.positions(), torch.long, dev)
        rows = to_device([i for i, n in enumerate(plan.query_lens) for _ in range(n)], torch.long, dev)
        tables = self.tables.rows(plan.slots)
        query_start = [0, *itertools.accumulate(plan.query_lens)]
        context_lens = plan.context_lens()
        meta = AttentionMetadata(
            slot_mapping=tables[rows, positions // bs].long() * bs + positions % bs,
            query_start_loc=to_device(query_start, torch.long, dev),
            context_lens=to_device(context_lens, torch.long, dev),
            block_tables=tables,
            num_prefills=plan.num_prefills,
            num_prefill_tokens=sum(plan.query_lens[: plan.num_prefills]),
            block_size=bs,
            query_start_loc_cpu=query_start,
            query_lens_cpu=list(plan.query_lens),
            context_lens_cpu=context_lens,
            lookback=(to_device(plan.lookback, torch.long, dev).view(len(plan.slots), -1)
                      if plan.lookback is not None else None),
            input_ids_cpu=plan.input_ids if inputs is None else None,
            lookback_cpu=plan.lookback,
        )
        input_ids = to_device(plan.input_ids, torch.long, dev) if inputs is None else inputs
        return input_ids, positions, meta

    @torch.inference_mode()
    def run(self, plan: StepPlan, inputs: torch.Tensor | None = None, offsets: torch.Tensor | None = None) -> StepResult:
        """inputs: the step's token ids on the device (drawn by a step the host has not read yet), where
        the plan carries none; offsets: [T] on the device, added to the plan's positions where it is
        `shifted` (launched before a speculative step's accepted counts were read)."""
        for key in plan.drop_images:
            self.image_embeds.pop(key, None)
        if plan.use_graph and plan.fused_verify and self.spec_graphs is not None and self.spec_graphs.takes(plan):
            self.last_step = None  # drafted already: nothing for `propose`
            return StepResult(None, spec=self.spec_graphs.replay(plan, inputs, offsets))
        if self.spec_graphs is not None:
            self.spec_graphs.resident = None  # this step's rows and positions are not what a fused one left
        if plan.use_graph and self.prefill_graphs is not None and self.prefill_graphs.takes(plan):
            return self.prefill_graphs.run(plan)
        if plan.use_graph:
            return self._replay(plan, inputs, offsets)
        if offsets is not None:
            plan = resolve_offsets(plan, offsets)
        return self._run_eager(plan, inputs)

    def _run_eager(self, plan: StepPlan, inputs: torch.Tensor | None = None, pieces: bool = True) -> StepResult:
        """pieces: a step the piecewise graphs take replays them around its eager attention."""
        input_ids, positions, meta = self._prepare(plan, inputs)
        if plan.images:
            hidden = self.model(input_ids, positions, meta, image_embeds=self._image_embeds(plan))
        elif pieces and self.piecewise is not None and self.piecewise.takes(plan):
            hidden = self.piecewise.forward(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, meta)
        if self.num_speculative_tokens:
            self.last_step = (plan, positions, meta.block_tables, meta, hidden)
        if plan.collect_logits:
            all_logits = self.model.compute_logits(hidden)
            logits = all_logits[plan.sample_indices] if plan.sample_indices else None
            return StepResult(logits, all_logits)
        return StepResult(self.model.compute_logits(hidden[plan.sample_indices]) if plan.sample_indices else None)

    def _image_embeds(self, plan: StepPlan) -> ImageEmbeds:
        """The step's image tokens: each image's span embedded by the model's tower on the step that
        reaches it, kept until the step that reaches its end."""
        index, rows = [], []
        for image in plan.images:
            if image.pixel_values is not None:
                self.image_embeds[image.key] = self.model.embed_image(image.pixel_values.to(self.device), image.grid)
            span = self.image_embeds.pop(image.key) if image.last else self.image_embeds[image.key]
            rows.append(span[image.first : image.first + image.count])
            index += range(image.index, image.index + image.count)
        index = to_device(index, torch.long, self.device)
        is_image = torch.zeros(plan.num_tokens, dtype=torch.bool, device=self.device)
        is_image[index] = True
        return ImageEmbeds(index, torch.cat(rows).to(self.dtype), is_image)

    def _replay(self, plan: StepPlan, inputs: torch.Tensor | None, offsets: torch.Tensor | None = None) -> StepResult:
        """A step of at most `graphs.max_batch` tokens through a decode graph: a prefill chunk's tokens
        are rows of their own (the eager step they replace costs ~75 PyTorch operations a layer)."""
        self.graphs.load(plan, inputs, offsets)
        hidden, logits, _ = self.graphs.replay(plan.num_tokens)
        if self.num_speculative_tokens:  # the graph's rows, in its buffers: the draft reads them there
            self.last_step = (plan, None, None, None, hidden)
            if hasattr(self.model, "replayed"):  # V4: where the replay kept its compressors' states
                self.model.replayed(plan.num_tokens)
        rows = plan.sample_indices
        drawn = self.draw_graphs.replay(plan) if plan.draw_in_graph and self.draw_graphs is not None else None
        if drawn is not None:
            # (a copy: the next replay rewrites the graph's buffer while these may still be on their way)
            return StepResult(None, tokens=drawn.clone())
        if not rows:
            return StepResult(None)
        if len(rows) == plan.num_tokens:  # every row samples (a decode step)
            return StepResult(logits.clone())
        return StepResult(logits.index_select(0, to_device(rows, torch.long, self.device)))

    @torch.inference_mode()
    def propose(self, draft: DraftPlan, next_ids: torch.Tensor, accepted: torch.Tensor | None,
                verified: torch.Tensor | None = None) -> torch.Tensor | None:
        """The MTP draft after the step just run (`last_step`): the MTP layer over every row of the step
        (next_ids [T]: the token after each row), so its cache holds each position; then, for each
        drafting sequence, from its row `draft.rows[i] + accepted[i]` (its last accepted one) the drafts
        one after another, the layer fed its own output for the tokens past the first (as SGLang and vLLM
        reuse one MTP layer for several) -> [S, num_drafts] int64, or None where nobody drafts. First, a
        model with state that rejected drafts advanced (V4's compressors) puts it back: verified [V] the
        drafts accepted by the step's verifications (`draft.verifications`)."""
        plan, positions, tables, meta, hidden = self.last_step
        self.last_step = None
        if draft.verifications:  # each verification's last accepted token among the step's
            starts = [0, *itertools.accumulate(plan.query_lens)]
            self.model.keep_accepted(index_to_device(tuple(starts[r] for r in draft.verifications), self.device)
                                     + verified)
        rows = draft_tables = None
        if draft.num_drafts and draft.rows:
            packed = index_to_device((*draft.rows, *draft.slots), self.device)  # one copy for both
            rows, draft_tables = packed[: len(draft.rows)], self.tables.table.index_select(0, packed[len(draft.rows) :])
        graphs = self.draft_graphs
        if plan.use_graph and graphs is not None and graphs.has(plan.num_tokens, 0 if rows is None else len(rows)):
            return graphs.replay(next_ids, rows, accepted, draft_tables)
        if meta is None:  # a replayed step's rows, drafted eagerly: one-token decodes at their positions
            n = plan.num_tokens
            # (the graph steps its positions on after the step: the rows' own are one less)
            positions, tables = self.graphs.positions[:n] - 1, self.graphs.block_tables[:n]
            meta, _ = decode_rows_metadata(positions, tables, self.block_size, self.graphs.rows_of(n))
        if rows is not None and accepted is not None:
            rows = rows + accepted
        return self._draft(next_ids, positions, meta, hidden, rows, draft_tables, draft.num_drafts)

    def _draft(self, next_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, hidden: torch.Tensor,
               rows: torch.Tensor | None, tables: torch.Tensor | None, num_drafts: int,
               out: torch.Tensor | None = None) -> torch.Tensor | None:
        """`propose`'s work: the MTP pass over the step's rows, then from `rows` [S] (its last accepted
        row per drafting sequence, whose block tables are `tables` [S, width]) num_drafts tokens, into
        `out` [S, num_drafts] if given."""
        h = self.model.draft(next_ids, positions, hidden, meta)  # [T, hidden]
        if rows is None:
            return None
        h, pos = h.index_select(0, rows), positions.index_select(0, rows)
        if out is None:
            out = torch.empty(rows.shape[0], num_drafts, dtype=torch.long, device=h.device)
        for i in range(num_drafts):
            drafts = greedy_tokens(self.model.draft_logits(h), out[:, i])  # [S]: greedy drafts
            if i + 1 == num_drafts:
                break
            step_meta, pos = decode_rows_metadata(pos + 1, tables, self.block_size)
            h = self.model.draft(drafts, pos, h, step_meta)
        return out


def greedy_tokens(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's argmax [R] int64 (into `out` if given: a column of a step's output buffer is fine). On
    a GPU one Triton scan a row: torch's argmax is a two-pass reduction, ~4.5 us for one row of a
    vocabulary on an H200, the scan ~2."""
    if logits.is_cuda:
        from engine.kernels.sampling import greedy

        return greedy(logits, out)
    tokens = logits.argmax(dim=-1)
    return tokens if out is None else out.copy_(tokens)


def resolve_offsets(plan: StepPlan, offsets: torch.Tensor) -> StepPlan:
    """A shifted plan with its offsets read (each row's first token's: a row's tokens share theirs) -> the
    plan at its real positions. The eager path's attention takes its lengths from the host: on a CPU
    reading them costs nothing, on a GPU it waits for the step in flight (the graph path adds the
    offsets on the device instead)."""
    host = offsets.tolist()
    firsts = itertools.accumulate([0, *plan.query_lens[:-1]])
    return dataclasses.replace(plan, num_computed=[c + host[f] for c, f in zip(plan.num_computed, firsts)],
                               shifted=False)


def decode_rows_metadata(positions: torch.Tensor, tables: torch.Tensor, block_size: int,
                         query_index: torch.Tensor | None = None) -> tuple[AttentionMetadata, torch.Tensor]:
    """Each row a one-token decode at its position over its block table ([R] int64, [R, width] int32),
    derived on the device, so a CUDA graph can capture it -> (metadata, positions). The host lists are
    read only by the reference path, which runs on a CPU, where taking them costs nothing. query_index
    [R]: each row's index among its sequence's consecutive rows (`AttentionMetadata.query_index`)."""
    from engine.kernels.spec_step import decode_rows, reference_decode_rows

    rows = tables.shape[0]
    on_host = positions.device.type == "cpu"
    # on a GPU one launch (the PyTorch ops were ten of a few bytes each, ~11 us of a decode step)
    slots, lens = (reference_decode_rows if on_host else decode_rows)(positions, tables, block_size)
    return AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.arange(rows + 1, device=positions.device),
        context_lens=lens,
        block_tables=tables,
        num_prefills=0,
        num_prefill_tokens=0,
        block_size=block_size,
        # on a GPU only their count matters: the fast decode path reads device tensors
        query_start_loc_cpu=list(range(rows + 1)),
        query_lens_cpu=[1] * rows,
        context_lens_cpu=(positions + 1).tolist() if on_host else [0] * rows,
        query_index=query_index,
    ), positions


def capture_graph(step, pool, reset=None) -> tuple[torch.cuda.CUDAGraph, object]:
    """step() run once on a side stream (Triton compiles, cuBLAS chooses: outside the capture), then
    captured into the memory pool `pool` -> (the graph, step's outputs in its buffers). reset(): puts
    back the state step() advances, after each of the two runs."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
        if reset is not None:
            reset()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = step()
    if reset is not None:
        reset()
    return graph, outputs


class DraftGraphs:
    """The MTP draft after a verification step replayed from a decode graph, as CUDA graphs too: one per
    (rows of the step, drafting sequences), both padded, captured at start for the steps where every
    running request verifies k drafts (k + 1 rows each). Each reads the step's rows where the decode
    graph of its row count left them (positions, block tables, hidden states: nothing copied), so it is
    replayed right after that graph. Other shapes (a prefill's first draft, mixed steps) run eagerly.
    Padding rows attend in the scratch block, as the decode graphs' do."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.k = runner.num_speculative_tokens
        decode = runner.graphs
        self.max_rows = decode.max_batch
        dev, n, width = runner.device, decode.max_batch, decode.width
        self.next_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.rows = torch.zeros(n, dtype=torch.long, device=dev)
        self.accepted = torch.zeros(n, dtype=torch.long, device=dev)
        self.draft_tables = torch.full((n, width), decode.scratch_block, dtype=torch.int32, device=dev)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.pool = None

    def key(self, num_rows: int, num_drafting: int) -> tuple[int, int]:
        padded = self.runner.graphs.padded
        return padded(num_rows), padded(num_drafting) if num_drafting else 0

    def has(self, num_rows: int, num_drafting: int) -> bool:
        return self.key(num_rows, num_drafting) in self.graphs

    def _draft(self, key: tuple[int, int]) -> torch.Tensor | None:
        rows, drafting = key
        decode = self.runner.graphs
        # the decode graph steps its positions on after the step: the rows' own are one less
        meta, pos = decode_rows_metadata(decode.positions[:rows] - 1, decode.block_tables[:rows], self.runner.block_size,
                                         decode.rows_of(rows))
        if not drafting:  # the MTP pass over the rows only (its cache gets their positions)
            return self.runner._draft(self.next_ids[:rows], pos, meta, decode.outputs[rows][0], None, None, 0)
        return self.runner._draft(self.next_ids[:rows], pos, meta, decode.outputs[rows][0],
                                  self.rows[:drafting] + self.accepted[:drafting], self.draft_tables[:drafting], self.k)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Steps where every one of S requests verifies k drafts: (S * (k + 1) rows, S drafting); and
        decode steps where nobody drafts (over the batch-size cutoff): (S rows, 0), the MTP pass alone, so
        its cache keeps every position for when they draft again."""
        decode = self.runner.graphs
        keys = {self.key(s * (self.k + 1), s) for s in DecodeGraphs.SIZES if s * (self.k + 1) <= self.max_rows}
        keys |= {self.key(s, 0) for s in DecodeGraphs.SIZES if s <= min(self.max_rows, self.runner.config.max_num_seqs)}
        for key in sorted(keys, reverse=True):  # largest first: the smaller ones reuse its pool
            if key[0] not in decode.graphs:
                decode._capture(key[0])  # its buffers are the draft's inputs
            # rows one past position 0 (of the scratch block) as a replayed step leaves them; the next
            # step's load rewrites them
            decode.positions[: key[0]].clamp_(min=1)
            graph, self.outputs[key] = capture_graph(lambda: self._draft(key), self.pool)
            self.pool = graph.pool()
            self.graphs[key] = graph
        logger.info("captured %d CUDA graphs for MTP drafts of %d tokens", len(self.graphs), self.k)

    @torch.inference_mode()
    def replay(self, next_ids: torch.Tensor, rows: torch.Tensor | None, accepted: torch.Tensor | None,
               draft_tables: torch.Tensor | None) -> torch.Tensor | None:
        """After the decode graph of the step's rows: the token after each row, and the drafting rows
        (their first sampled row, drafts accepted there, block tables; None: nobody drafts) into the
        buffers, one replay -> drafts [S, k], or None."""
        n, s = next_ids.shape[0], 0 if rows is None else rows.shape[0]
        key = self.key(n, s)
        self.next_ids[:n].copy_(next_ids)
        if n < key[0]:  # padding rows: token 0 (the decode graph put them at position 0 of the scratch block)
            self.next_ids[n : key[0]].zero_()
        if s:
            self.rows[:s].copy_(rows)
            if accepted is None:
                self.accepted[:s].zero_()
            else:
                self.accepted[:s].copy_(accepted)
            self.draft_tables[:s].copy_(draft_tables)
            if s < key[1]:
                self.rows[s : key[1]].zero_()
                self.accepted[s : key[1]].zero_()
                self.draft_tables[s : key[1]].fill_(self.runner.graphs.scratch_block)
        self.graphs[key].replay()
        return self.outputs[key][:s].clone() if s else None


class GraphSampling:
    """How rows draw inside a CUDA graph, as `sampler.draw_on_device` draws outside it (the same operations,
    so a seeded request draws the same tokens in and out of a graph): logits / temperature, Gumbel-max with
    the noise keyed by (seed, output position) and top-p applied by the same kernel (no sort); greedy rows
    (and padding) take the argmax. Three kinds of graph by how the rows draw: all greedy, some sampled
    (top-p or not), some also with top-k (`sampler.filter_rows`, a sort over the vocabulary, too costly
    to pay in every sampled step). Each
    row's parameters sit in device buffers loaded with its rows (`StepPlan.fused_sampling`, `load`)."""

    GREEDY, SAMPLED, TOP_K = DRAWS = range(3)

    def __init__(self, runner: ModelRunner, max_rows: int, rows_per_seq: int):
        n, dev = max_rows, runner.device
        self.rows_per_seq = rows_per_seq
        self.vocab = runner.model_config.vocab_size
        # per row: [temperature or 1 (greedy), 1 or 0 (greedy: the sampling kernel's argmax), top-p or inf]
        # and [seed, prompt length, top-k or the vocabulary size]
        self.drawing = torch.tensor([[1.0], [0.0], [float("inf")]], device=dev).repeat(1, n)  # greedy rows
        self.keying = torch.tensor([[0], [0], [self.vocab]], device=dev).repeat(1, n)
        self.step0 = torch.zeros(1, dtype=torch.long, device=dev)  # the noise is keyed by position alone
        self.no_top_p = torch.full((n,), float("inf"), device=dev)  # top-k's sort applies no top-p

    def draw(self, plan: StepPlan) -> int:
        fs = plan.fused_sampling
        if fs is None:
            return self.GREEDY
        return self.TOP_K if any(0 < k < self.vocab for k in fs.top_k) else self.SAMPLED

    def sample(self, logits: torch.Tensor, drawn_at: torch.Tensor, draw: int, tokens: torch.Tensor) -> None:
        """logits [n, V] -> tokens [n]; drawn_at [n]: each row's draw's position (its cache position + 1)."""
        from engine.kernels.sampling import sample
        from engine.sampler import filter_rows, noise_keys

        if draw == self.GREEDY:
            greedy_tokens(logits, tokens)
            return
        n = logits.shape[0]
        divisor, unit, top_p = self.drawing[:, :n]
        seeds, prompt, top_k = self.keying[:, :n]
        scaled = logits / divisor[:, None]
        if draw == self.TOP_K:
            scaled = filter_rows(scaled, top_k, self.no_top_p[:n])
        # the token drawn at position q is output token q - prompt length
        sample(scaled, unit, noise_keys(seeds, drawn_at - prompt), self.step0, out=tokens, top_p=top_p)

    def load(self, fs: FusedSampling, end: int) -> None:
        """The sequences' parameters into the buffers, `rows_per_seq` rows each (rows up to `end` past them
        greedy), two copies."""
        from engine.sampler import _signed

        rows = self.rows_per_seq

        def per_row(values: list, pad) -> list:
            return [v for v in values for _ in range(rows)] + [pad] * (end - len(values) * rows)

        temps = fs.temperature
        self.drawing[:, :end].copy_(to_device(
            [per_row([t if t > 0 else 1.0 for t in temps], 1.0), per_row([1.0 if t > 0 else 0.0 for t in temps], 0.0),
             per_row([p if p < 1.0 else float("inf") for p in fs.top_p], float("inf"))], torch.float32, self.drawing.device))
        self.keying[:, :end].copy_(to_device(
            [per_row([_signed(s) for s in fs.seeds], 0), per_row(fs.num_prompt_tokens, 0),
             per_row([k if 0 < k < self.vocab else self.vocab for k in fs.top_k], self.vocab)],
            torch.long, self.keying.device))


class DrawGraphs:
    """A plain decode step's draws as a CUDA graph of their own, replayed right after the decode graph,
    over its logits: one replay instead of ~25 eager launches and ~10 small copies a step (the scaling,
    the filters, the noise keys, the sampling kernel; on deepseek-tiny at one stream the host's cost of
    those was most of a sampled step's). For steps whose every row draws one token and needs nothing
    of the host (no logprobs, penalties or grammar: `StepPlan.draw_in_graph`); one graph per decode
    graph's size and kind of draw (`GraphSampling`)."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        decode = runner.graphs
        self.sizes = [s for s in DecodeGraphs.SIZES if s <= decode.padded(min(runner.config.max_num_seqs, decode.max_batch))]
        self.sampling = GraphSampling(runner, decode.max_batch, 1)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.pool = None

    def _step(self, size: int, draw: int) -> torch.Tensor:
        decode = self.runner.graphs
        logits = decode.outputs[size][1]
        tokens = torch.empty(size, dtype=torch.long, device=logits.device)
        # the decode graph has moved its rows on: a row's position is now where its draw goes
        self.sampling.sample(logits, decode.positions[:size], draw, tokens)
        return tokens

    def _capture(self, size: int, draw: int) -> None:
        graph, self.outputs[size, draw] = capture_graph(lambda: self._step(size, draw), self.pool)
        self.pool = graph.pool()
        self.graphs[size, draw] = graph

    @torch.inference_mode()
    def capture_all(self) -> None:
        for size in sorted(self.sizes, reverse=True):
            for draw in GraphSampling.DRAWS:
                self._capture(size, draw)
        logger.info("captured %d CUDA graphs for decode steps' draws", len(self.graphs))

    def replay(self, plan: StepPlan) -> torch.Tensor | None:
        """After the decode graph's replay of the plan's rows: their draws [T] (a view of the graph's buffer,
        which its next replay rewrites), or None where no graph takes them (the caller draws eagerly)."""
        key = (self.runner.graphs.padded(plan.num_tokens), self.sampling.draw(plan))
        if key not in self.graphs or plan.num_prefills or len(plan.sample_indices) != plan.num_tokens:
            return None
        if plan.fused_sampling is not None:
            self.sampling.load(plan.fused_sampling, key[0])
        self.graphs[key].replay()
        return self.outputs[key][: plan.num_tokens]


class SpecGraphs:
    """A whole speculative step as one CUDA graph per padded count of sequences S, each verifying k
    drafts (k + 1 rows): the target over the rows the decode graphs' buffers hold, the draw at every row,
    the accepted counts (the leading drafts equal to the draw at the row before each), the MTP layer over
    every row and k drafts from each sequence's last accepted row; tokens, counts and drafts land back to
    back in one buffer, so the host launches one replay and starts one copy a step (instead of a decode
    replay, the eager draws and acceptance, the draft graph's buffer copies and replay, and a copy of four
    tensors); the same buffer holds the next step's rows (each sequence's bonus token and drafts) and
    their offsets, which a step launched ahead takes as they are.

    Three graphs per S by how the rows draw: all greedy (argmax); some sampled (temperature, Gumbel
    noise keyed by seed and output position, as `sampler.draw_on_device`, top-p applied by the same
    kernel); some also with top-k (a sort, `sampler.filter_rows`). Each sampled row's parameters sit in buffers
    loaded with its rows (`StepPlan.fused_sampling`). Steps with other rows (prefills, penalized, logprob
    or guided rows, fewer drafts) take the decode and draft graphs. One rank only: the draft's inputs
    never leave the graph, so the other ranks' collectives would have nothing to broadcast."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.k = runner.num_speculative_tokens
        decode = runner.graphs
        self.rows = self.k + 1
        self.sizes = [s for s in DecodeGraphs.SIZES if s * self.rows <= decode.max_batch]
        # each sequence's first row: its block table, and its last accepted row is first + count
        self.firsts = torch.arange(0, decode.max_batch, self.rows, device=runner.device)
        self.sampling = GraphSampling(runner, decode.max_batch, self.rows)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        # [S * (k + 1) + S + S * k + 2 * S * (k + 1)] int64: tokens, counts, drafts, next rows, their offsets
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.views: dict[tuple[int, int], list[FusedVerify]] = {}  # per (sequences, draw): the same views every replay
        self.pool = None
        # the slots whose next rows the last replay left in the decode graphs' buffers; None once anything
        # else ran (`ModelRunner.run`)
        self.resident: tuple[int, ...] | None = None

    def padded(self, num_seqs: int) -> int | None:
        return next((s for s in self.sizes if s >= num_seqs), None)

    def takes(self, plan: StepPlan) -> bool:
        """Whether a plan the engine marked `fused_verify` fits a graph: k + 1 rows per sequence."""
        return ((self.padded(len(plan.slots)), self.sampling.draw(plan)) in self.graphs
                and plan.num_prefills == len(plan.slots) and all(n == self.rows for n in plan.query_lens))

    def _step(self, num_seqs: int, draw: int) -> torch.Tensor:
        from engine.kernels import spec_step

        runner, decode, k, rows = self.runner, self.runner.graphs, self.k, self.rows
        n = num_seqs * rows
        meta, pos = decode.metadata(n)
        # each sequence's k + 1 consecutive rows, which the decode attention may fold into its heads (a
        # padding sequence's rows all at position 0: folded, all but its last see nothing, finite zeros)
        meta.queries_per_seq = rows
        ids = decode.input_ids[:n]
        hidden = runner.model(ids, pos, meta)
        # [tokens n | counts S | drafts S * k | next rows n | their offsets n]: the host copies the first
        # three, a step launched ahead takes the last two
        out = torch.empty(3 * n + num_seqs * (1 + k), dtype=torch.long, device=ids.device)
        tokens, counts = out[:n], out[n : n + num_seqs]
        drafts = out[n + num_seqs : n + num_seqs * (1 + k)].view(num_seqs, k)
        following, offsets = out[n + num_seqs * (1 + k) :].split(n)
        logits = runner.model.compute_logits(hidden)
        # the token drawn at cache position p is output token p + 1 - prompt length
        self.sampling.sample(logits, pos + 1, draw, tokens)
        on_device = ids.is_cuda  # one launch each there; the same in PyTorch on a CPU
        accept = spec_step.accept if on_device else spec_step.reference_accept
        advance = spec_step.advance if on_device else spec_step.reference_advance
        _, last = accept(tokens, ids, k, counts)  # accepted drafts, and each sequence's last accepted row
        if hasattr(runner.model, "keep_accepted"):  # V4: the compressors' state after the last accepted token
            runner.model.keep_accepted(last)
        runner._draft(tokens, pos, meta, hidden, last, decode.block_tables.index_select(0, self.firsts[:num_seqs]), k,
                      out=drafts)
        # the next step's rows (bonus token, drafts), as `LLMEngine._launch_after_drafts` would gather them,
        # and into the buffers, as a decode graph steps its rows on: a step of the same sequences after this
        # one finds them there (`replay`); each row moves past its sequence's accepted tokens and its own,
        # padding sequences (the scratch block's table) stay at position 0
        advance(tokens, counts, drafts, decode.block_tables[:n], decode.scratch_block, ids, pos, following, offsets)
        return out

    def _capture(self, num_seqs: int, draw: int) -> None:
        decode = self.runner.graphs
        saved = [t.clone() for t in (decode.input_ids, decode.positions)]

        def restore():  # the step moves the rows on: the capture's runs leave them where they were
            decode.input_ids.copy_(saved[0])
            decode.positions.copy_(saved[1])

        key = (num_seqs, draw)
        graph, self.outputs[key] = capture_graph(lambda: self._step(num_seqs, draw), self.pool, restore)
        self.pool = graph.pool()
        self.graphs[key] = graph

    @torch.inference_mode()
    def capture_all(self) -> None:
        decode = self.runner.graphs
        for size in sorted(self.sizes, reverse=True):  # largest first: the smaller ones reuse its pool
            rows = size * self.rows
            # rows at position 0 of the scratch block; the next step's load rewrites them
            decode.input_ids[:rows].zero_()
            decode.positions[:rows].zero_()
            decode.block_tables[:rows].fill_(decode.scratch_block)
            for draw in GraphSampling.DRAWS:
                self._capture(size, draw)
        logger.info("captured %d CUDA graphs for fused speculative steps of %d drafts", len(self.graphs), self.k)

    @torch.inference_mode()
    def replay(self, plan: StepPlan, inputs: torch.Tensor | None, offsets: torch.Tensor | None) -> FusedVerify:
        """Load the plan's rows into the decode graphs' buffers, one replay -> its outputs (views of the
        graph's output buffer). A step of the same sequences right after a fused one finds its rows there
        already (the graph moved them on: the tokens are `inputs`, the positions the plan's plus
        `offsets`), and their sampling parameters: only new blocks of their tables are loaded."""
        decode = self.runner.graphs
        num_seqs, slots = len(plan.slots), tuple(plan.slots)
        key = (self.padded(num_seqs), self.sampling.draw(plan))
        end = key[0] * self.rows
        if self.resident != slots:
            n = plan.num_tokens
            decode.load(plan, inputs, offsets)
            if decode.padded(n) < end:  # padding sequences past load's: token 0 at position 0 of the scratch block
                decode.input_ids[n:end].zero_()
                decode.positions[n:end].zero_()
                decode.block_tables[n:end].fill_(decode.scratch_block)
                if decode.query_index is not None:
                    decode.query_index[n:end].zero_()
            if plan.fused_sampling is not None:
                self.sampling.load(plan.fused_sampling, end)
        elif plan.table_deltas:
            decode.load_tables(plan)
        self.resident = slots
        self.graphs[key].replay()
        turns = self.views.get((num_seqs, key[1]))
        if turns is None:
            turns = self.views[num_seqs, key[1]] = [self._views(key, num_seqs) for _ in range(2)]
        turns.reverse()  # two host buffers in turn (`HostSpan`)
        return turns[0]

    def _views(self, key: tuple[int, int], num_seqs: int) -> FusedVerify:
        """The outputs of the graph of `key` (padded sequences, draw) for its first num_seqs."""
        padded = key[0]
        out, k, end, n = self.outputs[key], self.k, padded * self.rows, num_seqs * self.rows
        drafts_at = end + padded
        next_at = drafts_at + padded * k
        sent = HostSpan(out[: drafts_at + num_seqs * k], [n, end - n, num_seqs, padded - num_seqs, num_seqs * k],
                        [(n,), (num_seqs,), (num_seqs, k)])
        return FusedVerify(out[:n], out[end : end + num_seqs],
                           out[drafts_at : drafts_at + num_seqs * k].view(num_seqs, k), sent,
                           out[next_at : next_at + n], out[next_at + end : next_at + end + n])


class LongStepGraphs:
    """What the graphs of steps longer than the decode graphs' rows share: their padded lengths, the rows
    a step they take has, and the memory pool they capture into."""

    MULTIPLE = 256

    @classmethod
    def lengths(cls, min_tokens: int, max_tokens: int, multiple: int = MULTIPLE) -> list[int]:
        """The padded lengths of graphs taking steps of min_tokens to max_tokens tokens: multiples of
        `multiple`, from 4k on of an eighth of the power of two at or below (at most 12.5 % padding
        there); lengths the un-absorbed prefill takes, so the whole-prompt graphs' metadata bounds
        never pick the absorbed path."""
        size, sizes = -(-max(min_tokens, ABSORBED_MAX_QUERY + 1) // multiple) * multiple, []
        while size <= max_tokens:
            sizes.append(size)
            size += max(multiple, (1 << (size.bit_length() - 1)) // 8)
        return sizes

    def __init__(self, runner: ModelRunner, sizes: list[int], pool, min_tokens: int):
        """min_tokens: the fewest rows a step taken has (fewer: the decode graphs take it)."""
        self.runner, self.sizes, self.pool, self.min_tokens = runner, sizes, pool, min_tokens

    def fits(self, num_tokens: int) -> bool:
        return self.min_tokens <= num_tokens <= self.sizes[-1]

    def padded(self, num_tokens: int) -> int:
        return next(s for s in self.sizes if s >= num_tokens)


class PrefillGraphs(LongStepGraphs):
    """One fresh prompt's prefill, alone in its step, as a CUDA graph of its padded length.

    A prefill of a few thousand tokens is bound by the host: the eager step launches ~70 kernels a
    layer from Python, and at 2k tokens that takes longer than the kernels run (docs/perf.md, "A 2k-token
    prefill is bound by the host"). A step that is one prompt with nothing cached, longer than the decode
    graphs' rows and at most the longest of `sizes`, replays the graph of its padded length: the prompt's
    rows, then padding rows as a second sequence of their own (causal attention keeps the
    prompt's rows from seeing them; their tokens and positions are 0, their latents go to the scratch
    block). What varies lives in static buffers (the prompt's length, its tokens, its block table) and
    the step derives positions, cache slots and both sequences' bounds from them on the device, so
    loading a step is two small copies. Up to MULTIPLE - 1 padding rows (`lengths`) cost device time,
    several times a short prompt's own, but a short prompt's step is bound by the host, which the graph
    takes off.

    Steps of several prompts, a chunk over a cached prefix, or prefill and decode rows together would
    need every sequence's bounds (and its context's) as buffers, and a graph for each shape: they replay
    `PiecewiseGraphs` instead, around their eager attention.
    """

    def __init__(self, runner: ModelRunner, sizes: list[int], pool, min_tokens: int):
        super().__init__(runner, sizes, pool, min_tokens)
        dev, width = runner.device, runner.tables.width
        self.input_ids = torch.zeros(sizes[-1], dtype=torch.long, device=dev)
        self.length = torch.ones(1, dtype=torch.long, device=dev)  # the prompt's tokens
        # the prompt's block table, then the padding sequence's: the scratch slot's (every entry the scratch block)
        self.table = torch.full((2, width), runner.kv_pool.scratch_block, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def takes(self, plan: StepPlan) -> bool:
        n = plan.num_tokens
        return (self.fits(n) and plan.num_prefills == 1
                and len(plan.slots) == 1 and plan.num_computed[0] == 0 and plan.input_ids is not None
                and plan.sample_indices in ([], [n - 1]) and not plan.collect_logits and not plan.images
                and not plan.shifted and plan.lookback is None)

    def metadata(self, size: int) -> tuple[AttentionMetadata, torch.Tensor]:
        """The two sequences' metadata over `size` rows, derived on the device -> (metadata, positions).
        The host lists are bounds only (each sequence at most `size` rows, no query absorbed): the fast
        prefill path reads them for its grid and its choice of path alone."""
        dev, bs = self.table.device, self.runner.block_size
        n = self.length
        row = torch.arange(size, device=dev)
        real = row < n
        positions = torch.where(real, row, 0)
        blocks = self.table[0, positions // bs].long()
        slots = torch.where(real, blocks * bs + positions % bs, self.runner.kv_pool.scratch_block * bs)
        bounds = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), n, torch.full_like(n, size)])
        meta = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=bounds,
            context_lens=bounds.diff(),
            block_tables=self.table,
            num_prefills=2,
            num_prefill_tokens=size,
            block_size=bs,
            query_start_loc_cpu=[0, size, size],
            query_lens_cpu=[size, size],
            context_lens_cpu=[size, size],
        )
        # nothing is cached: each sequence's context is its own rows, at the slots they are written to
        meta.set_prefill_context(slots, bounds.int())
        return meta, positions

    def _step(self, size: int) -> torch.Tensor:
        """The padded prefill -> the prompt's last row's logits [1, vocab]."""
        meta, positions = self.metadata(size)
        hidden = self.runner.model(self.input_ids[:size], positions, meta)
        return self.runner.model.compute_logits(hidden.index_select(0, self.length - 1))

    def _capture(self, size: int) -> None:
        graph, self.outputs[size] = capture_graph(lambda: self._step(size), self.pool)
        self.pool = graph.pool()
        self.graphs[size] = graph
        logger.info("captured a CUDA graph for prefills of up to %d tokens", size)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Every padded length, largest first (the smaller graphs reuse its memory pool; captured on first
        use instead, each larger one grows the pool)."""
        start = time.perf_counter()
        for size in reversed(self.sizes):
            if size not in self.graphs:
                self._capture(size)
        logger.info("captured %d CUDA graphs of fresh prompts (up to %d tokens) in %.1f s", len(self.graphs),
                    self.sizes[-1], time.perf_counter() - start)

    def replay(self, size: int) -> torch.Tensor:
        if size not in self.graphs:
            self._capture(size)
        self.graphs[size].replay()
        return self.outputs[size]

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> StepResult:
        n, size = plan.num_tokens, self.padded(plan.num_tokens)
        loaded = to_device([n, *plan.input_ids], torch.long, self.input_ids.device)  # one copy
        self.length.copy_(loaded[:1])
        self.input_ids[:n].copy_(loaded[1:])
        self.input_ids[n:size].zero_()  # the padding rows' routing and device time do not depend on history
        self.runner.tables.rows(plan.slots, out=self.table[:1])
        logits = self.replay(size)
        # a copy: the next replay rewrites the graph's buffer while these may still be on their way
        return StepResult(logits.clone() if plan.sample_indices else None)


class PiecewiseGraphs(LongStepGraphs):
    """Steps no whole graph takes, replayed in pieces around each layer's attention, one chain of pieces
    per padded length.

    Any step of more rows than the decode graphs hold and at most `sizes[-1]` (prefill chunks over
    cached prefixes or not, several prompts, decode rows beside them) keeps only its attention eager:
    attention is where a step's shape lives (each sequence's bounds and context), and everything else is
    row-wise. Piece 0 embeds the tokens and runs the first layer up to attention (`DecoderLayer.
    before_attention`: the input norm, the projections, the latent write); piece i runs layer i - 1
    after attention (`after_attention`: o_proj, the norm, the MLP or MoE) and layer i up to it; the last
    piece ends with the final norm. Between pieces `MLA.attend` runs eagerly over the step's own
    metadata. What crosses a piece's edge is in static buffers (the queries, the residual stream,
    attention's output, the final hidden state), so no piece's output stays alive in the graphs' pool;
    copying them costs ~60 MB of traffic a layer at 2k tokens of DeepSeek-V2-Lite (~1 % of the step).
    Padding rows carry token 0 at position 0, and their latents go to the scratch block; attention reads
    the step's own rows only.
    """

    def __init__(self, runner: ModelRunner, sizes: list[int], pool, min_tokens: int):
        super().__init__(runner, sizes, pool, min_tokens)
        model = runner.model.model
        self.embed, self.layers, self.norm = model.embed_tokens, model.layers, model.norm
        attn = self.layers[0].self_attn
        self.nope = attn.qk_nope_head_dim
        dev, n, dtype = runner.device, sizes[-1], runner.dtype
        hidden = runner.model_config.hidden_size
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.scratch_slot = runner.kv_pool.scratch_block * runner.block_size  # the scratch block's first row
        self.slots = torch.full((n,), self.scratch_slot, dtype=torch.long, device=dev)
        self.queries = torch.zeros(n, attn.num_heads, self.nope + attn.qk_rope_head_dim, dtype=dtype, device=dev)
        self.attn_out = torch.zeros(n, attn.num_heads, attn.v_head_dim, dtype=dtype, device=dev)
        self.residual = torch.zeros(n, hidden, dtype=dtype, device=dev)
        self.hidden = torch.zeros(n, hidden, dtype=dtype, device=dev)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}

    @staticmethod
    def buffer_bytes(rows: int, heads: int, cfg: ModelConfig, dtype: torch.dtype) -> int:
        """The static buffers' bytes for steps of `rows` rows and `heads` heads on this rank."""
        per_row = heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) + 2 * cfg.hidden_size
        return rows * (per_row * (torch.finfo(dtype).bits // 8) + 3 * 8)

    def takes(self, plan: StepPlan) -> bool:
        return self.fits(plan.num_tokens) and not plan.images

    def _metadata(self, size: int) -> AttentionMetadata:
        """What the pieces read of a step's metadata: the cache slots alone (`MLA.project`); the rest
        describes one chunk of `size` rows and is not read."""
        empty = self.slots[:0]
        return AttentionMetadata(slot_mapping=self.slots[:size], query_start_loc=empty, context_lens=empty,
                                 block_tables=empty.view(0, 0), num_prefills=1, num_prefill_tokens=size,
                                 block_size=self.runner.block_size, query_start_loc_cpu=[0, size],
                                 query_lens_cpu=[size], context_lens_cpu=[size])

    def _piece(self, size: int, i: int) -> None:
        """Piece i of a step of `size` rows, from and into the static buffers."""
        if i == 0:
            h, residual = self.embed(self.input_ids[:size]), None
        else:
            h, residual = self.layers[i - 1].after_attention(self.attn_out[:size], self.residual[:size])
        if i == len(self.layers):
            self.hidden[:size].copy_(self.norm(h, residual)[0])
            return
        (q_nope, q_pe, _), residual = self.layers[i].before_attention(self.positions[:size], h, residual,
                                                                      self._metadata(size))
        self.queries[:size, :, : self.nope].copy_(q_nope)
        self.queries[:size, :, self.nope:].copy_(q_pe)
        self.residual[:size].copy_(residual)

    def _capture(self, size: int) -> None:
        """The chain for `size` rows, with every row's latent sent to the scratch block (what the runs
        before the capture write is garbage)."""
        self.slots[:size].fill_(self.scratch_slot)
        chain = []
        for i in range(len(self.layers) + 1):
            graph, _ = capture_graph(lambda i=i: self._piece(size, i), self.pool)
            self.pool = graph.pool()
            chain.append(graph)
        self.graphs[size] = chain
        logger.debug("captured %d CUDA graphs around attention for steps of up to %d tokens", len(chain), size)

    @torch.inference_mode()
    def capture_all(self) -> None:
        start = time.perf_counter()
        for size in reversed(self.sizes):
            if size not in self.graphs:
                self._capture(size)
        logger.info("captured %d graphs around attention (%d lengths) in %.1f s",
                    sum(map(len, self.graphs.values())), len(self.graphs), time.perf_counter() - start)

    def replay(self, size: int, i: int) -> None:
        self.graphs[size][i].replay()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The model's forward for the step (`ModelRunner._prepare`'s tensors) -> hidden [T, hidden], a view
        of a buffer the next step rewrites."""
        n = input_ids.shape[0]
        size = self.padded(n)
        if size not in self.graphs:
            self._capture(size)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        if n < size:  # padding rows: token 0 at position 0, into the scratch block
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slots[n:size].fill_(self.scratch_slot)
        queries = self.queries[:n]
        for i, layer in enumerate(self.layers):
            self.replay(size, i)
            out = layer.self_attn.attend(queries[:, :, : self.nope], queries[:, :, self.nope:], None, meta)
            self.attn_out[:n].copy_(out)
        self.replay(size, len(self.layers))
        return self.hidden[:n]


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

    @classmethod
    def num_rows(cls, max_num_seqs: int, num_speculative_tokens: int) -> int:
        """The rows the buffers hold: the padded size of the largest batch, so every padded() row count fits;
        a verification takes 1 + k rows a request."""
        return cls.padded(min(max_num_seqs * (1 + num_speculative_tokens), cls.SIZES[-1]))

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.max_batch = self.num_rows(runner.config.max_num_seqs, runner.num_speculative_tokens)
        self.width = runner.tables.width  # block-table columns
        self.scratch_block = runner.kv_pool.scratch_block
        dev, n = runner.device, self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.block_tables = torch.full((n, self.width), self.scratch_block, dtype=torch.int32, device=dev)
        self.temperature = torch.zeros(n, dtype=torch.float32, device=dev)  # 0: greedy
        self.seeds = torch.arange(n, dtype=torch.long, device=dev)
        self.step = torch.zeros(1, dtype=torch.long, device=dev)
        # each row's index among its sequence's rows, where the model folds a sequence's rows in order
        # (V4's compressors; `AttentionMetadata.query_index`); others read a row's position alone
        limit = getattr(runner.model, "graph_chunk_tokens", None)
        self.query_index = torch.zeros(n, dtype=torch.long, device=dev) if limit is not None and limit > 1 else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.pool = None

    @classmethod
    def padded(cls, batch: int) -> int:
        return next(s for s in cls.SIZES if s >= batch)

    def load(self, plan: StepPlan, inputs: torch.Tensor | None = None, offsets: torch.Tensor | None = None) -> None:
        """Copy a plan's rows into the static buffers (a prefill chunk's tokens as rows of their own, at
        consecutive positions of its sequence's table); rows past it decode into the scratch block.
        inputs: the step's token ids already on the device (else the plan's own); offsets: [T] added to
        the positions on the device (a shifted plan: the graph derives slots and lengths from them)."""
        n = plan.num_tokens
        padded = self.padded(n)
        dev = self.input_ids.device
        tables = self.runner.tables
        # the scratch slot's row (all scratch blocks) for the padding rows
        slots = [s for s, count in zip(plan.slots, plan.query_lens) for _ in range(count)]
        slots += [tables.scratch_slot] * (padded - n)
        self.input_ids[:n].copy_(to_device(plan.input_ids, torch.long, dev) if inputs is None else inputs)
        if self.query_index is None:
            self.positions[:n].copy_(to_device(plan.positions(), torch.long, dev))
        else:  # one copy for both
            both = to_device([plan.positions(), [j for q in plan.query_lens for j in range(q)]], torch.long, dev)
            self.positions[:n].copy_(both[0])
            self.query_index[:n].copy_(both[1])
        if offsets is not None:
            self.positions[:n].add_(offsets)
        self.load_tables(plan, slots)
        if n < padded:  # padding rows decode token 0 at position 0 into the scratch block
            self.input_ids[n:padded].zero_()
            self.positions[n:padded].zero_()
            self.temperature[n:padded].zero_()
            if self.query_index is not None:
                self.query_index[n:padded].zero_()

    def load_tables(self, plan: StepPlan, slots: list[int] | None = None) -> None:
        """Each row's block table into the buffer (slots: per padded row, its sequence's slot)."""
        tables = self.runner.tables
        if slots is None:
            slots = [s for s, count in zip(plan.slots, plan.query_lens) for _ in range(count)]
            slots += [tables.scratch_slot] * (self.padded(len(slots)) - len(slots))
        tables.rows(slots, out=self.block_tables[: len(slots)])

    def rows_of(self, batch: int) -> torch.Tensor | None:
        """The first `batch` rows' indices among their sequences' rows (None where the model reads none)."""
        return None if self.query_index is None else self.query_index[:batch]

    def metadata(self, batch: int) -> tuple[AttentionMetadata, torch.Tensor]:
        """Attention metadata of the first `batch` rows, derived on the device -> (metadata, positions)."""
        return decode_rows_metadata(self.positions[:batch], self.block_tables[:batch], self.runner.block_size,
                                    self.rows_of(batch))

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

        graph, self.outputs[batch] = capture_graph(lambda: self._step(batch), self.pool, restore)
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
