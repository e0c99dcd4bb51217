"""Grammar-constrained decoding in the engine: outputs that match a JSON schema, any JSON object or a Lark
grammar, whatever the model would have said (the embedded deepseek-tiny, sampled at temperature 1)."""

import json

import jsonschema
import pytest
import torch

from engine import LLM, SamplingParams
from engine.structured_output import Guide, StructuredOutput, StructuredOutputError, apply_guides, fill_bitmask

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 2},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm():
    return LLM("deepseek-tiny", dtype="float32", device="cpu", show_progress=False, max_num_seqs=16)


def test_every_seeded_sample_validates_against_the_schema(llm):
    so = StructuredOutput(json_schema=SCHEMA)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=64, structured_output=so) for s in range(16)]
    outs = llm.generate(["Describe a person as JSON:"] * 16, params)
    for out in outs:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len({o.text for o in outs}) > 4  # sampled, not one forced string
    # unconstrained, the same model and seeds write no such JSON
    free = llm.generate(["Describe a person as JSON:"] * 4,
                        [SamplingParams(temperature=1.0, seed=s, max_tokens=64) for s in range(4)])
    assert not any(_is_valid(o.text) for o in free)


def _is_valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_json_object_and_a_lark_grammar(llm):
    out = llm.generate(["Give me a JSON object:"], SamplingParams(
        temperature=0.0, max_tokens=64, structured_output=StructuredOutput(json_object=True)))[0]
    assert isinstance(json.loads(out.text), dict) and out.finish_reason == "stop"
    yes_no = StructuredOutput(lark='start: "yes" | "no"')
    outs = llm.generate(["Is water wet?"] * 6, [SamplingParams(temperature=1.0, seed=s, max_tokens=8,
                                                               structured_output=yes_no) for s in range(6)])
    assert all(o.text in ("yes", "no") and o.finish_reason == "stop" for o in outs)


def test_guided_and_free_requests_share_batches(tmp_path):
    """Async scheduling on: a step with guided rows goes ahead on the tokens in flight (its forward runs
    while the host reads the last step and advances the grammars; its masks and draws follow), and every
    request gets the tokens the synchronous loop gives it: the free rows those they get alone."""
    def run(mode: str):
        llm = LLM("deepseek-tiny", dtype="float32", device="cpu", show_progress=False, async_scheduling=mode)
        free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        alone = llm.generate(["The capital of France"], free)[0]
        guided = SamplingParams(temperature=1.0, seed=3, max_tokens=64,
                                structured_output=StructuredOutput(json_schema=SCHEMA))
        launch, ahead = llm.engine._launch, []
        llm.engine._launch = lambda batch, inputs=None: ahead.append(
            inputs is not None and any(s.guide is not None for s in batch.decodes)) or launch(batch, inputs)
        outs = llm.generate(["The capital of France", "A person as JSON:", "The capital of France"],
                            [free, guided, free])
        assert outs[0].token_ids == outs[2].token_ids == alone.token_ids
        jsonschema.validate(json.loads(outs[1].text), SCHEMA)
        return [o.token_ids for o in outs], ahead.count(True)

    (sync, _), (async_, guided_ahead) = run("off"), run("on")
    assert async_ == sync and guided_ahead >= 5


def test_a_preempted_guided_request_still_matches(tmp_path):
    llm = LLM("deepseek-tiny", dtype="float32", device="cpu", show_progress=False, num_kv_blocks=12, block_size=4,
              enable_prefix_caching=False)
    so = StructuredOutput(json_schema=SCHEMA)
    outs = llm.generate(["Describe a person as JSON:"] * 4,
                        [SamplingParams(temperature=1.0, seed=s, max_tokens=40, structured_output=so) for s in range(4)])
    assert llm.engine.scheduler.num_preemptions > 0
    for out in outs:
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_what_cannot_be_enforced_is_named():
    with pytest.raises(StructuredOutputError, match="if"):
        StructuredOutput(json_schema={"type": "object", "if": {"required": ["a"]}}).validate()
    with pytest.raises(StructuredOutputError):
        StructuredOutput(lark="start: (").validate()
    with pytest.raises(StructuredOutputError, match="exactly one"):
        StructuredOutput(json_object=True, lark='start: "a"')
    StructuredOutput(json_schema=SCHEMA).validate()


def test_an_unenforceable_schema_is_refused_at_submission(llm):
    bad = SamplingParams(structured_output=StructuredOutput(json_schema={"type": "object", "if": {}}))
    with pytest.raises(ValueError, match="if"):
        llm.engine.add_request("bad", [5, 6, 7], bad)
    assert "bad" not in llm.engine.requests


def test_masks_apply_to_their_rows_only(llm):
    class Only:
        """A guide allowing tokens 3 and 40 alone."""

        def fill(self, bitmask, row):
            bitmask[row] = 0
            bitmask[row, 0] = 1 << 3
            bitmask[row, 1] = 1 << (40 - 32)

    logits = torch.randn(3, 70)
    want = logits.clone()
    apply_guides(logits, [None, Only(), None])
    assert torch.equal(logits[0], want[0]) and torch.equal(logits[2], want[2])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [3, 40]
    assert torch.equal(logits[1, [3, 40]], want[1, [3, 40]])
    # real matchers at different points of their grammars: each row gets its own guide's mask, not a
    # neighbour's
    tok = llm.engine._guide_tokenizer()
    guides = [Guide(tok, StructuredOutput(json_schema=SCHEMA)) for _ in range(9)]
    prefix = llm.tokenizer.encode('{"name":"Ada","age":3', add_bos=False)
    for i, g in enumerate(guides):
        for t in prefix[: i % len(prefix)]:
            assert g.advance(t)
    bitmask = torch.full((len(guides), -(-llm.engine.model_config.vocab_size // 32)), -1, dtype=torch.int32)
    fill_bitmask(guides, bitmask)
    assert not torch.equal(bitmask[0], bitmask[-1])
