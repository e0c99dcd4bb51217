"""DecodeGraphs.load: the static buffers a decode graph reads hold exactly the engine's batch. Every row
is its sequence's block table followed by the scratch block (graphs replayed back to back walk
positions past a table's end), padding rows are all scratch at position 0. The buffers are plain
tensors, so this runs on CPU; the graphs themselves need a GPU (tests/engine/test_fast_path.py)."""

from types import SimpleNamespace

import torch

from engine.model_runner import DecodeGraphs
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

SCRATCH = 99


def graphs() -> DecodeGraphs:
    runner = SimpleNamespace(config=SimpleNamespace(max_num_seqs=8), max_model_len=128, block_size=16,
                             num_blocks=SCRATCH, device=torch.device("cpu"))
    return DecodeGraphs(runner)


def seq(blocks: list[int], computed: int) -> Sequence:
    s = Sequence(f"s{computed}", list(range(3, 3 + computed + 1)), SamplingParams(), None, torch.Generator())
    s.block_table, s.num_computed_tokens = list(blocks), computed
    return s


def expected_row(blocks: list[int], width: int) -> list[int]:
    return blocks + [SCRATCH] * (width - len(blocks))


def test_load_writes_each_table_then_scratch_and_pads_with_scratch():
    g = graphs()
    wide = [seq([1, 2, 3, 4], 60), seq([5, 6], 20), seq([7], 3)]
    g.load(wide)
    assert g.padded(3) == 4
    assert g.block_tables[:3].tolist() == [expected_row(s.block_table, g.width) for s in wide]
    assert g.block_tables[3].tolist() == [SCRATCH] * g.width  # a padding row
    assert g.positions[:4].tolist() == [60, 20, 3, 0]
    assert g.input_ids[:4].tolist() == [63, 23, 6, 0]  # the token at each position

    # a narrower batch after a wider one: no column of the earlier tables survives in rows it uses
    narrow = [seq([8], 5), seq([9, 10], 17)]
    g.load(narrow)
    assert g.block_tables[:2].tolist() == [expected_row(s.block_table, g.width) for s in narrow]
    # a batch of one, then a larger one rewrites every row it reuses and pads the rest with scratch
    g.load([seq([11], 1)])
    assert g.block_tables[:1].tolist() == [expected_row([11], g.width)]
    g.load(wide + narrow)
    assert g.block_tables[:5].tolist() == [expected_row(s.block_table, g.width) for s in wide + narrow]
    assert all(row == [SCRATCH] * g.width for row in g.block_tables[5:8].tolist())  # padded to 8


def test_a_prefill_chunk_loads_as_rows_at_consecutive_positions_of_its_table():
    g = graphs()
    chunk = seq([1, 2], 16)  # 16 tokens cached; the chunk is its 17 tokens from position 16 on (ids 19..)
    chunk.prompt_token_ids += list(range(100, 104))
    decode = seq([5], 3)
    g.load([chunk, decode], counts=[5, 1])
    assert g.positions[:6].tolist() == [16, 17, 18, 19, 20, 3]
    assert g.input_ids[:6].tolist() == [19, 100, 101, 102, 103, 6]
    assert g.block_tables[:6].tolist() == [expected_row([1, 2], g.width)] * 5 + [expected_row([5], g.width)]
    assert g.padded(6) == 8 and g.positions[6:8].tolist() == [0, 0]
