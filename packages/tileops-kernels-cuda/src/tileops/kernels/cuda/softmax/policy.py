"""The softmax kernels' launch policy, from the row's length and dtype and the GPU's facts (pure
Python: no tilelang).

Which variant serves a call (refusals; selection takes the first that does not refuse):

* ``register`` holds a row in registers, read once: rows of at most ``REGISTER_MAX_N`` elements
  (1024 threads of at most 32 elements each). A 1024-thread block of a 16-bit row of 32000 takes
  56 registers a thread (the row, and the float32 exponentials softmax keeps for its write), so
  such rows run one block per SM: the per-element arithmetic, not the loads, is what its time
  depends on (it was 2.7 of 6.7 us a row before the exponentials became one exp2 each).
* ``streamed`` serves every longer row: an online pass and a write pass over the row, the second
  reading it from L2 (one 1024-thread block per row keeps 64 KiB in flight per SM, about what
  the copy bandwidth needs with HBM's latency, and at most 132 x 2 rows of 256 KiB, 68 MB, stay
  on chip between the passes; the split below keeps them smaller).

Builds chosen per call by the row count (x's size; n is fixed per kernel):

* the streamed kernel's split build, for calls of fewer rows than the GPU has SMs: each row is
  cut into chunks of at least ``_MIN_CHUNK_BYTES`` so that the call has about two blocks per SM
  even for one row (``split_config``); two launches, the second re-reading its chunk from L2.
* the register kernel has one build: its rows are at most 64 KiB, and a call of few such rows
  is a few microseconds of launch latency however it is cut.

Short rows share a block (at least ``_MIN_BLOCK_THREADS`` threads), each row taking about four
16-byte accesses per thread so that enough loads are in flight. These rules follow from the
H200's facts (132 SMs, 64K registers and 228 KiB of shared memory per SM, 60 MB of L2, 16-byte
accesses); ``tuning_candidates`` (and ``split_candidates`` on a call the split build serves) are
what ``request_tune`` times around them.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import torch

from ..powers import pow2_ceil
from . import programs

#: The dtypes the TileLang kernels take (float64 is served by plain torch).
DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_MAX_ELEMENTS_PER_THREAD = 32
#: The longest row the register variant holds: 1024 threads of 32 elements.
REGISTER_MAX_N = programs.MAX_THREADS * _MAX_ELEMENTS_PER_THREAD
_ACCESSES_PER_THREAD = 4  # 16-byte accesses in flight per thread in the register variant
_MIN_BLOCK_THREADS = 128
_STREAMED_THREADS = 1024
_STREAMED_UNROLL = 4
#: A split chunk is at least this many bytes (256 threads x 16 bytes x 4 accesses): smaller
#: blocks would spend more on the launch and the two reductions than on moving their data.
_MIN_CHUNK_BYTES = 256 * 16 * 4
_SPLIT_THREADS = 256
_BLOCKS_PER_SM = 2


def refusal(variant: str, n: int, dtype: torch.dtype, out_dtype: torch.dtype) -> str | None:
    """None if ``variant`` serves rows of ``n`` elements of ``dtype`` (into ``out_dtype``), else why not."""
    if dtype not in DTYPES or out_dtype not in DTYPES:
        return f"takes float16, bfloat16 and float32, not {dtype} -> {out_dtype} (plain torch serves float64)"
    if n < 1:
        return f"n={n}: a row holds at least one element"
    if variant == "register" and n > REGISTER_MAX_N:
        return (
            f"a row of {n} elements exceeds the register variant's {REGISTER_MAX_N} "
            f"({programs.MAX_THREADS} threads of {_MAX_ELEMENTS_PER_THREAD}): the streamed variant serves it"
        )
    return None


def launch_config(variant: str, n: int, dtype: torch.dtype, aligned: bool) -> dict[str, Any]:
    """The main build's configuration (``programs.make_program``'s keywords) before tuning."""
    vec = programs.vector_width(dtype, aligned)
    accesses = n // vec
    if variant == "register":
        # About four accesses per thread, at most 32 elements, at most 1024 threads per row.
        per_thread = _ACCESSES_PER_THREAD if vec > 1 else _ACCESSES_PER_THREAD * 4
        tpr = min(pow2_ceil(math.ceil(accesses / per_thread)), programs.MAX_THREADS)
        rows = max(1, _MIN_BLOCK_THREADS // tpr)
        return {"variant": "register", "vec": vec, "threads": tpr * rows, "rows": rows}
    return {"variant": "streamed", "vec": vec, "threads": _STREAMED_THREADS, "unroll": _STREAMED_UNROLL}


def split_rows(sm_count: int) -> int:
    """Calls of at most this many rows take the streamed kernel's split build: fewer rows than
    SMs leave SMs idle with one block per row."""
    return max(1, sm_count - 1)


def split_config(n: int, dtype: torch.dtype, config: dict[str, Any], sm_count: int) -> dict[str, Any] | None:
    """The split build's configuration beside streamed ``config``, or None where a row is too
    short to cut into two chunks of ``_MIN_CHUNK_BYTES``. The chunk count gives one row about
    ``_BLOCKS_PER_SM`` blocks per SM."""
    vec = config["vec"]
    most = (n * dtype.itemsize) // _MIN_CHUNK_BYTES
    chunks = min(_BLOCKS_PER_SM * sm_count, most)
    if chunks < 2:
        return None
    return {"variant": "streamed", "vec": vec, "threads": _SPLIT_THREADS, "unroll": _STREAMED_UNROLL, "chunks": chunks}


def split_candidates(n: int, dtype: torch.dtype, split: dict[str, Any]) -> list[dict[str, Any]]:
    """Split-build configurations worth timing, ``split`` first: half and twice its chunks per
    row (within two chunks and chunks of ``_MIN_CHUNK_BYTES``), each with blocks of 128 to 512
    threads. How many blocks a row is best cut into depends on the call's row count and the
    GPU, which the rule does not see."""
    most = (n * dtype.itemsize) // _MIN_CHUNK_BYTES
    chunk_counts = sorted({c for c in (split["chunks"] // 2, split["chunks"], split["chunks"] * 2) if 2 <= c <= most})
    candidates = [split]
    for chunks in chunk_counts:
        for threads in (128, 256, 512):
            candidate = {**split, "chunks": chunks, "threads": threads}
            if candidate not in candidates:
                candidates.append(candidate)
    return candidates


def tuning_candidates(variant: str, n: int, dtype: torch.dtype, aligned: bool) -> list[dict[str, Any]]:
    """Main-build configurations worth timing, the default first: half and twice the threads
    per row (register), or 512 threads and other unrolls (streamed).

    Half the threads of a register row hold twice the elements each; past 32 (a 16-bit row's
    default is four 16-byte accesses, 32 elements, a thread) that fits only without the kept
    exponentials (``keep=False``). For the longest rows (1024 threads of 32 elements) two such
    blocks may then share an SM (ptxas: 56 registers a thread, no spill, at 32000 bfloat16, as
    the default's), one loading its row while the other computes, where one
    1024-thread block per SM cannot overlap them (4096 rows of 32000 bfloat16 elements ran at 71 %
    of the copy bandwidth that way, 175 us on an H200). Not measured yet: a candidate."""
    default = launch_config(variant, n, dtype, aligned)
    candidates = [default]
    if variant == "register":
        tpr = default["threads"] // default["rows"]
        for threads_per_row in (tpr // 2, tpr * 2):
            held = math.ceil(n / default["vec"] / max(1, threads_per_row)) * default["vec"]  # elements per thread
            if 1 <= threads_per_row <= programs.MAX_THREADS and held <= 2 * _MAX_ELEMENTS_PER_THREAD:
                rows = max(1, _MIN_BLOCK_THREADS // threads_per_row)
                candidate = {**default, "threads": threads_per_row * rows, "rows": rows}
                if held > _MAX_ELEMENTS_PER_THREAD:
                    candidate["keep"] = False
                candidates.append(candidate)
    else:
        for threads, unroll in ((512, 4), (1024, 2), (512, 8)):
            candidates.append({**default, "threads": threads, "unroll": unroll})
    return candidates


def has_cache_priorities(target: str | dict) -> bool:
    """Whether ``target``'s GPU has L2 cache-policy loads (``createpolicy``: sm_80 and later).

    The architecture comes from the target (``{"arch": "sm_90"}``); a bare ``"cuda"`` means the
    current GPU, as TileLang reads it.
    """
    found = re.search(r"sm_(\d+)", json.dumps(target) if isinstance(target, dict) else str(target))
    if found:
        return int(found.group(1)) >= 80
    return not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] >= 8
