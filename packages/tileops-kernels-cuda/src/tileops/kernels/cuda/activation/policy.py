"""The activation kernels' launch rules, from the hardware facts.

The kernels are elementwise and memory-bound: what matters is 16-byte accesses, enough of them
in flight per SM, and, on small calls, enough blocks to reach every SM. A thread issues all its
loads before it computes (``programs``), so the loads in flight per thread are ``per_thread``
times the tensors the kind reads. Two builds per kernel:

- the main build: 256 threads, each with ``LOADS_IN_FLIGHT`` = 4 loads of 16 bytes in flight
  (``per_thread`` = 4 accesses for SiLU's one input, 2 for SwiGLU's two, 1 for its backward's
  three): 64 bytes a thread, so that the 32 KB or less an SM needs in flight (the H200's 4.2
  TB/s over 132 SMs times a load's latency, under a microsecond) takes a quarter of its threads,
  while a thread's registers stay few (4 accesses of each of the SwiGLU backward's five tensors
  took 139 registers, one block of 256 threads per SM);
- the small build, for calls whose sizing tensor has at most ``small_call_elements`` elements
  (at most four blocks of 128 accesses per SM): 128 threads of one access each, so that a
  decode call (one to 64 rows of an MLP's intermediate size) spreads over as many SMs as it
  can fill instead of a few large blocks.

``vec`` is 16 bytes' worth of elements where the call is aligned (``ActivationCall.aligned``),
else 1 (the scalar build: any length and alignment). These rules were written from the H200's
facts (132 SMs, 16-byte accesses) and have not been measured yet; ``tuning_candidates`` (and
``small_candidates`` on a small call) are what ``request_tune`` times.
"""

from __future__ import annotations

from typing import Any

import torch

from ..row_layout import vector_width
from . import programs

#: The dtypes the TileLang kernels take (float64 is served by plain torch).
DTYPES = (torch.float16, torch.bfloat16, torch.float32)

THREADS = 256
LOADS_IN_FLIGHT = 4
SMALL = {"threads": 128, "per_thread": 1}
_SMALL_BLOCKS_PER_SM = 4


def refusal(dtype: torch.dtype) -> str | None:
    if dtype not in DTYPES:
        return f"takes float16, bfloat16 and float32, not {dtype}"
    return None


def launch_config(kind: str, dtype: torch.dtype, aligned: bool) -> dict[str, Any]:
    """The main build's configuration of ``kind`` before tuning."""
    per_thread = max(1, LOADS_IN_FLIGHT // programs.INPUTS[kind])
    return {"vec": vector_width(dtype, aligned), "threads": THREADS, "per_thread": per_thread}


def small_config(config: dict[str, Any]) -> dict[str, Any]:
    """The small build's configuration beside main ``config`` (the same access width)."""
    return {"vec": config["vec"], **SMALL}


def small_candidates(small: dict[str, Any]) -> list[dict[str, Any]]:
    """Small-build configurations worth timing, ``small`` first: blocks of 64 to 256 threads of
    one or two accesses each. A small call is a handful of blocks' latency: whether more, smaller
    blocks (more SMs) beat fewer, larger ones (fewer block launches) depends on the GPU."""
    shapes = [(small["threads"], small["per_thread"])]
    shapes += [(threads, per_thread) for threads in (64, 128, 256) for per_thread in (1, 2)]
    return [{**small, "threads": threads, "per_thread": per_thread} for threads, per_thread in dict.fromkeys(shapes)]


def small_call_elements(config: dict[str, Any], sm_count: int) -> int:
    """The largest sizing tensor (in elements) the small build serves."""
    return sm_count * _SMALL_BLOCKS_PER_SM * SMALL["threads"] * SMALL["per_thread"] * config["vec"]


def tuning_candidates(kind: str, dtype: torch.dtype, aligned: bool) -> list[dict[str, Any]]:
    """Main-build configurations worth timing, the default first: half and twice its loads
    in flight, and its loads spread over half and twice the threads."""
    default = launch_config(kind, dtype, aligned)
    threads, per_thread = default["threads"], default["per_thread"]
    shapes = [(threads, per_thread), (threads, max(1, per_thread // 2)), (threads, per_thread * 2),
              (threads // 2, per_thread), (threads * 2, per_thread)]
    unique = list(dict.fromkeys(shapes))
    return [{**default, "threads": t, "per_thread": p} for t, p in unique]
