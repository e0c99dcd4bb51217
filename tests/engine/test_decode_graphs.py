"""DecodeGraphs.load: the static buffers a decode graph reads hold exactly the plan's rows. Every row is
its slot's row of the persistent block tables (its table, then the scratch block: graphs replayed back
to back walk positions past a table's end); padding rows are the scratch slot's, at position 0. The
buffers are plain tensors, so this runs on CPU; the graphs themselves need a GPU
(tests/engine/test_fast_path.py)."""

from types import SimpleNamespace

import pytest
import torch

from engine.model_runner import BlockTables, DecodeGraphs
from engine.step_plan import StepPlan
from tests.engine.test_spec_decode import EagerGraph, capture_eagerly

SCRATCH = 99


def graphs(num_speculative_tokens: int = 0, model: SimpleNamespace | None = None) -> DecodeGraphs:
    tables = BlockTables(8, 8, SCRATCH, torch.device("cpu"))
    runner = SimpleNamespace(config=SimpleNamespace(max_num_seqs=8), max_model_len=128, block_size=16,
                             kv_pool=SimpleNamespace(scratch_block=SCRATCH), tables=tables,
                             device=torch.device("cpu"), num_speculative_tokens=num_speculative_tokens,
                             model=model or SimpleNamespace())
    return DecodeGraphs(runner)


def test_the_graphs_hold_every_request_verifying_its_drafts():
    """max_num_seqs requests of 1 + k rows each (speculative decoding's verifications) replay a graph."""
    assert graphs().max_batch == 8
    assert graphs(num_speculative_tokens=2).max_batch == 24


def decode_plan(g: DecodeGraphs, rows: list[tuple[int, list[int], int]], fresh: bool = True) -> StepPlan:
    """rows: (slot, blocks, tokens cached); each decodes the token 3 + position."""
    deltas = [(slot, 0, blocks) for slot, blocks, _ in rows] if fresh else []
    g.runner.tables.apply(deltas)
    return StepPlan([r[0] for r in rows], [r[2] for r in rows], [1] * len(rows), 0, [3 + r[2] for r in rows],
                    list(range(len(rows))))


def expected_row(blocks: list[int], width: int) -> list[int]:
    return blocks + [SCRATCH] * (width - len(blocks))


def test_load_writes_each_table_then_scratch_and_pads_with_scratch():
    g = graphs()
    wide = [(0, [1, 2, 3, 4], 60), (1, [5, 6], 20), (2, [7], 3)]
    g.load(decode_plan(g, wide))
    assert g.padded(3) == 4
    assert g.block_tables[:3].tolist() == [expected_row(b, g.width) for _, b, _ in wide]
    assert g.block_tables[3].tolist() == [SCRATCH] * g.width  # a padding row
    assert g.positions[:4].tolist() == [60, 20, 3, 0]
    assert g.input_ids[:4].tolist() == [63, 23, 6, 0]  # the token at each position

    # slots taken by other sequences: nothing of the earlier, wider tables survives
    narrow = [(0, [8], 5), (1, [9, 10], 17)]
    g.load(decode_plan(g, narrow))
    assert g.block_tables[:2].tolist() == [expected_row(b, g.width) for _, b, _ in narrow]
    # a batch of one, then a larger one rewrites every row it reuses and pads the rest with scratch
    g.load(decode_plan(g, [(3, [11], 1)]))
    assert g.block_tables[:1].tolist() == [expected_row([11], g.width)]
    both = [(2, [7], 3), (0, [8], 5), (1, [9, 10], 17), (3, [11], 1), (4, [12], 2)]
    g.load(decode_plan(g, both[4:]))
    g.load(decode_plan(g, both, fresh=False))
    assert g.block_tables[:5].tolist() == [expected_row(b, g.width) for _, b, _ in both]
    assert all(row == [SCRATCH] * g.width for row in g.block_tables[5:8].tolist())  # padded to 8


def test_a_prefill_chunk_loads_as_rows_at_consecutive_positions_of_its_table():
    g = graphs()
    g.runner.tables.apply([(0, 0, [1, 2]), (1, 0, [5])])
    # 16 tokens cached, a chunk of 5 from position 16 on; then a decode at position 3
    plan = StepPlan([0, 1], [16, 3], [5, 1], 1, [19, 100, 101, 102, 103, 6], [4, 5])
    g.load(plan)
    assert g.positions[:6].tolist() == [16, 17, 18, 19, 20, 3]
    assert g.input_ids[:6].tolist() == [19, 100, 101, 102, 103, 6]
    assert g.block_tables[:6].tolist() == [expected_row([1, 2], g.width)] * 5 + [expected_row([5], g.width)]
    assert g.padded(6) == 8 and g.positions[6:8].tolist() == [0, 0]


def test_rows_of_a_sequence_load_their_index_where_the_model_folds_them_in_order():
    """V4 (chunks of up to k + 1 tokens as rows, its compressors folding a sequence's rows in order): each
    row's index among its sequence's rows goes into the graphs' buffer, padding rows 0; V3 keeps none."""
    assert graphs().query_index is None and graphs().rows_of(4) is None
    g = graphs(2, SimpleNamespace(graph_chunk_tokens=3))
    g.runner.tables.apply([(0, 0, [1, 2]), (1, 0, [5]), (2, 0, [6])])
    plan = StepPlan([0, 1, 2], [14, 3, 7], [3, 3, 1], 2, [1, 2, 3, 4, 5, 6, 7], list(range(7)))
    g.query_index.fill_(5)
    g.load(plan)
    assert g.positions[:7].tolist() == [14, 15, 16, 3, 4, 5, 7]
    assert g.rows_of(8).tolist() == [0, 1, 2, 0, 1, 2, 0, 0]
    meta, _ = g.metadata(8)
    assert meta.query_index.tolist() == [0, 1, 2, 0, 1, 2, 0, 0]


def test_table_deltas_append_and_a_fresh_slot_forgets_the_last_table():
    tables = BlockTables(4, 6, SCRATCH, torch.device("cpu"))
    tables.apply([(0, 0, [1, 2, 3])])
    tables.apply([(0, 3, [4]), (1, 0, [7])])  # a new block for slot 0, a new sequence in slot 1
    assert tables.rows([0, 1]).tolist() == [[1, 2, 3, 4, SCRATCH, SCRATCH], [7] + [SCRATCH] * 5]
    tables.apply([(0, 0, [9])])  # slot 0 taken by another sequence
    assert tables.rows([0]).tolist() == [[9] + [SCRATCH] * 5]
    assert tables.rows([tables.scratch_slot]).tolist() == [[SCRATCH] * 6]


# -- plain decode steps' draws in a graph of their own (DrawGraphs) ------------------------------------
def keyed_sample(logits, temperature, keys, step, out=None, top_p=None):
    """The sampling kernel's contract in PyTorch for the CPU: argmax where temperature is 0, else
    Gumbel-max with noise that is a function of the row's key alone (as the kernel's is), over the rows
    filtered by top-p where given."""
    from engine.sampler import filter_rows

    if top_p is not None:
        logits = filter_rows(logits, torch.full_like(top_p, logits.shape[1], dtype=torch.long), top_p)
    rows = []
    for row, t, key in zip(logits, temperature.tolist(), keys.tolist()):
        if t <= 0:
            rows.append(row.argmax())
            continue
        u = torch.rand(row.shape, generator=torch.Generator().manual_seed(key & (2**63 - 1)))
        rows.append((row / t - torch.log(-torch.log(u.clamp(min=1e-20)))).argmax())
    tokens = torch.stack(rows) if rows else torch.empty(0, dtype=torch.long)
    return tokens if out is None else out.copy_(tokens)


def mixed_draws(llm, max_tokens: int) -> tuple[list[list[int]], list]:
    """Four prompts: a greedy request, a sampled one, one with top-p, one with top-k (seeded)."""
    from engine import SamplingParams

    tok = llm.tokenizer
    prompts = [tok.encode(q) for q in ("The capital of France", "One, two, three,", "A short poem:", "def main():")]
    drawn = [dict(temperature=0.0), dict(temperature=0.9, seed=5), dict(temperature=0.8, top_p=0.9, seed=6),
             dict(temperature=1.2, top_k=20, seed=7)]
    return prompts, [SamplingParams(max_tokens=max_tokens, ignore_eos=True, **d) for d in drawn]


@pytest.mark.skipif(torch.cuda.is_available(), reason="emulates the CUDA graphs on a CPU (a GPU engine captures real ones)")
def test_decode_steps_draw_in_a_graph_what_the_eager_draws_give(monkeypatch):
    """Greedy, sampled, top-p and top-k requests in one batch (async scheduling on): with the decode and
    draw graphs (each graph's function run where its replay would be, as on a GPU the replay writes the
    same output buffer) every request gets exactly the tokens the eager draws (`draw_on_device`) give,
    seeds keyed by output position; a request with logprobs keeps the eager draws for its steps."""
    import engine.kernels.sampling
    from engine import LLM, SamplingParams
    from engine.model_runner import DrawGraphs

    monkeypatch.setattr(engine.kernels.sampling, "sample", keyed_sample)
    llm = LLM("deepseek-tiny", dtype="float32", max_num_seqs=4, async_scheduling="on")
    llm.engine.sampler.on_device = True  # the draws a GPU makes outside a graph
    prompts, params = mixed_draws(llm, 10)
    eager = [o.token_ids for o in llm.generate(prompts, params)]
    assert len({tuple(t) for t in eager}) == 4

    runner = llm.engine.runner
    def decode_capture(self, batch):  # as a graph does: outputs at capture, rewritten by each replay
        state = [t.clone() for t in (self.input_ids, self.positions, self.step)]
        self.outputs[batch] = self._step(batch)
        for t, saved in zip((self.input_ids, self.positions, self.step), state):
            t.copy_(saved)
        self.graphs[batch] = EagerGraph(lambda: [o.copy_(n) for o, n in zip(self.outputs[batch], self._step(batch))])

    monkeypatch.setattr(DecodeGraphs, "_capture", decode_capture)

    monkeypatch.setattr(DrawGraphs, "_capture", capture_eagerly)
    runner.graphs = DecodeGraphs(runner)
    runner.graphs.capture_all()
    runner.draw_graphs = DrawGraphs(runner)
    runner.draw_graphs.capture_all()
    replays, replay = [], DrawGraphs.replay
    monkeypatch.setattr(DrawGraphs, "replay", lambda self, plan: replays.append(
        (plan.num_tokens, self.sampling.draw(plan))) or replay(self, plan))
    assert [o.token_ids for o in llm.generate(prompts, params)] == eager
    # every decode step of the four drew in the graph that filters (top-p, top-k rows among them)
    assert (4, 2) in replays and len(replays) >= 8
    del replays[:]
    assert [o.token_ids for o in llm.generate(prompts[:2], params[:2])] == eager[:2]
    assert replays and all(r == (2, 1) for r in replays)  # a greedy and a sampled row: no filter
    del replays[:]
    with_logprobs = SamplingParams(temperature=0.9, seed=5, max_tokens=10, ignore_eos=True, logprobs=2)
    out = llm.generate(prompts[1:2], with_logprobs)[0]
    assert out.token_ids == eager[1] and not replays and len(out.logprobs) == 10


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_draws_in_the_graph_are_the_eager_draws():
    """Real CUDA graphs and the sampling kernel: the same decode graphs with the draws in a graph and with
    them made eagerly after it (`draw_on_device`) give every seeded request the same tokens."""
    from engine import LLM

    llm = LLM("deepseek-tiny", dtype="float32", max_num_seqs=4)
    prompts, params = mixed_draws(llm, 24)
    runner = llm.engine.runner
    assert runner.draw_graphs is not None and runner.draw_graphs.graphs
    replays, replay = [], runner.draw_graphs.replay
    runner.draw_graphs.replay = lambda plan: replays.append(plan.num_tokens) or replay(plan)
    in_graph = [o.token_ids for o in llm.generate(prompts, params)]
    assert replays and len({tuple(t) for t in in_graph}) == 4
    runner.draw_graphs = None
    assert [o.token_ids for o in llm.generate(prompts, params)] == in_graph


def test_prefill_graphs_are_on_by_default_where_the_model_has_them(caplog):
    """prefill_graph_tokens None: 2048 tokens' lengths where CUDA graphs run a V3-family model, and quietly
    none elsewhere (V4, eager, CPU); a number asked for where there can be none says why; 0: none."""
    from engine.config import DEFAULT_PREFILL_GRAPH_TOKENS
    from engine.model_runner import LongStepGraphs, ModelRunner
    from engine.models.deepseek_v3 import DeepseekV3ForCausalLM
    from engine.models.deepseek_v4 import DeepseekV4ForCausalLM

    def sizes(wanted, model_type=DeepseekV3ForCausalLM, graphs=True):
        runner = SimpleNamespace(use_cuda_graphs=graphs, num_speculative_tokens=0, max_model_len=32768,
                                 config=SimpleNamespace(max_num_seqs=64, max_num_batched_tokens=4096))
        return ModelRunner._prefill_graph_sizes(runner, wanted, model_type)

    with caplog.at_level("WARNING"):
        assert sizes(None) == LongStepGraphs.lengths(65, DEFAULT_PREFILL_GRAPH_TOKENS) and sizes(None)[-1] == 2048
        assert sizes(None, DeepseekV4ForCausalLM) == sizes(None, graphs=False) == sizes(0) == []
        assert not caplog.text
        assert sizes(4096)[-1] == 4096 and sizes(512, graphs=False) == []
    assert "prefill_graph_tokens=512: no prefill graphs (CUDA graphs are off)" in caplog.text
