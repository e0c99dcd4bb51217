"""The OpenAI API end to end: a real `deepseek-engine serve` on loopback, driven by the official client.

One server for the module (API key required); the offline `LLM` on the same checkpoint is the oracle
for what the server must return.
"""

import json

import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from tests.engine.conftest_server import (  # noqa: F401
    API_KEY,
    CONTRACT_METRICS,
    MODEL_NAME,
    ServerProcess,
    module_servers,
    selected_params,
    tiny_checkpoint,
    tiny_checkpoint_in,
)

HELLO = [{"role": "user", "content": "Hello! Who are you?"}]


def start_servers(session, tmp_path_factory) -> dict[str, ServerProcess]:
    # every API behaviour also with async scheduling (a GPU's default), against the same offline oracle
    key_file = tmp_path_factory.mktemp("secrets") / "api-key"
    key_file.write_text(API_KEY + "\n")
    return {mode: ServerProcess(tiny_checkpoint_in(tmp_path_factory), tmp_path_factory.mktemp("log") / "server.log",
                                "--api-key-file", str(key_file), "--async-scheduling", mode)
            for mode in selected_params(session, __name__, "server")}


@pytest.fixture(scope="module", params=["off", "on"], ids=["sync", "async"])
def server(request):
    proc = module_servers(request).pop(request.param)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(str(tiny_checkpoint), dtype="float32")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


def chat_prompt_ids(llm, messages, **template_kwargs):
    tok = llm.tokenizer
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs))


def greedy(llm, prompt, max_tokens, **kw):
    return llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw))[0]


def sse_events(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


# ------------------------------------------------------------------------------------------------- basics


def test_models_lists_the_served_name(client, llm):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].model_extra["max_model_len"] == llm.engine.max_model_len


def test_chat_matches_offline_generation(client, llm):
    resp = client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=8, temperature=0)
    expected = greedy(llm, chat_prompt_ids(llm, HELLO), 8)
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert resp.model == MODEL_NAME
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert resp.usage.prompt_tokens == len(chat_prompt_ids(llm, HELLO))
    assert resp.usage.completion_tokens == len(expected.token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_chat_text_parts_and_system_roles(client, llm):
    messages = [
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "Hello!"}, {"type": "text", "text": "Who are you?"}]},
    ]
    resp = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0)
    rendered = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello!\nWho are you?"}]
    assert resp.choices[0].message.content == greedy(llm, chat_prompt_ids(llm, rendered), 6).text


def test_chat_stream_is_openai_chunk_format(http, llm):
    body = {"model": MODEL_NAME, "messages": HELLO, "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL_NAME for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:-1])
    *content_chunks, finish, usage = chunks
    assert finish["choices"][0]["delta"] == {} and finish["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in content_chunks)
    assert all(c["usage"] is None for c in content_chunks + [finish])
    expected = greedy(llm, chat_prompt_ids(llm, HELLO), 8)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in content_chunks) == expected.text
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 8
    assert usage["usage"]["prompt_tokens"] == len(chat_prompt_ids(llm, HELLO))


def test_stream_without_usage_has_no_usage_key(http):
    body = {"model": MODEL_NAME, "messages": HELLO, "max_tokens": 3, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        chunks = [json.loads(e) for e in sse_events(r)[:-1]]
    assert chunks and all("usage" not in c for c in chunks)


def test_chat_stream_with_the_official_client(client, llm):
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=HELLO, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    text, reasons, usage = "", [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reasons.append(choice.finish_reason)
    assert text == greedy(llm, chat_prompt_ids(llm, HELLO), 8).text
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
    assert usage.completion_tokens == 8


def test_completions_text_and_token_prompts(client, llm):
    prompt_ids = llm.tokenizer.encode("def add(a, b):")
    expected = greedy(llm, prompt_ids, 6)
    by_text = client.completions.create(model=MODEL_NAME, prompt="def add(a, b):", max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=prompt_ids, max_tokens=6, temperature=0)
    for resp in (by_text, by_ids):
        assert resp.object == "text_completion"
        assert resp.choices[0].text == expected.text
        assert resp.usage.prompt_tokens == len(prompt_ids) and resp.usage.completion_tokens == 6


def test_completions_default_max_tokens_is_16(client):
    resp = client.completions.create(model=MODEL_NAME, prompt="Hello", temperature=0, extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 16 and resp.choices[0].finish_reason == "length"


def test_completions_batch_of_prompts_with_n(client, llm):
    prompts = ["Hello", "The quick brown fox"]
    resp = client.completions.create(model=MODEL_NAME, prompt=prompts, n=2, max_tokens=4, temperature=0)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):
        expected = greedy(llm, llm.tokenizer.encode(prompt), 4).text
        assert resp.choices[2 * i].text == resp.choices[2 * i + 1].text == expected
    assert resp.usage.prompt_tokens == sum(len(llm.tokenizer.encode(p)) for p in prompts)
    assert resp.usage.completion_tokens == 16


def test_completions_stream(client, llm):
    expected = greedy(llm, llm.tokenizer.encode("Hello"), 6)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


# ---------------------------------------------------------------------------------------------- sampling


def test_stop_string_ends_the_text_before_it(client, llm):
    full = greedy(llm, chat_prompt_ids(llm, HELLO), 24).text
    stop = next(full[i : i + 2] for i in range(3, len(full) - 2) if full[i : i + 2].strip())
    resp = client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=24, temperature=0, stop=[stop])
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].message.content == full[: full.index(stop)]
    streamed = client.chat.completions.create(
        model=MODEL_NAME, messages=HELLO, max_tokens=24, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == full[: full.index(stop)]


def test_n_choices_are_distinct_and_counted(client):
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=HELLO, n=3, max_tokens=12, temperature=1.0, seed=7,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert len({c.message.content for c in resp.choices}) > 1
    assert resp.usage.completion_tokens == 36


def test_n_choices_stream(client):
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=HELLO, n=2, max_tokens=5, temperature=1.0, seed=3, stream=True
    )
    finished = {}
    roles = set()
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.role:
                roles.add(choice.index)
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert roles == {0, 1} and set(finished) == {0, 1}


def test_seed_reproduces_and_differs(client):
    def sample(seed):
        return client.chat.completions.create(
            model=MODEL_NAME, messages=HELLO, max_tokens=16, temperature=1.0, top_p=0.95, seed=seed,
        ).choices[0].message.content  # fmt: skip

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(s) != first for s in (1, 2, 3))


def test_chat_logprobs_match_offline(client, llm):
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=HELLO, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    expected = greedy(llm, chat_prompt_ids(llm, HELLO), 5, logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == 5
    for entry, token_id, lps in zip(content, expected.token_ids, expected.logprobs):
        assert entry.token == llm.tokenizer.decode([token_id])
        assert entry.logprob == pytest.approx(lps[token_id], abs=1e-4)
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)  # greedy picks the top


def test_completion_logprobs_format(client):
    resp = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    assert all(v <= 0.0 for v in lp.token_logprobs)


def test_penalties_and_top_k_are_accepted(client):
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=HELLO, max_tokens=4, presence_penalty=0.5, frequency_penalty=0.5,
        extra_body={"top_k": 5}, user="someone",
    )  # fmt: skip
    assert resp.choices[0].finish_reason in ("length", "stop")


def test_cached_tokens_reported_for_a_repeated_prompt(client):
    messages = [{"role": "user", "content": "Kubernetes schedules pods onto nodes. " * 12}]
    first = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2)
    second = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens


def test_thinking_switch_splits_reasoning(client):
    on = client.chat.completions.create(
        model=MODEL_NAME, messages=HELLO, max_tokens=6, temperature=0,
        extra_body={"chat_template_kwargs": {"thinking": True}},
    )  # fmt: skip
    off = client.chat.completions.create(
        model=MODEL_NAME, messages=HELLO, max_tokens=6, temperature=0,
        extra_body={"chat_template_kwargs": {"thinking": False}},
    )  # fmt: skip
    # Thinking on: the prompt ends inside <think>; a reply that never closes it is all reasoning.
    assert on.choices[0].message.model_extra["reasoning_content"]
    assert on.choices[0].message.content == ""
    assert "reasoning_content" not in off.choices[0].message.model_extra
    assert off.choices[0].message.content


def test_thinking_stream_sends_reasoning_deltas(client):
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=HELLO, max_tokens=6, temperature=0, stream=True,
        extra_body={"chat_template_kwargs": {"thinking": True}},
    )  # fmt: skip
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    assert not "".join(d.content or "" for d in deltas)


# -------------------------------------------------------------------------------------------------- errors


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize(
    ("payload", "param", "words"),
    [
        ({"logit_bias": {"1": 2}, "functions": []}, "logit_bias", "logit_bias, functions"),
        ({"temperature": "hot"}, "temperature", "valid number"),
        ({"max_tokens": True}, "max_tokens", "valid integer"),
        ({"n": 0}, "n", "greater than or equal to 1"),
        ({"top_p": 0}, "top_p", "greater than 0"),
        ({"messages": []}, "messages", "at least 1 item"),
        ({"messages": [{"role": "function", "content": "x"}]}, "messages[0]", "'function'"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "Field required"),
        ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages[0].name", "messages[0].name"),
        ({"top_logprobs": 2}, "top_logprobs", "requires logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream"),
        ({"stop": [""]}, "stop", "non-empty"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs", "template"),
    ],
)
def test_invalid_chat_requests_are_400_naming_the_problem(http, payload, param, words):
    body = {"model": MODEL_NAME, "messages": HELLO, "max_tokens": 2, **payload}
    error = error_of(http.post("/v1/chat/completions", json=body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert words in error["message"]


def test_tools_for_a_template_that_writes_no_calls_are_400(http):
    # the random checkpoint's template renders no tool calls (and its tokenizer has no tool tokens)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"model": MODEL_NAME, "messages": HELLO, "tools": [tool]}
    error = error_of(http.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == "tools" and "no tool-call format" in error["message"]


def test_response_format_on_any_model(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "ok", "schema": schema}}
    for seed in range(3):
        resp = client.chat.completions.create(model=MODEL_NAME, messages=HELLO, response_format=fmt, seed=seed)
        assert resp.choices[0].finish_reason == "stop" and json.loads(resp.choices[0].message.content) in (
            {"ok": True}, {"ok": False})


def test_image_content_is_400_no_vision(http):
    content = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}]}
    error = error_of(http.post("/v1/chat/completions", json=body), 400)
    assert "no vision input" in error["message"] and error["param"] == "messages[0].content[1]"


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        ({"echo": True}, "echo"),
        ({"suffix": "x"}, "suffix"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [10**9]}, "prompt token ids"),
        ({"logprobs": 21}, "logprobs"),
    ],
)
def test_invalid_completion_requests_are_400(http, payload, words):
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2, **payload}
    error = error_of(http.post("/v1/completions", json=body), 400)
    assert words in error["message"] or error["param"] == words


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"{not json", "not valid JSON"),
        (b"", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'"text"', "must be a JSON object"),
        (b"\xff\xfe", "not valid JSON"),
    ],
)
def test_malformed_bodies_are_400_never_500(http, content, message):
    for path in ("/v1/chat/completions", "/v1/completions"):
        error = error_of(http.post(path, content=content, headers={"Content-Type": "application/json"}), 400)
        assert message in error["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL_NAME, "messages": "hi"}, "messages"),
        ({"model": 5, "messages": HELLO}, "model"),
        ({"messages": HELLO}, "model"),
        ({"model": MODEL_NAME, "messages": [{"role": "user"}]}, "messages[0].content"),
        ({"model": MODEL_NAME, "messages": [{"role": "user", "content": [{"type": "audio"}]}]},
         "messages[0].content[0]"),  # fmt: skip
        ({"model": MODEL_NAME, "messages": HELLO, "stream": "yes"}, "stream"),
        ({"model": MODEL_NAME, "messages": HELLO, "seed": 2**70}, "seed"),
        ({"model": MODEL_NAME, "messages": HELLO, "stop": [1, 2]}, "stop[0]"),
        ({"model": MODEL_NAME, "messages": HELLO, "chat_template_kwargs": []}, "chat_template_kwargs"),
    ],
)
def test_wrong_types_are_400_naming_the_field(http, body, param):
    error = error_of(http.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == param and param in error["message"]


def test_context_length_exceeded(client, http, llm):
    limit = llm.engine.max_model_len
    body = {"model": MODEL_NAME, "messages": HELLO, "max_tokens": limit}
    error = error_of(http.post("/v1/chat/completions", json=body), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert str(limit) in error["message"]
    long_prompt = list(range(10, 20)) * (limit // 10 + 1)
    error = error_of(http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": long_prompt}), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL_NAME, prompt=long_prompt)
    assert exc.value.code == "context_length_exceeded"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-4o", messages=HELLO)
    assert exc.value.code == "model_not_found" and exc.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="x")


def test_wrong_or_missing_api_key_is_401(server):
    for key in ("wrong", ""):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        body = {"model": MODEL_NAME, "messages": HELLO}
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers)
        error = error_of(r, 401)
        assert error["code"] == "invalid_api_key"
        assert error_of(httpx.get(f"{server.url}/v1/models", headers=headers), 401)
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL_NAME, messages=HELLO)


def test_unknown_route_and_method_use_the_error_body(http):
    assert error_of(http.get("/v1/nothing"), 404)
    assert error_of(http.get("/v1/chat/completions"), 405)


# -------------------------------------------------------------------------------------------- operations


def test_probes_are_open_without_a_key(server):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/ready").json() == {"status": "ready"}


def test_metrics_are_exactly_the_contract(server, client):
    client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=3)
    r = httpx.get(f"{server.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {line.split()[2] for line in r.text.splitlines() if line.startswith("# TYPE")}
    assert families == CONTRACT_METRICS
    samples = server.metrics()
    assert 'deepseek_engine_prefix_cache_hit_tokens_total{source="local"}' in samples
    assert 'deepseek_engine_prefix_cache_hit_tokens_total{source="remote"}' in samples
    assert samples["deepseek_engine_generation_tokens_total"] >= 3
    assert samples["deepseek_engine_prompt_tokens_total"] > 0
    assert samples['deepseek_engine_requests_total{finish_reason="length"}'] >= 1
    assert samples["deepseek_engine_time_to_first_token_seconds_count"] >= 1
    assert not any(name.endswith("_created") for name in samples)


def test_each_finished_request_logs_one_line(server, client):
    resp = client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=3)
    lines = [line for line in server.log().splitlines() if f"request {resp.id}-0 finished" in line]
    assert len(lines) == 1
    for field in ("prompt_tokens=", "cached_tokens=", "ttft=", "prefill=", "decode="):
        assert field in lines[0]
