"""Reading the engines' Prometheus metrics: every pod at once, each within a short timeout."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from fleet.autoscaler.decision import PodLoad
from fleet.autoscaler.pods import EnginePod

WAITING = "deepseek_engine_requests_waiting"
RUNNING = "deepseek_engine_requests_running"
KV_CACHE_USAGE = "deepseek_engine_kv_cache_usage"
MAX_BYTES = 1 << 20  # an engine's exposition is a few kB; anything near this is not an engine
MAX_CONNECTIONS = 256


def parse_load(text: str) -> PodLoad | None:
    """The load in one exposition; None when it is malformed or lacks the queue gauges."""
    wanted = (WAITING, RUNNING, KV_CACHE_USAGE)
    # Only the lines that mention the three gauges go to the parser: the histograms that make up
    # most of an exposition would cost ten times as much to parse, for nothing.
    relevant = "\n".join(line for line in text.splitlines() if any(name in line for name in wanted)) + "\n"
    values: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(relevant):
            if family.name in wanted:
                # Summed over label sets (and untyped repeats), should an engine ever split its gauges.
                total = sum(s.value for s in family.samples if s.name == family.name)
                values[family.name] = values.get(family.name, 0.0) + total
    except ValueError:
        return None
    if WAITING not in values or RUNNING not in values or not all(map(math.isfinite, values.values())):
        return None
    return PodLoad(waiting=values[WAITING], running=values[RUNNING], kv_cache_usage=values.get(KV_CACHE_USAGE))


class MetricsClient:
    """One HTTP connection pool for all fleets; create and close it inside the operator's event loop."""

    def __init__(self, *, max_connections: int = MAX_CONNECTIONS) -> None:
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    async def read(self, pods: Iterable[EnginePod], *, timeout: float) -> dict[str, PodLoad | None]:
        """Each pod's load, or None for a pod that did not answer in time or answered nonsense."""
        pods = list(pods)
        loads = await asyncio.gather(*(self._read_one(pod, timeout) for pod in pods))
        return {pod.name: load for pod, load in zip(pods, loads)}

    async def _read_one(self, pod: EnginePod, timeout: float) -> PodLoad | None:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections),
                trust_env=False,  # pod IPs are reached directly, never through a proxy
            )
        try:
            async with self._session.get(pod.metrics_url, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
                if response.status != 200:
                    return None
                body = bytearray()
                async for chunk in response.content.iter_chunked(1 << 16):
                    body += chunk
                    if len(body) > MAX_BYTES:
                        return None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return None
        return parse_load(body.decode("utf-8", errors="replace"))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
