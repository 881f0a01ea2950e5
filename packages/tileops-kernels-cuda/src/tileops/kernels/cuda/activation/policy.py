"""The activation kernels' launch rules, from the hardware facts.

The kernels are elementwise and memory-bound: what matters is 16-byte accesses, enough of them
in flight per SM, and, on small calls, enough blocks to reach every SM. Two builds per kernel:

- the main build: 256 threads, each making ``per_thread`` = 4 accesses (four independent
  16-byte loads per input in flight per thread), one block per 1024 accesses;
- the small build, for calls whose sizing tensor has at most ``small_call_elements`` elements
  (at most four blocks of 128 accesses per SM): 128 threads of one access each, so that a
  decode call (one to 64 rows of an MLP's intermediate size) spreads over as many SMs as it
  can fill instead of a few large blocks.

``vec`` is 16 bytes' worth of elements where the call is aligned (``ActivationCall.aligned``),
else 1 (the scalar build: any length and alignment). These rules were written from the H200's
facts (132 SMs, 16-byte accesses) and have not been measured yet; ``tuning_candidates`` are
what ``request_tune`` times.
"""

from __future__ import annotations

from typing import Any

import torch

from . import programs

#: The dtypes the TileLang kernels take (float64 is served by plain torch).
DTYPES = (torch.float16, torch.bfloat16, torch.float32)

MAIN = {"threads": 256, "per_thread": 4}
SMALL = {"threads": 128, "per_thread": 1}
_SMALL_BLOCKS_PER_SM = 4


def refusal(dtype: torch.dtype) -> str | None:
    if dtype not in DTYPES:
        return f"takes float16, bfloat16 and float32, not {dtype}"
    return None


def launch_config(dtype: torch.dtype, aligned: bool) -> dict[str, Any]:
    """The main build's configuration before tuning."""
    return {"vec": programs.vector_width(dtype, aligned), **MAIN}


def small_config(config: dict[str, Any]) -> dict[str, Any]:
    """The small build's configuration beside main ``config`` (the same access width)."""
    return {"vec": config["vec"], **SMALL}


def small_call_elements(config: dict[str, Any], sm_count: int) -> int:
    """The largest sizing tensor (in elements) the small build serves."""
    return sm_count * _SMALL_BLOCKS_PER_SM * SMALL["threads"] * SMALL["per_thread"] * config["vec"]


def tuning_candidates(dtype: torch.dtype, aligned: bool) -> list[dict[str, Any]]:
    """Main-build configurations worth timing, the default first."""
    vec = programs.vector_width(dtype, aligned)
    shapes = (MAIN, {"threads": 128, "per_thread": 4}, {"threads": 512, "per_thread": 2},
              {"threads": 256, "per_thread": 2}, {"threads": 256, "per_thread": 8})
    return [{"vec": vec, **shape} for shape in shapes]
