"""What is alive at the peak of a CUDA allocator trace: the allocations, grouped by size and by
the Python lines that made them.

    with recording() as events:
        train_step()
    print(breakdown(peak_allocations(events)))

A training step's peak memory says how much, not what: two variants whose peaks differ by a few
hundred MiB differ in a handful of tensors alive at one moment (a loss's chunk of logits held
twice, a KV cache's copies held until the loss). ``peak_allocations`` replays the allocator's
events of the recorded span, finds the moment the most bytes were allocated, and lists the
allocations alive then; ``breakdown`` groups them by (size, source) and names each source by the
innermost lines outside torch's own code.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator, Sequence

import torch

#: Allocator events the replay counts: what it allocated, and what it gave back.
_ALLOC, _FREE = "alloc", "free_completed"


@contextlib.contextmanager
def recording(device: int = 0, max_entries: int = 500_000) -> Iterator[list[dict]]:
    """Record the CUDA allocator's events on ``device``, with the Python stack of each
    allocation, inside the block; the list it yields holds them once the block ends. Needs a
    CUDA GPU."""
    events: list[dict] = []
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        yield events
        torch.cuda.synchronize()
        traces = torch.cuda.memory._snapshot()["device_traces"]
        events.extend(traces[device] if device < len(traces) else ())
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def peak_allocations(events: Sequence[dict]) -> tuple[int, list[dict]]:
    """(bytes allocated at the peak, the allocations alive then) of ``events``, counting only
    what the span allocated (memory held before it started is the same at every moment)."""
    total = peak = 0
    peak_index = -1
    for index, event in enumerate(events):
        if event["action"] == _ALLOC:
            total += event["size"]
        elif event["action"] == _FREE:
            total -= event["size"]
        if total > peak:
            peak, peak_index = total, index
    alive: dict[int, dict] = {}
    for event in events[: peak_index + 1]:
        if event["action"] == _ALLOC:
            alive[event["addr"]] = event
        elif event["action"] == _FREE:
            alive.pop(event["addr"], None)
    return peak, list(alive.values())


def source(event: dict, depth: int = 3) -> str:
    """The innermost ``depth`` Python lines outside torch that made an allocation ("file:line:function",
    innermost first), or what made it where Python did not (autograd's engine runs a backward's
    kernels from C++)."""
    frames = [f for f in event.get("frames", ()) if "/torch/" not in f["filename"]]
    shown = [f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']}:{f['name']}" for f in frames[:depth]]
    return " < ".join(shown) or "no Python frame (autograd's engine)"


def breakdown(peak: tuple[int, list[dict]], rows: int = 24) -> str:
    """``peak_allocations``' result as lines: the total, then the largest (size, source) groups,
    then what the groups not listed hold together (two peaks a MiB apart differ down there)."""
    total, alive = peak
    groups: dict[tuple[int, str], list[int]] = collections.defaultdict(lambda: [0, 0])
    for event in alive:
        group = groups[(event["size"], source(event))]
        group[0] += 1
        group[1] += event["size"]
    ranked = sorted(groups.items(), key=lambda item: -item[1][1])
    lines = [f"{total / 2**20:.1f} MiB allocated in the span at its peak; alive then, largest first:"]
    for (size, where), (count, nbytes) in ranked[:rows]:
        lines.append(f"  {nbytes / 2**20:9.3f} MiB = {count:3d} x {size / 2**20:8.3f} MiB  {where}")
    rest = ranked[rows:]
    if rest:
        count, nbytes = sum(c for _, (c, _) in rest), sum(b for _, (_, b) in rest)
        lines.append(f"  {nbytes / 2**20:9.3f} MiB in {count} allocations of {len(rest)} smaller groups")
    return "\n".join(lines)
