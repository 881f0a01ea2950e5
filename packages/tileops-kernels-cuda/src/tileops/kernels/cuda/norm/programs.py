"""TileLang programs for the forward pass of row normalisations (CUDA).

The TileLang programs of TileOPs' norm kernels: each normalises every row of a
row-major, contiguous (..., N) tensor over its last dimension:

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

The launch configuration (``make_program``'s keywords) and the variant come from
``policy``; ``compile_config`` compiles one build, once per process (the shared
runtime's ``compile_once``).

Kernel call convention (positional, caller-allocated outputs, no out_idx)::

    rms_norm        kernel(x, [weight], y)
    layer_norm      kernel(x, [weight], [bias], y)
    add_rms_norm    kernel(x, residual, [weight], y, s)
    add_layer_norm  kernel(x, residual, [weight], [bias], y, s)

An argument in brackets is absent from the call (not passed as None) when its
flag (``has_weight`` / ``has_bias``) is False. x, residual, y and s are (..., N),
M >= 1 rows; weight and bias are (N,). A build with ``save_stats`` also takes,
last, the statistics it normalised each row with (of s for the fused kinds), as
the backward reads them: ``mean`` (the layer-norm kinds only) and ``rstd``,
float32 of shape (...), x's leading dimensions. The kernel launches on torch's
current stream, does not synchronise and allocates nothing. Every tensor must be
contiguous and on the same device.

Importing this module does not import tilelang (that costs seconds and the
library must import without it); only building a program does.
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func
# annotations, which must stay objects rather than strings.

import math

import torch

from tileops.ops.vector_access import VECTOR_BYTES

from ..cache_hints import PRIORITY_LOADS, has_cache_priorities
from ..compile import compile_once
from .builds import has_evict_first_build
from .policy import MAX_THREADS, check_kind

_TL_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


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
    save_stats: bool = False,
    row_strides: tuple[int, ...] | None = None,
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
    vectors and cache priorities; see ``evict_first_elements``); save_stats: also
    write each row's mean (layer-norm kinds) and rstd, once, by the row's first
    thread (every thread of a row holds them once reduced); without it the program
    is the one built before the flag existed; row_strides: the pitch of x (and of
    the residual), in elements, for a build that reads them as row views (slices of
    wider rows): (M, N) tensors whose rows are that far apart (one leading
    dimension; y and s stay contiguous). A compile-time pitch keeps every row start
    a provable multiple of the vector, so the accesses stay 16-byte vectors.
    """
    check_kind(kind, has_bias)
    if n % vec or tpr & (tpr - 1) or tpr * rows > MAX_THREADS:
        raise ValueError(f"bad launch configuration vec={vec} tpr={tpr} rows={rows} for N={n}")
    if leading < 0:
        raise ValueError(f"leading={leading}: a count of leading dimensions is at least 0")
    if row_strides is not None and (
        leading != 1 or len(row_strides) != (2 if kind.startswith("add_") else 1)
        or any(pitch < n or pitch % vec for pitch in row_strides)
    ):
        raise ValueError(
            f"row_strides={row_strides} for {kind} N={n} vec={vec} leading={leading}: one pitch per row input "
            "(x, and residual for the fused kinds), each at least N and a whole number of vectors, one leading dimension"
        )
    fused = kind.startswith("add_")
    layer = kind.endswith("layer_norm")
    if evict_first_inputs and not (has_evict_first_build(kind, mode, vec, dtype) and cache_priorities):
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
    def row_input(position):
        if row_strides is None:
            return T.Tensor((*batch, n), dt)
        return T.StridedTensor((*batch, n), (row_strides[position], 1), dt)

    x_t, y_t = row_input(0), T.Tensor((*batch, n), dt)
    r_t = row_input(1) if fused else absent
    s_t = T.Tensor((*batch, n), dt) if fused else absent
    w_t = T.Tensor((n,), dt) if has_weight else absent
    b_t = T.Tensor((n,), dt) if has_bias else absent
    mean_t = T.Tensor(tuple(batch), f32) if save_stats and layer else absent
    rstd_t = T.Tensor(tuple(batch), f32) if save_stats else absent

    def f(e):
        return T.cast(e, f32)

    # Loop over the lanes of one access: vectorised for 16-byte accesses, a
    # plain loop for the scalar variant's single lane.
    lanes = T.vectorized if vec > 1 else T.serial
    # Where the cached modes hold the row between the passes, the streamed mode
    # keeps it in L1/L2 by cache priority: rows and weight/bias are loaded
    # "evict last" and the second pass's re-read "evict first" (16-byte accesses).
    prioritised = cache_priorities and mode == "streamed" and vec * dtype.itemsize == VECTOR_BYTES
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
    def main(x_in: x_t, r_in: r_t, w: w_t, b: b_t, y_in: y_t, s_in: s_t, mean_in: mean_t, rstd_in: rstd_t):
        # The kernel body indexes (row, column) views of the caller's tensors.
        # (Row views are (m, n) already: a reshape would drop their pitch.)
        x = x_in if row_strides is not None else T.reshape(x_in, (m, n))
        y = T.reshape(y_in, (m, n))
        r = r_in if row_strides is not None or not fused else T.reshape(r_in, (m, n))
        s = T.reshape(s_in, (m, n)) if fused else s_in
        # The statistics as (m,) views of their data (T.reshape refuses the 0-dim one of a single row).
        mean_out = T.Tensor((m,), f32, mean_in.data) if save_stats and layer else mean_in
        rstd_out = T.Tensor((m,), f32, rstd_in.data) if save_stats else rstd_in
        with T.Kernel(T.ceildiv(m, rows), threads=threads) as bx:
            if hinted:
                T.import_source(PRIORITY_LOADS)
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
                if save_stats:
                    # Every thread of the row holds the reduced statistics: one stores them.
                    if lane == 0:
                        rstd_out[row] = rstd
                        if layer:
                            # A product of its own (__fmul_rn: never fused, nor shared with
                            # `mean`): were `mean` stored, the compiler would round the product a
                            # plain build fuses into each x - mean (one FFMA) and subtract that,
                            # and y would differ from the plain build's in the last bit.
                            mean_out[row] = T.call_extern(f32, "__fmul_rn", acc[0], f(inv_n))
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


def compile_config(kind, n, dtype, eps, has_weight, has_bias, target, **config):
    """The kernel of one build: ``make_program`` for a launch configuration (its keywords,
    ``leading`` and ``save_stats`` included) and a TileLang target, compiled once per process
    (and kept on disk by TileLang). Safe to call from several threads: distinct configurations
    compile concurrently.
    """
    identity = ("norm", kind, n, dtype, float(eps), bool(has_weight), bool(has_bias), tuple(sorted(config.items())))
    priorities = has_cache_priorities(target)
    return compile_once(
        identity,
        lambda: make_program(kind, n, dtype, eps, has_weight, has_bias, cache_priorities=priorities, **config),
        target,
    )
