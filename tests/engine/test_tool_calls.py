"""Tool calling's pure parts: the DeepSeek formats, the call parser (whatever the chunking), the grammars
(run through llguidance over the embedded model's tokenizer), and the chat-template rendering of tools
against transformers' apply_chat_template."""

import json
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import llguidance
import llguidance.hf
import pytest
import transformers

from engine.config import resolve_model_path
from engine.server import structured, tool_format
from engine.server.errors import InvalidRequest
from engine.server.protocol import ChatCompletionRequest, JSONSchemaFormat, NamedToolChoice, Tool
from engine.server.serving_chat import ChatServing, _Reply
from engine.server.tool_format import CALLS_BEGIN, CALLS_END, V3, V31
from engine.server.tool_parser import ToolCallParser
from engine.tokenizer import Tokenizer

TINY = resolve_model_path("deepseek-tiny")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
CLOCK = {"type": "function", "function": {"name": "now"}}  # no description, no parameters
TOOLS = [WEATHER, SEARCH, CLOCK]
HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris and news?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "search", "arguments": '{"q": "news"}'}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "nothing new"},
    {"role": "assistant", "content": "21 C and nothing new."},
    {"role": "user", "content": "And tomorrow?"},
]


# --------------------------------------------------------------------------------------------------- parser


def parse(fmt, pieces, max_calls=None):
    parser = ToolCallParser(fmt, max_calls)
    content, names, arguments, ids = "", {}, {}, {}
    for result in [parser.feed(piece) for piece in pieces] + [parser.finish()]:
        content += result[0]
        for d in result[1]:
            if d.id is not None:
                assert d.index not in ids, "a call's id comes once, in its first delta"
                ids[d.index], names[d.index] = d.id, d.name
            assert d.index in ids, "the first delta of a call carries its id and name"
            arguments[d.index] = arguments.get(d.index, "") + d.arguments
    assert [(c.name, c.arguments) for c in parser.calls] == [(names[i], arguments.get(i, "")) for i in sorted(ids)]
    return content, [(names[i], arguments.get(i, "")) for i in sorted(ids)]


def random_splits(text, rng, count=200):
    for _ in range(count):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(40, len(text) - 1))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    yield list(text)


@pytest.mark.parametrize("fmt", [V31, V3], ids=lambda f: f.name)
def test_calls_parse_whatever_the_chunking(fmt):
    calls = [("get_weather", '{"city": "Paris", "unit": "c"}'), ("search", '{"q": "a<b, ``` <｜ x"}')]
    text = "Let me look. " + fmt.calls(calls) + "trailing"
    for pieces in random_splits(text, random.Random(0)):
        assert parse(fmt, pieces) == ("Let me look. ", calls), pieces


def test_text_without_calls_is_content_and_partial_markers_are_released():
    text = "a < b and <｜tool▁calls▁beg is not a marker <｜tool"
    for pieces in random_splits(text, random.Random(1), 50):
        assert parse(V31, pieces) == (text, [])


def test_parallel_off_keeps_the_first_call():
    text = V31.calls([("a", "{}"), ("b", "{}")])
    assert parse(V31, [text], max_calls=1) == ("", [("a", "{}")])


def test_a_cut_off_call_keeps_its_arguments_so_far():
    text = CALLS_BEGIN + V31.call("search", '{"q": "new').removesuffix(V31.args_end)
    assert parse(V31, [text]) == ("", [("search", '{"q": "new')])
    # a name still being written is no call yet
    assert parse(V31, [CALLS_BEGIN + V31.head + "sea"]) == ("", [])


def test_text_after_the_calls_or_instead_of_a_call_is_dropped():
    assert parse(V31, [V31.calls([("a", "{}")]) + " more"]) == ("", [("a", "{}")])
    assert parse(V31, [CALLS_BEGIN + "oops" + CALLS_END]) == ("", [])


def test_reasoning_stays_apart_from_content_and_calls():
    text = "The user wants Paris.</think>Checking." + V31.calls([("get_weather", '{"city":"Paris","unit":"c"}')])
    serving = SimpleNamespace(served_model_name="m")
    for pieces in random_splits(text, random.Random(2), 50):
        reply = _Reply(serving, "id", "<｜User｜>hi<｜Assistant｜><think>", 1, None, V31, None)
        reasoning = content = arguments = ""
        for i, piece in enumerate(pieces):
            r, c, deltas = reply.split(0, piece, finished=i == len(pieces) - 1)
            reasoning, content = reasoning + r, content + c
            arguments += "".join(d.function.arguments or "" for d in deltas)
        assert (reasoning, content, arguments) == ("The user wants Paris.", "Checking.", '{"city":"Paris","unit":"c"}')


# ------------------------------------------------------------------------------------------------- formats


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return Tokenizer(TINY)


@pytest.fixture(scope="module")
def v3_tokenizer(deepseek_tokenizer_dir):
    return Tokenizer(deepseek_tokenizer_dir)


def test_formats_are_read_from_the_chat_templates(tiny_tokenizer, v3_tokenizer, random_checkpoint):
    assert tool_format.detect(tiny_tokenizer) is V31  # V3.1's template, as the embedded model ships it
    assert tool_format.detect(v3_tokenizer) is V3  # DeepSeek-V3's own
    assert tool_format.detect(Tokenizer(random_checkpoint)) is None  # a template that writes no calls


# ------------------------------------------------------------------------------------------------ grammars


@pytest.fixture(scope="module")
def ll_tokenizer():
    return llguidance.hf.from_tokenizer(transformers.AutoTokenizer.from_pretrained(TINY))


@pytest.fixture(scope="module")
def hf_tiny():
    return transformers.AutoTokenizer.from_pretrained(TINY)


def tools_of(*tools):
    return [Tool.model_validate(t) for t in tools]


def constraint(tools=TOOLS, tool_choice="required", parallel=True, prompt="<｜Assistant｜></think>",
               response_format=None):
    return structured.for_chat(
        response_format=response_format, tools=tools_of(*tools) if tools else None, tool_choice=tool_choice,
        parallel=parallel, fmt=V31, prompt=prompt, think_tokens=True,
    )


def accepts(ll_tokenizer, hf_tiny, so, text, eos=False) -> bool:
    """Whether the grammar takes exactly the tokens of `text` and is then complete (or takes EOS there)."""
    matcher = llguidance.LLMatcher(ll_tokenizer, so.grammar(), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = hf_tiny.encode(text, add_special_tokens=False) + ([hf_tiny.eos_token_id] if eos else [])
    return all(matcher.consume_token(t) for t in ids) and matcher.is_stopped()


def call_text(*calls):
    return V31.calls([(name, json.dumps(args, separators=(",", ":"))) for name, args in calls])


PARIS = ("get_weather", {"city": "Paris", "unit": "c"})
NEWS = ("search", {"q": "news"})


def test_required_takes_calls_of_any_tool_with_valid_arguments(ll_tokenizer, hf_tiny):
    so = constraint()
    ok = lambda text: accepts(ll_tokenizer, hf_tiny, so, text)  # noqa: E731
    assert ok(call_text(PARIS))
    assert ok(call_text(PARIS, NEWS, ("now", {})))
    assert not ok(call_text(("get_weather", {"city": "Paris"})))  # a required argument missing
    assert not ok(call_text(("get_weather", {"city": "Paris", "unit": "k"})))  # not in the enum
    assert not ok(call_text(("get_weather", {"city": "Paris", "unit": "c", "x": 1})))  # no other keys
    assert not ok(call_text(("now", {"a": 1})))  # no parameters: {}
    assert not ok(call_text(("unknown", {})))
    assert not ok("Sure. " + call_text(PARIS))  # no answer instead of, or before, the call
    assert not ok(call_text(PARIS).replace('{"city"', '{ "city"'))  # arguments written compactly
    assert not ok("Paris is sunny.")
    # the exact tokens the model writes: markers are single special tokens, never their spelled-out text
    ids = hf_tiny.encode(call_text(PARIS), add_special_tokens=False)
    assert ids[:2] == [hf_tiny.convert_tokens_to_ids(CALLS_BEGIN), hf_tiny.convert_tokens_to_ids(V31.head)]


def test_named_and_single_calls(ll_tokenizer, hf_tiny):
    named = constraint(tool_choice=NamedToolChoice.model_validate({"type": "function", "function": {"name": "search"}}))
    assert accepts(ll_tokenizer, hf_tiny, named, call_text(NEWS))
    assert accepts(ll_tokenizer, hf_tiny, named, call_text(NEWS, NEWS))
    assert not accepts(ll_tokenizer, hf_tiny, named, call_text(PARIS))
    single = constraint(parallel=False)
    assert accepts(ll_tokenizer, hf_tiny, single, call_text(NEWS))
    assert not accepts(ll_tokenizer, hf_tiny, single, call_text(NEWS, PARIS))


def test_none_answers_and_never_calls(ll_tokenizer, hf_tiny):
    so = constraint(tool_choice="none")
    assert accepts(ll_tokenizer, hf_tiny, so, "It is sunny in Paris.", eos=True)
    assert not accepts(ll_tokenizer, hf_tiny, so, "Let me check." + call_text(PARIS))
    assert not accepts(ll_tokenizer, hf_tiny, so, call_text(PARIS))


def test_auto_is_free_unless_a_function_is_strict(ll_tokenizer, hf_tiny):
    assert constraint(tool_choice="auto") is None  # calls parsed, not enforced
    strict = {**SEARCH, "function": {**SEARCH["function"], "strict": True}}
    so = constraint(tools=[WEATHER, strict], tool_choice="auto")
    assert accepts(ll_tokenizer, hf_tiny, so, "No call needed.", eos=True)
    assert accepts(ll_tokenizer, hf_tiny, so, "Checking." + call_text(NEWS))
    assert not accepts(ll_tokenizer, hf_tiny, so, call_text(("search", {"query": "x"})))


def test_response_format_with_tools_answers_in_json_or_calls(ll_tokenizer, hf_tiny):
    fmt = JSONSchemaFormat.model_validate({"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}})
    so = constraint(tool_choice="auto", response_format=fmt)
    assert accepts(ll_tokenizer, hf_tiny, so, '{"ok":true}', eos=True)
    assert accepts(ll_tokenizer, hf_tiny, so, call_text(NEWS))
    assert not accepts(ll_tokenizer, hf_tiny, so, "plain words", eos=True)


def test_thinking_comes_before_the_calls(ll_tokenizer, hf_tiny):
    so = constraint(prompt="<｜Assistant｜><think>")
    assert accepts(ll_tokenizer, hf_tiny, so, "The user wants Paris.</think>" + call_text(PARIS))
    assert not accepts(ll_tokenizer, hf_tiny, so, call_text(PARIS))  # the reasoning must be closed first
    maybe = constraint(prompt="<｜tool▁output▁end｜>")  # a reply that may open its reasoning
    assert accepts(ll_tokenizer, hf_tiny, maybe, call_text(PARIS))
    assert accepts(ll_tokenizer, hf_tiny, maybe, "<think>hmm</think>" + call_text(PARIS))


def test_plain_json_answers_use_the_json_schema_form():
    fmt = JSONSchemaFormat.model_validate(
        {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "integer"}}})
    assert constraint(tools=None, tool_choice="none", response_format=fmt).json_schema == {"type": "integer"}
    assert structured.for_completion(fmt).json_schema == {"type": "integer"}
    assert constraint(tools=None, tool_choice="none") is None


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "strin"}, "Invalid type: strin"),
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "string", "pattern": "(?=a)"}, "look-around"),
        ({"$ref": "#/$defs/missing"}, "does not exist"),
    ],
)
def test_schemas_that_cannot_be_enforced_are_400_naming_why(schema, words):
    fmt = JSONSchemaFormat.model_validate({"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    with pytest.raises(InvalidRequest) as exc:
        constraint(tools=None, tool_choice="none", response_format=fmt)
    assert exc.value.param == "response_format.json_schema.schema" and words in exc.value.message
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    with pytest.raises(InvalidRequest) as exc:
        constraint(tools=[WEATHER, bad_tool])
    assert exc.value.param == "tools[1].function.parameters" and words in exc.value.message


# --------------------------------------------------------------------------------------------- templates

# DeepSeek's templates render tool calls and results but not the tools themselves; this block (put where a
# template writes its system prompt) renders them as DeepSeek-V3.1's model card lays them out, so that
# transformers can render `tools=` with it.
TOOLS_BLOCK = (
    "{%- if tools is defined and tools is not none -%}"
    "{%- set tool_ns = namespace(text='## Tools\\nYou have access to the following tools:\\n') -%}"
    "{%- for tool in tools -%}"
    "{%- set tool_ns.text = tool_ns.text + '\\n### ' + tool['function']['name'] + '\\nDescription: '"
    " + (tool['function']['description'] or '') + '\\n\\nParameters: '"
    " + ((tool['function']['parameters'] or {'type': 'object', 'properties': {}}) | tojson) + '\\n' -%}"
    "{%- endfor -%}"
    "{%- set tool_ns.text = tool_ns.text + '\\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\\n'"
    " + EXAMPLE + '\\n\\nWhere:\\n\\n- `tool_call_name` must be an exact match to one of the available tools\\n'"
    " + '- `tool_call_arguments` must be valid JSON that strictly follows the tool\\'s Parameters Schema\\n'"
    " + '- For multiple tool calls, ' + CHAINING + '\\n' -%}"
    "{%- set ns.system_prompt = ns.system_prompt + '\\n\\n' + tool_ns.text if ns.system_prompt else tool_ns.text -%}"
    "{%- endif -%}"
)


def with_tools_block(template: str, fmt) -> str:
    example = CALLS_BEGIN + fmt.call("tool_call_name", "tool_call_arguments") + "{{additional_tool_calls}}" + CALLS_END
    block = TOOLS_BLOCK.replace("EXAMPLE", json.dumps(example)).replace("CHAINING", json.dumps(fmt.chaining))
    for anchor in ("{{ bos_token }}{{ ns.system_prompt }}", "{{bos_token}}{{ns.system_prompt}}"):
        if anchor in template:
            return template.replace(anchor, block + anchor, 1)
    raise AssertionError("no system prompt in the template")


def model_dir_with_template(src: Path, dst: Path, template: str) -> Path:
    dst.mkdir()
    shutil.copy(src / "tokenizer.json", dst)
    config = json.loads((src / "tokenizer_config.json").read_text())
    (dst / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}, ensure_ascii=False))
    return dst


def our_rendering(model_dir: Path, messages: list[dict], **fields) -> str:
    serving = ChatServing(SimpleNamespace(tokenizer=Tokenizer(model_dir)), "m")
    return serving.render(ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **fields}))[0]


def transformers_rendering(model_dir: Path, messages: list[dict], **kwargs) -> str:
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    return hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


def as_transformers_sends(messages: list[dict]) -> list[dict]:
    """transformers 5 drops the keys whose value is None before rendering, so a template never sees OpenAI's
    `"content": null` beside tool calls (DeepSeek's templates test it with `is none`): "" renders the same."""
    return [{**m, "content": ""} if m.get("content", "") is None else m for m in messages]


@pytest.mark.parametrize("messages", [HISTORY, HISTORY[:2], HISTORY[:5]], ids=["whole", "first-turn", "after-tools"])
def test_tools_render_as_transformers_renders_them(messages, tmp_path):
    """The tools as transformers renders them with a DeepSeek template that supports tools (the embedded
    model's, V3.1's, with the tools in its system prompt as V3.1's model card lays them out): our rendering
    with the model's own template, which does not render tools, is the same text; so is ours of the tool
    template (passed `tools` as transformers passes them)."""
    template = json.loads((TINY / "tokenizer_config.json").read_text())["chat_template"]
    with_tools = model_dir_with_template(TINY, tmp_path / "with-tools", with_tools_block(template, V31))
    expected = transformers_rendering(with_tools, as_transformers_sends(messages), tools=TOOLS)
    assert "## Tools" in expected and "### now\nDescription: \n" in expected
    assert our_rendering(TINY, messages, tools=TOOLS) == expected
    assert our_rendering(with_tools, messages, tools=TOOLS) == expected
    # without tools: the model's own template, as transformers renders it
    assert our_rendering(TINY, messages) == transformers_rendering(TINY, as_transformers_sends(messages))


def test_v3_tools_render_as_transformers_renders_them(deepseek_tokenizer_dir, tmp_path):
    """The same for DeepSeek-V3's template (V3's call format). Its tool-call turns need `content` to be null,
    which transformers 5 cannot pass (see above): those are checked against the V3 format instead."""
    template = json.loads((deepseek_tokenizer_dir / "tokenizer_config.json").read_text())["chat_template"]
    with_tools = model_dir_with_template(deepseek_tokenizer_dir, tmp_path / "with-tools",
                                         with_tools_block(template, V3))
    first_turn = HISTORY[:2]
    expected = transformers_rendering(with_tools, first_turn, tools=TOOLS)
    assert our_rendering(deepseek_tokenizer_dir, first_turn, tools=TOOLS) == expected
    assert our_rendering(with_tools, first_turn, tools=TOOLS) == expected
    text = our_rendering(deepseek_tokenizer_dir, HISTORY, tools=TOOLS)
    assert CALLS_BEGIN + V3.call("get_weather", '{"city": "Paris", "unit": "c"}') + V3.call_sep in text


def test_tool_calls_in_history_render_in_the_models_format():
    text = our_rendering(TINY, HISTORY, tools=TOOLS)
    assert V31.calls([("get_weather", '{"city": "Paris", "unit": "c"}'), ("search", '{"q": "news"}')]) in text
    assert "<｜tool▁output▁begin｜>21 C<｜tool▁output▁end｜>" in text
