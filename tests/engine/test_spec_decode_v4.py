"""Speculative decoding on DeepSeek-V4 with its MTP block (`mtp.0`), on the tiny HF-oracle checkpoint (float32,
CPU): greedy tokens are HF's (as they are without speculation: tests/engine/test_deepseek_v4.py) through
windows of every kind (CSA pools 4 tokens, HCA 8, the sliding window 8, blocks of 8), chunked prefill,
preemption, an abort inside a verified step and a prefix cached after a speculative request.

The checkpoint's MTP block is random, so its drafts are almost never accepted; `oracle_drafts` swaps the drafts
it proposes (after the real MTP pass) for HF's greedy tokens with every fifth position wrong, so verifications
accept none, some or all of their drafts, and a rejected draft sits inside an open compressor window most steps:
the compressors' state must be put back to the one after the last accepted token."""

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.hf_oracle import hf_greedy, hf_logits, prompts, save_hf_checkpoint
from tests.engine.hf_oracle_v4 import VOCAB, add_mtp_block, build_v4_model
from tests.engine.test_spec_decode import (EagerGraph, capture_eagerly, emulated_graphs, record_launches,
                                          step_to_the_end)

NEW = 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def spec(k: int, **extra) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k, **extra}


@pytest.fixture(scope="module")
def v4mtp(tmp_path_factory):
    hf = build_v4_model(seed=1)
    path = save_hf_checkpoint(hf, tmp_path_factory.mktemp("v4mtp") / "ckpt")
    add_mtp_block(path, seed=2)
    return hf, path


@pytest.fixture(scope="module")
def batch(v4mtp) -> tuple[list[list[int]], dict[tuple, list[int]]]:
    """Prompts of 13-45 tokens and each one's HF greedy continuation (a few tokens past NEW, for drafts)."""
    hf, _ = v4mtp
    ids = prompts(20, [45, 13, 30], VOCAB)
    return ids, {tuple(p): hf_greedy(hf, p, NEW + 4) for p in ids}


def engine(path, k: int, **args) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", show_progress=False, block_size=8,
               speculative_config=spec(k), **args)


def oracle_drafts(llm: LLM, continuations: dict[tuple, list[int]]) -> list[int]:
    """After the real MTP pass, each drafting sequence's drafts become its true next tokens, each position
    that is a multiple of 5 made wrong -> a list that gets every verification's accepted count."""
    eng = llm.engine
    runner = eng.runner
    draft = runner._draft

    def drafting(next_ids, positions, meta, hidden, rows, tables, num_drafts):
        drafts = draft(next_ids, positions, meta, hidden, rows, tables, num_drafts)
        if drafts is None:
            return None
        by_block = {seq.block_table[0]: seq for seq in eng.scheduler.running if seq.block_table}
        out = drafts.tolist()
        for i, (first_block, p) in enumerate(zip(tables[:, 0].tolist(), positions[rows].tolist())):
            seq = by_block.get(first_block)
            if seq is None:  # aborted while its step ran: its drafts are dropped anyway
                continue
            prompt = seq.token_ids(0, seq.num_prompt_tokens)
            if tuple(prompt) not in continuations:  # scored, not generated
                continue
            tokens = prompt + continuations[tuple(prompt)]
            at = range(p + 2, p + 2 + num_drafts)
            out[i] = [(tokens[q] + (q % 5 == 0)) % VOCAB if q < len(tokens) else 0 for q in at]
        return torch.tensor(out, dtype=drafts.dtype, device=drafts.device)

    runner._draft = drafting
    counts = []
    result = eng._resolve_spec

    def resolve(spec):
        accepted, next_drafts = result(spec)
        if spec is not None:
            counts.extend(accepted[id(seq)] for seq, n in zip(spec.seqs, spec.num_verified) if n)
        return accepted, next_drafts

    eng._resolve_spec = resolve
    return counts


def check_greedy(llm: LLM, batch, params=GREEDY) -> None:
    ids, continuations = batch
    for p, out in zip(ids, llm.generate(ids, params)):
        assert out.token_ids == continuations[tuple(p)][: len(out.token_ids)]
        assert len(out.token_ids) == params.max_tokens
    assert llm.engine.kv_cache_usage == 0.0


@pytest.mark.parametrize("k,mode", [(1, "off"), (3, "off"), (3, "on")])
def test_greedy_tokens_are_hf_with_drafts_accepted_in_part(v4mtp, batch, k, mode):
    """With async scheduling a step goes ahead of the verification before it, whose rollback it finds done."""
    _, path = v4mtp
    llm = engine(path, k, async_scheduling=mode)
    counts = oracle_drafts(llm, batch[1])
    launches = record_launches(llm.engine)
    check_greedy(llm, batch)
    assert any(launches) == (mode == "on")
    # none, some and (k = 3) all of a verification's drafts accepted
    assert {0, k} <= set(counts) and (k == 1 or 1 in counts or 2 in counts)


def test_drafts_through_the_decode_path_the_graphs_capture(v4mtp, batch):
    """Attention's device-only decode path on (as the decode CUDA graphs run it, here on the CPU): the MTP
    block's draft steps take it, verifications still run as chunks; tokens stay HF's."""
    _, path = v4mtp
    llm = engine(path, 3, max_model_len=128)
    for attn in llm.engine.runner.model.attention_layers():
        attn.use_kernels = True
    oracle_drafts(llm, batch[1])
    check_greedy(llm, batch)


def test_two_ranks_roll_back_as_one(v4mtp, batch):
    """TP=2: every rank receives the verifications' accepted counts and puts its replicated compressor
    state back; greedy tokens are HF's."""
    _, path = v4mtp
    ids, continuations = batch
    llm = engine(path, 2, tensor_parallel_size=2)
    try:
        counts = oracle_drafts(llm, continuations)  # rank 0's drafts; each rank runs the MTP pass
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        for p, out in zip(ids[:2], llm.generate(ids[:2], params)):
            assert out.token_ids == continuations[tuple(p)][:10]
        assert 0 < sum(counts) < 2 * len(counts)
    finally:
        llm.engine.shutdown()


def test_the_trained_layer_drafts_and_the_tokens_stay_hf(v4mtp, batch):
    """The checkpoint's own MTP block proposes (loaded from `mtp.0.*`, the kv norm spelled `kv_norm`)."""
    _, path = v4mtp
    llm = engine(path, 2)
    mtp = llm.engine.runner.model.mtp[0]
    assert mtp.attn.kind == "window" and not mtp.ffn.gate.hashed
    check_greedy(llm, (batch[0][:2], batch[1]))
    assert llm.engine.speculator.num_draft_tokens > 0


def test_without_the_state_rollback_the_tokens_go_wrong(v4mtp, batch, monkeypatch):
    """The scenario above is one where rejected drafts change the compressors' state: left in place, the
    tokens leave HF's."""
    from engine.models.deepseek_v4 import DeepseekV4ForCausalLM

    monkeypatch.setattr(DeepseekV4ForCausalLM, "keep_accepted", lambda self, tokens: None)
    _, path = v4mtp
    llm = engine(path, 3)
    oracle_drafts(llm, batch[1])
    ids, continuations = batch
    outs = llm.generate(ids, GREEDY)
    assert any(o.token_ids != continuations[tuple(p)][:NEW] for p, o in zip(ids, outs))


def test_chunked_prefill_and_preemption(v4mtp, batch):
    _, path = v4mtp
    # chunks of 7 tokens start and end inside windows of every kind, verifications share the budget
    chunked = engine(path, 3, max_num_batched_tokens=7)
    oracle_drafts(chunked, batch[1])
    check_greedy(chunked, batch)
    # 14 blocks of 8 cannot hold the three sequences (and their drafts' lookahead) at once
    tight = engine(path, 3, num_kv_blocks=14, enable_prefix_caching=False)
    oracle_drafts(tight, batch[1])
    check_greedy(tight, batch)
    assert tight.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("mode", ["off", "on"])
def test_window_pages_under_drafts_and_their_rollback(v4mtp, batch, mode):
    """The window in 7 pages of its own for three sequences: each holds its window's block, the block it
    writes and those its drafts' lookahead reaches; rejected drafts' window rows are rewritten in pages
    still held, sequences are preempted by pages, and (async) the steps launched ahead slide too."""
    _, path = v4mtp
    llm = engine(path, 3, max_num_batched_tokens=16, num_window_pages=7, async_scheduling=mode)
    assert llm.engine.runner.kv_pool.has_window_pages
    counts = oracle_drafts(llm, batch[1])
    launches = record_launches(llm.engine)
    check_greedy(llm, batch)
    assert {0, 3} <= set(counts) and any(launches) == (mode == "on")
    assert llm.engine.scheduler.num_preemptions > 0
    bm = llm.engine.block_manager
    assert bm.num_held_pages == 0 and bm.num_available_pages == 7


def test_an_abort_in_the_middle_of_a_verified_step(v4mtp, batch):
    """A request aborted after its verification's forward, before its tokens are read: the step's state
    rollback and MTP pass still run over its rows; the others go on as if alone, every block comes back."""
    _, path = v4mtp
    ids, continuations = batch
    llm = engine(path, 3)
    oracle_drafts(llm, continuations)
    eng = llm.engine
    for i, p in enumerate(ids):
        eng.add_request(f"r{i}", p, GREEDY)
    propose, aborted = eng.executor.propose, []

    def abort_during(draft, *args):
        if len(draft.verifications) == 3 and not aborted:
            eng.abort_request("r1")
            aborted.append(True)
        return propose(draft, *args)

    eng.executor.propose = abort_during
    finished = step_to_the_end(eng)
    assert aborted and "r1" not in finished
    assert [finished[f"r{i}"].token_ids for i in (0, 2)] == [continuations[tuple(ids[i])][:NEW] for i in (0, 2)]
    assert eng.kv_cache_usage == 0.0


def test_a_prefix_cached_by_a_speculative_request_is_a_fresh_prefills(v4mtp, batch):
    """Turn 2 over the blocks turn 1 registered while verifying drafts (window rows, entries, indexer keys,
    open state of every kind of layer): the logits HF gives for turn 2, and its greedy tokens."""
    hf, path = v4mtp
    llm = engine(path, 3)
    continuations = dict(batch[1])
    counts = oracle_drafts(llm, continuations)
    turn1 = batch[0][0]
    first = llm.generate([turn1], GREEDY)[0]
    assert 0 < sum(counts) < 3 * len(counts)
    turn2 = turn1 + first.token_ids + prompts(21, [11], VOCAB)[0]
    continuations[tuple(turn2)] = want = hf_greedy(hf, turn2, 16)
    again = llm.generate([turn2], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    # every whole block of turn 1 whose tokens were computed (8 tokens each; its last token was never an
    # input), those its last step's accepted drafts completed included
    assert again.num_cached_tokens == (len(turn1) + len(first.token_ids) - 1) // 8 * 8
    assert again.token_ids == want[:12]
    ours = llm.score([turn2])[0]  # over the blocks turn 2 registered, speculating too
    assert (ours - hf_logits(hf, turn2)).abs().max().item() <= 1e-4


def test_sampled_requests_run_to_the_end_and_seeds_repeat(v4mtp, batch):
    _, path = v4mtp
    llm = engine(path, 2)
    ids = batch[0][:2]
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=12, ignore_eos=True) for s in (3, 4)]
    first = [o.token_ids for o in llm.generate(ids, params)]
    assert [len(t) for t in first] == [12, 12] and all(0 <= t < VOCAB for ts in first for t in ts)
    assert [o.token_ids for o in llm.generate(ids, params)] == first
    assert llm.engine.speculator.num_draft_tokens > 0 and llm.engine.kv_cache_usage == 0.0


# -- verifications as rows of the decode CUDA graphs ---------------------------------------------------
def graphed(monkeypatch, llm: LLM, fused: bool = False) -> list[int]:
    """The decode and draft graphs (and with `fused` the fused speculative ones) on a CPU, each graph's function
    run where its replay would be, over the attention's device-only decode path -> a list that gets the
    tokens of every replayed step with verifications in it."""
    import engine.kernels.sampling
    from engine.model_runner import DecodeGraphs, DraftGraphs, SpecGraphs

    monkeypatch.setattr(engine.kernels.sampling, "sample", lambda logits, *args, out=None, **filters: (
        logits.argmax(-1) if out is None else out.copy_(logits.argmax(-1))))
    runner = llm.engine.runner
    compressors = [c for attn in runner.model.attention_layers()
                   for c in (attn.compressor, attn.indexer.compressor if attn.indexer is not None else None) if c]

    def step(graphs, batch):
        # a CUDA graph's replay runs no Python: what the step's forward sets on the host (the compressors'
        # `candidates`) is not set by a replay
        before = [c.candidates for c in compressors]
        graphs.outputs[batch] = graphs._step(batch)
        for c, was in zip(compressors, before):
            c.candidates = was

    monkeypatch.setattr(DecodeGraphs, "_capture", lambda self, batch: self.graphs.__setitem__(
        batch, EagerGraph(lambda: step(self, batch))))
    for attn in runner.model.attention_layers():
        attn.use_kernels = True
    runner.graphs = DecodeGraphs(runner)
    runner.graphs.capture_all()
    drafts = runner.draft_graphs = DraftGraphs(runner)
    k = runner.num_speculative_tokens
    for key in {drafts.key(s * (k + 1), s) for s in (1, 2, 3)} | {drafts.key(s, s) for s in (1, 2, 3)}:
        drafts.graphs[key] = EagerGraph(lambda key=key: drafts.outputs.__setitem__(key, drafts._draft(key)))
    if fused:
        monkeypatch.setattr(SpecGraphs, "_capture", capture_eagerly)
        runner.spec_graphs = SpecGraphs(runner)
        runner.spec_graphs.capture_all()
    verified, replay = [], runner._replay

    def replaying(plan, *args):
        if plan.num_prefills:
            verified.append(plan.num_tokens)
        return replay(plan, *args)

    runner._replay = replaying
    return verified


@emulated_graphs
@pytest.mark.parametrize("k,mode", [(1, "off"), (3, "off"), (3, "on")])
def test_verifications_replay_the_decode_graphs(monkeypatch, v4mtp, batch, k, mode):
    """A verification's k + 1 rows run as decode rows of the graphs (each sequence's rows folded into its
    compressors in order, each row's state kept for the rollback), the draft from its own graph after it:
    greedy tokens are HF's through windows of every kind, drafts accepted none, some or all."""
    _, path = v4mtp
    llm = engine(path, k, max_num_seqs=3, max_model_len=128, async_scheduling=mode)
    verified = graphed(monkeypatch, llm)
    counts = oracle_drafts(llm, batch[1])
    check_greedy(llm, batch)
    assert len(verified) >= 5 and max(verified) == 3 * (k + 1)
    assert {0, k} <= set(counts) and (k == 1 or 1 in counts or 2 in counts)


@emulated_graphs
def test_fused_speculative_steps_roll_the_state_back_in_the_graph(monkeypatch, v4mtp, batch):
    """The fused greedy step (verify, accept, put the compressors' state back, draft: one replay) on V4."""
    from engine.model_runner import SpecGraphs

    _, path = v4mtp
    llm = engine(path, 3, max_num_seqs=3, max_model_len=128)
    graphed(monkeypatch, llm, fused=True)
    replays, replay = [], SpecGraphs.replay
    monkeypatch.setattr(SpecGraphs, "replay", lambda self, plan, *args: replays.append(len(plan.slots))
                        or replay(self, plan, *args))
    check_greedy(llm, (batch[0][:2], batch[1]), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert len(replays) > 3
    assert llm.engine.speculator.num_draft_tokens > 0


@emulated_graphs
@pytest.mark.parametrize("broken", ["fold", "rollback"])
def test_without_the_fold_in_order_or_the_rollback_the_graphed_tokens_go_wrong(monkeypatch, v4mtp, batch, broken):
    """Verifications through the graphs with the compressors' decode step starting every row from the state its
    block held before the step (a sequence's rows not folded one after another), or with the state left
    after the rejected drafts: the tokens leave HF's."""
    from engine.models.deepseek_v4 import Attention, Compressor, DeepseekV4ForCausalLM

    # the PyTorch decode paths, the ones broken here: under Triton's interpreter (TRITON_INTERPRET=1, as a
    # module run earlier in this process may have set) the steps would take the pool kernels instead
    monkeypatch.setattr(Attention, "pool_kernels", False)
    if broken == "fold":
        decode = Compressor._decode
        monkeypatch.setattr(Compressor, "_decode", lambda self, *args, **kwargs: decode(
            self, *args[:8], None, 1, kwargs.get("kept", args[10] if len(args) > 10 else None)))
    else:
        monkeypatch.setattr(DeepseekV4ForCausalLM, "keep_accepted", lambda self, tokens: None)
    _, path = v4mtp
    llm = engine(path, 3, max_num_seqs=3, max_model_len=128)
    verified = graphed(monkeypatch, llm)
    oracle_drafts(llm, batch[1])
    ids, continuations = batch
    outs = llm.generate(ids, GREEDY)
    assert verified and any(o.token_ids != continuations[tuple(p)][:NEW] for p, o in zip(ids, outs))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_verifications_replay_the_graphs(v4mtp, batch):
    """Float32 on the card, the V4 decode kernels and real CUDA graphs: verifications replay the decode graphs
    (the compressor kernel folding each sequence's rows in order), the MTP draft and the fused greedy step
    their own; greedy tokens are plain decoding's with k = 1 and 3, drafted by the checkpoint's MTP block and
    by HF's tokens with every fifth wrong (drafts accepted none, some or all; those drafts replace the graphs'
    own, so that run drafts eagerly after each replayed verification)."""
    _, path = v4mtp
    ids, continuations = batch
    common = dict(dtype="float32", device="cuda", show_progress=False, block_size=8, max_model_len=128, max_num_seqs=4)
    plain = [o.token_ids for o in LLM(str(path), **common).generate(ids, GREEDY)]
    for k in (1, 3):
        llm = LLM(str(path), speculative_config=spec(k, disable_by_batch_size=1024), **common)
        runner = llm.engine.runner
        assert runner.draft_graphs.graphs and runner.spec_graphs.graphs
        verified, fused = [], []
        replay, fused_replay = runner._replay, runner.spec_graphs.replay
        runner._replay = lambda plan, *args: (plan.num_prefills and verified.append(plan.num_tokens)) or replay(plan, *args)
        runner.spec_graphs.replay = lambda plan, *args: fused.append(len(plan.slots)) or fused_replay(plan, *args)
        assert [o.token_ids for o in llm.generate(ids, GREEDY)] == plain
        assert fused and llm.engine.speculator.num_draft_tokens > 0
        runner.draft_graphs = runner.spec_graphs = None
        del verified[:]
        counts = oracle_drafts(llm, continuations)
        assert [o.token_ids for o in llm.generate(ids, GREEDY)] == plain
        assert len(verified) >= 5 and max(verified) == 3 * (k + 1)
        assert {0, k} <= set(counts), counts
