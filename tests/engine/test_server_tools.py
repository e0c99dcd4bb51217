"""Tool calling and structured outputs end to end: the official client against a real `deepseek-engine serve`
of the embedded deepseek-tiny. The model was never trained on tools; constrained decoding is what makes its
calls and JSON valid, so every assertion here is about the path, not the model's judgement."""

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from engine.server.tool_format import MARKERS
from tests.engine.conftest_server import MODEL_NAME, ServerProcess, module_servers

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 24},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "maxLength": 32}, "limit": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 10}},
            "required": ["query"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, SEARCH]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {"type": "array", "items": {"enum": ["en", "fr", "de"]}, "maxItems": 3},
        "retired": {"type": "boolean"},
    },
    "required": ["name", "age", "languages", "retired"],
    "additionalProperties": False,
}
DESCRIBE = [{"role": "user", "content": "Describe a person."}]
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


def start_servers(session, tmp_path_factory) -> dict[str, ServerProcess]:
    return {"server": ServerProcess(Path("deepseek-tiny"), tmp_path_factory.mktemp("log") / "server.log")}


@pytest.fixture(scope="module")
def server(request):
    proc = module_servers(request).pop("server")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def for_each_seed(seeds, ask):
    """`ask(seed)` for every seed at once, results in seed order: the server batches them (a seeded request
    draws the same tokens whatever shares its batch), where one after another each decoded alone."""
    seeds = list(seeds)
    with ThreadPoolExecutor(len(seeds)) as pool:
        return list(pool.map(ask, seeds))


def check_call(call) -> dict:
    """A call as OpenAI shapes it, whose arguments are JSON that its function's schema validates."""
    assert call.id.startswith("call_") and call.type == "function"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


def no_markers(text: str | None) -> None:
    assert not any(m in (text or "") for m in MARKERS), text


def answer_after(client, messages, message, **kw):
    """Runs the calls of `message` (fake results) and asks again: the conversation's next turn."""
    history = [*messages, message.model_dump(exclude_none=True)]
    history += [{"role": "tool", "tool_call_id": c.id, "content": json.dumps({"ok": True, "for": c.function.name})}
                for c in message.tool_calls]
    return client.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, temperature=0,
                                          max_tokens=24, **kw)


# -------------------------------------------------------------------------------------------- tool calls


@pytest.mark.parametrize("seed", range(5))
def test_required_call_round_trips(client, seed):
    resp = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                          temperature=1, seed=seed, max_tokens=200)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        check_call(call)
    assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)
    # the results go back as tool messages; the model answers (the engine decides what it writes)
    answer = answer_after(client, ASK, choice.message)
    assert answer.choices[0].finish_reason in ("stop", "length") and not answer.choices[0].message.tool_calls
    no_markers(answer.choices[0].message.content)


def test_named_call_streams_as_openai_deltas(client):
    named = {"type": "function", "function": {"name": "search"}}
    stream = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice=named,
                                            parallel_tool_calls=False, seed=1, max_tokens=200, stream=True)
    deltas, content, reasons = [], "", []
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            deltas += choice.delta.tool_calls or []
            reasons.append(choice.finish_reason)
    no_markers(content)
    assert content == "" and reasons[-1] == "tool_calls" and set(reasons[:-1]) == {None}
    first, rest = deltas[0], deltas[1:]
    assert (first.index, first.type, first.function.name) == (0, "function", "search") and first.id.startswith("call_")
    assert all(d.index == 0 and d.id is None and d.type is None and d.function.name is None for d in rest)
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), SCHEMAS["search"])


def test_streamed_call_round_trips_through_the_sdks_accumulator(client):
    with client.chat.completions.stream(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                        seed=2, max_tokens=200) as stream:
        final = stream.get_final_completion()
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls" and message.tool_calls
    for call in message.tool_calls:
        check_call(call)
    # the accumulated message goes back as it is (with the `index` the accumulator leaves on each call)
    history = [*ASK, message.model_dump(exclude_none=True),
               *({"role": "tool", "tool_call_id": c.id, "content": "21 C"} for c in message.tool_calls)]
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, temperature=0,
                                                 max_tokens=24, stream=True))
    assert not any(c.delta.tool_calls for chunk in chunks for c in chunk.choices)
    no_markers("".join(c.delta.content or "" for chunk in chunks for c in chunk.choices))


def test_parallel_tool_calls_false_makes_exactly_one_call(client):
    replies = for_each_seed(range(6), lambda seed: client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=1,
        seed=seed, max_tokens=200))
    for resp in replies:
        calls = resp.choices[0].message.tool_calls
        assert len(calls) == 1 and resp.choices[0].finish_reason == "tool_calls"
        check_call(calls[0])


def test_n_choices_each_call(client):
    resp = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                          n=3, seed=7, max_tokens=200)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            check_call(call)


def test_a_call_cut_short_is_length_with_its_arguments_so_far(client):
    choice = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                            seed=0, max_tokens=6).choices[0]
    assert choice.finish_reason == "length"
    for call in choice.message.tool_calls or []:
        assert call.function.name in SCHEMAS and call.function.arguments.startswith("{")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_tool_choice_none_never_calls(client, stream):
    def ask(seed):
        kw = dict(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="none", temperature=1.5, seed=seed,
                  max_tokens=48)
        if stream:
            chunks = list(client.chat.completions.create(**kw, stream=True))
            assert not any(c.delta.tool_calls for ch in chunks for c in ch.choices)
            content = "".join(c.delta.content or "" for ch in chunks for c in ch.choices)
            reason = [c.finish_reason for ch in chunks for c in ch.choices][-1]
        else:
            choice = client.chat.completions.create(**kw).choices[0]
            assert choice.message.tool_calls is None
            content, reason = choice.message.content, choice.finish_reason
        return content, reason

    for content, reason in for_each_seed(range(8), ask):
        assert reason in ("stop", "length")
        no_markers(content)


def test_auto_with_a_strict_function_calls_validly_or_answers(client):
    strict = {**SEARCH, "function": {**SEARCH["function"], "strict": True}}
    replies = for_each_seed(range(4), lambda seed: client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=[strict], temperature=1, seed=seed, max_tokens=200))
    for choice in (resp.choices[0] for resp in replies):
        no_markers(choice.message.content)
        for call in choice.message.tool_calls or []:
            check_call(call)
        assert choice.finish_reason == ("tool_calls" if choice.message.tool_calls else choice.finish_reason)


# ------------------------------------------------------------------------------------ structured outputs


def test_strict_json_schema_always_validates(client):
    replies = for_each_seed(range(20), lambda seed: client.chat.completions.create(
        model=MODEL_NAME, messages=DESCRIBE, response_format=PERSON_FORMAT, temperature=1, seed=seed))
    for resp in replies:
        choice = resp.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_schema_streams(client):
    stream = client.chat.completions.create(model=MODEL_NAME, messages=DESCRIBE,
                                            response_format=PERSON_FORMAT, seed=3, stream=True)
    text = "".join(c.delta.content or "" for chunk in stream for c in chunk.choices)
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object(client):
    replies = for_each_seed(range(4), lambda seed: client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "In JSON?"}], response_format={"type": "json_object"},
        temperature=0.7, seed=seed, max_tokens=300))
    for choice in (resp.choices[0] for resp in replies):
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:  # cut at max_tokens: a JSON prefix
            assert choice.message.content.startswith("{")


def test_completions_take_response_format(client):
    replies = for_each_seed(range(5), lambda seed: client.completions.create(
        model=MODEL_NAME, prompt="A person:", max_tokens=200, temperature=1, seed=seed,
        extra_body={"response_format": PERSON_FORMAT}))
    for resp in replies:
        assert resp.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(resp.choices[0].text), PERSON)


# ------------------------------------------------------------------------------------------------ errors


def error_of(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return error


def with_params(tool, **parameters):
    return {**tool, "function": {**tool["function"], "parameters": parameters}}


@pytest.mark.parametrize(
    ("payload", "param", "words"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
         "response_format.json_schema.schema", "Invalid type: strin"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "array", "uniqueItems": True}}}}, "response_format.json_schema.schema", "uniqueItems"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "string", "pattern": "(?<=a)b"}}}}, "response_format.json_schema.schema", "look-around"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema", "Field required"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "has space", "schema": {}}}},
         "response_format.json_schema.name", "pattern"),
        ({"response_format": {"type": "xml"}}, "response_format", "'json_schema'"),
        ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema", "Unsupported"),
        ({"tools": [with_params(WEATHER, type="object", **{"if": {}, "then": {}})], "tool_choice": "required"},
         "tools[0].function.parameters", "Unimplemented keys"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "delete_everything"}}},
         "tool_choice", "delete_everything"),
        ({"tool_choice": "required"}, "tool_choice", "requires tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", '"required"'),
        ({"tools": [WEATHER, WEATHER]}, "tools", "repeated: get_weather"),
        ({"tools": []}, "tools", "at least 1"),
        ({"tools": [{"type": "function", "function": {"name": "no spaces allowed"}}]}, "tools[0].function.name",
         "pattern"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type", "'function'"),
        ({"tools": [with_params(WEATHER)], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
        ({"messages": [*ASK, {"role": "assistant"}]}, "messages[1]", "content or tool_calls"),
        ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {
            "name": "f", "arguments": {"a": 1}}}]}]}, "messages[1].tool_calls[0].function.arguments", "string"),
        ({"messages": [*ASK, {"role": "tool", "content": "21 C"}]}, "messages[1].tool_call_id", "Field required"),
        ({"functions": [{"name": "f"}]}, "functions", "Unsupported parameter"),
    ],
)
def test_invalid_tools_and_formats_are_400_naming_the_problem(http, payload, param, words):
    body = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 4, **payload}
    error = error_of(http.post("/v1/chat/completions", json=body))
    assert error["param"] == param and words in error["message"], error


def test_completions_have_no_tools_and_check_their_schemas(http):
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 4}
    error = error_of(http.post("/v1/completions", json={**body, "tools": TOOLS}))
    assert error["param"] == "tools" and "Unsupported parameter" in error["message"]
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}}
    error = error_of(http.post("/v1/completions", json={**body, "response_format": bad}))
    assert error["param"] == "response_format.json_schema.schema" and '"not"' in error["message"]
