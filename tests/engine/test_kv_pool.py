"""The KV pool: tensors from specs, sized by blocks, bytes or (on a GPU) the card's memory; and the plans'
block-table deltas, whose size does not grow with context length."""

import pickle

import pytest
import torch

from engine import LLM
from engine.kv_pool import KVCacheSpec, KVPool, block_bytes
from engine.model_runner import DEFAULT_CPU_KV_MEMORY
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence, SequenceStatus
from engine.step_plan import PlanBuilder


def test_specs_lay_out_every_kind_in_raw_token_coordinates():
    specs = [KVCacheSpec("latent", 0, 576, torch.bfloat16),
             KVCacheSpec("window", 0, 512, torch.bfloat16, window=128),
             KVCacheSpec("compressed", 0, 512, torch.bfloat16, compress_ratio=4),
             KVCacheSpec("compressor_state", 0, 1024, torch.float32, has_block_state=True)]
    pool = KVPool(specs, num_blocks=10, block_size=64, device=torch.device("cpu"))
    # one extra block: the scratch block; a 4x compressed kind holds 64 / 4 rows of a 64-token block, a
    # block state one row
    assert [tuple(c.shape) for c in pool.caches] == [(11, 64, 576), (11, 64, 512), (11, 16, 512), (11, 1, 1024)]
    assert pool.scratch_block == 10
    assert pool.block_bytes == 64 * 576 * 2 + 64 * 512 * 2 + 16 * 512 * 2 + 1024 * 4
    with pytest.raises(ValueError, match="multiple of"):
        KVPool(specs, 4, block_size=50, device=torch.device("cpu"))  # 50 tokens are not whole 4-token rows
    with pytest.raises(ValueError, match="unknown KV cache kind"):
        KVCacheSpec("values", 0, 8, torch.float32)


def test_pool_size_follows_num_blocks_kv_cache_memory_and_the_cpu_default(random_checkpoint):
    llm = LLM(str(random_checkpoint), dtype="float32", num_kv_blocks=37)
    runner = llm.engine.runner
    assert runner.num_blocks == 37 and runner.kv_pool.caches[0].shape[0] == 38
    per_block = block_bytes(runner.kv_specs, runner.block_size)
    assert per_block == runner.model_config.num_hidden_layers * 16 * runner.model_config.kv_cache_dim * 4

    sized = LLM(str(random_checkpoint), dtype="float32", kv_cache_memory=100 * per_block + per_block // 2)
    assert sized.engine.runner.num_blocks == 100  # whole blocks within the given bytes
    assert sized.engine.max_model_len == min(sized.engine.model_config.max_position_embeddings, 100 * 16)

    default = LLM(str(random_checkpoint), dtype="float32", max_num_seqs=2, device="cpu")
    by_need = 2 * -(-default.engine.max_model_len // 16)  # two sequences at full length use no more
    assert default.engine.runner.num_blocks == min(DEFAULT_CPU_KV_MEMORY // per_block, by_need)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_pool_takes_what_gpu_memory_utilization_leaves(random_checkpoint):
    import gc

    gc.collect()  # earlier tests' engines
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    sizes = {}
    for util in (0.3, 0.5):
        # enough sequences of enough tokens that the card, not their need, bounds the pool
        llm = LLM(str(random_checkpoint), dtype="bfloat16", gpu_memory_utilization=util, max_num_seqs=1024,
                  block_size=256, max_model_len=1 << 20, extra={"capture_graphs_at_start": False})
        runner = llm.engine.runner
        sizes[util] = runner.num_blocks * runner.block_bytes
        # what the card holds stays within the share (the pool fills what the rest leaves of it)
        assert (total - torch.cuda.mem_get_info()[0]) <= util * total + 0.01 * total
        assert sizes[util] > util * total - (total - free) - 0.05 * total
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()
    # a fifth of the card more gives the pool about a fifth of the card more
    assert abs((sizes[0.5] - sizes[0.3]) - 0.2 * total) < 0.02 * total


def _running(name: str, num_tokens: int, blocks: list[int]) -> Sequence:
    seq = Sequence(name, list(range(num_tokens)), SamplingParams(), torch.Generator())
    seq.block_table, seq.num_computed_tokens, seq.status = blocks, num_tokens - 1, SequenceStatus.RUNNING
    return seq


def test_plans_send_a_table_once_then_only_new_blocks():
    planner = PlanBuilder(num_slots=4)
    a, b = _running("a", 40, [3, 4, 5]), _running("b", 8, [9])
    first = planner.build(ScheduledBatch(decodes=[a, b]))
    assert first.table_deltas == [(first.slots[0], 0, [3, 4, 5]), (first.slots[1], 0, [9])]
    assert first.sample_indices == [0, 1] and first.input_ids == [39, 7]
    a.num_computed_tokens += 1
    assert planner.build(ScheduledBatch(decodes=[a, b])).table_deltas == []  # nothing changed
    a.block_table.append(6)
    assert planner.build(ScheduledBatch(decodes=[a])).table_deltas == [(first.slots[0], 3, [6])]
    # b finished: its slot goes to the next sequence, whose table starts at column 0 (the row is reset)
    b.status = SequenceStatus.FINISHED
    c = _running("c", 4, [11])
    plan = planner.build(ScheduledBatch(decodes=[a, c]))
    assert plan.slots == [first.slots[0], first.slots[1]] and plan.table_deltas == [(first.slots[1], 0, [11])]
    # a preempted sequence comes back with its whole (new) table, wherever it lands
    a.status = SequenceStatus.WAITING
    planner.build(ScheduledBatch(decodes=[c]))
    a.status, a.block_table = SequenceStatus.RUNNING, [7, 8, 1, 2]
    plan = planner.build(ScheduledBatch(decodes=[a]))
    assert plan.table_deltas == [(plan.slots[0], 0, [7, 8, 1, 2])]


def test_a_sequence_preempted_and_admitted_again_between_plans_sends_its_new_table():
    """Preempted with every running sequence (no plan built: the batch was empty), then admitted again
    with other blocks: the planner sees a new table (BlockManager.release gives it a new list) and
    resends it whole, instead of keeping the old row on the device."""
    planner = PlanBuilder(num_slots=2)
    a = _running("a", 40, [3, 4, 5])
    first = planner.build(ScheduledBatch(decodes=[a]))
    a.block_table = []  # what BlockManager.release does
    a.block_table += [3, 4, 9]  # admitted again, before any plan saw it waiting
    plan = planner.build(ScheduledBatch(decodes=[a]))
    assert plan.table_deltas == [(plan.slots[0], 0, [3, 4, 9])] and plan.slots == first.slots


def test_a_decode_plan_does_not_grow_with_context_length():
    """What crosses to the workers for a decode step of 64 sequences is the same at 4k and 128k tokens of
    context (the tables live on the device; a step sends at most a block per sequence)."""
    sizes = {}
    for context in (4096, 131072):
        planner = PlanBuilder(num_slots=64)
        seqs = [_running(f"s{i}", context, list(range(context // 16))) for i in range(64)]
        planner.build(ScheduledBatch(decodes=seqs))  # admission: the whole tables, once
        for s in seqs:
            s.num_computed_tokens += 1
        sizes[context] = len(pickle.dumps(planner.build(ScheduledBatch(decodes=seqs))))
    assert abs(sizes[4096] - sizes[131072]) <= 64 * 2 * 4  # only the ids and positions are wider numbers
