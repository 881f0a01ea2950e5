"""The norm kernels' launch policy: which variant serves a call (refusals), which launch
configuration a variant's main build runs for a shape, and what tuning tries, from the row's
length, its dtype and the GPU's architecture and shared memory (pure Python: no tilelang).

Variants (selection takes the ones that do not refuse a call, in the preference order the
kernel classes declare):

* ``register``  each thread keeps its slice of the row in registers between the
  statistics pass and the normalisation pass; x is read from HBM once.
* ``shared``    the row is parked in shared memory instead, for rows too long
  for the register file; x is still read from HBM once.
* ``streamed``  nothing is held: the row is read again for the second pass,
  kept in L1/L2 in between by eviction-priority loads (rows and weight/bias
  "evict last", the re-read "evict first"; sm_80 and later, plain loads
  before), so any row length fits.
* ``scalar``    the fallback for any N and any alignment: element-wise
  (unvectorised) accesses, register-cached for short rows, streamed otherwise.

The first three use 16-byte vector accesses and therefore need
N * itemsize % 16 == 0 and every row starting 16-byte aligned (the data pointers,
and a row view's pitch).

A variant's kernel runs its launch configuration (``launch_config``) and may have
three more builds for some calls, by x's size (``builds``: decode, few-row, evict-first).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..powers import pow2_ceil
from ..row_layout import vector_width

KINDS = ("rms_norm", "layer_norm", "add_rms_norm", "add_layer_norm")

VARIANTS = ("register", "shared", "streamed", "scalar")

DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Measured on an H200 (bf16): the rms kinds are fastest with the row in
# registers; the layer-norm kinds (more live values per element) are fastest
# with it in shared memory, which keeps occupancy up, except for short rows,
# where registers won: up to 1 KiB for layer_norm (4-9%), up to 2 KiB for
# add_layer_norm (N = 1000 and 1024: 1-14% on 4096 rows, 1% on 65536).
_LAYER_NORM_REGISTER_MAX_ROW_BYTES = {"layer_norm": 1024, "add_layer_norm": 2048}
# The streamed single norms (the kinds of _STREAMED_VECTORS_PER_THREAD), whose rows
# stay on chip by eviction priority, beat 'shared' on long rows: 4% on 16384 x 16384
# rms_norm, 12% on layer_norm (bf16 and fp16; 3% slower on 2048 x 16384 rms_norm,
# still ahead of torch.compile). Layer-norm rows of at most 4 KiB also go streamed
# (N = 1000: 7% in bf16 on 4096 rows, 8% in fp32; a tie on 65536 rows of 1024 and on
# 2048-element rows).
_STREAMED_MIN_ROW_BYTES = 32 * 1024
_LAYER_NORM_STREAMED_MAX_SHORT_ROW_BYTES = 4 * 1024

# Largest row, in bytes, that each cached variant serves (see their refusals).
_REGISTER_MAX_ROW_BYTES = 8 * 1024
_SHARED_MAX_ROW_BYTES = 128 * 1024
# The scalar fallback keeps at most this many elements per thread in registers.
_SCALAR_MAX_CACHED_PER_THREAD = 16
MAX_THREADS = 1024
# Vectors each thread loads in one step of the streamed single norms, whose rows stay
# on chip by eviction priority: on an H200 (bf16, N = 1000 .. 16384) layer_norm was
# fastest with all of a thread's vectors in flight, up to 8, and at least a warp per
# row; rms_norm with 4 (N = 16384: 1024 threads per row ran 1.5x slower than 512).
_STREAMED_VECTORS_PER_THREAD = {"layer_norm": 8, "rms_norm": 4}


# --------------------------------------------------------------------------
# Refusals.
# --------------------------------------------------------------------------


def _common_refusal(n: int, dtype: torch.dtype) -> str | None:
    if dtype not in DTYPES:
        return f"dtype {dtype} is not supported: use float16, bfloat16 or float32"
    if n < 1:
        return f"N={n}: the normalised dimension must hold at least one element"
    return None


def _vector_refusal(n: int, dtype: torch.dtype, aligned: bool) -> str | None:
    reason = _common_refusal(n, dtype)
    if reason:
        return reason
    itemsize = dtype.itemsize
    if (n * itemsize) % 16:
        return (
            f"rows of N={n} {dtype} elements are {n * itemsize} bytes, not a multiple of 16: "
            "16-byte vector access needs N a multiple of "
            f"{16 // itemsize}; the 'scalar' variant serves any N"
        )
    if not aligned:
        return "a row does not start 16-byte aligned: pass 16-byte aligned tensors (row views: a pitch of whole vectors) or use 'scalar'"
    return None


def register_refusal(n: int, dtype: torch.dtype, aligned: bool) -> str | None:
    """None if the 'register' variant serves (n, dtype, aligned), else why not.

    Needs 16-byte vector access and a row of at most 8 KiB (N <= 4096 in
    16-bit types, 2048 in float32). Longer rows need more live registers per
    thread than the register file holds at full occupancy: on an H200 the
    fused and layer-norm kinds then ran 1.5-10x slower than 'shared'.
    """
    reason = _vector_refusal(n, dtype, aligned)
    if reason:
        return reason
    if n * dtype.itemsize > _REGISTER_MAX_ROW_BYTES:
        return (
            f"a row of {n * dtype.itemsize} bytes exceeds the register variant's "
            f"{_REGISTER_MAX_ROW_BYTES} bytes: use 'shared' or 'streamed'"
        )
    return None


def shared_refusal(n: int, dtype: torch.dtype, aligned: bool) -> str | None:
    """None if the 'shared' variant serves (n, dtype, aligned), else why not.

    Needs 16-byte vector access and a row of at most 128 KiB of shared
    memory (N <= 65536 in 16-bit types, 32768 in float32); on an H200 it
    reached 4.0 TB/s at N = 16384 .. 65536.
    """
    reason = _vector_refusal(n, dtype, aligned)
    if reason:
        return reason
    if n * dtype.itemsize > _SHARED_MAX_ROW_BYTES:
        return (
            f"a row of {n * dtype.itemsize} bytes exceeds the shared variant's "
            f"{_SHARED_MAX_ROW_BYTES} bytes: use 'streamed'"
        )
    return None


def streamed_refusal(n: int, dtype: torch.dtype, aligned: bool) -> str | None:
    """None if the 'streamed' variant serves (n, dtype, aligned), else why not.

    Serves any row length; needs only 16-byte vector access. The row is
    read twice, the second time from L1 or L2, where eviction priorities keep
    it: on an H200 rms_norm and layer_norm of 16384 x 16384 (bf16) ran at
    4.2 TB/s, the device-to-device copy's speed.
    """
    return _vector_refusal(n, dtype, aligned)


def scalar_refusal(n: int, dtype: torch.dtype, aligned: bool) -> str | None:
    """None if the 'scalar' fallback serves (n, dtype, aligned), else why not.

    Serves every N >= 1 at any alignment; refuses only unsupported dtypes.
    """
    return _common_refusal(n, dtype)


REFUSALS = {
    "register": register_refusal,
    "shared": shared_refusal,
    "streamed": streamed_refusal,
    "scalar": scalar_refusal,
}


def refusal(
    kind: str, variant: str, n: int, dtype: torch.dtype, aligned: bool, shared_per_block: int | None = None
) -> str | None:
    """None if ``variant`` should serve (kind, n, dtype, aligned) on a GPU that gives a block at
    most ``shared_per_block`` bytes of shared memory (None: not known, taken as enough), else
    why not.

    The variant's own limits, plus the measured preferences: layer-norm rows over
    1 KiB (2 KiB fused with the residual add) are faster in 'shared' than in
    'register', so 'register' leaves them; single-norm rows of 32 KiB or more, and
    layer-norm rows of at most 4 KiB, are faster 'streamed', so 'shared' leaves them;
    and 'shared' leaves the rows the GPU's shared memory cannot park (``shared_memory_refusal``).
    """
    reason = REFUSALS[variant](n, dtype, aligned)
    if reason is not None:
        return reason
    row_bytes = n * dtype.itemsize
    if variant == "register" and kind in _LAYER_NORM_REGISTER_MAX_ROW_BYTES:
        limit = _LAYER_NORM_REGISTER_MAX_ROW_BYTES[kind]
        if row_bytes > limit:
            return f"{kind} rows over {limit} bytes run faster in the 'shared' variant (this row is {row_bytes} bytes)"
    if variant == "shared" and kind in _STREAMED_VECTORS_PER_THREAD:
        if row_bytes >= _STREAMED_MIN_ROW_BYTES:
            return (
                f"{kind} rows of {_STREAMED_MIN_ROW_BYTES} bytes or more run faster in the "
                f"'streamed' variant (this row is {row_bytes} bytes)"
            )
        if kind == "layer_norm" and row_bytes <= _LAYER_NORM_STREAMED_MAX_SHORT_ROW_BYTES:
            return (
                f"{kind} rows of at most {_LAYER_NORM_STREAMED_MAX_SHORT_ROW_BYTES} bytes run faster in the "
                f"'streamed' variant (this row is {row_bytes} bytes)"
            )
    if variant == "shared":
        return shared_memory_refusal(kind, n, dtype, shared_per_block)
    return None



def check_kind(kind: str, has_bias: bool) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}: expected one of {KINDS}")
    if has_bias and kind.endswith("rms_norm"):
        raise ValueError(f"{kind} takes no bias")



# --------------------------------------------------------------------------
# Launch configuration.
# --------------------------------------------------------------------------


def launch_config(kind: str, variant: str, n: int, dtype: torch.dtype) -> dict[str, Any]:
    """Launch configuration of a variant (``make_program``'s keywords).

    From H200 measurements (bf16, graph replay, N = 256 .. 65536):
    * rms_norm was fastest with two 16-byte vectors per thread, layer-norm
      kinds (two reductions, more live values) with four, but never fewer
      than 16 threads per row (N = 256: 1-2% on 32768 rows, 2% on 262144);
    * add_rms_norm with one vector per thread, within the 256-thread cap
      (N = 256 .. 2048: 2-17% faster than two on L2-resident inputs, 1-2%
      on HBM-bound ones);
    * add_layer_norm in registers with two vectors per thread where the row
      is a power of two of vectors (N = 512 and 1024 in 16 bits, 256 and 512
      in fp32: 1-2% faster than four on 65536 rows, up to 11% on 4096 and 64
      rows), four otherwise (N = 1000: two lost 6-8% on 4096 rows);
    * rows of more than 256 threads lost 5-45% in register mode (barrier
      waits, fewer resident blocks), while the shared and streamed modes
      want about 8-16 vectors per thread on very long rows;
    * loading weight and bias before the reduction paid for rows of at most
      2 KiB (3-17%) and cost up to 50% on long rows (register spills);
    * short rows share a block so that blocks have at least 128 threads;
    * the streamed single norms, whose second pass re-reads the row from
      cache, as ``_STREAMED_VECTORS_PER_THREAD`` says.
    """
    check_kind(kind, False)
    per_thread = {"rms_norm": 2, "add_rms_norm": 1}.get(kind, 4)
    min_tpr = 16 if kind.endswith("layer_norm") else 1
    preload = False
    unroll = 4
    if variant == "streamed" and kind in _STREAMED_VECTORS_PER_THREAD:
        per_thread = unroll = _STREAMED_VECTORS_PER_THREAD[kind]
        min_tpr = 32
    if variant == "scalar":
        vec = 1
        per_thread = 8
        max_tpr = MAX_THREADS
        cached = math.ceil(n / MAX_THREADS) <= _SCALAR_MAX_CACHED_PER_THREAD
        mode = "register" if cached else "streamed"
    else:
        vec = vector_width(dtype)
        mode = variant
        nv = n // vec
        if variant == "register":
            max_tpr = 256
            preload = n * dtype.itemsize <= 2048
            if kind == "add_layer_norm" and nv == pow2_ceil(nv):
                per_thread = 2
        elif variant == "shared":
            # Rows of the largest size served (8192 vectors, 128 KiB) ran 5-10% faster with
            # 1024 threads than with 512 when tuned on an H200 (64 x 65536, bf16).
            max_tpr = MAX_THREADS if nv >= 8192 else min(max(256, pow2_ceil(math.ceil(nv / 16))), MAX_THREADS)
        else:
            max_tpr = MAX_THREADS
    tpr = min(pow2_ceil(math.ceil(n // vec / per_thread)), max_tpr)
    if variant != "scalar":
        tpr = max(tpr, min(min_tpr, pow2_ceil(n // vec)))
    rows = max(1, 128 // tpr)
    return {"vec": vec, "tpr": tpr, "rows": rows, "mode": mode, "unroll": unroll, "preload": preload}


def tuning_candidates(
    kind: str, variant: str, n: int, dtype: torch.dtype, shared_per_block: int | None = None
) -> list[dict[str, Any]]:
    """Launch configurations worth timing for (kind, variant, n, dtype), the default first.

    Around the default: half and twice the threads per row, more or fewer rows per
    block, weight/bias preloaded or not (cached modes), and 2-8 vectors in flight
    (streamed mode), each within the shared memory a block may have (``shared_budget``).
    The default's measurements were taken on HBM-bound sizes; on inputs that sit in L2,
    or on another GPU, a neighbour can win.
    """
    default = launch_config(kind, variant, n, dtype)
    vec, tpr, mode = default["vec"], default["tpr"], default["mode"]
    vectors = n // vec
    cap = 256 if mode == "register" else MAX_THREADS
    thread_counts = sorted({t for t in (tpr // 2, tpr, tpr * 2) if 1 <= t <= cap and t <= pow2_ceil(vectors)})
    candidates = [default]
    for threads_per_row in thread_counts:
        for block_threads in (128, 256, 512):
            rows = max(1, block_threads // threads_per_row)
            if threads_per_row * rows > MAX_THREADS:
                continue
            preloads = (False, True) if mode != "streamed" and n * dtype.itemsize <= 4096 else (False,)
            unrolls = (2, 4, 8) if mode == "streamed" else (default["unroll"],)
            for preload in preloads:
                for unroll in unrolls:
                    candidates.append(
                        {**default, "tpr": threads_per_row, "rows": rows, "preload": preload, "unroll": unroll}
                    )
    unique = []
    for config in candidates:
        if config not in unique and shared_bytes(n, dtype, config) <= shared_budget(shared_per_block):
            unique.append(config)
    return unique


def shared_bytes(n: int, dtype: torch.dtype, config: dict[str, Any]) -> int:
    """Bytes of shared memory a block of ``config`` takes: the rows it parks (shared mode) and
    its reduction's float32 partials, two per warp of each row."""
    warps = math.ceil(config["tpr"] / 32) * config["rows"]
    scratch = 2 * warps * 4
    if config["mode"] != "shared":
        return scratch
    vectors_per_thread = math.ceil(n // config["vec"] / config["tpr"])
    return vectors_per_thread * config["tpr"] * config["rows"] * config["vec"] * dtype.itemsize + scratch


def shared_budget(shared_per_block: int | None) -> int:
    """The shared memory a block of the forward kernels may take on a device that gives a block at
    most ``shared_per_block`` bytes (None: not known, taken as enough): the shared variant's rows
    of up to ``_SHARED_MAX_ROW_BYTES`` fit the opt-in of sm_80 (163 KiB) and sm_90 (227 KiB), not
    that of sm_86 and sm_89 (99 KiB)."""
    ceiling = _SHARED_MAX_ROW_BYTES + 1024  # the longest parked row and its reduction's scratch
    return ceiling if shared_per_block is None else min(ceiling, shared_per_block)


def shared_memory_refusal(kind: str, n: int, dtype: torch.dtype, shared_per_block: int | None) -> str | None:
    """Why the 'shared' variant does not serve rows of ``n`` on a device that gives a block at
    most ``shared_per_block`` bytes of shared memory (its launch would fail there), or None."""
    need = shared_bytes(n, dtype, launch_config(kind, "shared", n, dtype))
    if need <= shared_budget(shared_per_block):
        return None
    return (
        f"a row of {n * dtype.itemsize} bytes takes {need} bytes of shared memory a block and this GPU gives "
        f"a block at most {shared_per_block}: the 'streamed' variant serves it"
    )
