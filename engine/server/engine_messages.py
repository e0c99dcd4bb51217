"""What crosses between the server process and the engine loop's process, and how outputs are rebuilt.

Only deltas cross (new tokens, new text, new logprobs): a request's cumulative state would make every
step cost O(sequence length) in pickling. The server side rebuilds full RequestOutputs from them.
"""

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from engine.outputs import RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams

# ------------------------------------------------------------------------------- server -> engine process


@dataclass
class AddRequests:
    """One API request's choices: all admitted, or none."""

    batch_id: str
    # (request id, prompt token ids, params, the prompt's images (engine.multimodal.ImageInput) or None)
    requests: list[tuple[str, list[int], SamplingParams, list | None]]


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class Stop:
    pass


# ------------------------------------------------------------------------------- engine process -> server


@dataclass
class Ready:
    model_path: str
    max_model_len: int
    max_num_seqs: int = 0  # requests the engine runs at once (the rest wait)


@dataclass
class Admission:
    batch_id: str
    error: str | None = None  # None: admitted
    too_long: bool = False  # the refusal is about the context length


class Delta(NamedTuple):
    """What one request gained in one engine step. Crosses the pipe as a plain tuple (`tuple(delta)`,
    rebuilt with `Delta._make`): plain tuples pickle about five times faster, and there are many."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[dict[int, float]] | None
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    num_remote_cached_tokens: int
    metrics: RequestMetrics | None  # only with a request's first tokens and its last: all the server reads

    @classmethod
    def of(cls, out: RequestOutput) -> "Delta":
        num_new, num_tokens = len(out.new_token_ids), len(out.token_ids)
        logprobs = None if out.logprobs is None else out.logprobs[num_tokens - num_new : num_tokens]
        first_or_last = num_tokens == num_new or out.finished
        return cls(
            out.request_id, list(out.new_token_ids), out.new_text, logprobs, out.finished, out.finish_reason,
            out.num_cached_tokens, out.num_remote_cached_tokens, out.metrics if first_or_last else None,
        )  # fmt: skip


@dataclass
class Report:
    """Everything that changed in one pass of the engine loop."""

    time: float  # time.monotonic() of the engine process (CLOCK_MONOTONIC: one clock for both processes)
    num_waiting: int
    num_running: int
    kv_cache_usage: float
    admissions: list[Admission] = field(default_factory=list)
    deltas: list[tuple] = field(default_factory=list)  # tuple(Delta)
    aborted: list[str] = field(default_factory=list)  # requests the engine still held when aborted
    kv: "KVSnapshot | None" = None  # cross-replica KV counters, when they changed
    spec: tuple[int, int] | None = None  # speculative decoding's (draft, accepted) tokens, when they changed

    def pack(self) -> tuple:
        """The report as a plain tuple: what crosses the pipe (a dataclass pickles several times slower)."""
        return (self.time, self.num_waiting, self.num_running, self.kv_cache_usage, self.admissions, self.deltas,
                self.aborted, self.kv, self.spec)

    @classmethod
    def unpack(cls, fields: tuple) -> "Report":
        return cls(*fields)


@dataclass(frozen=True)
class KVSnapshot:
    """The engine's cross-replica KV counters (cumulative) and the directory's health."""

    transfer_bytes: int
    pull_fallbacks: dict[str, int]  # reason -> count
    directory_up: bool

    @classmethod
    def of(cls, connector: Any) -> "KVSnapshot":
        stats = connector.stats
        return cls(stats.transfer_bytes, dict(stats.fallbacks), bool(connector.directory.healthy))


@dataclass
class Failed:
    """The engine could not be built, or its loop died."""

    message: str


# ----------------------------------------------------------------------------------------- server side


class OutputBuilder:
    """One request's cumulative output, rebuilt from its deltas.

    Deltas accumulate here until the request's consumer reads (`output()`): however far behind it is, it
    then gets one output whose `new_*` fields hold everything since its last read, and the server does no
    work per token beyond appending. Between reads the builder also stands for the request's last step
    (its `new_token_ids`, `finished`, `metrics`, ...), which is what the metrics observe.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], want_logprobs: bool) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[dict[int, float]] | None = [] if want_logprobs else None
        self.finished = False
        self.finish_reason: str | None = None
        self.num_cached_tokens = 0
        self.num_remote_cached_tokens = 0
        self.metrics: RequestMetrics | None = None
        self.new_token_ids: list[int] = []  # the last delta's
        self._num_read_tokens = 0  # what the last output() carried
        self._num_read_chars = 0

    def add(self, delta: Delta) -> "OutputBuilder":
        self.token_ids += delta.new_token_ids
        self.text += delta.new_text
        if self.logprobs is not None and delta.new_logprobs:
            self.logprobs += delta.new_logprobs
        self.new_token_ids = delta.new_token_ids
        self.finished, self.finish_reason = delta.finished, delta.finish_reason
        self.num_cached_tokens, self.num_remote_cached_tokens = delta.num_cached_tokens, delta.num_remote_cached_tokens
        if delta.metrics is not None:  # sent with the first tokens and the last only
            self.metrics = delta.metrics
        return self

    def output(self) -> RequestOutput:
        """A snapshot (later deltas do not change it); its new_* fields: everything since the last one."""
        num_tokens, num_chars = len(self.token_ids), len(self.text)
        out = RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=self.token_ids[:],
            text=self.text,
            logprobs=None if self.logprobs is None else self.logprobs[:],
            finished=self.finished,
            finish_reason=self.finish_reason,
            num_cached_tokens=self.num_cached_tokens,
            num_remote_cached_tokens=self.num_remote_cached_tokens,
            new_token_ids=self.token_ids[self._num_read_tokens :],
            new_text=self.text[self._num_read_chars :],
            metrics=self.metrics,
        )
        self._num_read_tokens, self._num_read_chars = num_tokens, num_chars
        return out
