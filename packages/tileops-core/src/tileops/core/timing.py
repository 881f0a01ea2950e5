"""GPU time of a callable, by CUDA-graph replay: the method of ``tileops bench`` and of kernel
tuning (docs/performance.md), for anything that launches work on the current CUDA stream."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch


def gpu_time_us(fn: Callable[[], Any], *, calls: int = 40, replays: int = 15, warmup: int = 3) -> float:
    """Median GPU time of one call of ``fn``, in microseconds.

    ``fn`` runs ``warmup`` times on a side stream, then ``calls`` calls are captured back to
    back in one CUDA graph; the graph is replayed ``replays`` times and the median replay time
    is divided by ``calls``. Host work (Python, launches) is not counted.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)
