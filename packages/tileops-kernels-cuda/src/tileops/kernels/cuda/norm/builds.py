"""The norm kernels' builds beside a variant's main one, each chosen per call by x's size
(``build_plan`` in the kernels' module): the decode build for calls of at most a row per SM
(``decode_config``), the few-row build for calls of at most ``few_rows`` rows
(``few_row_config``), the fused kinds' evict-first build for calls whose tensors straddle the L2
(``evict_first_elements``), and the configurations a tuning request times for a one-row-per-block
build (``one_row_candidates``). Rules from the SM count, the L2 size and the row; pure Python
(no tilelang).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tileops.ops.vector_access import VECTOR_BYTES

from ..powers import pow2_ceil, pow2_floor
from ..cache_hints import has_cache_priorities
from .policy import MAX_THREADS, check_kind

# The fused kinds in registers read x and the residual once. Loading them "evict first" leaves
# the L2 to the outputs, which pays on calls whose four tensors (x, the residual, y and the sum:
# four times x's bytes) are over two thirds of the L2 and at most 16/15 of it: they straddle it.
# On an H200 (60 MiB of L2: x over 10 and at most 16 MiB; ops called as in ``tileops bench``,
# fresh outputs each call; bf16, fp16, fp32, N = 256 .. 4096): 1-5% faster from 12 to 16 MiB
# (2048 x 4096 add_rms_norm bf16: 18.1 -> 17.4 us, as torch.compile's kernel, which loads them
# so), 7-18% slower from 7.8 to 10 MiB (inputs that a plain load would have kept in L2 for the
# next call), 2-5% slower from 20 MiB up. Those calls get a second build of the kernel
# (``evict_first_elements``): one kernel that chose by its row count cost up to 5% on the others.
_FUSED_EVICT_FIRST_L2_SHARE = ((2, 3), (16, 15))  # (numerator, denominator) of the L2's bytes
_FUSED_TENSORS = 4
# Calls of at most this many rows per SM take a kernel's few-row build (``few_row_config``),
# which gives each row a block of its own in registers: on an H200 (132 SMs; bf16, 8 to 4096
# rows) it beat the default launch of rows over 1 and up to 4 KiB on every count up to 1024 rows
# (layer_norm 1.1-2.1x, add_layer_norm 1.03-1.39x, rms_norm of 1024 1.02-1.05x); on 4096 rows of
# 1.5 and 2 KiB the default led again by 3-7%.
_FEW_ROWS_PER_SM = 8
_FEW_ROW_BYTES = (1024, 4 * 1024)  # rows over the first and at most the second
# Longer 16-bit rows of the rms kinds, up to 16 KiB, in registers or shared memory, keep their
# launch on few rows but load the weight with the row (the main build loads it after the
# reduction, which paid on thousands of rows: see ``policy.launch_config``). Measured on an H100
# against Liger-Kernel in the same run (graph replay; 140 to 2048 rows of 2560 to 8192): RMSNorm
# 264 x 5120 bf16 3.13 ->
# 2.76 us (Liger 3.04), 1056 x 3072 bf16 3.90 -> 3.53 (4.42), 300 x 2560 fp16 2.40 -> 2.18
# (2.37), fused 150 x 7168 bf16 3.65 -> 3.30 (3.35), 900 x 5120 bf16 10.63 -> 9.68 (10.22); rows
# of 8 KiB lost up to 7% (140 x 4096 bf16 1.86 -> 2.00, still ahead of Liger's 2.12), float32
# rows 1-4% (not taken), and a launch of one row per block in registers at about four vectors a
# thread (the decode build's) lost up to 18% on some of these calls. Longer rows were not measured.
_PRELOAD_KINDS = ("rms_norm", "add_rms_norm")
_PRELOAD_MAX_ROW_BYTES = 16 * 1024
# A call of at most one row per SM (decode: a token per sequence) is latency-bound: each row's
# time is its loads, one block reduction and its stores, with the SM to itself. The decode build
# issues all of a row's loads at once, weight and bias with x, in registers (the main builds of
# long rows stage them in shared memory or re-read them, and load the weight after the
# reduction: one more round trip to memory). Threads: about four 16-byte vectors each, but at
# least a warp for each of the SM's four schedulers and at most 16 warps, whose block reduction
# would cost more than the loads it spreads. Measured on an H100 against Liger-Kernel in the same
# run (1 to 68 rows of 1536 to 14336; graph replay): fused add+RMSNorm 1 x 7168 fp16 1.89 us
# (main build 2.66, Liger 2.08), RMSNorm 68 x 3072 bf16 1.77 (2.13, 1.86), 8 x 14336 fp32 3.13
# (3.79, 3.20), 1 x 5120 bf16 1.73 (2.27, 1.96); two vectors a thread (up to 1024 threads) took
# 0.04-0.21 us more on eight of the ten shapes, and more than four won only where 512 threads
# leave more (14336 fp32: seven). Rows that would need more vectors a thread than the second
# figure (over 64 KiB) keep their main build.
_DECODE_VECTORS_PER_THREAD = 4
_DECODE_MAX_VECTORS_PER_THREAD = 8
_DECODE_THREADS = (128, 512)


def has_evict_first_build(kind: str, mode: str, vec: int, dtype: torch.dtype) -> bool:
    return kind.startswith("add_") and mode == "register" and vec * dtype.itemsize == VECTOR_BYTES


def evict_first_elements(
    kind: str, dtype: torch.dtype, config: dict[str, Any], target: str | dict, l2_bytes: int | None
) -> tuple[int, int] | None:
    """Sizes of x, in elements, on which the kernel of ``kind`` with launch ``config`` runs its
    second build, the one that loads x and the residual "evict first" (``make_program``'s
    ``evict_first_inputs``): over the first and at most the second, the calls whose tensors
    straddle an L2 of ``l2_bytes``. None where there is no such build (the single norms, other
    modes, GPUs without cache priorities or whose L2 size is not known).
    """
    if not (has_evict_first_build(kind, config["mode"], config["vec"], dtype) and has_cache_priorities(target)):
        return None
    if not l2_bytes:
        return None
    per_element = _FUSED_TENSORS * dtype.itemsize
    return tuple(l2_bytes * numerator // (denominator * per_element) for numerator, denominator in _FUSED_EVICT_FIRST_L2_SHARE)


def few_rows(sm_count: int) -> int:
    """Calls of at most this many rows take a kernel's few-row build: ``_FEW_ROWS_PER_SM`` rows per
    SM, about as many one-row blocks as an SM runs at once (1056 on 132 SMs)."""
    return _FEW_ROWS_PER_SM * sm_count


def few_row_config(kind: str, n: int, dtype: torch.dtype, config: dict[str, Any]) -> dict[str, Any] | None:
    """The launch configuration of the kernel's few-row build, for calls of at most ``few_rows``
    rows, or None where it has none.

    Rows of 16-bit elements over 1 and up to 4 KiB, in 16-byte vectors, whose launch ``config``
    is not already one register row per block: one row per block, in registers, about two
    vectors per thread. Measured on an H200 (bf16: layer_norm rows of 768 to 2048, add_layer_norm
    of 1024 and 2048, rms_norm of 1024; ``_FEW_ROWS_PER_SM`` has the figures); shorter rows, where one
    row per block lost up to 9%, and float32 rows were not, and have none. Longer 16-bit rows of
    the rms kinds, up to 16 KiB, in registers or shared memory: their launch ``config`` with the
    weight loaded with the row (``_PRELOAD_KINDS`` has the figures).
    """
    row_bytes = n * dtype.itemsize
    if dtype.itemsize != 2 or config["vec"] * dtype.itemsize != VECTOR_BYTES:
        return None
    if row_bytes > _FEW_ROW_BYTES[1]:
        early_weight = (
            kind in _PRELOAD_KINDS and row_bytes <= _PRELOAD_MAX_ROW_BYTES
            and config["mode"] in ("register", "shared") and not config["preload"]
        )
        return {**config, "preload": True} if early_weight else None
    if row_bytes <= _FEW_ROW_BYTES[0]:
        return None
    if config["mode"] == "register" and config["rows"] == 1:
        return None
    two_vectors_each = pow2_floor(n // config["vec"] // 2)
    return {**config, "mode": "register", "rows": 1, "tpr": two_vectors_each, "unroll": 4, "preload": row_bytes <= 2048}


def decode_config(kind: str, n: int, dtype: torch.dtype, config: dict[str, Any]) -> dict[str, Any] | None:
    """The launch configuration of the kernel's decode build, for calls of at most one row per
    SM, or None where it has none: one row per block in registers, weight and bias loaded with
    the row, ``_DECODE_VECTORS_PER_THREAD`` vectors a thread within ``_DECODE_THREADS`` (no
    more threads than the row has vectors, to a power of two). None for the scalar variant's
    element-wise accesses, for rows that would need more than ``_DECODE_MAX_VECTORS_PER_THREAD``
    vectors a thread, and where it is the launch ``config`` itself."""
    check_kind(kind, False)
    vec = config["vec"]
    if vec * dtype.itemsize != VECTOR_BYTES:
        return None
    vectors = n // vec
    fewest, most = _DECODE_THREADS
    threads = min(most, max(min(fewest, pow2_ceil(vectors)), pow2_ceil(math.ceil(vectors / _DECODE_VECTORS_PER_THREAD))))
    if math.ceil(vectors / threads) > _DECODE_MAX_VECTORS_PER_THREAD:
        return None
    decode = {**config, "mode": "register", "rows": 1, "tpr": threads, "unroll": 4, "preload": True}
    return None if decode == config else decode


def one_row_candidates(n: int, dtype: torch.dtype, config: dict[str, Any]) -> list[dict[str, Any]]:
    """Configurations worth timing for a build of one row per block (the decode and few-row
    builds' ``config``), that one first: every power of two of threads per row from the fewest
    that hold the row at ``_DECODE_MAX_VECTORS_PER_THREAD`` vectors each to one thread per
    vector (at most 1024), the weight and bias loaded with the row or after the reduction, the
    row in the build's own place and, where that is shared memory, in registers (which won some
    calls of a few hundred rows). The rules were fitted on a few shapes of one GPU; another GPU,
    or another width, may want a neighbour."""
    vectors = n // config["vec"]
    fewest = pow2_ceil(math.ceil(vectors / _DECODE_MAX_VECTORS_PER_THREAD))
    modes = [config["mode"]] + (["register"] if config["mode"] == "shared" else [])
    candidates = [config]
    for mode in modes:
        for threads in (1 << k for k in range(fewest.bit_length() - 1, MAX_THREADS.bit_length())):
            if threads > pow2_ceil(vectors):
                break
            for preload in (True, False):
                candidate = {**config, "mode": mode, "tpr": threads, "preload": preload}
                if candidate not in candidates:
                    candidates.append(candidate)
    return candidates
