"""What the CUDA kernels need to know about the device and machine they are built on: the
compile target, the SM count, the GPU model, where per-machine results are kept, and the current
device."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from tileops.core import DeviceFacts, facts_for, is_stated


def compile_target(device: torch.device) -> dict[str, str]:
    """The TileLang target for ``device``: CUDA for its own architecture (e.g. sm_90)."""
    facts = facts_for(device)
    return {"kind": "cuda", "arch": f"sm_{facts.arch}"}


def hopper_target(target: dict) -> dict:
    """``target`` with sm_90 made sm_90a, for programs that multiply tiles (``T.gemm``): on sm_90
    TileLang lowers it to wgmma, which with TMA and the register reallocation of its
    warp-specialised pipelines are instructions of the architecture-specific sm_90a only (built
    for plain sm_90, a wgmma kernel stops on a device-side assert)."""
    return dict(target, arch="sm_90a") if target.get("arch") == "sm_90" else dict(target)


def sm_count(facts: DeviceFacts | None) -> int:
    """The SMs of a device with ``facts``, 1 where they do not say: rules that give each SM its
    share of a call then plan for a single one."""
    return facts.sm_count if facts is not None and facts.sm_count else 1


def rows_fit_l2(facts: DeviceFacts | None, blocks_per_sm: int, row_bytes: int) -> bool | None:
    """Whether the rows of ``blocks_per_sm`` one-row blocks on every SM of a device with
    ``facts`` fit in its L2 together: where a kernel reads each row twice, whether the second
    read is served from L2. None where the facts do not say (the caller's rule decides)."""
    if facts is None or not (facts.l2_bytes and facts.sm_count):
        return None
    return facts.sm_count * blocks_per_sm * row_bytes <= facts.l2_bytes


def shared_memory_per_block(device: torch.device) -> int | None:
    """The shared memory one block may opt in to on ``device``; None where it is not known, and on
    a machine without CUDA, where selection is only asked what would serve a call (``tileops
    explain``, tests) and nothing launches, unless the question states the device's facts."""
    if device.type == "cuda" and not torch.cuda.is_available() and not is_stated(device):
        return None
    facts = facts_for(device)
    return None if facts is None else facts.shared_memory_per_block


def gpu_model(device: torch.device) -> str:
    """The model of the GPU ``device`` is (e.g. ``NVIDIA H200``): tuned configurations hold per model."""
    return facts_for(device).name


def cache_root() -> Path:
    """Where the kernels keep what they work out once per machine (tuned configurations, the
    C++ launch path): ``$TILEOPS_CACHE_DIR``, by default ``~/.cache/tileops``."""
    return Path(os.environ.get("TILEOPS_CACHE_DIR") or Path.home() / ".cache" / "tileops")


#: The index of the current CUDA device. ``torch.cuda.current_device`` first makes sure CUDA is
#: initialised, which a kernel built for a tensor already on the GPU does not need, and it costs
#: a Python call more on every launch.
current_device_index: Callable[[], int] = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
