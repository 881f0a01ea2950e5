"""The softmax kernels' launch policy, from the row's length and dtype and the GPU's facts (pure
Python: no tilelang).

Which variant serves a call (refusals; selection takes the first that does not refuse):

* ``register`` holds a row in registers, read once: rows of at most ``REGISTER_MAX_N`` elements
  (1024 threads of at most 32 elements each). A 1024-thread block of a 16-bit row of 32000 takes
  56 registers a thread (the row, and the float32 exponentials softmax keeps for its write), so
  such rows would run one block per SM, none loading while it computes: the softmax forward's
  wide rows take half the threads instead, each holding twice the elements and computing each
  exponential again for the write (``launch_config``).
* ``streamed`` serves every longer row: an online pass and a write pass over the row, the second
  reading it from L2 (one 1024-thread block per row keeps 64 KiB in flight per SM, about what
  the copy bandwidth needs with HBM's latency, and at most 132 x 2 rows of 256 KiB, 68 MB, stay
  on chip between the passes; the split below keeps them smaller). A softmax forward whose
  rows are short enough that four 512-thread blocks per SM keep theirs in L2 takes those
  (``launch_config``).

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

import math
from typing import Any

import torch

from tileops.core import DeviceFacts

from ..device import rows_fit_l2
from ..powers import pow2_ceil
from ..row_layout import shifts, vector_width
from . import programs

#: The dtypes the TileLang kernels take (float64 is served by plain torch).
DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_MAX_ELEMENTS_PER_THREAD = 32
#: The longest row the register variant holds: 1024 threads of 32 elements.
REGISTER_MAX_N = programs.MAX_THREADS * _MAX_ELEMENTS_PER_THREAD
_ACCESSES_PER_THREAD = 4  # 16-byte accesses in flight per thread in the register variant
_MIN_BLOCK_THREADS = 128
#: A softmax forward row this wide (threads at the default elements per thread) or wider takes
#: half the threads without kept exponentials (``launch_config``).
_RECOMPUTED_FROM_THREADS = 512
#: The streamed softmax forward's blocks where the rows they hold at once fit in L2.
_STREAMED_SHORT_THREADS, _STREAMED_SHORT_UNROLL = 512, 8
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


def launch_config(
    variant: str, n: int, dtype: torch.dtype, aligned: bool, *, pointers_aligned: bool = False,
    softmax_forward: bool = False, facts: DeviceFacts | None = None,
) -> dict[str, Any]:
    """The main build's configuration (``programs.make_program``'s keywords) before tuning.
    ``aligned``: rows of whole 16-byte accesses at aligned addresses; ``pointers_aligned``: the
    tensors' data pointers aligned, whatever the row length (a row of another length then takes
    the shifted program: 16-byte accesses over its aligned middle); ``softmax_forward``: the
    build is a softmax forward's (not a log-softmax's, not a backward's), whose threads would
    keep a float32 exponential per element for the write; ``facts``: the GPU's (its SMs and L2
    tell the streamed forward's block size; unknown: none)."""
    shifted = {"shifted": True} if shifts(n, dtype, aligned, pointers_aligned) else {}
    vec = vector_width(dtype, aligned or bool(shifted))
    accesses = n // vec
    if variant == "register":
        # About four accesses per thread, at most 32 elements, at most 1024 threads per row.
        per_thread = _ACCESSES_PER_THREAD if vec > 1 else _ACCESSES_PER_THREAD * 4
        tpr = min(pow2_ceil(math.ceil(accesses / per_thread)), programs.MAX_THREADS)
        if shifted and tpr < 2 * vec:
            # A row's first 2 * vec threads read its edges; a row this short is a few accesses
            # whichever way it is read.
            return launch_config(variant, n, dtype, False, softmax_forward=softmax_forward, facts=facts)
        # Element-wise accesses are never halved: 64 of them a thread ran 15 % slower than 32
        # (1000 x 30001 bfloat16 on an H100).
        if softmax_forward and tpr >= _RECOMPUTED_FROM_THREADS and vec > 1:
            # Kept exponentials (a float32 register per element) leave room for at most two
            # blocks of 512 threads per SM, one of 1024. Half the threads, each holding twice
            # the elements and computing each exponential again for the write (one exp2), take
            # fewer registers a row in all, so twice the rows share an SM (the build is held
            # to 64 registers a thread: ``programs``), one loading while another computes.
            # Measured on an H100 in bf16 (graph replay), GPU time before -> after: 4096 x 32000
            # 194 -> 178 us, 4096 x 32768 191 -> 187, 3000 x 24576 117 -> 110, 6000 x 11008 92
            # -> 88, 2048 x 16384 44.7 -> 43.8; rows of 128 threads and fewer gained nothing
            # either way (16384 x 4096 87.6 / 87.9 us, 8192 x 2048 21.6 / 21.4), so they keep
            # theirs.
            return {"variant": "register", "vec": vec, "threads": tpr // 2, "rows": 1, "keep": False, **shifted}
        rows = max(1, _MIN_BLOCK_THREADS // tpr)
        return {"variant": "register", "vec": vec, "threads": tpr * rows, "rows": rows, **shifted}
    if softmax_forward and _short_rows_stay_in_l2(n * dtype.itemsize, facts):
        # Four 512-thread blocks per SM keep as much in flight as two of 1024, and start a
        # row's second pass while another's first runs, as long as the L2 still holds each row
        # for its second pass. Measured on an H100 (50 MiB of L2: rows of up to 97 KiB), GPU
        # time of 1024 x 4 -> 512 x 8: 3000 x 40000 bfloat16 213 -> 169 us, 2000 x 36000
        # float16 137 -> 105; longer rows, which the rule leaves alone, won at 98 KiB too (1500
        # x 50304 bfloat16 126 -> 109 us), tied at 128 KiB (1024 x 65536 bfloat16 97.8 / 97.4)
        # and lost at 200 KiB (600 x 100000 96 -> 120 us), where the rows no longer fit.
        return {"variant": "streamed", "vec": vec, "threads": _STREAMED_SHORT_THREADS, "unroll": _STREAMED_SHORT_UNROLL, **shifted}
    return {"variant": "streamed", "vec": vec, "threads": _STREAMED_THREADS, "unroll": _STREAMED_UNROLL, **shifted}


def _short_rows_stay_in_l2(row_bytes: int, facts: DeviceFacts | None) -> bool:
    """Whether the rows of every 512-thread block the GPU runs at once fit in its L2 together
    (False where the facts do not say)."""
    if facts is None or not facts.threads_per_sm:
        return False
    return bool(rows_fit_l2(facts, facts.threads_per_sm // _STREAMED_SHORT_THREADS, row_bytes))


def split_rows(sm_count: int) -> int:
    """Calls of at most this many rows take the streamed kernel's split build: fewer rows than
    SMs leave SMs idle with one block per row."""
    return max(1, sm_count - 1)


def split_config(n: int, dtype: torch.dtype, config: dict[str, Any], sm_count: int) -> dict[str, Any] | None:
    """The split build's configuration beside streamed ``config``, or None where a row is too
    short to cut into two chunks of ``_MIN_CHUNK_BYTES``. The chunk count gives one row about
    ``_BLOCKS_PER_SM`` blocks per SM."""
    most = (n * dtype.itemsize) // _MIN_CHUNK_BYTES
    chunks = min(_BLOCKS_PER_SM * sm_count, most)
    if chunks < 2:
        return None
    layout = {key: config[key] for key in ("vec", "shifted") if key in config}
    return {"variant": "streamed", **layout, "threads": _SPLIT_THREADS, "unroll": _STREAMED_UNROLL, "chunks": chunks}


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


def tuning_candidates(
    variant: str, n: int, dtype: torch.dtype, aligned: bool, *, pointers_aligned: bool = False,
    softmax_forward: bool = False, facts: DeviceFacts | None = None,
) -> list[dict[str, Any]]:
    """Main-build configurations worth timing, the default first: half and twice the threads
    per row (register), or 512 threads and other unrolls, and pass 2 from the row's end
    (streamed).

    A register thread holds at most 64 elements; past 32 (a 16-bit row's default is four
    16-byte accesses, 32 elements, a thread) it keeps no exponentials (``keep=False``), and at
    32 or fewer it keeps them (a softmax forward's; ``keep`` means nothing to the others)."""
    default = launch_config(
        variant, n, dtype, aligned, pointers_aligned=pointers_aligned, softmax_forward=softmax_forward, facts=facts
    )
    candidates = [default]
    if variant == "register":
        tpr = default["threads"] // default["rows"]
        fewest = 2 * default["vec"] if default.get("shifted") else 1  # a shifted row's edge readers
        for threads_per_row in (tpr // 2, tpr * 2):
            held = math.ceil(n / default["vec"] / max(1, threads_per_row)) * default["vec"]  # elements per thread
            if fewest <= threads_per_row <= programs.MAX_THREADS and held <= 2 * _MAX_ELEMENTS_PER_THREAD:
                rows = max(1, _MIN_BLOCK_THREADS // threads_per_row)
                candidate = {**default, "threads": threads_per_row * rows, "rows": rows}
                candidate.pop("keep", None)
                if held > _MAX_ELEMENTS_PER_THREAD:
                    candidate["keep"] = False
                candidates.append(candidate)
    else:
        for threads, unroll in ((1024, 4), (512, 4), (1024, 2), (512, 8)):
            candidate = {**default, "threads": threads, "unroll": unroll}
            if candidate not in candidates:
                candidates.append(candidate)
        # Pass 2 from the row's end: no rule takes it, as the loss kernels' fused step (the same
        # two passes over a row in one block) showed no direction ahead once the loads carried
        # eviction priorities (H100, rows that overflow L2, forwards / from the end: 4096 x
        # 128256 761 / 767 us, 2048 x 151936 511 / 489, 1024 x 256000 486 / 468, 3000 x
        # 100000 463 / 468); a tuning request times it.
        candidates.append({**default, "from_end": True})
    return candidates
