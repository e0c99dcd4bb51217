"""Async scheduling: a decode step launched before the host reads the tokens of the step before it.

On CPU the "device" finishes each step before the host moves on, so these tests check the bookkeeping
(which rows run, which tokens are kept, blocks, the prefix cache), not the overlap itself; the overlap
on a GPU is measured by benchmarks/step_time.py and benchmarks/server_overhead.py.
"""

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampler import Sampler
from engine.sequence import Sequence
from engine.step_plan import StepResult
from tests.engine.hf_oracle import prompts


@pytest.fixture(scope="module")
def engines(random_checkpoint):
    def make(mode: str, **kwargs) -> LLM:
        return LLM(str(random_checkpoint), dtype="float32", block_size=4, async_scheduling=mode, **kwargs)

    return make


def snapshot(outs) -> list[tuple]:
    return [(o.token_ids, o.text, o.finish_reason) for o in outs]


def assert_same_logprobs(a, b) -> None:
    # a row dropped after an EOS changes a batch's size, which may round a logit differently
    for x, y in zip(a, b):
        assert (x.logprobs is None) == (y.logprobs is None)
        for u, v in zip(x.logprobs or [], y.logprobs or []):
            assert u.keys() == v.keys() and all(abs(u[t] - v[t]) < 1e-5 for t in u)


def mixed_workload(llm: LLM) -> tuple[list, list, list]:
    """Requests that end every way there is, at different steps, with sampling of every kind."""
    batch = prompts(31, [9, 14, 5, 22, 11, 7], vocab=512)
    greedy = llm.generate(batch[0], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[greedy.token_ids[12]]),  # ends mid-way
        SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=25, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, top_k=20, seed=8, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True, presence_penalty=1.5),  # needs history
        SamplingParams(temperature=1.0, seed=9, max_tokens=40, ignore_eos=True, stop=["a"]),
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
    ]
    outs = llm.generate(batch, params)
    bm = llm.engine.block_manager
    return outs, sorted(bm.hash_to_block)


def test_async_and_sync_give_the_same_outputs_and_prefix_cache(engines):
    sync, async_ = engines("off"), engines("on")
    (outs, cached), (expected, expected_cached) = mixed_workload(async_), mixed_workload(sync)
    assert snapshot(outs) == snapshot(expected) and cached == expected_cached
    assert_same_logprobs(outs, expected)
    for llm in (sync, async_):
        assert llm.engine.kv_cache_usage == 0.0 and not llm.engine.has_unfinished_requests()


def test_decode_steps_launch_before_the_previous_tokens_are_read(engines):
    llm = engines("on")
    eng = llm.engine
    launches = []  # per launch: did every row have a token in flight (drawn, not yet read)?
    execute = eng.executor.execute

    def recording_execute(plan, inputs=None, offsets=None):
        running = eng.scheduler.running
        launches.append(inputs is not None and plan.input_ids is None
                        and all(s.num_inflight_tokens == 1 for s in running))
        return execute(plan, inputs, offsets)

    eng.executor.execute = recording_execute
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=20, ignore_eos=True)
    outs = llm.generate(prompts(32, [6, 6, 6], vocab=512), params)
    assert [len(o.token_ids) for o in outs] == [20, 20, 20]
    # the prefill and the first decode step are scheduled with every token known; the other 18 decode
    # steps are launched ahead, and the last token's step is never launched (the length is known)
    assert launches.count(True) == 18 and len(launches) == 20


def test_an_ending_request_drops_the_row_it_was_given_ahead(engines):
    llm = engines("on")
    eng = llm.engine
    p = prompts(33, [8], vocab=512)[0]
    full = llm.generate(p, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]
    stop = full.token_ids[6]
    rows = []
    execute = eng.executor.execute
    eng.executor.execute = lambda plan, inputs=None, offsets=None: rows.append(len(plan.slots)) or execute(
        plan, inputs, offsets)
    out = llm.generate(p, SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop]))[0]
    end = full.token_ids.index(stop) + 1
    assert out.token_ids == full.token_ids[:end] and out.finish_reason == "stop"
    assert len(rows) == end + 1  # one step more than tokens: the row launched before the stop was read
    assert eng.kv_cache_usage == 0.0 and not eng.has_unfinished_requests()


def test_abort_while_a_step_is_in_flight(engines):
    llm = engines("on")
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i, p in enumerate(prompts(34, [10, 12], vocab=512)):
        eng.add_request(f"r{i}", p, params)
    for _ in range(4):
        eng.step()
    assert eng.inflight is not None and len(eng.inflight.groups) == 2
    eng.abort_request("r0")
    seen = []
    while eng.has_unfinished_requests():
        seen += [o.request_id for o in eng.step()]
    assert "r0" not in seen and seen.count("r1") == 30 - 4  # four steps gave four tokens; r1 goes on
    assert eng.kv_cache_usage == 0.0
    eng.abort_request("r1")  # already finished: harmless


def test_aborting_every_request_in_flight_leaves_nothing_to_do(engines):
    eng = engines("on").engine
    eng.add_request("only", prompts(35, [10], vocab=512)[0], SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng.inflight is not None
    eng.abort_request("only")
    assert not eng.has_unfinished_requests() and eng.kv_cache_usage == 0.0
    eng.add_request("next", prompts(36, [10], vocab=512)[0], SamplingParams(max_tokens=4, ignore_eos=True))
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert [o.request_id for o in outs] == ["next"] * 4 and outs[-1].finished


def test_a_short_cache_falls_back_to_synchronous_preemption(engines):
    # 14 blocks of 4 tokens for three requests that need 8 each at their end: some are preempted
    batch = prompts(37, [10, 11, 12], vocab=512)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs = {}
    for mode in ("off", "on"):
        llm = engines(mode, num_kv_blocks=14)
        outs[mode] = snapshot(llm.generate(batch, params))
        assert llm.engine.scheduler.num_preemptions > 0
    assert outs["on"] == outs["off"]


def test_a_request_arriving_mid_decode_is_admitted_at_the_next_step(engines):
    eng = engines("on").engine
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    eng.add_request("early", prompts(38, [10], vocab=512)[0], params)
    for _ in range(5):
        eng.step()
    eng.add_request("late", prompts(39, [6], vocab=512)[0], params)
    eng.step()  # resolves the step in flight, launches nothing ahead: the new request waits for admission
    assert eng.inflight is None
    outs = eng.step()  # schedules the late request's prefill with the early one's decode
    assert {o.request_id for o in outs} == {"early", "late"}


def test_the_penalties_count_the_token_still_in_flight():
    # token 3 is the favourite by 1.0; the step in flight drew it, so a penalty of 2 must move the draw
    seq = Sequence("r", [1, 2], SamplingParams(temperature=0.0, frequency_penalty=2.0))
    seq.output_token_ids = [5]
    logits = torch.tensor([[0.0, 0.0, 0.0, 2.0, 1.0, 0.5]])
    assert Sampler().sample(logits.clone(), [seq]).result()[0] == [3]
    assert Sampler().sample(logits.clone(), [seq], pending=torch.tensor([3])).result()[0] == [4]


def test_penalized_requests_go_ahead_and_count_the_token_in_flight(engines):
    """A stand-in for the model's logits that favours repeating the row's input token (the last one) by
    less than the penalty: a draw that misses the token in flight repeats it."""

    def repeating(llm: LLM) -> tuple[list[list[int]], list[bool]]:
        executor, ahead = llm.engine.executor, []
        execute = executor.execute

        def run_favouring_the_last_token(plan, inputs=None, offsets=None):
            ahead.append(inputs is not None)
            result = execute(plan, inputs, offsets)  # the real step: KV writes, positions
            logits = result.logits
            if logits is None:
                return result
            last = inputs if inputs is not None else torch.tensor([plan.input_ids[i] for i in plan.sample_indices],
                                                                  device=logits.device)
            vocab = logits.shape[1]
            fake = torch.zeros_like(logits)
            fake.scatter_(1, last[:, None], 1.0)
            fake.scatter_(1, ((last + 1) % vocab)[:, None], 0.5)
            return StepResult(fake)

        executor.execute = run_favouring_the_last_token
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, frequency_penalty=1.0)
        outs = llm.generate(prompts(42, [5, 9], vocab=512), params)
        return [o.token_ids for o in outs], ahead

    want, _ = repeating(engines("off"))
    got, ahead = repeating(engines("on"))
    assert got == want
    assert all(out[1] == (out[0] + 1) % 512 for out in got)  # the repeat after the first token was penalized
    assert ahead.count(True) == 10  # every decode step after the first went ahead
