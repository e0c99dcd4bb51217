"""Prometheus metrics of one engine: exactly the contract the operator's autoscaler and dashboards read,
plus the cross-replica KV counters when KV reuse is on."""

import time
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.outputs import RequestOutput

PREFIX = "deepseek_engine"
FINISH_REASONS = ("stop", "length", "abort")
CACHE_SOURCES = ("local", "remote")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
_DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class _WithoutCreated(Collector):
    """Drops the `*_created` samples prometheus-client adds, so the exposition is the contract alone."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator:
        for family in self._registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


class _KVCollector(Collector):
    """The engine's cumulative KV-reuse counters, exposed as they were last reported."""

    def __init__(self) -> None:
        self.transfer_bytes = 0
        self.pull_fallbacks: dict[str, int] = {}
        self.directory_up = True

    def collect(self) -> Iterator:
        yield CounterMetricFamily(
            f"{PREFIX}_kv_transfer_bytes", "KV-cache bytes pulled from other replicas.", value=self.transfer_bytes
        )
        fallbacks = CounterMetricFamily(
            f"{PREFIX}_kv_pull_fallbacks", "Prefixes recomputed instead of pulled, by reason.", labels=["reason"]
        )
        for reason, count in sorted(self.pull_fallbacks.items()):
            fallbacks.add_metric([reason], count)
        yield fallbacks
        yield GaugeMetricFamily(
            f"{PREFIX}_kv_directory_up", "1 while the KV-cache directory answers.", value=int(self.directory_up)
        )


class _SpecCollector(Collector):
    """Speculative decoding's cumulative counters, exposed once the engine reports them (it drafts)."""

    def __init__(self) -> None:
        self.counts: tuple[int, int] | None = None  # (draft tokens verified, of them accepted)

    def collect(self) -> Iterator:
        if self.counts is None:
            return
        yield CounterMetricFamily(f"{PREFIX}_spec_decode_draft_tokens", "Draft tokens verified (speculative decoding).",
                                  value=self.counts[0])
        yield CounterMetricFamily(f"{PREFIX}_spec_decode_accepted_tokens",
                                  "Draft tokens accepted (speculative decoding).", value=self.counts[1])


class EngineMetrics:
    """The engine's metrics on a registry of their own (`kv_reuse` adds the cross-replica KV counters)."""

    def __init__(self, kv_reuse: bool = False) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests_waiting = Gauge(
            f"{PREFIX}_requests_waiting", "Admitted requests not yet scheduled (queue depth).", registry=r
        )
        self.requests_running = Gauge(
            f"{PREFIX}_requests_running", "Requests being prefilled or decoded.", registry=r
        )
        self.kv_cache_usage = Gauge(f"{PREFIX}_kv_cache_usage",
                                    "Fraction of the KV cache in use, 0..1 (of the blocks, or of the sliding window's "
                                    "pages where those are fuller).", registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens generated.", registry=r)
        self.prefix_cache_hit_tokens = Counter(
            f"{PREFIX}_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache, by where the cached blocks came from.",
            ["source"],
            registry=r,
        )
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Time between two generated tokens of one request.",
            buckets=_TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.request_duration = Histogram(
            f"{PREFIX}_request_duration_seconds",
            "Time from arrival to the last token.",
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.requests = Counter(f"{PREFIX}_requests", "Finished requests.", ["finish_reason"], registry=r)
        # Every label value is exposed from the start: dashboards and alerts see zeros, not gaps.
        for source in CACHE_SOURCES:
            self.prefix_cache_hit_tokens.labels(source=source)
        for reason in FINISH_REASONS:
            self.requests.labels(finish_reason=reason)
        self._kv = _KVCollector()
        if kv_reuse:
            r.register(self._kv)
        self._spec = _SpecCollector()
        r.register(self._spec)
        self._last_token_time: dict[str, float] = {}  # request_id -> time of its last token
        self._exposition = _WithoutCreated(self.registry)

    def set_queue(self, num_waiting: int, num_running: int, kv_cache_usage: float) -> None:
        self.requests_waiting.set(num_waiting)
        self.requests_running.set(num_running)
        self.kv_cache_usage.set(kv_cache_usage)

    def set_kv(self, transfer_bytes: int, pull_fallbacks: dict[str, int], directory_up: bool) -> None:
        self._kv.transfer_bytes, self._kv.pull_fallbacks, self._kv.directory_up = (
            transfer_bytes, pull_fallbacks, directory_up,
        )  # fmt: skip

    def set_spec(self, draft_tokens: int, accepted_tokens: int) -> None:
        self._spec.counts = (draft_tokens, accepted_tokens)

    def observe_outputs(self, outputs: Iterable[RequestOutput], now: float | None = None) -> None:
        """Counts the tokens and latencies of one engine step's outputs (`now`: time.monotonic())."""
        now = time.monotonic() if now is None else now
        for out in outputs:
            self._observe(out, now)

    def forget(self, request_id: str) -> None:
        """The request's client left: nothing more is observed for it (its last-token time goes)."""
        self._last_token_time.pop(request_id, None)

    def observe_abort(self, request_id: str) -> None:
        """Counts a request aborted before the engine reported it finished."""
        self._last_token_time.pop(request_id, None)
        self.requests.labels(finish_reason="abort").inc()

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self._exposition)

    def _observe(self, out: RequestOutput, now: float) -> None:
        num_new = len(out.new_token_ids)
        last = self._last_token_time.get(out.request_id)
        if num_new:
            self.generation_tokens.inc(num_new)
            if last is None:
                self._observe_first_token(out, now)
            else:
                # Several tokens in one step (speculative decoding) share the step's latency.
                gap = (now - last) / num_new
                for _ in range(num_new):
                    self.inter_token_latency.observe(gap)
            self._last_token_time[out.request_id] = now
        if out.finished:
            self._last_token_time.pop(out.request_id, None)
            self.requests.labels(finish_reason=out.finish_reason or "abort").inc()
            if out.metrics is not None:
                self.request_duration.observe(now - out.metrics.arrival_time)

    def _observe_first_token(self, out: RequestOutput, now: float) -> None:
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        remote = out.num_remote_cached_tokens
        self.prefix_cache_hit_tokens.labels(source="local").inc(out.num_cached_tokens - remote)
        self.prefix_cache_hit_tokens.labels(source="remote").inc(remote)
        if out.metrics is not None:
            first = out.metrics.first_token_time or now
            self.time_to_first_token.observe(first - out.metrics.arrival_time)
