"""How TileOPs times things (docs/performance.md): GPU time by CUDA-graph replay (``tileops
bench`` and kernel tuning), and host-inclusive call time by short interleaved loops (``tileops
bench`` on small shapes, ``tileops overhead``)."""

from __future__ import annotations

import statistics
import time
import warnings
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
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except Exception:
        _end_failed_capture()
        raise
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


def _end_failed_capture() -> None:
    """Leave the process able to draw random numbers after a capture that raised.

    A capture that ``fn`` invalidated (a host synchronisation, say) ends with an error before
    torch takes the CUDA generator out of its capture mode, and every later ``torch.randn`` on
    the device then fails with "Offset increment outside graph capture". An empty capture that
    succeeds ends that mode.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            pass


def best_call_times_us(
    fns: list[Callable[[], Any]], *, calls: int, loops: int, synchronize: Callable[[], Any] | None = None
) -> list[float]:
    """Host-inclusive time of one call of each of ``fns``, in microseconds: for each, the best
    of ``loops`` timed loops of ``calls`` calls (``synchronize``, when given, ends each loop,
    so that the work a loop queued is counted).

    The loops are short and the callables take turns: on a shared machine other work only
    ever adds time, in bursts lasting seconds, so the fastest of many short loops is the
    closest to what a call itself costs, and taking turns exposes every side of a comparison
    to the same bursts.
    """
    for fn in fns:
        for _ in range(calls):
            fn()
    if synchronize is not None:
        synchronize()
    best = [float("inf")] * len(fns)
    for _ in range(loops):
        for index, fn in enumerate(fns):
            begin = time.perf_counter()
            for _ in range(calls):
                fn()
            if synchronize is not None:
                synchronize()
            best[index] = min(best[index], (time.perf_counter() - begin) / calls * 1e6)
    return best
