"""TileLang programs for the forward pass of row normalisations (CUDA).

Role: this module is the kernel layer of TileOPs' norm operators. It builds and
compiles TileLang kernels that normalise each row of a row-major, contiguous
(..., N) tensor over its last dimension:

* ``rms_norm``        y = x * rsqrt(mean(x^2) + eps) [* weight]
* ``layer_norm``      y = (x - mean) * rsqrt(var + eps) [* weight] [+ bias]
  (biased variance, as torch computes it)
* ``add_rms_norm``    s = x + residual, y = rms_norm(s); returns y and s
* ``add_layer_norm``  s = x + residual, y = layer_norm(s); returns y and s

For the fused kinds, s is rounded to the input dtype first and the statistics
are computed from that rounded s, exactly as ``F.rms_norm(x + r)`` does in
torch. Inputs may be float16, bfloat16 or float32 (weight and bias in x's
dtype); statistics are accumulated in float32; outputs are in x's dtype.

The leading dimensions are dynamic (symbolic), so one compiled kernel serves
every batch size of a given rank (``leading``: how many leading dimensions; the
rows M are their product); N, the dtype, eps and the weight/bias flags are
compile-time constants.

Variants (the dispatcher chooses with the ``*_refusal`` functions, or takes
``choose_variant``, which applies them in a measured preference order):

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
N * itemsize % 16 == 0 and 16-byte aligned data pointers.

A variant's kernel runs its launch configuration (``launch_config``) and may have
two more builds for some calls, by x's size: a few-row build (``few_row_config``)
and an evict-first one for the fused kinds (``evict_first_elements``).

Kernel call convention (positional, caller-allocated outputs, no out_idx)::

    rms_norm        kernel(x, [weight], y)
    layer_norm      kernel(x, [weight], [bias], y)
    add_rms_norm    kernel(x, residual, [weight], y, s)
    add_layer_norm  kernel(x, residual, [weight], [bias], y, s)

An argument in brackets is absent from the call (not passed as None) when its
flag (``has_weight`` / ``has_bias``) is False; ``kernel_arguments`` returns the
exact list. x, residual, y and s are (..., N), M >= 1 rows; weight and bias are
(N,). The kernel launches on torch's current stream, does not synchronise and
allocates nothing. Every tensor must be contiguous and on the same device.

Importing this module does not import tilelang (that costs seconds and the
library must import without it); only the build functions do.
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func
# annotations, which must stay objects rather than strings.

import json
import math
import re
import threading
from typing import Any

import torch

KINDS = ("rms_norm", "layer_norm", "add_rms_norm", "add_layer_norm")

VARIANTS = ("register", "shared", "streamed", "scalar")

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

DEFAULT_TARGET = {"kind": "cuda", "arch": "sm_90"}

_TL_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}

# Largest row, in bytes, that each cached variant serves (see their refusals).
_REGISTER_MAX_ROW_BYTES = 8 * 1024
_SHARED_MAX_ROW_BYTES = 128 * 1024
# The scalar fallback keeps at most this many elements per thread in registers.
_SCALAR_MAX_CACHED_PER_THREAD = 16
_MAX_THREADS = 1024
# Vectors each thread loads in one step of the streamed single norms, whose rows stay
# on chip by eviction priority: on an H200 (bf16, N = 1000 .. 16384) layer_norm was
# fastest with all of a thread's vectors in flight, up to 8, and at least a warp per
# row; rms_norm with 4 (N = 16384: 1024 threads per row ran 1.5x slower than 512).
_STREAMED_VECTORS_PER_THREAD = {"layer_norm": 8, "rms_norm": 4}
# The fused kinds in registers read x and the residual once. Loading them "evict first" leaves
# the L2 to the outputs, which pays on calls whose x is over 10 and at most 16 MiB. On an H200
# (ops called as in ``tileops bench``, fresh outputs each call; bf16, fp16, fp32, N = 256 ..
# 4096): 1-5% faster from 12 to 16 MiB (2048 x 4096 add_rms_norm bf16: 18.1 -> 17.4 us, as
# torch.compile's kernel, which loads them so), 7-18% slower from 7.8 to 10 MiB (inputs that
# a plain load would have kept in L2 for the next call), 2-5% slower from 20 MiB up. Those calls
# get a second build of the kernel (``evict_first_elements``): one kernel that chose by its
# row count cost up to 5% on the others.
_FUSED_EVICT_FIRST_X_BYTES = (10 * 2**20, 16 * 2**20)
#: Calls of at most this many rows take a kernel's few-row build (``few_row_config``), which
#: gives each row a block of its own in registers: on an H200 (bf16, 8 to 4096 rows) it beat the
#: default launch of rows over 1 and up to 4 KiB on every count up to 1024 rows (layer_norm 1.1-2.1x,
#: add_layer_norm 1.03-1.39x, rms_norm of 1024 1.02-1.05x); on 4096 rows of 1.5 and 2 KiB the
#: default led again by 3-7%.
FEW_ROWS = 1024
_FEW_ROW_BYTES = (1024, 4 * 1024)  # rows over the first and at most the second


# --------------------------------------------------------------------------
# Refusals: pure Python, no tilelang.
# --------------------------------------------------------------------------


def _common_refusal(n: int, dtype: torch.dtype) -> str | None:
    if dtype not in _TL_DTYPES:
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
        return "a data pointer is not 16-byte aligned: pass contiguous, 16-byte aligned tensors or use 'scalar'"
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


def refusal(kind: str, variant: str, n: int, dtype: torch.dtype, aligned: bool) -> str | None:
    """None if ``variant`` should serve (kind, n, dtype, aligned), else why not.

    The variant's own limits, plus the measured preferences: layer-norm rows over
    1 KiB (2 KiB fused with the residual add) are faster in 'shared' than in
    'register', so 'register' leaves them; single-norm rows of 32 KiB or more, and
    layer-norm rows of at most 4 KiB, are faster 'streamed', so 'shared' leaves them.
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
    return None


def choose_variant(kind: str, n: int, dtype: torch.dtype, aligned: bool) -> str:
    """The fastest variant serving (kind, n, dtype, aligned); ValueError if none does."""
    _check_kind(kind, False)
    for variant in VARIANTS:
        if refusal(kind, variant, n, dtype, aligned) is None:
            return variant
    raise ValueError(scalar_refusal(n, dtype, aligned))


def kernel_arguments(kind: str, has_weight: bool, has_bias: bool) -> tuple[str, ...]:
    """Names of the compiled kernel's positional arguments, in call order."""
    _check_kind(kind, has_bias)
    fused = kind.startswith("add_")
    args = ["x"]
    if fused:
        args.append("residual")
    if has_weight:
        args.append("weight")
    if has_bias:
        args.append("bias")
    args.append("y")
    if fused:
        args.append("s")
    return tuple(args)


def _check_kind(kind: str, has_bias: bool) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}: expected one of {KINDS}")
    if has_bias and kind.endswith("rms_norm"):
        raise ValueError(f"{kind} takes no bias")


# --------------------------------------------------------------------------
# Launch configuration: pure Python.
# --------------------------------------------------------------------------


def _pow2_floor(v: int) -> int:
    return 1 << (v.bit_length() - 1)


def _pow2_ceil(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


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
    _check_kind(kind, False)
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
        max_tpr = _MAX_THREADS
        cached = math.ceil(n / _MAX_THREADS) <= _SCALAR_MAX_CACHED_PER_THREAD
        mode = "register" if cached else "streamed"
    else:
        vec = 16 // dtype.itemsize
        mode = variant
        nv = n // vec
        if variant == "register":
            max_tpr = 256
            preload = n * dtype.itemsize <= 2048
            if kind == "add_layer_norm" and nv == _pow2_ceil(nv):
                per_thread = 2
        elif variant == "shared":
            # Rows of the largest size served (8192 vectors, 128 KiB) ran 5-10% faster with
            # 1024 threads than with 512 when tuned on an H200 (64 x 65536, bf16).
            max_tpr = _MAX_THREADS if nv >= 8192 else min(max(256, _pow2_ceil(math.ceil(nv / 16))), _MAX_THREADS)
        else:
            max_tpr = _MAX_THREADS
    tpr = min(_pow2_ceil(math.ceil(n // vec / per_thread)), max_tpr)
    if variant != "scalar":
        tpr = max(tpr, min(min_tpr, _pow2_ceil(n // vec)))
    rows = max(1, 128 // tpr)
    return {"vec": vec, "tpr": tpr, "rows": rows, "mode": mode, "unroll": unroll, "preload": preload}


def tuning_candidates(kind: str, variant: str, n: int, dtype: torch.dtype) -> list[dict[str, Any]]:
    """Launch configurations worth timing for (kind, variant, n, dtype), the default first.

    Around the default: half and twice the threads per row, more or fewer rows per
    block, weight/bias preloaded or not (cached modes), and 2-8 vectors in flight
    (streamed mode). The default's measurements were taken on HBM-bound sizes; on
    inputs that sit in L2, or on another GPU, a neighbour can win.
    """
    default = launch_config(kind, variant, n, dtype)
    vec, tpr, mode = default["vec"], default["tpr"], default["mode"]
    vectors = n // vec
    cap = 256 if mode == "register" else _MAX_THREADS
    thread_counts = sorted({t for t in (tpr // 2, tpr, tpr * 2) if 1 <= t <= cap and t <= _pow2_ceil(vectors)})
    candidates = [default]
    for threads_per_row in thread_counts:
        for block_threads in (128, 256, 512):
            rows = max(1, block_threads // threads_per_row)
            if threads_per_row * rows > _MAX_THREADS:
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
        if config not in unique and _shared_bytes(n, dtype, config) <= _SHARED_MAX_ROW_BYTES:
            unique.append(config)
    return unique


def _shared_bytes(n: int, dtype: torch.dtype, config: dict[str, Any]) -> int:
    """Bytes of shared memory a block parks rows in (shared mode; 0 otherwise)."""
    if config["mode"] != "shared":
        return 0
    vectors_per_thread = math.ceil(n // config["vec"] / config["tpr"])
    return vectors_per_thread * config["tpr"] * config["rows"] * config["vec"] * dtype.itemsize


# --------------------------------------------------------------------------
# Program construction and compilation (tilelang imported lazily).
# --------------------------------------------------------------------------


def make_program(
    kind: str,
    n: int,
    dtype: torch.dtype,
    eps: float,
    has_weight: bool,
    has_bias: bool,
    *,
    vec: int,
    tpr: int,
    rows: int,
    mode: str,
    unroll: int = 4,
    preload: bool = False,
    leading: int = 1,
    cache_priorities: bool = True,
    evict_first_inputs: bool = False,
):
    """The TileLang PrimFunc for one configuration (see ``launch_config``).

    vec: elements per access (16-byte vectors, or 1); tpr: threads per row, a
    power of two <= 1024; rows: rows per block; mode: where the row lives
    between the two passes, "register", "shared" or "streamed"; unroll:
    vectors in flight per thread and step in streamed mode; preload (cached modes):
    load weight and bias with x, before the reduction, rather than after it;
    leading: how many leading (batch) dimensions x, residual, y and s have, each
    symbolic: the kernel takes the caller's (..., N) tensors as they are, and
    its rows are their product (none: one row); cache_priorities: whether
    loads may carry eviction priorities (PTX of sm_80 and later; ``compile_config``
    decides from the target): the streamed mode's always do; evict_first_inputs:
    load x and the residual "evict first" (the fused kinds in registers with 16-byte
    vectors and cache priorities; see ``evict_first_elements``).
    """
    _check_kind(kind, has_bias)
    if n % vec or tpr & (tpr - 1) or tpr * rows > _MAX_THREADS:
        raise ValueError(f"bad launch configuration vec={vec} tpr={tpr} rows={rows} for N={n}")
    if leading < 0:
        raise ValueError(f"leading={leading}: a count of leading dimensions is at least 0")
    fused = kind.startswith("add_")
    layer = kind.endswith("layer_norm")
    if evict_first_inputs and not (_has_evict_first_build(kind, mode, vec, dtype) and cache_priorities):
        raise ValueError(
            f"evict_first_inputs is for the fused kinds in registers with 16-byte vectors and cache priorities, "
            f"not {kind} mode={mode} vec={vec} {dtype} cache_priorities={cache_priorities}"
        )
    import tilelang.language as T

    dt = _TL_DTYPES[dtype]
    f32 = "float32"
    threads = tpr * rows
    nv = n // vec  # vectors per row
    iters = math.ceil(nv / tpr)  # vectors per thread
    cached = mode in ("register", "shared")
    preload = preload and cached  # a streamed thread holds one step at a time
    # Cached modes walk all of a thread's vectors in one unrolled step; the
    # streamed mode walks them `unroll` at a time in a runtime loop.
    step = iters if cached else min(unroll, iters)
    steps = math.ceil(iters / step)
    warps_per_row = max(1, tpr // 32)
    inv_n = 1.0 / n
    eps = float(eps)

    batch = [T.dynamic("m" if leading == 1 else f"m{i}") for i in range(leading)]
    m = math.prod(batch, start=1)
    # Each parameter needs its own annotation object: parameters annotated with
    # the same object would share one buffer. An annotation that is not a
    # buffer makes the parameter a compile-time constant, left out of the
    # kernel's signature.
    absent = 0
    x_t, y_t = T.Tensor((*batch, n), dt), T.Tensor((*batch, n), dt)
    r_t = T.Tensor((*batch, n), dt) if fused else absent
    s_t = T.Tensor((*batch, n), dt) if fused else absent
    w_t = T.Tensor((n,), dt) if has_weight else absent
    b_t = T.Tensor((n,), dt) if has_bias else absent

    def f(e):
        return T.cast(e, f32)

    # Loop over the lanes of one access: vectorised for 16-byte accesses, a
    # plain loop for the scalar variant's single lane.
    lanes = T.vectorized if vec > 1 else T.serial
    # Where the cached modes hold the row between the passes, the streamed mode
    # keeps it in L1/L2 by cache priority: rows and weight/bias are loaded
    # "evict last" and the second pass's re-read "evict first" (16-byte accesses).
    prioritised = cache_priorities and mode == "streamed" and vec * dtype.itemsize == 16
    hinted = prioritised or evict_first_inputs
    # x is read again in pass 2 only by the streamed single norms (the fused kinds re-read s);
    # a load without priority is an ordinary one.
    x_priority = "evict_first" if evict_first_inputs else None if cached or fused else "evict_last"

    @T.macro
    def load_row(dst, di, src, row_, col, priority):
        if hinted and priority is not None:
            T.call_extern("handle", f"tileops_load_{priority}", T.address_of(dst[di]), T.address_of(src[row_, col]))
        else:
            for v in lanes(vec):
                dst[di + v] = src[row_, col + v]

    @T.macro
    def load_param(dst, di, src, col):
        if prioritised:
            T.call_extern("handle", "tileops_load_evict_last", T.address_of(dst[di]), T.address_of(src[col]))
        else:
            for v in lanes(vec):
                dst[di + v] = src[col + v]

    def normalised(c, wv, bv, mean, rstd):
        """y from c, the float32 value of x (or s), and weight/bias values there."""
        o = (c - mean) * rstd if layer else c * rstd
        if has_weight:
            o = o * f(wv)
        if has_bias:
            o = o + f(bv)
        return T.cast(o, dt)

    @T.macro
    def row_sum(acc, first, count, red, tx):
        """Replace acc[first:first + count] by their sums over each row's threads.

        Rows of up to 32 threads reduce with shuffles alone; longer rows add
        one round through shared memory (one barrier for all `count` values).
        """
        if tpr <= 32:
            for i in [first + c for c in range(count)]:
                for off in [1 << k for k in reversed(range(tpr.bit_length() - 1))]:
                    acc[i] = acc[i] + T.shfl_xor(acc[i], off)
        else:
            for i in [first + c for c in range(count)]:
                acc[i] = T.warp_reduce_sum(acc[i])
                if tx % 32 == 0:
                    red[i * rows * warps_per_row + tx // 32] = acc[i]
            T.sync_threads()
            for i in [first + c for c in range(count)]:
                acc[i] = f(0)
                for k in T.unroll(warps_per_row):
                    acc[i] = acc[i] + red[i * rows * warps_per_row + (tx // tpr) * warps_per_row + k]

    @T.prim_func
    def main(x_in: x_t, r_in: r_t, w: w_t, b: b_t, y_in: y_t, s_in: s_t):
        # The kernel body indexes (row, column) views of the caller's tensors.
        x = T.reshape(x_in, (m, n))
        y = T.reshape(y_in, (m, n))
        r = T.reshape(r_in, (m, n)) if fused else r_in
        s = T.reshape(s_in, (m, n)) if fused else s_in
        with T.Kernel(T.ceildiv(m, rows), threads=threads) as bx:
            if hinted:
                T.import_source(_PRIORITY_LOADS)
            tx = T.get_thread_binding()
            lane = tx % tpr
            row = bx * rows + tx // tpr
            # Threads past the last row of the tail block read a valid row (so
            # that they join the block's barriers without branches) and store nothing.
            src = T.min(row, m - 1)
            if mode == "register":
                buf = T.alloc_local((iters * vec,), dt)
            elif mode == "shared":
                buf = T.alloc_shared((iters * threads * vec,), dt)
            else:
                buf = T.alloc_local((step * vec,), dt)
            res = T.alloc_local((step * vec,), dt)  # residual (fused kinds)
            # Preloaded weight and bias (unused unless `preload`).
            wl = T.alloc_local((step * vec,), dt)
            bl = T.alloc_local((step * vec,), dt)
            red = T.alloc_shared((2 * rows * warps_per_row,), f32)
            # acc[0]: sum of squares (rms) or of values; acc[1]: of squared deviations.
            acc = T.alloc_local((2,), f32)
            acc[0] = f(0)
            acc[1] = f(0)
            mean = T.alloc_var(f32, init=0.0)
            rstd = T.alloc_var(f32, init=0.0)
            # Used by the streamed layer norm only (see below).
            shift = T.alloc_var(f32, init=0.0)
            count = T.alloc_var(f32, init=0.0)
            dev_sum = T.alloc_var(f32, init=0.0)
            gap = T.alloc_var(f32, init=0.0)

            # Pass 1: load (and add) the row, write s, accumulate statistics.
            for st in T.serial(steps):
                for u in T.unroll(step):
                    vi = (st * step + u) * tpr + lane
                    slot = (st * step + u) if cached else u
                    bi = (slot * threads + tx) * vec if mode == "shared" else slot * vec
                    if vi < nv:
                        load_row(buf, bi, x, src, vi * vec, x_priority)
                        if fused:
                            load_row(res, u * vec, r, src, vi * vec, "evict_first" if evict_first_inputs else None)
                        if preload and has_weight:
                            load_param(wl, u * vec, w, vi * vec)
                        if preload and has_bias:
                            load_param(bl, u * vec, b, vi * vec)
                for u in T.unroll(step):
                    vi = (st * step + u) * tpr + lane
                    slot = (st * step + u) if cached else u
                    bi = (slot * threads + tx) * vec if mode == "shared" else slot * vec
                    if vi < nv:
                        if fused:
                            for v in lanes(vec):
                                buf[bi + v] = T.cast(f(buf[bi + v]) + f(res[u * vec + v]), dt)
                            if row < m:
                                for v in lanes(vec):
                                    s[row, vi * vec + v] = buf[bi + v]
                        if layer and not cached:
                            # The streamed layer norm sums deviations from the
                            # thread's first value, which keeps the sums small.
                            if st == 0:
                                if u == 0:
                                    shift = f(buf[bi])
                            count = count + vec
                        for v in T.unroll(vec):
                            if not layer:
                                acc[0] = acc[0] + f(buf[bi + v]) * f(buf[bi + v])
                            elif cached:
                                acc[0] = acc[0] + f(buf[bi + v])
                            else:
                                acc[0] = acc[0] + (f(buf[bi + v]) - shift)
                                acc[1] = acc[1] + (f(buf[bi + v]) - shift) * (f(buf[bi + v]) - shift)

            if layer and cached:
                # Exact two-pass variance from the cached row.
                row_sum(acc, 0, 1, red, tx)
                mean = acc[0] * inv_n
                for it in T.unroll(iters):
                    vi = it * tpr + lane
                    bi = (it * threads + tx) * vec if mode == "shared" else it * vec
                    if vi < nv:
                        for v in T.unroll(vec):
                            acc[1] = acc[1] + (f(buf[bi + v]) - mean) * (f(buf[bi + v]) - mean)
                row_sum(acc, 1, 1, red, tx)
                rstd = T.rsqrt(acc[1] * inv_n + eps)
            elif layer:
                # With S1, S2 the thread's sums of d = x - shift and of d^2 over
                # its `count` values, and g = shift - mean, the thread's share of
                # sum((x - mean)^2) is exactly S2 + 2 g S1 + count g^2.
                dev_sum = acc[0]
                acc[0] = acc[0] + count * shift
                row_sum(acc, 0, 1, red, tx)
                mean = acc[0] * inv_n
                gap = shift - mean
                acc[1] = acc[1] + 2 * gap * dev_sum + count * gap * gap
                row_sum(acc, 1, 1, red, tx)
                rstd = T.rsqrt(acc[1] * inv_n + eps)
            else:
                row_sum(acc, 0, 1, red, tx)
                rstd = T.rsqrt(acc[0] * inv_n + eps)

            # Pass 2: normalise from the cached row, or re-read it (s holds the
            # rounded sum in the fused kinds) and normalise.
            if row < m:
                for st in T.serial(steps):
                    if not cached:
                        for u in T.unroll(step):
                            vi = (st * step + u) * tpr + lane
                            if vi < nv:
                                load_row(buf, u * vec, s if fused else x, row, vi * vec, "evict_first")
                    for u in T.unroll(step):
                        vi = (st * step + u) * tpr + lane
                        slot = (st * step + u) if cached else u
                        bi = (slot * threads + tx) * vec if mode == "shared" else slot * vec
                        if vi < nv:
                            if prioritised:
                                if has_weight:
                                    load_param(wl, u * vec, w, vi * vec)
                                if has_bias:
                                    load_param(bl, u * vec, b, vi * vec)
                            for v in lanes(vec):
                                col = vi * vec + v
                                if preload or prioritised:
                                    y[row, col] = normalised(f(buf[bi + v]), wl[u * vec + v], bl[u * vec + v], mean, rstd)
                                else:
                                    wv = w[col] if has_weight else None
                                    bv = b[col] if has_bias else None
                                    y[row, col] = normalised(f(buf[bi + v]), wv, bv, mean, rstd)

    return main


def _priority_load(priority: str) -> str:
    """CUDA source of tileops_load_<priority>(dst, src): one 16-byte global load
    with that eviction priority in L1 and in L2 (PTX createpolicy + cache_hint)."""
    return f"""
template <typename T>
__device__ __forceinline__ void tileops_load_{priority}(T* dst, const T* src) {{
  uint4 v;
  unsigned long long policy;
  asm("createpolicy.fractional.L2::{priority}.b64 %0, 1.0;" : "=l"(policy));
  asm("ld.global.L1::{priority}.L2::cache_hint.v4.u32 {{%0, %1, %2, %3}}, [%4], %5;"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(src), "l"(policy));
  *reinterpret_cast<uint4*>(dst) = v;
}}
"""


_PRIORITY_LOADS = _priority_load("evict_last") + _priority_load("evict_first")


def _has_evict_first_build(kind: str, mode: str, vec: int, dtype: torch.dtype) -> bool:
    return kind.startswith("add_") and mode == "register" and vec * dtype.itemsize == 16


def evict_first_elements(kind: str, dtype: torch.dtype, config: dict[str, Any], target: str | dict):
    """Sizes of x, in elements, on which the kernel of ``kind`` with launch ``config`` runs its
    second build, the one that loads x and the residual "evict first" (``make_program``'s
    ``evict_first_inputs``): over the first and at most the second. None where there is no
    such build (the single norms, other modes, GPUs without cache priorities).
    """
    if not (_has_evict_first_build(kind, config["mode"], config["vec"], dtype) and _has_cache_priorities(target)):
        return None
    above, up_to = _FUSED_EVICT_FIRST_X_BYTES
    return above // dtype.itemsize, up_to // dtype.itemsize


def few_row_config(kind: str, n: int, dtype: torch.dtype, config: dict[str, Any]) -> dict[str, Any] | None:
    """The launch configuration of the kernel's few-row build, for calls of at most ``FEW_ROWS``
    rows, or None where it has none.

    Rows of 16-bit elements over 1 and up to 4 KiB, in 16-byte vectors, whose launch ``config``
    is not already one register row per block: one row per block, in registers, about two
    vectors per thread. Measured on an H200 (bf16: layer_norm rows of 768 to 2048, add_layer_norm
    of 1024 and 2048, rms_norm of 1024; ``FEW_ROWS`` has the figures); shorter rows, where one
    row per block lost up to 9%, and float32 rows were not, and have none.
    """
    row_bytes = n * dtype.itemsize
    if dtype.itemsize != 2 or config["vec"] * dtype.itemsize != 16:
        return None
    if not _FEW_ROW_BYTES[0] < row_bytes <= _FEW_ROW_BYTES[1]:
        return None
    if config["mode"] == "register" and config["rows"] == 1:
        return None
    two_vectors_each = _pow2_floor(n // config["vec"] // 2)
    return {**config, "mode": "register", "rows": 1, "tpr": two_vectors_each, "unroll": 4, "preload": row_bytes <= 2048}


def _has_cache_priorities(target: str | dict) -> bool:
    """Whether ``target``'s GPU has L2 cache-policy loads (``createpolicy``: sm_80 and later).

    The architecture comes from the target (``{"arch": "sm_90"}``, ``-arch=sm_90``); a bare
    ``"cuda"`` means the current GPU, as TileLang reads it.
    """
    found = re.search(r"sm_(\d+)", json.dumps(target) if isinstance(target, dict) else str(target))
    if found:
        return int(found.group(1)) >= 80
    return not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] >= 8


_CACHE: dict[tuple, Any] = {}
# One lock per configuration, so that different configurations (tuning candidates) compile in
# parallel threads while one configuration still compiles once.
_KEY_LOCKS: dict[tuple, threading.Lock] = {}
_KEY_LOCKS_LOCK = threading.Lock()


def build(
    kind: str,
    variant: str,
    n: int,
    dtype: torch.dtype,
    eps: float,
    has_weight: bool = True,
    has_bias: bool = False,
    target: str | dict | None = None,
):
    """Compile (once per process) and return the kernel for one configuration.

    kind: one of ``KINDS``; variant: one of ``VARIANTS`` (it must not refuse
    ``n`` and ``dtype``; alignment is the caller's to check); n: row length;
    dtype: torch.float16 / bfloat16 / float32; eps: compile-time epsilon;
    has_weight / has_bias: whether those arguments exist (rms kinds take no
    bias); target: a tilelang target, ``DEFAULT_TARGET`` when None ("cuda"
    auto-detects on a machine with a GPU).

    The returned kernel is called with the tensors listed by
    ``kernel_arguments(kind, has_weight, has_bias)``, in that order.
    """
    _check_kind(kind, has_bias)
    if variant not in REFUSALS:
        raise ValueError(f"unknown variant {variant!r}: expected one of {VARIANTS}")
    reason = REFUSALS[variant](n, dtype, True)
    if reason:
        raise ValueError(f"{variant} variant cannot serve N={n} {dtype}: {reason}")
    target = DEFAULT_TARGET if target is None else target
    config = launch_config(kind, variant, n, dtype)
    return compile_config(kind, n, dtype, eps, has_weight, has_bias, target, **config)


def compile_config(kind, n, dtype, eps, has_weight, has_bias, target, **config):
    """``build`` for an explicit launch configuration (``make_program``'s keywords, ``leading``
    included).

    Cached per process on every argument; ``build`` and tuning use it. Safe to call from
    several threads: distinct configurations compile concurrently.
    """
    key = (kind, n, dtype, float(eps), bool(has_weight), bool(has_bias), json.dumps(target, sort_keys=True),
           tuple(sorted(config.items())))
    kernel = _CACHE.get(key)
    if kernel is not None:
        return kernel
    with _KEY_LOCKS_LOCK:
        lock = _KEY_LOCKS.setdefault(key, threading.Lock())
    with lock:
        kernel = _CACHE.get(key)
        if kernel is None:
            import tilelang

            priorities = _has_cache_priorities(target)
            program = make_program(kind, n, dtype, eps, has_weight, has_bias, cache_priorities=priorities, **config)
            kernel = tilelang.compile(program, target=target)
            _CACHE[key] = kernel
    return kernel
