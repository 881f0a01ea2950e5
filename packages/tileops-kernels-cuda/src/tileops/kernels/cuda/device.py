"""What the CUDA kernels need to know about the device and machine they are built on, and how
they are launched."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tileops.core.device_facts import facts_for


def compile_target(device: torch.device) -> dict[str, str]:
    """The TileLang target for ``device``: CUDA for its own architecture (e.g. sm_90)."""
    facts = facts_for(device)
    return {"kind": "cuda", "arch": f"sm_{facts.arch}"}


def cache_root() -> Path:
    """Where the kernels keep what they work out once per machine (tuned configurations, the
    C++ launch path): ``$TILEOPS_CACHE_DIR``, by default ``~/.cache/tileops``."""
    return Path(os.environ.get("TILEOPS_CACHE_DIR") or Path.home() / ".cache" / "tileops")


#: The index of the current CUDA device. ``torch.cuda.current_device`` first makes sure CUDA is
#: initialised, which a kernel built for a tensor already on the GPU does not need, and it costs
#: a Python call more on every launch.
current_device_index: Callable[[], int] = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)


def launcher(kernel: Any) -> Callable[..., Any]:
    """The cheapest way to call a compiled TileLang kernel whose outputs the caller allocates.

    TileLang's own ``kernel(*tensors)`` goes through a Python adapter that re-derives output
    shapes and counts arguments on every call (several microseconds on a decode-sized call).
    Our kernels allocate nothing (no ``out_idx``), so the compiled entry function can take the
    tensors directly; where this TileLang does not expose it, the adapter is used.

    The entry function keeps the GIL while it launches, as torch's own launches do: releasing and
    taking it back around a launch that only queues work cost 0.1-0.3 us per call on the H200's
    host (2-3% of a decode-sized call).
    """
    adapter = getattr(kernel, "adapter", None)
    executable = getattr(adapter, "get_exportable_executable", None)
    if executable is None or getattr(adapter, "result_idx", None):
        return kernel
    try:
        entry = executable()["main"]
    except (AttributeError, KeyError, RuntimeError):
        return kernel
    if hasattr(entry, "release_gil"):
        entry.release_gil = False
    return entry
