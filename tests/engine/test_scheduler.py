"""Scheduler decisions that the runner's fast paths rely on."""

import torch

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence


def seq(rid: str, num_tokens: int) -> Sequence:
    return Sequence(rid, list(range(1, num_tokens + 1)), SamplingParams(), torch.Generator())


def test_a_one_token_chunk_short_of_the_prompts_end_is_a_prefill_not_a_decode():
    # a decode samples; a one-token chunk in the middle of a prompt must not (the graph step samples
    # every decode row)
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=4)
    for i in range(3):
        sched.add(seq(f"d{i}", 1))
    first = sched.schedule()  # three one-token prompts: each is its prompt's last token
    assert [s.request_id for s in first.decodes] == ["d0", "d1", "d2"]
    for s in first.decodes:
        s.num_computed_tokens += 1
        s.output_token_ids.append(7)
    sched.add(seq("long", 6))
    batch = sched.schedule()  # three decodes take three of the four tokens: the prompt gets one
    assert [s.request_id for s in batch.decodes] == ["d0", "d1", "d2"]
    assert [(s.request_id, n) for s, n in batch.prefills] == [("long", 1)]


def test_the_head_of_the_queue_that_cannot_be_admitted_does_not_count_as_admissible():
    sched = Scheduler(BlockManager(4, 4), max_num_seqs=8, max_num_batched_tokens=64)
    sched.add(seq("fits", 8))
    assert sched.can_admit_next()
    sched.schedule()  # takes 2 of the 4 blocks
    sched.add(seq("too-big", 16))  # 4 blocks: more than the 2 left
    assert not sched.can_admit_next()
