"""Timers that wait for the device: CUDA events on a GPU, the host clock elsewhere."""

import statistics
import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], device: torch.device, repeats: int = 5, warmup: int = 1) -> float:
    """Median seconds of fn() over `repeats` runs, after `warmup` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_replayed(fn: Callable[[], object], device: torch.device, calls: int = 20, repeats: int = 5) -> float:
    """Median seconds of one fn() call with the host out of the way: on a GPU, `calls` calls are captured
    in one CUDA graph and replayed (small kernels are otherwise timed by their launch cost)."""
    if device.type != "cuda":
        return time_fn(fn, device, repeats=repeats)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compiles and warms up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return time_fn(graph.replay, device, repeats=repeats, warmup=1) / calls
