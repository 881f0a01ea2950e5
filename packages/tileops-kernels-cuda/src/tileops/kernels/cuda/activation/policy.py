"""The activation kernels' launch rule, from the hardware facts.

The kernels are elementwise and memory-bound: what matters is 16-byte accesses, enough of them
in flight per SM, and every SM given the same share of a call. One build serves every call:
blocks of ``THREADS`` = 128 threads, each thread making one 16-byte access of every tensor the
kind reads (``per_thread`` = 1; a thread issues its loads before it computes, ``programs``).

- Balance: a block covers 1024 half-precision elements, so a call of any size cuts into blocks
  that spread evenly over the SMs; with four accesses a thread (256 threads), a call of 1 to 7
  million elements (64 to 512 rows of an MLP's intermediate size) cut into 150 to 900 blocks
  and left some SMs a block more than others.
- Loads in flight: 16 blocks of 128 threads fill an SM (2048 threads; the kinds take few
  registers), which then has 32 KB of loads in flight for each tensor it reads: the H200's copy
  bandwidth (about 4.2 TB/s) over its 132 SMs is 32 KB a microsecond, longer than a load takes;
  more accesses a thread add nothing there.

Measured on an H100 (bf16, each program alone by CUDA-graph replay), silu kinds, 1x14336 to
8192x14336 elements: 128 x 1 was the fastest configuration or within 1 % of it everywhere
against 256 x 4, 256 x 2, 256 x 1, 512 x 1 and 128 x 2 (act; gated and gated_bwd likewise);
the former main build (256 threads of four loads in flight) took act at 64x18944 2.75 us
against 2.19, 256x14336 3.88 against 3.57, and tied from 2048x11008 on (31.9-32.1 us).

``vec`` is 16 bytes' worth of elements where the call is aligned (``ActivationCall.aligned``),
else 1 (the scalar build: any length and alignment). ``tuning_candidates`` are what
``request_tune`` times.
"""

from __future__ import annotations

from typing import Any

import torch

from ..row_layout import vector_width

#: The dtypes the TileLang kernels take (float64 is served by plain torch).
DTYPES = (torch.float16, torch.bfloat16, torch.float32)

THREADS = 128
PER_THREAD = 1


def refusal(dtype: torch.dtype) -> str | None:
    if dtype not in DTYPES:
        return f"takes float16, bfloat16 and float32, not {dtype}"
    return None


def launch_config(dtype: torch.dtype, aligned: bool) -> dict[str, Any]:
    """The build's configuration before tuning (the same for every kind)."""
    return {"vec": vector_width(dtype, aligned), "threads": THREADS, "per_thread": PER_THREAD}


def tuning_candidates(dtype: torch.dtype, aligned: bool) -> list[dict[str, Any]]:
    """Configurations worth timing, the default first: blocks of half and twice the threads,
    and two and four accesses a thread (fewer, larger blocks: fewer block launches, which a
    GPU other than the one measured may prefer)."""
    default = launch_config(dtype, aligned)
    shapes = [(THREADS, PER_THREAD), (64, 1), (256, 1), (128, 2), (256, 2), (256, 4)]
    return [{**default, "threads": t, "per_thread": p} for t, p in dict.fromkeys(shapes)]
