"""The peak breakdown of the end-to-end benchmark (tools/memory_peak.py) on allocator traces
written out: which allocations are alive at the moment the most bytes are."""

from __future__ import annotations

import pytest
import torch

from helpers import load_tool

memory_peak = load_tool("memory_peak")

MIB = 2**20


def _frames(*lines: str) -> list[dict]:
    """Stack frames, innermost first, from "path:line:function" strings."""
    return [dict(zip(("filename", "line", "name"), (path, int(line), name)))
            for path, line, name in (text.split(":") for text in lines)]


def _alloc(addr: int, mib: int, *lines: str) -> dict:
    return {"action": "alloc", "addr": addr, "size": mib * MIB, "frames": _frames(*lines)}


def _free(addr: int, mib: int) -> dict:
    return {"action": "free_completed", "addr": addr, "size": mib * MIB, "frames": []}


def test_the_allocations_alive_at_the_peak_are_grouped_by_size_and_source_outside_torch():
    activations = [_alloc(100 + i, 8, "/lib/torch/nn/functional.py:10:linear", "/m/model.py:20:forward") for i in range(3)]
    events = [
        *activations,
        _alloc(1, 125, "/m/loss.py:87:chunk", "/m/loss.py:80:chunks"),  # a chunk of logits...
        _free(1, 125),  # ...freed before the next: not alive at the peak
        _alloc(2, 125, "/m/loss.py:87:chunk", "/m/loss.py:80:chunks"),
        _alloc(3, 501, "/m/loss.py:77:chunks"),
        {"action": "free_requested", "addr": 2, "size": 125 * MIB, "frames": []},  # not yet given back
        _alloc(4, 32),  # made by autograd's engine: no Python frame
        _free(2, 125),
        _free(4, 32),
        _free(3, 501),
    ]
    total, alive = memory_peak.peak_allocations(events)
    assert total == (3 * 8 + 125 + 501 + 32) * MIB
    assert sorted(event["addr"] for event in alive) == [2, 3, 4, 100, 101, 102]
    text = memory_peak.breakdown((total, alive))
    lines = text.splitlines()
    assert lines[0].startswith(f"{3 * 8 + 125 + 501 + 32:.1f} MiB")
    assert lines[1].split() == ["501.000", "MiB", "=", "1", "x", "501.000", "MiB", "loss.py:77:chunks"]
    assert lines[2].split()[-3:] == ["loss.py:87:chunk", "<", "loss.py:80:chunks"]
    assert lines[3].endswith("no Python frame (autograd's engine)")
    assert lines[4].split()[:5] == ["24.000", "MiB", "=", "3", "x"] and lines[4].endswith("model.py:20:forward")
    assert len(lines) == 5  # every group listed: no remainder line
    # Past ``rows`` groups, the rest are totalled on one line.
    short = memory_peak.breakdown((total, alive), rows=2).splitlines()
    assert len(short) == 4 and short[3].split() == ["56.000", "MiB", "in", "4", "allocations", "of", "2", "smaller", "groups"]


def test_a_span_that_allocates_nothing_has_no_peak():
    assert memory_peak.peak_allocations([]) == (0, [])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_recorded_span_finds_its_own_tensors():
    with memory_peak.recording() as events:
        kept = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
        torch.empty(16 * MIB, dtype=torch.uint8, device="cuda")  # freed at once
    total, alive = memory_peak.peak_allocations(events)
    assert total >= 64 * MIB and any(event["size"] >= 64 * MIB for event in alive)
    assert "test_memory_peak.py" in memory_peak.breakdown((total, alive))
    del kept
