"""The server's pure parts: reasoning split, output merging, metrics exposition, request log, flags."""

import argparse
import asyncio
import pickle

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.metrics import EngineMetrics
from engine.outputs import RequestMetrics, RequestOutput
from engine.server.engine_messages import Delta, OutputBuilder
from engine.server.launch import add_serve_args, engine_config, settings_from_args
from engine.server.reasoning import ReasoningParser
from engine.server.request_log import summarize
from engine.server.request_stream import RequestStream
from tests.engine.conftest_server import CONTRACT_METRICS

# ---------------------------------------------------------------------------------------------- reasoning


def split_all(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    reasoning = content = ""
    for piece in pieces:
        r, c = parser.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    return reasoning + r, content + c


def every_split(text: str) -> list[list[str]]:
    """The text cut into single characters, and into two pieces at every position."""
    return [list(text)] + [[text[:i], text[i:]] for i in range(len(text) + 1)]


@pytest.mark.parametrize(
    ("prompt_tail", "text", "expected"),
    [
        ("<｜Assistant｜><think>", "weigh options</think>\n\nThe answer.", ("weigh options", "The answer.")),
        ("<｜Assistant｜><think>\n", "still thinking <thi", ("still thinking <thi", "")),
        ("<｜Assistant｜>", "<think>plan</think>Done", ("plan", "Done")),
        ("<｜Assistant｜>", "  <think>plan</think> Done", ("plan", "Done")),
        ("<｜Assistant｜>", "No thinking at all, a < b.", ("", "No thinking at all, a < b.")),
        ("<｜Assistant｜>", "<thin", ("", "<thin")),
        ("<｜Assistant｜><think>", "a</think>b</think>c", ("a", "b</think>c")),
    ],
)
def test_reasoning_split_whatever_the_chunking(prompt_tail, text, expected):
    for pieces in every_split(text):
        parser = ReasoningParser.for_prompt("<｜User｜>hi" + prompt_tail)
        assert split_all(parser, pieces) == expected, pieces


def test_thinking_off_prompt_needs_no_parser():
    assert ReasoningParser.for_prompt("<｜User｜>hi<｜Assistant｜></think>") is None


def test_parser_reports_whether_it_saw_reasoning():
    parser = ReasoningParser.for_prompt("<｜Assistant｜>")
    split_all(parser, ["plain answer"])
    assert not parser.saw_reasoning
    parser = ReasoningParser.for_prompt("<｜Assistant｜>")
    split_all(parser, ["<think>x</think>y"])
    assert parser.saw_reasoning


# ------------------------------------------------------------------------------------------ request stream


def output(request_id: str, token_ids: list[int], new: list[int], finished: bool = False) -> RequestOutput:
    text = "".join(f"<{t}>" for t in token_ids)
    return RequestOutput(
        request_id=request_id, prompt_token_ids=[1, 2, 3], token_ids=token_ids, text=text, logprobs=None,
        finished=finished, finish_reason="length" if finished else None, num_cached_tokens=0,
        new_token_ids=new, new_text="".join(f"<{t}>" for t in new),
    )  # fmt: skip


def step(builder: OutputBuilder, new: list[int], finished: bool = False) -> OutputBuilder:
    """One engine step's delta for `builder`'s request, through the pipe's encoding."""
    token_ids = builder.token_ids + new
    delta = Delta.of(output(builder.request_id, token_ids, new, finished))
    return builder.add(Delta._make(pickle.loads(pickle.dumps(tuple(delta)))))


async def test_a_slow_reader_gets_outputs_merged_not_queued():
    closed = []
    stream = RequestStream("req", 2, closed.append)
    first, second = OutputBuilder("req-0", [1, 2, 3], False), OutputBuilder("req-1", [1, 2, 3], False)
    for t in range(100):  # 100 engine steps before the reader looks once
        stream.put(0, step(first, [t], finished=t == 99))
    stream.put(1, step(second, [7], finished=True))
    assert len(stream._pending) == 2  # one merged output per choice, however far behind
    batches = [batch async for batch in stream]
    assert len(batches) == 1
    merged = batches[0][0]
    assert merged.new_token_ids == list(range(100)) and merged.token_ids == list(range(100))
    assert merged.new_text == merged.text and merged.finished
    assert batches[0][1].token_ids == [7]
    stream.close()
    stream.close()
    assert closed == [stream]  # close is idempotent


async def test_each_read_gets_what_came_since_the_last_once():
    stream = RequestStream("req", 1, lambda s: None)
    builder = OutputBuilder("req-0", [1, 2, 3], False)
    reader = stream.__aiter__()
    stream.put(0, step(builder, [5]))
    stream.put(0, step(builder, [6]))
    batch = await reader.__anext__()
    assert batch[0].new_token_ids == [5, 6] and batch[0].new_text == "<5><6>"
    stream.put(0, step(builder, [7], finished=True))
    batch = await reader.__anext__()
    # the tokens of the earlier read are not repeated; the cumulative fields keep everything
    assert batch[0].new_token_ids == [7] and batch[0].new_text == "<7>"
    assert batch[0].token_ids == [5, 6, 7] and batch[0].text == "<5><6><7>" and batch[0].finished
    with pytest.raises(StopAsyncIteration):
        await reader.__anext__()


async def test_stream_raises_the_failure_and_admission_refusal():
    stream = RequestStream("req", 1, lambda s: None)
    stream.admit(ValueError("prompt too long"))
    with pytest.raises(ValueError, match="prompt too long"):
        await stream.admitted()
    assert stream.finished
    stream = RequestStream("req", 1, lambda s: None)
    stream.admit(None)
    await stream.admitted()
    stream.put(0, step(OutputBuilder("req-0", [1, 2, 3], False), [1]))
    stream.fail(RuntimeError("engine died"))
    with pytest.raises(RuntimeError, match="engine died"):
        async for _ in stream:
            pass


async def test_cancelled_admission_wait_closes_the_stream():
    closed = []
    stream = RequestStream("req", 1, closed.append)
    waiter = asyncio.ensure_future(stream.admitted())
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert closed == [stream]


# ------------------------------------------------------------------------------------------ engine pipe


def test_only_deltas_cross_the_pipe_and_outputs_are_rebuilt():
    steps = [([5], "<5>"), ([6, 7], "<6><7>"), ([8], "<8>")]
    builder = OutputBuilder("r-0", [1, 2, 3], want_logprobs=True)
    token_ids, logprobs, rebuilt = [], [], []
    for i, (new, text) in enumerate(steps):
        token_ids += new
        logprobs += [{t: -0.5} for t in new]
        engine_out = output("r-0", list(token_ids), new, finished=i == len(steps) - 1)
        engine_out.logprobs, engine_out.new_text = list(logprobs), text
        delta = Delta.of(engine_out)
        assert delta.new_token_ids == new and delta.new_logprobs == [{t: -0.5} for t in new]
        builder.add(Delta._make(pickle.loads(pickle.dumps(tuple(delta)))))
        rebuilt.append(builder.output())
    assert [o.token_ids for o in rebuilt] == [[5], [5, 6, 7], [5, 6, 7, 8]]  # snapshots, not one live list
    assert rebuilt[-1].text == "<5><6><7><8>" and rebuilt[-1].logprobs == [{t: -0.5} for t in (5, 6, 7, 8)]
    assert rebuilt[-1].finished and rebuilt[-1].prompt_token_ids == [1, 2, 3]


# ------------------------------------------------------------------------------------------------- metrics


def test_metrics_exposition_is_exactly_the_contract():
    metrics = EngineMetrics()
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    names = {f"{name}_total" if f.type == "counter" else name for name, f in families.items()}
    assert names == CONTRACT_METRICS
    text = metrics.render().decode()
    assert 'source="local"' in text and 'source="remote"' in text
    for reason in ("stop", "length", "abort"):
        assert f'finish_reason="{reason}"' in text
    assert "_created" not in text


def sample(metrics: EngineMetrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels or None)


def test_metrics_observe_a_request_lifecycle():
    metrics = EngineMetrics()
    m = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.1, first_token_time=100.5)
    first = output("a", [5], [5])
    first.num_cached_tokens, first.num_remote_cached_tokens, first.metrics = 5, 3, m
    metrics.observe_outputs([first], now=100.5)
    metrics.observe_outputs([output("a", [5, 6], [6])], now=100.6)
    last = output("a", [5, 6, 7, 8], [7, 8], finished=True)
    last.metrics = m
    metrics.observe_outputs([last], now=101.0)
    metrics.set_queue(num_waiting=3, num_running=1, kv_cache_usage=0.25)
    assert sample(metrics, "deepseek_engine_prompt_tokens_total") == 3
    assert sample(metrics, "deepseek_engine_generation_tokens_total") == 4
    assert sample(metrics, "deepseek_engine_prefix_cache_hit_tokens_total", source="local") == 2
    assert sample(metrics, "deepseek_engine_prefix_cache_hit_tokens_total", source="remote") == 3
    assert sample(metrics, "deepseek_engine_time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert sample(metrics, "deepseek_engine_inter_token_latency_seconds_count") == 3
    assert sample(metrics, "deepseek_engine_inter_token_latency_seconds_sum") == pytest.approx(0.1 + 0.4)
    assert sample(metrics, "deepseek_engine_request_duration_seconds_sum") == pytest.approx(1.0)
    assert sample(metrics, "deepseek_engine_requests_total", finish_reason="length") == 1
    assert sample(metrics, "deepseek_engine_requests_waiting") == 3
    assert sample(metrics, "deepseek_engine_kv_cache_usage") == 0.25
    metrics.observe_abort("b")
    assert sample(metrics, "deepseek_engine_requests_total", finish_reason="abort") == 1


def test_kv_reuse_adds_its_counters_and_only_then():
    names = lambda m: {f.name for f in text_string_to_metric_families(m.render().decode())}  # noqa: E731
    kv = {"deepseek_engine_kv_transfer_bytes", "deepseek_engine_kv_pull_fallbacks", "deepseek_engine_kv_directory_up"}
    assert not names(EngineMetrics()) & kv
    metrics = EngineMetrics(kv_reuse=True)
    assert kv <= names(metrics)
    metrics.set_kv(4096, {"checksum": 2}, directory_up=False)
    assert sample(metrics, "deepseek_engine_kv_transfer_bytes_total") == 4096
    assert sample(metrics, "deepseek_engine_kv_pull_fallbacks_total", reason="checksum") == 2
    assert sample(metrics, "deepseek_engine_kv_directory_up") == 0


def test_request_summary_line():
    out = output("chatcmpl-1-0", list(range(11)), [10], finished=True)
    out.num_cached_tokens = 1
    out.metrics = RequestMetrics(
        arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0, finished_time=12.0, num_prefill_tokens=2
    )
    assert summarize(out) == (
        "request chatcmpl-1-0 finished (length): prompt_tokens=3 cached_tokens=1 generated_tokens=11 "
        "ttft=1.000s prefill=4.0 tok/s decode=10.0 tok/s"
    )


# --------------------------------------------------------------------------------------------------- flags


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="serve")
    add_serve_args(parser)
    return parser


def test_flag_defaults_serve_the_embedded_model():
    args = serve_parser().parse_args([])
    assert (args.model, args.port, args.kv_transfer_port, args.kv_transport) == ("deepseek-tiny", 8000, 8100, "auto")
    settings = settings_from_args(args)
    assert settings.served_model_name == "deepseek-tiny" and settings.api_key is None


def test_every_flag_reads_its_environment_variable(monkeypatch, tmp_path):
    key = tmp_path / "key"
    key.write_text("secret\n")
    env = {
        "MODEL": str(tmp_path), "SERVED_MODEL_NAME": "v3", "PORT": "9000", "HOST": "127.0.0.1",
        "TENSOR_PARALLEL_SIZE": "1", "MAX_MODEL_LEN": "8192", "REPLICA_ID": "pod-0", "ADVERTISE_HOST": "10.0.0.7",
        "KV_DIRECTORY": "redis://dir:6379/0", "KV_TRANSPORT": "rdma", "KV_TRANSFER_PORT": "8101",
        "API_KEY_FILE": str(key), "MAX_WAITING_REQUESTS": "32", "MAX_NUM_SEQS": "8", "DRAIN_TIMEOUT": "12.5",
        "DTYPE": "bfloat16", "KV_MIN_PREFIX_TOKENS": "32", "KV_PULL_POLICY": "never", "KV_TRANSFER_STREAMS": "3",
        "ASYNC_SCHEDULING": "off", "MAX_NUM_BATCHED_TOKENS": "512", "ENABLE_EXPERT_PARALLEL": "true",
        "NNODES": "2", "NODE_RANK": "1", "DIST_INIT_ADDR": "leader:29500", "GPU_MEMORY_UTILIZATION": "0.8",
        "KV_CACHE_MEMORY": "2GiB", "NUM_GPU_BLOCKS_OVERRIDE": "64", "KV_SECRET_FILE": str(tmp_path / "kv-secret"),
        "ENGINE_HEARTBEAT_TIMEOUT": "4", "MAX_REQUEST_BODY_SIZE": "1MiB",
        "SPECULATIVE_CONFIG": '{"method": "mtp", "num_speculative_tokens": 2}', "ENABLE_IMAGE_URLS": "true",
        "ENGRAM_TABLES": "host",
        "IMAGE_FETCH_TIMEOUT": "3", "MAX_IMAGE_SIZE": "2MiB", "MAX_IMAGE_PIXELS": "1000000", "MAX_IMAGES_PER_REQUEST": "4",
        "LOAD_FORMAT": "dummy", "KV_CACHE_DTYPE": "fp8", "NUM_WINDOW_PAGES": "96", "PREFILL_GRAPH_TOKENS": "0",
        "BLOCK_SIZE": "64",
    }  # fmt: skip
    (tmp_path / "kv-secret").write_text("0123456789abcdef0123456789abcdef\n")
    env["TENSOR_PARALLEL_SIZE"] = "4"
    for name, value in env.items():
        monkeypatch.setenv(f"DEEPSEEK_ENGINE_{name}", value)
    parser = serve_parser()
    flags = {a.option_strings[0] for a in parser._actions if a.option_strings and a.dest != "help"}
    assert flags == {"--" + name.lower().replace("_", "-") for name in env}  # no flag without its variable
    args = parser.parse_args([])
    assert (args.port, args.max_model_len, args.drain_timeout, args.kv_transport) == (9000, 8192, 12.5, "rdma")
    s = settings_from_args(args)
    assert (s.served_model_name, s.api_key, s.max_waiting_requests) == ("v3", "secret", 32)
    assert (s.engine_silence_timeout, s.max_body_bytes) == (4.0, 2**20)
    assert (s.images.fetch_urls, s.images.fetch_timeout) == (True, 3.0)
    assert (s.images.limits.max_bytes, s.images.limits.max_pixels, s.images.limits.max_images) == (2 << 20, 10**6, 4)
    c = engine_config(args)
    assert (c.model, c.dtype, c.max_model_len, c.max_num_seqs) == (str(tmp_path), "bfloat16", 8192, 8)
    assert c.load_format == "dummy" and c.kv_cache_dtype == "fp8"
    assert c.num_speculative_tokens == 2
    assert (c.replica_id, c.advertise_host, c.kv_directory, c.kv_transport, c.kv_transfer_port) == (
        "pod-0", "10.0.0.7", "redis://dir:6379/0", "rdma", 8101,
    )  # fmt: skip
    assert (c.kv_min_prefix_tokens, c.kv_pull_policy, c.kv_transfer_streams) == (32, "never", 3)
    assert c.async_scheduling == "off" and c.engram_tables == "host"
    assert (c.tensor_parallel_size, c.enable_expert_parallel, c.max_num_batched_tokens) == (4, True, 512)
    assert (c.nnodes, c.node_rank, c.dist_init_addr, c.ranks_per_node) == (2, 1, "leader:29500", 2)
    assert (c.gpu_memory_utilization, c.kv_cache_memory, c.num_kv_blocks) == (0.8, 2 * 2**30, 64)
    assert c.num_window_pages == 96 and c.prefill_graph_tokens == 0 and c.block_size == 64
    assert c.kv_secret == b"0123456789abcdef0123456789abcdef" and b"0123" not in repr(c).encode()
    assert parser.parse_args(["--port", "9100"]).port == 9100  # the command line wins
    assert parser.parse_args(["--async-scheduling"]).async_scheduling == "on"  # a bare flag, as vLLM's


@pytest.mark.parametrize(
    ("name", "value", "words"),
    [("PORT", "eighty", "DEEPSEEK_ENGINE_PORT"), ("KV_TRANSPORT", "carrier-pigeon", "choose from"),
     ("MAX_NUM_SEQS", "0", "must be >= 1")],
)  # fmt: skip
def test_bad_environment_values_are_clear_errors(monkeypatch, capsys, name, value, words):
    monkeypatch.setenv(f"DEEPSEEK_ENGINE_{name}", value)
    with pytest.raises(SystemExit):
        serve_parser()
    assert words in capsys.readouterr().err


def test_empty_or_missing_api_key_file_is_an_error(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for path in (empty, tmp_path / "missing"):
        with pytest.raises(SystemExit, match="api-key-file"):
            settings_from_args(serve_parser().parse_args(["--api-key-file", str(path)]))


def test_metrics_forget_a_request_whose_client_left():
    """A client gone after its last token but before the engine's final report: its inter-token state
    goes with it (it used to stay forever)."""
    import time

    from engine.metrics import EngineMetrics
    from engine.outputs import RequestMetrics, RequestOutput
    from engine.server.async_engine import AsyncEngine

    metrics = EngineMetrics(kv_reuse=False)
    engine = AsyncEngine(lambda: None, (), metrics, load_tokenizer=lambda path: None)
    out = RequestOutput(request_id="r-0", prompt_token_ids=[1], token_ids=[5], text="", logprobs=None,
                        finished=False, finish_reason=None, num_cached_tokens=0, new_token_ids=[5], new_text="",
                        metrics=RequestMetrics(arrival_time=time.monotonic()))
    metrics.observe_outputs([out])
    assert "r-0" in metrics._last_token_time
    engine._routes["r-0"], engine._builders["r-0"] = (None, 0), None
    engine._forget("r-0")  # what the stream's close does when its client leaves
    assert metrics._last_token_time == {}
