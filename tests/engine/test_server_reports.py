"""The engine process's reports to the server (held while the server is behind, read in one go) and the
stream chunks written without pydantic."""

import json
import threading
from multiprocessing import Pipe

import pytest

from engine.outputs import RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams
from engine.server.engine_messages import AddRequests, Delta, Report, Stop
from engine.server.engine_process import EngineLoop
from engine.server.protocol import ChatChunkChoice, ChatCompletionChunk, ChatDelta, Completion, CompletionChoice
from engine.server.report_pipe import ReportReader, ReportWriter
from engine.server.sse import ChunkFrames, sse


def pipe() -> tuple[ReportReader, ReportWriter]:
    reader, writer = Pipe(duplex=False)
    return ReportReader(reader), ReportWriter(writer)


def read_reports(reader: ReportReader) -> list[Report]:
    messages, _ = reader.read()
    return [Report.unpack(fields) for batch in messages for fields in batch]


def test_reports_wait_while_the_server_is_behind_and_arrive_once_in_order():
    reader, writer = pipe()
    reports = [Report(time=float(i), num_waiting=0, num_running=1, kv_cache_usage=0.0) for i in range(50)]
    got = []
    for i, report in enumerate(reports):
        writer.add(report.pack())
        writer.flush()
        if i % 10 == 9:  # the server's event loop reads now and then
            got += read_reports(reader)
    writer.flush(force=True)
    got += read_reports(reader)
    assert [r.time for r in got] == [r.time for r in reports]
    # the first report, then one message after each of the server's 5 reads: not one per report
    assert writer.num_writes == 6


def test_the_engine_never_blocks_on_a_server_that_does_not_read():
    reader, writer = pipe()
    text = "x" * 1000

    def engine() -> None:  # far more than a pipe's buffer (64 KiB)
        for i in range(1000):
            writer.add(Report(time=float(i), num_waiting=0, num_running=1, kv_cache_usage=0.0,
                              deltas=[("r", [i], text, None, False, None, 0, 0, None)]).pack())
            writer.flush()

    thread = threading.Thread(target=engine, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    got = read_reports(reader)
    writer.flush(force=True)
    got += read_reports(reader)
    assert [r.deltas[0][1] for r in got] == [[i] for i in range(1000)]


def test_a_message_larger_than_the_pipe_arrives_whole():
    reader, writer = pipe()
    big = [("r", list(range(50_000)), "y" * 200_000, None, False, None, 0, 0, None)]
    thread = threading.Thread(target=lambda: writer.add(
        Report(time=1.0, num_waiting=0, num_running=1, kv_cache_usage=0.0, deltas=big).pack()) or writer.flush())
    thread.start()
    got = []
    while not got:  # partial frames stay buffered until the rest arrives
        got = read_reports(reader)
    thread.join()
    assert got[0].deltas == big


def test_a_closed_engine_end_is_reported():
    reader, writer = pipe()
    writer.send(Stop())
    writer._conn.close()
    messages, _ = reader.read()
    assert isinstance(messages[0], Stop)
    assert reader.read() == ([], True)  # the event loop's next wake-up (the pipe stays readable)


class StepEngine:
    """One token per step for each request, as LLMEngine.step's outputs."""

    def __init__(self) -> None:
        self.requests: dict[str, list[int]] = {}
        self.max_tokens: dict[str, int] = {}
        self.num_waiting = self.num_running = 0
        self.kv_cache_usage = 0.0

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams, images=None) -> None:
        self.requests[request_id], self.max_tokens[request_id] = [], params.max_tokens

    def abort_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        outputs = []
        for request_id, tokens in list(self.requests.items()):
            tokens.append(len(tokens))
            finished = len(tokens) == self.max_tokens[request_id]
            outputs.append(RequestOutput(
                request_id=request_id, prompt_token_ids=[1], token_ids=list(tokens), text="", logprobs=None,
                finished=finished, finish_reason="length" if finished else None, num_cached_tokens=0,
                new_token_ids=[tokens[-1]], new_text=f"<{tokens[-1]}>", metrics=RequestMetrics(arrival_time=0.0)))
            if finished:
                del self.requests[request_id]
        return outputs


def test_engine_loop_batches_steps_for_a_late_reader_and_loses_nothing():
    commands_reader, commands = Pipe(duplex=False)
    reader, writer = pipe()
    params = SamplingParams(max_tokens=200)
    commands.send(AddRequests("a", [("a-0", [1], params, None), ("a-1", [1], params, None)]))
    loop = EngineLoop(StepEngine(), commands_reader, writer)
    engine_step = loop.engine.step
    reports: list[Report] = []

    def step() -> list[RequestOutput]:
        if len(loop.engine.requests["a-0"]) % 50 == 0:  # the server reads every 50 steps
            reports.extend(read_reports(reader))
        outputs = engine_step()
        if not loop.engine.requests:
            commands.send(Stop())
        return outputs

    loop.engine.step = step
    runner = threading.Thread(target=loop.run, daemon=True)  # returns at the Stop sent after the last step
    runner.start()
    runner.join(30)
    assert not runner.is_alive(), "the engine loop never finished the requests"
    writer.flush(force=True)
    reports += read_reports(reader)
    deltas = [Delta._make(d) for r in reports for d in r.deltas]
    for request_id in ("a-0", "a-1"):
        tokens = [t for d in deltas if d.request_id == request_id for t in d.new_token_ids]
        assert tokens == list(range(200))  # every token once, in order
    times = [r.time for r in reports if r.deltas]
    assert len(times) == 200 and times == sorted(times)  # one report (and time, for the ITL) per step
    assert writer.num_writes < 20  # not one message per step


@pytest.mark.parametrize("text", [" the", 'a "quote" and \\ back', "line\n\ttab\r", "ünï 中文 😀", "\x00\x1f\x7f", ""])
@pytest.mark.parametrize("include_usage", [False, True])
def test_frames_are_the_models_json(text, include_usage):
    frames = ChunkFrames("text_completion", "cmpl-1", 1700000000, 'model "x"', include_usage)
    for index, reason in ((0, None), (3, "length")):
        model = Completion(id="cmpl-1", created=1700000000, model='model "x"', include_usage=include_usage,
                           choices=[CompletionChoice(index=index, text=text, logprobs=None, finish_reason=reason)])
        assert frames.completion_text(index, text, reason) == sse(model)
    frames = ChunkFrames("chat.completion.chunk", "chatcmpl-1", 1700000000, "m", include_usage)
    for content, reasoning in ((text, None), (None, text), (text, "why")):
        delta = ChatDelta(content=content, reasoning_content=reasoning)
        model = ChatCompletionChunk(id="chatcmpl-1", created=1700000000, model="m", include_usage=include_usage,
                                    choices=[ChatChunkChoice(index=2, delta=delta)])
        fast = frames.chat_delta(2, content, reasoning)
        assert fast == sse(model) or json.loads(fast[6:]) == json.loads(sse(model)[6:])
