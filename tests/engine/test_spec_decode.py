"""Speculative decoding with the MTP layer: the draft is the layer the checkpoint trained, and the output
is exactly the target's (greedy tokens identical to plain decoding and to HF; sampled tokens from the
target's distribution), through chunked prefill, preemption, aborts and two ranks."""

import json
import math
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.bench.presets import preset_config
from engine.config import EngineConfig, ModelConfig, SpeculativeConfig, resolve_model_path
from engine.model_runner import ModelRunner
from engine.step_plan import StepPlan
from tests.engine.hf_oracle import build_hf_model, hf_greedy, prompts, save_hf_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
QUESTIONS = ["What does json.dumps do?", "Define the word harbor.", "What is 17 plus 25?", "Hello! Who are you?"]


def spec(k: int) -> dict:
    # drafting at every batch size: on a GPU the default would measure where it pays (the cutoff's own tests)
    return {"method": "mtp", "num_speculative_tokens": k, "disable_by_batch_size": 1024}


@pytest.fixture(scope="module")
def tiny_prompts() -> list[list[int]]:
    llm = LLM("deepseek-tiny", dtype="float32", num_kv_blocks=8)
    tok = llm.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_bos=False) for q in QUESTIONS]


@pytest.fixture(scope="module")
def plain_tokens(tiny_prompts) -> list[list[int]]:
    llm = LLM("deepseek-tiny", dtype="float32")
    return [o.token_ids for o in llm.generate(tiny_prompts, GREEDY)]


def test_the_mtp_layer_drafts_as_it_was_trained():
    """deepseek-tiny's MTP layer, loaded as our draft, gives the logits its training code gives (HF's
    decoder layer under DeepSeek-V3's MTP wiring, engine/tools/tiny/mtp.py) at every position."""
    from transformers import DeepseekV3ForCausalLM

    from engine.tools.tiny.mtp import MTPLayer, mtp_logits

    path = resolve_model_path("deepseek-tiny")
    hf = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    n = hf.config.num_hidden_layers
    # the MTP layer's block is a decoder layer at index n: HF reads it (experts and all) as such
    host = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32, num_hidden_layers=n + 1).eval()
    mtp = MTPLayer(hf.config).float().eval()
    mtp.block = host.model.layers[n]
    tensors = {}
    for shard in path.glob("*.safetensors"):
        tensors.update(load_file(shard))
    with torch.no_grad():
        for ours, theirs in [("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"),
                             ("shared_head_norm", "shared_head.norm")]:
            getattr(mtp, ours).weight.copy_(tensors[f"model.layers.{n}.{theirs}.weight"].float())
        ids = torch.tensor([prompts(5, [40], vocab=hf.config.vocab_size)[0]])
        hidden = hf.model(ids).last_hidden_state  # after the final norm
        positions = torch.arange(ids.shape[1] - 1)[None]
        want = mtp_logits(hf, mtp, hidden[:, :-1], ids[:, 1:], positions)[0]

    config = EngineConfig(model="deepseek-tiny", dtype="float32", device="cpu", block_size=16,
                          speculative_config=spec(1))
    model_config = ModelConfig.from_dir(path)
    runner = ModelRunner(config, model_config, path, 256)
    runner.init_cache(8)
    length = ids.shape[1]
    runner.tables.apply([(0, 0, [0, 1, 2])])
    runner.run(StepPlan([0], [0], [length], 1, ids[0].tolist(), [length - 1]))
    _, positions, _, meta, hidden_ours = runner.last_step
    with torch.inference_mode():
        next_ids = torch.cat([ids[0, 1:], ids[0, :1]])  # the last row's next token is not compared
        got = runner.model.compute_logits(runner.model.draft(next_ids, positions, hidden_ours, meta))[:-1]
    assert model_config.num_nextn_predict_layers == 1
    assert (got - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_tokens_are_the_plain_ones_and_the_trained_draft_is_accepted(tiny_prompts, plain_tokens, k):
    llm = LLM("deepseek-tiny", dtype="float32", speculative_config=spec(k))
    outs = llm.generate(tiny_prompts, GREEDY)
    assert [o.token_ids for o in outs] == plain_tokens
    s = llm.engine.speculator
    assert s.num_draft_tokens > 0
    # the held-out one-ahead agreement of this MTP layer with the model is 72.6 % (its model card)
    assert s.num_accepted_tokens / s.num_draft_tokens > (0.55 if k == 1 else 0.35)
    assert all(o.metrics.num_verify_steps > 0 for o in outs)
    assert llm.engine.kv_cache_usage == 0.0


def test_chunked_prefill_and_preemption_keep_the_greedy_tokens(tiny_prompts, plain_tokens):
    # chunks of 7 tokens split every prompt; 10 blocks of 16 cannot hold four 52-token sequences (and their
    # drafts' lookahead) at once
    chunked = LLM("deepseek-tiny", dtype="float32", max_num_batched_tokens=7, speculative_config=spec(2))
    assert [o.token_ids for o in chunked.generate(tiny_prompts, GREEDY)] == plain_tokens
    tight = LLM("deepseek-tiny", dtype="float32", num_kv_blocks=10, speculative_config=spec(3))
    assert [o.token_ids for o in tight.generate(tiny_prompts, GREEDY)] == plain_tokens
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.kv_cache_usage == 0.0


def test_an_abort_in_the_middle_of_a_verified_step(tiny_prompts, plain_tokens):
    """A request aborted while its verification runs drops its rows; the others go on as if alone, and
    every block comes back."""
    llm = LLM("deepseek-tiny", dtype="float32", speculative_config=spec(2))
    eng = llm.engine
    for i, p in enumerate(tiny_prompts):
        eng.add_request(f"r{i}", p, GREEDY)
    propose, aborted = eng.executor.propose, []

    def abort_during(draft, *args):
        if len(draft.rows) == 4 and not aborted and eng.scheduler.running[1].draft_token_ids:
            eng.abort_request("r1")  # after the verification's forward, before its tokens are read
            aborted.append(True)
        return propose(draft, *args)

    eng.executor.propose = abort_during
    finished = step_to_the_end(eng)
    assert aborted and "r1" not in finished
    assert [finished[f"r{i}"].token_ids for i in (0, 2, 3)] == [plain_tokens[i] for i in (0, 2, 3)]
    assert eng.kv_cache_usage == 0.0 and not eng.block_manager.num_hashed_blocks


def step_to_the_end(eng, after_step=lambda: None) -> dict:
    """Step the engine until every request ends -> request id -> its final output; after_step() runs
    after each step."""
    finished = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out
        after_step()
    return finished


def record_launches(eng) -> list[bool]:
    """Per step launched: whether it went ahead of a speculative step whose tokens, accepted counts and
    drafts the host has not read (its rows placed by offsets on the device, every running request with a
    step in flight)."""
    execute, launches = eng.executor.execute, []

    def recording(plan, inputs=None, offsets=None):
        behind = eng.inflight
        launches.append(offsets is not None and plan.shifted and plan.input_ids is None and behind is not None
                        and bool(behind.spec.seqs) and all(s.num_inflight_tokens == 1 for s in eng.scheduler.running))
        return execute(plan, inputs, offsets)

    eng.executor.execute = recording
    return launches


@pytest.mark.parametrize("k", [1, 2, 3])
def test_async_speculative_steps_go_ahead_and_give_the_plain_tokens(tiny_prompts, plain_tokens, k):
    """With async scheduling every step after the first verification is launched before the one ahead of
    it is read; greedy tokens stay the plain ones (and so the synchronous speculative ones, tested above)."""
    llm = LLM("deepseek-tiny", dtype="float32", async_scheduling="on", speculative_config=spec(k))
    launches = record_launches(llm.engine)
    outs = llm.generate(tiny_prompts, GREEDY)
    assert [o.token_ids for o in outs] == plain_tokens
    # only the prefill and the first verification are scheduled with every token known
    assert launches.count(True) == len(launches) - 2 and len(launches) > 10
    s = llm.engine.speculator
    assert s.num_accepted_tokens / s.num_draft_tokens > (0.55 if k == 1 else 0.35)
    assert llm.engine.kv_cache_usage == 0.0 and not llm.engine.has_unfinished_requests()


def check_stops_inside_drafts(llm, prompt: list[int], plain: list[int]) -> None:
    """A stop token, max_tokens and a stop string that fall inside drafted tokens end their requests
    exactly where plain decoding would."""
    params = [SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[plain[17]]),
              SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[llm.tokenizer.decode(plain[25:27])])]
    outs = llm.generate([prompt] * 3, params)
    assert outs[0].token_ids == plain[: plain.index(plain[17]) + 1] and outs[0].finish_reason == "stop"
    assert outs[1].token_ids == plain[:13] and outs[1].finish_reason == "length"
    assert outs[2].token_ids == plain[:27] and outs[2].finish_reason == "stop"


@pytest.mark.parametrize("mode", ["off", "on"])
def test_stop_tokens_and_max_tokens_inside_accepted_drafts(tiny_prompts, plain_tokens, mode):
    """A stop token or the length limit reached inside a step's accepted tokens ends the request there;
    with async scheduling the step launched after it drops the request's rows."""
    llm = LLM("deepseek-tiny", dtype="float32", async_scheduling=mode, speculative_config=spec(3))
    launches = record_launches(llm.engine)
    check_stops_inside_drafts(llm, tiny_prompts[0], plain_tokens[0])
    assert any(launches) == (mode == "on")
    assert llm.engine.kv_cache_usage == 0.0


def test_an_abort_while_two_speculative_steps_are_in_flight(tiny_prompts, plain_tokens):
    """A request aborted just as the step after its verification is launched (that verification not
    read yet): both steps' rows for it are dropped, the others go on as if alone, every block comes back."""
    llm = LLM("deepseek-tiny", dtype="float32", async_scheduling="on", speculative_config=spec(2))
    eng = llm.engine
    for i, p in enumerate(tiny_prompts):
        eng.add_request(f"r{i}", p, GREEDY)
    execute, aborted = eng.executor.execute, []

    def abort_during(plan, inputs=None, offsets=None):
        if offsets is not None and not aborted and eng.requests["r1"].metrics.num_verify_steps >= 2:
            eng.abort_request("r1")
            aborted.append(len(plan.slots))
        return execute(plan, inputs, offsets)

    eng.executor.execute = abort_during
    finished = step_to_the_end(eng)
    assert aborted == [4] and "r1" not in finished  # the launched step still held r1's rows
    assert [finished[f"r{i}"].token_ids for i in (0, 2, 3)] == [plain_tokens[i] for i in (0, 2, 3)]
    assert eng.kv_cache_usage == 0.0 and not eng.block_manager.num_hashed_blocks


def test_async_speculative_preemption_and_penalties_keep_the_sync_tokens(tiny_prompts, plain_tokens):
    """10 blocks of 16 cannot hold four 52-token sequences and their drafts: a step launched ahead finds
    blocks short, the synchronous schedule preempts, the chain starts again; a penalized request (its
    penalties count the tokens before each row) makes steps wait for the one ahead, with the tokens the
    synchronous engine gives."""
    tight = LLM("deepseek-tiny", dtype="float32", num_kv_blocks=10, async_scheduling="on", speculative_config=spec(3))
    launches = record_launches(tight.engine)
    assert [o.token_ids for o in tight.generate(tiny_prompts, GREEDY)] == plain_tokens
    assert tight.engine.scheduler.num_preemptions > 0 and any(launches)
    assert tight.engine.kv_cache_usage == 0.0
    penalized = [GREEDY, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, presence_penalty=1.0)]
    outs = {}
    for mode in ("off", "on"):
        llm = LLM("deepseek-tiny", dtype="float32", async_scheduling=mode, speculative_config=spec(2))
        outs[mode] = [o.token_ids for o in llm.generate(tiny_prompts[:2], penalized)]
    assert outs["on"] == outs["off"] and outs["on"][0] == plain_tokens[0]


class EagerGraph:
    """A captured CUDA graph's stand-in on a CPU: replaying it runs what the capture would have recorded."""

    def __init__(self, fn):
        self.replay = fn


def capture_eagerly(self, *key):
    """A `_capture(self, *key)` for graphs keyed by (rows, kind of draw): as a graph does, each replay
    rewrites the output buffer the capture made."""
    self.outputs[key] = self._step(*key)
    self.graphs[key] = EagerGraph(lambda: self.outputs[key].copy_(self._step(*key)))


# the emulations replace the graphs of an engine that, on a GPU, captured real ones over the same buffers
# (an illegal memory access there); on a card `test_on_the_gpu_graphs_give_the_plain_tokens` runs the real ones
emulated_graphs = pytest.mark.skipif(torch.cuda.is_available(), reason="emulates the CUDA graphs on a CPU")


@emulated_graphs
def test_the_graph_path_on_a_cpu_places_rows_by_their_offsets(monkeypatch, tiny_prompts, plain_tokens):
    """The decode and draft graphs' host side (buffers loaded, positions shifted on the device by the
    accepted counts, the draft reading the verification's rows from the decode graph's buffers) with each
    graph's function run where its replay would be: greedy tokens are the plain ones."""
    import engine.kernels.sampling
    from engine.model_runner import DecodeGraphs, DraftGraphs

    # the graph's own draw is not read (the engine samples its logits); greedy stands in for the kernel
    monkeypatch.setattr(engine.kernels.sampling, "sample", lambda logits, *args, out=None, **filters: (
        logits.argmax(-1) if out is None else out.copy_(logits.argmax(-1))))
    monkeypatch.setattr(DecodeGraphs, "_capture", lambda self, batch: self.graphs.__setitem__(
        batch, EagerGraph(lambda: self.outputs.__setitem__(batch, self._step(batch)))))
    llm = LLM("deepseek-tiny", dtype="float32", max_num_seqs=4, async_scheduling="on", speculative_config=spec(2))
    runner = llm.engine.runner
    runner.graphs = DecodeGraphs(runner)
    runner.graphs.capture_all()
    drafts = runner.draft_graphs = DraftGraphs(runner)
    for key in {drafts.key(s * 3, s) for s in (1, 2, 4)}:
        drafts.graphs[key] = EagerGraph(lambda key=key: drafts.outputs.__setitem__(key, drafts._draft(key)))
    launches = record_launches(llm.engine)
    replays = []
    replay = drafts.replay
    drafts.replay = lambda *args: replays.append(args[0].shape[0]) or replay(*args)
    assert [o.token_ids for o in llm.generate(tiny_prompts, GREEDY)] == plain_tokens
    assert launches.count(True) == len(launches) - 2 and len(replays) > 10


@emulated_graphs
def test_steps_over_the_cutoff_keep_the_mtp_cache_from_its_graph(monkeypatch, tiny_prompts, plain_tokens):
    """Over the batch-size cutoff nobody drafts, and the MTP pass over the step's rows replays a draft graph
    of its own (S rows, 0 drafting); once the batch is under the cutoff again the requests draft from a
    cache that pass filled: the drafts are accepted as usual, and greedy tokens are the plain ones."""
    import engine.kernels.sampling
    from engine.model_runner import DecodeGraphs, DraftGraphs

    monkeypatch.setattr(engine.kernels.sampling, "sample", lambda logits, *args, out=None, **filters: (
        logits.argmax(-1) if out is None else out.copy_(logits.argmax(-1))))
    monkeypatch.setattr(DecodeGraphs, "_capture", lambda self, batch: self.graphs.__setitem__(
        batch, EagerGraph(lambda: self.outputs.__setitem__(batch, self._step(batch)))))
    cutoff = {"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": 2}
    llm = LLM("deepseek-tiny", dtype="float32", max_num_seqs=4, async_scheduling="on", speculative_config=cutoff)
    runner = llm.engine.runner
    runner.graphs = DecodeGraphs(runner)
    runner.graphs.capture_all()
    drafts = runner.draft_graphs = DraftGraphs(runner)
    for key in {drafts.key(s * 3, s) for s in (1, 2)} | {drafts.key(s, 0) for s in (1, 2, 4)}:
        drafts.graphs[key] = EagerGraph(lambda key=key: drafts.outputs.__setitem__(key, drafts._draft(key)))
    keys, replay = [], drafts.replay
    drafts.replay = lambda ids, rows, *args: keys.append(drafts.key(ids.shape[0], 0 if rows is None else
                                                                     rows.shape[0])) or replay(ids, rows, *args)
    # two requests end early: the other two run 24 tokens with four running (no drafts), then draft
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (24, 24, 40, 40)]
    outs = llm.generate(tiny_prompts, params)
    assert [o.token_ids for o in outs] == [plain_tokens[0][:24], plain_tokens[1][:24], *plain_tokens[2:]]
    assert keys.count((4, 0)) >= 20 and drafts.key(2 * 3, 2) in keys  # the MTP pass alone, then drafts again
    late = [o.metrics for o in outs[2:]]
    assert all(m.num_verify_steps > 0 for m in late) and all(m.num_accepted_tokens / m.num_draft_tokens > 0.35
                                                             for m in late)


def fused_graphs(monkeypatch, llm) -> "Replays":
    """The decode and fused speculative graphs' host side on a CPU, each graph's function run where its
    replay would be -> a list that gets each fused replay's sequence count (`Replays`)."""
    import engine.kernels.sampling
    from engine.model_runner import DecodeGraphs, SpecGraphs

    monkeypatch.setattr(engine.kernels.sampling, "sample", lambda logits, *args, out=None, **filters: (
        logits.argmax(-1) if out is None else out.copy_(logits.argmax(-1))))
    monkeypatch.setattr(DecodeGraphs, "_capture", lambda self, batch: self.graphs.__setitem__(
        batch, EagerGraph(lambda: self.outputs.__setitem__(batch, self._step(batch)))))

    monkeypatch.setattr(SpecGraphs, "_capture", capture_eagerly)
    runner = llm.engine.runner
    runner.graphs = DecodeGraphs(runner)
    runner.graphs.capture_all()
    fused = runner.spec_graphs = SpecGraphs(runner)
    fused.capture_all()
    replays, replay = Replays(), fused.replay

    def checked(plan, inputs, offsets):
        """A step of the same sequences after a fused one loads nothing: the rows the graph left are the
        plan's (tokens, positions shifted by the offsets), and padding sequences stay at position 0."""
        if fused.resident == tuple(plan.slots):
            n, end = plan.num_tokens, fused.padded(len(plan.slots)) * fused.rows
            decode = runner.graphs
            want = torch.tensor(plan.positions()) + (0 if offsets is None else offsets)
            assert decode.positions[:n].tolist() == want.tolist()
            ids = inputs.tolist() if inputs is not None else plan.input_ids
            assert decode.input_ids[:n].tolist() == ids
            assert not decode.positions[n:end].any()
            replays.resident += 1
        replays.append(len(plan.slots))
        return replay(plan, inputs, offsets)

    fused.replay = checked
    return replays


class Replays(list):
    """Each fused replay's sequence count, and how many found their rows in the buffers already."""

    resident = 0

    @property
    def batches(self) -> int:
        """Runs of replays of one sequence count: a batch's first step loads its rows."""
        return sum(1 for i, n in enumerate(self) if i == 0 or self[i - 1] != n)


@emulated_graphs
@pytest.mark.parametrize("k,mode", [(1, "on"), (2, "off"), (3, "on"), (4, "on"), (4, "off")])
def test_fused_speculative_steps_give_the_plain_tokens(monkeypatch, tiny_prompts, plain_tokens, k, mode):
    """A greedy step of verifications verifies, accepts, gathers and drafts in one replay (tokens, counts and
    drafts from one buffer); with async scheduling the step after it is still launched ahead. Greedy
    tokens are the plain ones, for one stream and four (three of them padded to four sequences)."""
    llm = LLM("deepseek-tiny", dtype="float32", max_num_seqs=4, async_scheduling=mode, speculative_config=spec(k))
    replays = fused_graphs(monkeypatch, llm)
    launches = record_launches(llm.engine)
    model = llm.engine.runner.model
    forward, folds = model.forward, set()  # (rows a sequence the attention is told, rows left over)
    monkeypatch.setattr(model, "forward", lambda ids, pos, meta: (
        folds.add((meta.queries_per_seq, ids.shape[0] % meta.queries_per_seq)), forward(ids, pos, meta))[1])
    assert [o.token_ids for o in llm.generate(tiny_prompts, GREEDY)] == plain_tokens
    assert len(replays) > 5 and 4 in replays
    # the fused steps tell the attention their rows come k + 1 a sequence (`AttentionMetadata.queries_per_seq`)
    assert folds == {(1, 0), (k + 1, 0)}
    assert any(launches) == (mode == "on")
    # every fused step after the first of a batch loads no rows (requests keep their k drafts to their
    # last step, so the batch shrinks inside fused steps as requests end)
    assert replays.resident >= len(replays) - replays.batches - 1
    del replays[:]
    assert [o.token_ids for o in llm.generate(tiny_prompts[1:], GREEDY)] == plain_tokens[1:]
    assert 3 in replays
    assert llm.generate([tiny_prompts[2]], GREEDY)[0].token_ids == plain_tokens[2] and 1 in replays
    s = llm.engine.speculator
    assert s.num_accepted_tokens / s.num_draft_tokens > (0.55 if k == 1 else 0.3)
    assert llm.engine.kv_cache_usage == 0.0 and not llm.engine.has_unfinished_requests()


@emulated_graphs
@pytest.mark.parametrize("mode", ["off", "on"])
def test_fused_steps_stop_inside_accepted_drafts_and_keep_host_rows_apart(monkeypatch, tiny_prompts, plain_tokens,
                                                                         mode):
    """A stop token or the length limit inside a fused step's accepted tokens ends the request there; a
    penalized or sampled request keeps its steps on the host's path, and the greedy ones' tokens stay
    the plain ones; an abort between fused steps drops the request's rows and every block comes back."""
    llm = LLM("deepseek-tiny", dtype="float32", max_num_seqs=4, async_scheduling=mode, speculative_config=spec(3))
    replays = fused_graphs(monkeypatch, llm)
    check_stops_inside_drafts(llm, tiny_prompts[0], plain_tokens[0])
    assert 3 in replays
    del replays[:]
    mixed = [GREEDY, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, presence_penalty=1.0)]
    assert llm.generate(tiny_prompts[:2], mixed)[0].token_ids == plain_tokens[0]
    assert 2 not in replays and 1 in replays  # fused only once the penalized request is done

    eng = llm.engine
    for i, p in enumerate(tiny_prompts):
        eng.add_request(f"r{i}", p, GREEDY)
    aborted = []

    def abort_after_two_verifications():
        if not aborted and eng.requests["r1"].metrics.num_verify_steps >= 2:
            eng.abort_request("r1")  # with async scheduling: a fused step holding its rows is in flight
            aborted.append(True)

    finished = step_to_the_end(eng, abort_after_two_verifications)
    assert aborted and "r1" not in finished
    assert [finished[f"r{i}"].token_ids for i in (0, 2, 3)] == [plain_tokens[i] for i in (0, 2, 3)]
    assert eng.kv_cache_usage == 0.0 and not eng.block_manager.num_hashed_blocks

@emulated_graphs
def test_fused_steps_draw_sampled_rows_in_the_graph(monkeypatch, tiny_prompts, plain_tokens):
    """A sampled request (temperature, top-p, seed) beside a greedy one verifies in the fused graph of
    both: its rows are divided by its temperature, kept to its top-p and keyed by (seed, output position)
    as `sampler.draw_on_device` keys the host path's draws; the greedy rows and the padding take the
    argmax. (The emulation's draw is an argmax, so here the sampled request decodes the greedy tokens;
    the GPU test checks the seeded draws against plain decoding's.)"""
    import engine.kernels.sampling
    from engine.sampler import noise_key

    llm = LLM("deepseek-tiny", dtype="float32", max_num_seqs=4, speculative_config=spec(3))
    replays = fused_graphs(monkeypatch, llm)
    fused = llm.engine.runner.spec_graphs
    calls = []

    def recorded(logits, temperature, keys, step, out=None, top_p=None):
        if step is fused.sampling.step0:  # the fused step's draw, not a decode graph's
            calls.append((logits.clone(), temperature.clone(), keys.clone(), top_p.clone()))
        tokens = logits.argmax(-1)
        return tokens if out is None else out.copy_(tokens)

    monkeypatch.setattr(engine.kernels.sampling, "sample", recorded)
    sampled = SamplingParams(temperature=0.7, top_p=0.5, seed=11, max_tokens=40, ignore_eos=True)
    outs = llm.generate(tiny_prompts[:2], [GREEDY, sampled])
    assert [o.token_ids for o in outs] == plain_tokens[:2]
    assert 2 in replays and len(calls) > 5
    seed, rows, starts = 11, 4, []
    for logits, unit, keys, top_p in calls:
        assert unit.tolist() == [0.0] * rows + [1.0] * rows  # the greedy request's rows, then the sampled one's
        # its keys: consecutive output positions from the step's first draw
        start = next(p for p in range(40) if keys[rows].item() == noise_key(seed, p))
        assert keys[rows : 2 * rows].tolist() == [noise_key(seed, start + j) for j in range(rows)]
        starts.append(start)
        # the sampling kernel applies the sampled rows' top-p; the greedy rows have none
        assert top_p.tolist() == [float("inf")] * rows + [0.5] * rows and not logits.isinf().any()  # no sort
    assert starts == sorted(starts) and len(set(starts)) == len(starts) and starts[0] <= 1


def test_device_noise_keys_are_the_hosts():
    """A row launched before its position is known keys its noise on the device: the same 63-bit keys."""
    import random

    from engine.sampler import _signed, noise_key, noise_keys

    rng = random.Random(0)
    seeds = [rng.getrandbits(64) for _ in range(300)] + [0, 1, 2**63, 2**64 - 1]
    positions = [rng.randrange(1 << 24) for _ in seeds]
    keys = noise_keys(torch.tensor([_signed(s) for s in seeds]), torch.tensor(positions))
    assert keys.tolist() == [noise_key(s, p) for s, p in zip(seeds, positions)]


def mtp_checkpoint(tmp_path, seed: int = 3):
    """An HF-saved V3 checkpoint with a random MTP layer as DeepSeek lays it out (model.layers.{n}.*, with
    copies of the embedding and head), and the HF model without it (the oracle)."""
    from transformers import DeepseekV3ForCausalLM

    with_mtp = build_hf_model(seed=seed, num_hidden_layers=4)  # layer 3 becomes the MTP layer's block
    n = with_mtp.config.num_hidden_layers - 1
    path = save_hf_checkpoint(with_mtp, tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config.update(num_hidden_layers=n, num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(seed)
    hidden = with_mtp.config.hidden_size
    extra = {f"model.layers.{n}.{name}": t for name, t in {
        "enorm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
        "hnorm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
        "eh_proj.weight": 0.15 * torch.randn(hidden, 2 * hidden, generator=g),
        "shared_head.norm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
        "shared_head.head.weight": with_mtp.lm_head.weight.detach().clone(),
        "embed_tokens.weight": with_mtp.model.embed_tokens.weight.detach().clone(),
    }.items()}
    save_file(extra, path / "mtp.safetensors")
    index = json.loads((path / "model.safetensors.index.json").read_text()) if (
        path / "model.safetensors.index.json").exists() else None
    if index is not None:
        index["weight_map"].update(dict.fromkeys(extra, "mtp.safetensors"))
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    hf = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # layers 0..n-1 only
    assert hf.config.num_hidden_layers == n
    return hf, path


def test_greedy_matches_hf_on_a_v3_checkpoint_with_an_mtp_layer(tmp_path):
    hf, path = mtp_checkpoint(tmp_path)
    batch = prompts(4, [9, 30, 17])
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    llm = LLM(str(path), dtype="float32", device="cpu", max_num_batched_tokens=16, speculative_config=spec(2))
    for ids, out in zip(batch, llm.generate(batch, params)):
        assert out.token_ids == hf_greedy(hf, ids, 32)
    assert llm.engine.speculator.num_draft_tokens > 0
    # the same checkpoint without speculation never reads the MTP layer
    plain = LLM(str(path), dtype="float32", device="cpu")
    assert not hasattr(plain.engine.runner.model, "mtp") or not len(plain.engine.runner.model.mtp)


@pytest.mark.parametrize("mode", ["off", "on"])
def test_two_ranks_draft_and_verify_as_one(tmp_path, mode):
    """TP=2 on CPU: every rank runs the MTP layer over the step's rows (rank 0's draws broadcast), and
    with async scheduling places a step launched ahead by rank 0's offsets (broadcast too), so the greedy
    tokens are HF's."""
    hf, path = mtp_checkpoint(tmp_path, seed=5)
    batch = prompts(6, [12, 7])
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = LLM(str(path), dtype="float32", device="cpu", tensor_parallel_size=2, async_scheduling=mode,
              speculative_config=spec(2))
    try:
        launches = record_launches(llm.engine)
        for ids, out in zip(batch, llm.generate(batch, params)):
            assert out.token_ids == hf_greedy(hf, ids, 16)
        assert llm.engine.speculator.num_draft_tokens > 0
        assert any(launches) == (mode == "on")
    finally:
        llm.engine.shutdown()


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at the normal quantile z (3.09: p = 0.001), Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampled_tokens_follow_the_target_distribution(tiny_prompts):
    """Temperature 1, top-k 3: the first three tokens' joint distribution over 1,500 seeds with k = 2
    drafts (the second and third tokens come from verification rows, accepted or drawn past a rejected
    draft) against the exact probabilities of the target: chi-square below its p = 0.001 quantile.
    Seeds reproduce their tokens."""
    prompt = tiny_prompts[2]
    params = [SamplingParams(temperature=1.0, top_k=3, seed=s, max_tokens=3, ignore_eos=True) for s in range(1500)]
    llm = LLM("deepseek-tiny", dtype="float32", max_num_seqs=256, speculative_config=spec(2))
    outs = llm.generate([prompt] * len(params), params)
    counts = Counter(tuple(o.token_ids) for o in outs)
    assert llm.engine.speculator.num_draft_tokens > 0
    assert [o.token_ids for o in llm.generate([prompt] * 5, params[:5])] == [o.token_ids for o in outs[:5]]

    def top3(logits: torch.Tensor) -> dict[int, float]:
        values, ids = logits.topk(3)
        return dict(zip(ids.tolist(), values.softmax(-1).tolist()))

    plain = LLM("deepseek-tiny", dtype="float32")
    exact: dict[tuple, float] = {}
    first = top3(plain.score([prompt])[0][-1])
    seconds = plain.score([prompt + [a] for a in first])
    for a, pa in first.items():
        second = top3(seconds.pop(0)[-1])
        thirds = plain.score([prompt + [a, b] for b in second])
        for (b, pb), logits in zip(second.items(), thirds):
            for c, pc in top3(logits[-1]).items():
                exact[(a, b, c)] = pa * pb * pc
    assert set(counts) <= set(exact)
    n = len(outs)
    chi2 = sum((counts.get(cell, 0) - n * p) ** 2 / (n * p) for cell, p in exact.items())
    assert chi2 < chi_square_critical(len(exact) - 1)


def test_speculative_config_is_parsed_and_checked():
    assert SpeculativeConfig.parse('{"method": "mtp", "num_speculative_tokens": 3}').num_speculative_tokens == 3
    assert SpeculativeConfig.parse("") is None and SpeculativeConfig.parse({}) is None
    for bad, why in [('{"method": "eagle", "num_speculative_tokens": 1}', "not supported"),
                     ('{"num_speculative_tokens": 0}', "in \\[1, 8\\]"), ('{"method": "mtp"}', "needs"),
                     ('{"num_speculative_tokens": 1, "draft_model": "x"}', "unknown"), ("{", "not valid JSON")]:
        with pytest.raises(ValueError, match=why):
            SpeculativeConfig.parse(bad)
    v41 = ModelConfig.from_hf(preset_config("v41-tiny"))  # V4.1 ships DSpark drafts, not an MTP layer
    with pytest.raises(ValueError, match="not implemented for DeepseekV41ForCausalLM"):
        ModelRunner(EngineConfig(model="v41", dtype="float32", device="cpu", speculative_config=spec(1)), v41, None, 64)
    for preset in ("tiny", "v4-tiny"):  # num_nextn_predict_layers 0
        no_mtp = ModelConfig.from_hf(preset_config(preset))
        with pytest.raises(ValueError, match="num_nextn_predict_layers"):
            ModelRunner(EngineConfig(model=preset, dtype="float32", device="cpu", speculative_config=spec(1)), no_mtp,
                        None, 64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("k,fold", [(1, False), (3, False), (3, True)])
def test_on_the_gpu_graphs_give_the_plain_tokens(tiny_prompts, k, fold, monkeypatch):
    """The fast path: verification rows replayed from the decode graphs, the draft from its own graphs,
    steps launched ahead of the verification before them (positions and noise keys shifted on the
    device); greedy and seeded sampled tokens as plain decoding's (the sampling noise is keyed by position).
    Steps verify, draw (greedy, or with temperature and top-p), accept and draft in one fused replay, its
    three outputs copied as one span; with `attention.FOLD_VERIFICATIONS` the fused graphs' k + 1 rows a
    sequence folded into the decode kernel's heads."""
    from engine.kernels import mla_decode
    from engine.layers import attention
    from engine.model_runner import SpecGraphs

    # the decode kernel's fold while the fused graphs are captured (elsewhere a verification run as a
    # chunk of k + 1 equal rows is folded by `attention.FOLD_CHUNKS`, whatever this switch says)
    folds, attend, capture, capturing = [], mla_decode.mla_decode_attention, SpecGraphs._capture, [False]

    def attend_recorded(*args, **kwargs):
        if capturing[0]:
            folds.append(kwargs.get("queries_per_seq", 1))
        return attend(*args, **kwargs)

    def capture_recorded(self, *args):
        capturing[0] = True
        try:
            capture(self, *args)
        finally:
            capturing[0] = False

    monkeypatch.setattr(mla_decode, "mla_decode_attention", attend_recorded)
    monkeypatch.setattr(SpecGraphs, "_capture", capture_recorded)
    monkeypatch.setattr(attention, "FOLD_VERIFICATIONS", fold)
    params = [GREEDY, SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=40, ignore_eos=True)]
    batch = [tiny_prompts[0], tiny_prompts[1], tiny_prompts[1]]
    plain = LLM("deepseek-tiny", dtype="float32").generate(batch, [params[0], params[0], params[1]])
    llm = LLM("deepseek-tiny", dtype="float32", speculative_config=spec(k))
    assert llm.engine.runner.draft_graphs.graphs and llm.engine.async_scheduling
    launches = record_launches(llm.engine)
    fused = llm.engine.runner.spec_graphs
    assert fused.graphs
    replays, replay = [], fused.replay
    fused.replay = lambda plan, *args: replays.append(len(plan.slots)) or replay(plan, *args)
    outs = llm.generate(batch, [params[0], params[0], params[1]])
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert launches.count(True) >= len(launches) - 3
    assert len(replays) > 5 and 3 in replays  # the seeded top-p request's rows drawn in the fused graph
    replays.clear()
    one = llm.generate([tiny_prompts[3]], GREEDY)[0]  # one stream: the fused (k + 1)-row graph
    assert one.token_ids == LLM("deepseek-tiny", dtype="float32").generate([tiny_prompts[3]], GREEDY)[0].token_ids
    assert len(replays) > 5 and set(replays) == {1}
    two = llm.generate(tiny_prompts[:3], GREEDY)  # three streams: padded to a graph of four sequences
    assert [o.token_ids for o in two] == [o.token_ids for o in LLM("deepseek-tiny", dtype="float32").generate(
        tiny_prompts[:3], GREEDY)] and 3 in replays
    assert folds and (k + 1 in folds) == fold  # the fused graphs' captures


def start_servers(session, tmp_path_factory) -> dict:
    """The server of the test below, if the run selected it: started ahead of the module (tests/conftest.py)."""
    from tests.engine.conftest_server import ServerProcess, selected_items

    if not any(item.name == "test_served_with_the_flag_through_the_official_client"
               for item in selected_items(session, __name__)):
        return {}
    return {"server": ServerProcess(resolve_model_path("deepseek-tiny"), tmp_path_factory.mktemp("log") / "server.log",
                                    "--speculative-config", json.dumps(spec(2)))}


def test_served_with_the_flag_through_the_official_client(request, tiny_prompts, plain_tokens):
    """`deepseek-engine serve --speculative-config ...` answers the official client with the plain greedy
    text, streamed and whole, counts drafts in /metrics and logs each request's accepted length."""
    import openai

    from tests.engine.conftest_server import MODEL_NAME, module_servers

    server = module_servers(request).pop("server")
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        whole = client.completions.create(model=MODEL_NAME, prompt=tiny_prompts[0], max_tokens=40, temperature=0)
        stream = client.completions.create(model=MODEL_NAME, prompt=tiny_prompts[1], max_tokens=40, temperature=0,
                                           stream=True)
        streamed = "".join(chunk.choices[0].text for chunk in stream)
        tok = LLM("deepseek-tiny", dtype="float32", num_kv_blocks=8).tokenizer
        for text, ids in [(whole.choices[0].text, plain_tokens[0]), (streamed, plain_tokens[1])]:
            stop = ids.index(1) if 1 in ids else len(ids)  # the server stops at EOS
            assert text == tok.decode(ids[:stop])
        metrics = server.metrics()
        drafts = metrics["deepseek_engine_spec_decode_draft_tokens_total"]
        assert drafts > 0 and 0 < metrics["deepseek_engine_spec_decode_accepted_tokens_total"] <= drafts
        assert "spec_accepted=" in server.log() and "accepted_len=" in server.log()
    finally:
        server.stop()


def test_the_batch_cutoff_drafts_where_the_measured_steps_pay():
    """Given step times (no timing here): a step of k drafts gains 1 + k * acceptance tokens where a plain
    step gains one; drafting runs up to the largest batch size where that beats the speculative step's
    time by the margin at every size up to it, and moves with the acceptance counted while serving."""
    from engine.spec_decode import Speculator, StepTimes, batch_cutoff

    times = StepTimes([1, 2, 4, 8], plain=[1.0, 1.1, 1.2, 1.5], spec=[2.0, 2.3, 3.5, 6.0])
    assert batch_cutoff(times, 3, 0.6, 0.1) == 2  # gains 2.8: 2.8 > 2.2, 3.08 > 2.53, 3.36 < 3.85
    assert batch_cutoff(times, 3, 0.9, 0.1) == 4  # gains 3.7: 4.44 > 3.85, 5.55 < 6.6
    assert batch_cutoff(times, 3, 0.9, 0.3) == 2  # a larger margin asks more: 4.44 < 1.3 * 3.5
    assert batch_cutoff(times, 3, 0.2, 0.1) == 0  # gains 1.6 < 2.2: nowhere
    assert batch_cutoff(StepTimes([1, 2, 4], [1.0, 1.0, 1.0], [2.0, 9.0, 2.0]), 3, 0.6, 0.1) == 1  # no gaps
    assert batch_cutoff(StepTimes([], [], []), 3, 0.9, 0.1) == 0

    sp = Speculator(SpeculativeConfig(num_speculative_tokens=3), None, 1024)
    assert sp.drafts_at(64)  # nothing measured (a CPU): every batch size drafts, as configured
    assert sp.use_times(times) == 2 and sp.acceptance() == Speculator.PRIOR_ACCEPTANCE
    assert sp.drafts_at(2) and not sp.drafts_at(3)
    sp.num_draft_tokens, sp.num_accepted_tokens = 3000, 2700  # well accepted drafts: larger batches pay
    assert sp.drafts_at(4) and sp.limit == 4 and not sp.drafts_at(5)
    sp.num_draft_tokens, sp.num_accepted_tokens = 30000, 3000  # hardly any accepted: none pays
    assert not sp.drafts_at(1) and sp.limit == 0
    sp.forced = True
    assert sp.drafts_at(256)
    user = Speculator(SpeculativeConfig(num_speculative_tokens=3, disable_by_batch_size=1), None, 1024)
    user.use_times(times)
    assert user.drafts_at(1) and not user.drafts_at(2)  # the setting wins over the measurement


def test_the_batch_cutoff_measures_every_size_up_to_the_largest_batch():
    """The padded graph sizes below the largest batch, then the largest batch itself: a max_num_seqs that is
    no graph size (3, 10) is measured, so a full batch is not left undrafted for want of a measurement."""
    from engine.spec_decode import measured_sizes

    sizes = [1, 2, 4, 8, 12, 16, 24, 32]
    assert measured_sizes(sizes, 3, 128, 2) == [1, 2, 3]
    assert measured_sizes(sizes, 10, 128, 3) == [1, 2, 4, 8, 10]
    assert measured_sizes(sizes, 16, 128, 3) == [1, 2, 4, 8, 12, 16]
    assert measured_sizes(sizes, 64, 32, 3) == [1, 2, 4, 8]  # k + 1 rows a request: 8 requests fill 32 rows
    assert measured_sizes(sizes, 4, 3, 3) == []


def test_the_batch_cutoff_is_measured_on_the_engines_own_steps(tiny_prompts, plain_tokens):
    """The measurement steps the engine itself, without drafts and with them, at each size asked for;
    on a CPU it is not made unless asked (no graphs: speculation runs wherever it is configured).
    Afterwards nothing of it is left running or counted, and the greedy tokens are the plain ones."""
    llm = LLM("deepseek-tiny", dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    eng = llm.engine
    on_gpu = eng.runner.graphs is not None
    assert (eng.speculator.times is not None) == on_gpu  # measured at start where the graphs run
    assert on_gpu or eng.speculator.drafts_at(256)
    propose, drafted = eng.executor.propose, []
    eng.executor.propose = lambda draft, *args: drafted.append(draft.num_drafts) or propose(draft, *args)
    limit = eng.measure_batch_cutoff(sizes=[1, 2], steps=2)
    times = eng.speculator.times
    assert times.sizes == [1, 2] and all(t > 0 for t in times.plain + times.spec)
    assert limit == eng.speculator.limit and limit in (0, 1, 2)
    assert 0 in drafted and 2 in drafted  # steps without drafts (the MTP pass alone) and with
    assert not eng.requests and not eng.has_unfinished_requests() and eng.inflight is None
    assert eng.kv_cache_usage == 0.0 and eng.speculator.num_draft_tokens == 0
    eng.executor.propose = propose
    eng.speculator.times = eng.speculator.limit = None  # the tokens, whoever drafts
    assert [o.token_ids for o in llm.generate(tiny_prompts, GREEDY)] == plain_tokens


def test_a_context_too_short_for_the_cutoff_measurement_drafts_everywhere():
    """Where max_model_len is shorter than the measurement's requests, they would end inside the timed steps:
    nothing is measured and every batch size drafts."""
    llm = LLM("deepseek-tiny", dtype="float32", max_model_len=48,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    eng = llm.engine
    eng.speculator.times = eng.speculator.limit = None
    assert eng.measure_batch_cutoff(sizes=[1, 2]) == eng.config.max_num_seqs  # 52 tokens a request at k = 2
    assert eng.speculator.times is None and eng.speculator.drafts_at(256) and not eng.requests


def test_steps_in_pieces_around_attention_keep_the_greedy_tokens(tiny_prompts, plain_tokens):
    """Steps of several rows replayed in pieces around their eager attention (`PiecewiseGraphs`, each
    piece run where its graph would replay): the MTP draft after them reads the hidden state from the
    pieces' buffer, and greedy tokens are the plain ones."""
    from engine.model_runner import PiecewiseGraphs

    llm = LLM("deepseek-tiny", dtype="float32", max_num_batched_tokens=64, speculative_config=spec(2))
    runner = llm.engine.runner
    pieces = runner.piecewise = PiecewiseGraphs(runner, PiecewiseGraphs.lengths(8, 64, 32), None, min_tokens=8)
    pieces._capture = lambda size: pieces.graphs.setdefault(size, [])
    sizes = []
    pieces.replay = lambda size, i: (sizes.append(size) if i == 0 else None, pieces._piece(size, i))
    assert [o.token_ids for o in llm.generate(tiny_prompts, GREEDY)] == plain_tokens
    assert 64 in sizes and 32 in sizes  # the prompts' steps, and verifications of more than 7 rows
    s = llm.engine.speculator  # drafts from a wrong hidden state would be rejected
    assert s.num_draft_tokens > 0 and s.num_accepted_tokens / s.num_draft_tokens > 0.35
