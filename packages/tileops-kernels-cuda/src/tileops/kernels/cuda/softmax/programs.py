"""TileLang programs of the softmax kernels (CUDA), forward and backward, and their compilation.

Every program works on (m, n) rows, m symbolic (one compiled program serves every row count; row
indices are 64-bit, so m * n may pass 2**31), n, the dtypes and the function compile-time
constants. Forward: y = softmax(x) or log_softmax(x) per row, in ``out_dtype``, each row
accumulated in float32 (x is rounded to ``out_dtype`` first where that is not wider, as torch
converts it). Backward: dx = y * (dy - sum(dy * y)) or dy - exp(y) * sum(dy), in dy's dtype.

Variants (``make_program``'s ``variant``):

* ``register``: ``tpr`` threads per row, ``rows`` rows per block; each thread holds its slice
  of the row in registers, so the row is read once: a max and a sum reduction (one sum
  backward), then the write.
* ``streamed``: one block per row (or per chunk of a row, below); pass 1 reads the row keeping a
  running max and a running sum rescaled to it (the online softmax), the block combines the
  threads' pairs, pass 2 reads the row again and writes. Pass 1 loads "evict last" and pass 2
  "evict first" (16-byte accesses on sm_80 and later), so the second read comes from L2.
* the split row: the same two passes in two launches over (row, chunk) blocks, so that a few
  long rows still fill every SM. ``phase="partial"`` writes each chunk's (max, sum) to a float32
  workspace of (m, chunks, 2); ``phase="finish"`` combines a row's pairs and writes its chunk.
  ``phase="whole"`` is the one-launch streamed program.

An access is ``vec`` elements: 16 bytes where the call is aligned, else 1 (any length and
alignment). A ``shifted`` program takes rows that are not whole 16-byte accesses in tensors
whose data pointers are aligned: 16-byte accesses over each row's aligned middle and the elements
around it one by one (``row_layout``, where every program's flat addressing is explained).
Kernel call convention (positional, caller-allocated outputs)::

    forward   kernel(x, y)            [split: partial(x, ws), finish(x, ws, y)]
    backward  kernel(dy, y, dx)       [split: partial(dy, y, ws), finish(dy, y, ws, dx)]

Importing this module does not import tilelang; building a program does.
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func's annotations.

import math

import torch

from ..cache_hints import PRIORITY_LOADS, has_cache_priorities
from ..compile import GUARDED_BY_THE_PROGRAM, compile_once
from ..row_layout import GEOMETRY, RowLayout

_TL_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
KINDS = ("forward", "backward")
VARIANTS = ("register", "streamed")
PHASES = ("whole", "partial", "finish")
MAX_THREADS = 1024
#: Threads an SM runs at once where each takes 64 registers (its 64K 32-bit registers).
_THREADS_AT_64_REGISTERS = 1024
#: exp(d) is computed as exp2(d * log2(e)): one MUFU instruction where CUDA's precise expf spends
#: about ten; the per-element exponentials were the register kernel's bottleneck on rows of 32000
#: (compute, not memory, set its time with one 1024-thread block per SM). d = x - max is formed
#: first, so the rounding of the product is relative to d, not to x.
_LOG2E = 1.4426950408889634


def rounds_input(dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Whether x is rounded to ``out_dtype`` before the math: torch converts x to the requested
    dtype first, which changes values only where that dtype is not wider."""
    return out_dtype != dtype and out_dtype.itemsize <= dtype.itemsize


def make_program(
    kind: str,
    n: int,
    dtype: torch.dtype,
    out_dtype: torch.dtype,
    log: bool,
    *,
    variant: str,
    vec: int,
    threads: int,
    rows: int = 1,
    unroll: int = 4,
    chunks: int = 1,
    phase: str = "whole",
    cache_priorities: bool = True,
    keep: bool = True,
    shifted: bool = False,
):
    """The TileLang PrimFunc of one configuration (see the module and ``policy.launch_config``).

    threads: threads per block; rows (register): rows per block, each of ``threads // rows``
    threads (a power of two); unroll (streamed): accesses in flight per thread and step;
    chunks (streamed): chunks per row of the split phases; cache_priorities: whether the streamed
    passes may load with eviction priorities (PTX of sm_80 and later); keep (register softmax
    forward): whether a thread keeps each float32 exponential for the write, or computes it
    again there (half the registers per element: room for twice the elements per thread);
    shifted: rows that are not whole accesses, covered by aligned accesses and edges (see the
    module; a row's threads, at least ``2 * vec``, read its edges).
    """
    if kind not in KINDS or variant not in VARIANTS or phase not in PHASES:
        raise ValueError(f"unknown kind {kind!r}, variant {variant!r} or phase {phase!r}")
    if kind == "backward" and out_dtype != dtype:
        raise ValueError(f"the backward writes dx in dy's dtype: out_dtype {out_dtype} must be {dtype}")
    tpr = threads // rows
    if n < 1 or (n % vec and not shifted) or tpr & (tpr - 1) or tpr * rows != threads or threads > MAX_THREADS:
        raise ValueError(f"bad launch configuration vec={vec} threads={threads} rows={rows} for n={n}")
    if shifted and tpr < 2 * vec:
        raise ValueError(f"a shifted program needs 2 * vec threads per row to read the edges: vec={vec}, {tpr} threads")
    if variant == "register" and phase != "whole":
        raise ValueError("the register variant has one phase")
    if phase == "whole" and chunks != 1:
        raise ValueError(f"the one-launch program covers a whole row: chunks must be 1, got {chunks}")
    import tilelang.language as T

    dt, odt, f32 = _TL_DTYPES[dtype], _TL_DTYPES[out_dtype], "float32"
    backward = kind == "backward"
    rounded = rounds_input(dtype, out_dtype)
    lanes = T.vectorized if vec > 1 else T.serial
    nv = n // vec  # accesses per row (a shifted row has nv or nv - 1)
    warps = max(1, tpr // 32)  # warps per row
    neg_inf = -T.infinity(f32)
    m = T.dynamic("m", "int64")

    layout = RowLayout(n, vec, shifted)
    locate, first_access, accesses, edge, has_edge = (
        layout.locate, layout.first_access, layout.accesses, layout.edge, layout.has_edge
    )

    def value(element):
        """An input element as float32, rounded to out_dtype first where torch would round it."""
        if rounded:
            return T.cast(T.cast(element, odt), f32)
        return T.cast(element, f32)

    def exp(d):
        return T.exp2(d * _LOG2E)

    def rescale(old, new):
        # exp(old - new), exactly 1 where they are equal (both -inf or both +inf included).
        return T.if_then_else(old == new, T.float32(1.0), exp(old - new))

    def shift_of(peak):
        # The max subtracted before exp: 0 where the row holds only -inf, whose terms are then 0.
        return T.if_then_else(peak == neg_inf, T.float32(0.0), peak)

    @T.macro
    def reduce(stat, i, maximum, red, tx):
        """stat[i] reduced (max or sum) over the threads of each row; every thread gets it."""
        if tpr <= 32:
            for off in [1 << k for k in reversed(range(tpr.bit_length() - 1))]:
                if maximum:
                    stat[i] = T.max(stat[i], T.shfl_xor(stat[i], off))
                else:
                    stat[i] = stat[i] + T.shfl_xor(stat[i], off)
        else:
            stat[i] = T.warp_reduce_max(stat[i]) if maximum else T.warp_reduce_sum(stat[i])
            if tx % 32 == 0:
                red[i * (threads // 32) + tx // 32] = stat[i]
            T.sync_threads()
            stat[i] = red[i * (threads // 32) + (tx // tpr) * warps]
            for k in range(1, warps):
                if maximum:
                    stat[i] = T.max(stat[i], red[i * (threads // 32) + (tx // tpr) * warps + k])
                else:
                    stat[i] = stat[i] + red[i * (threads // 32) + (tx // tpr) * warps + k]

    def forward_value(v, stat):
        """y of one element from its float32 value and the row's (max, sum, log-sum) in stat."""
        if log:
            return (v - shift_of(stat[0])) - stat[2]
        return exp(v - shift_of(stat[0])) * stat[2]

    @T.macro
    def finish_statistics(stat):
        # stat[2]: 1 / sum for softmax, log(sum) for log-softmax, computed once per thread.
        if log:
            stat[2] = T.log(stat[1])
        else:
            stat[2] = T.float32(1.0) / stat[1]

    if variant == "register":
        iters = math.ceil(nv / tpr)  # accesses per thread
        # A build that keeps no exponentials exists to run two blocks per SM where one that
        # does runs one, so ptxas is told that two must fit. Left to itself, it gave halved
        # 512-thread blocks 70-72 registers a thread (bfloat16 rows of 30001, 30522, 24576: one
        # block per SM); bounded, 64 and no spills. Measured on an H100 (GPU time, bf16),
        # halved build unbounded -> bounded: 2048 x 30522 146.6 -> 100.4 us (full width 120.3,
        # Liger-Kernel 133.8), 1000 x 30001 72.5 -> 54.1, 3000 x 24576 108.4 -> 99.9; unchanged
        # where two fitted already (4096 x 32000 177.0, 2048 x 16384 47.3, 6000 x 11008 89.8).
        # Four 256-thread blocks would cap those at 64 registers too, where a halved 16384-element
        # row spills (172 bytes, ptxas), and a 1024-thread build at two blocks would get 32:
        # neither is asked.
        resident_blocks = 2 if not keep and 2 * threads <= _THREADS_AT_64_REGISTERS else 1

        def row_index(bx, tx):
            return T.cast(bx, "int64") * rows + tx // tpr

        if not backward:

            @T.prim_func
            def main(x: T.Tensor((m, n), dt), y: T.Tensor((m, n), odt)):
                with T.Kernel(T.ceildiv(m, rows), threads=threads) as bx:
                    if resident_blocks > 1:
                        T.annotate_min_blocks_per_sm(resident_blocks)
                    xf, yf = T.reshape(x, (m * n,)), T.reshape(y, (m * n,))
                    tx = T.get_thread_binding()
                    lane = tx % tpr
                    row = row_index(bx, tx)
                    # Threads past the last row read a valid one (they join the barriers) and store nothing.
                    src = T.min(row, m - 1)
                    geo = T.alloc_local((GEOMETRY,), "int64")
                    buf = T.alloc_local((iters * vec,), dt)
                    ebuf = T.alloc_local((1,), dt)  # the thread's edge element (shifted)
                    out = T.alloc_local((vec,), odt)
                    stat = T.alloc_local((3,), f32)
                    red = T.alloc_shared((2 * max(1, threads // 32),), f32)
                    locate(geo, src)
                    for it in T.unroll(iters):
                        if it * tpr + lane < accesses(geo):
                            for v in lanes(vec):
                                buf[it * vec + v] = xf[(first_access(geo, src) + it * tpr + lane) * vec + v]
                    stat[0] = neg_inf
                    if shifted:
                        if has_edge(geo, lane):
                            ebuf[0] = xf[edge(geo, src, lane)]
                            stat[0] = value(ebuf[0])
                    for it in T.unroll(iters):
                        if it * tpr + lane < accesses(geo):
                            for v in T.unroll(vec):
                                stat[0] = T.max(stat[0], value(buf[it * vec + v]))
                    reduce(stat, 0, True, red, tx)
                    # Softmax keeps each exponential for the write instead of computing it again
                    # (log-softmax writes v - shift - log(sum) and needs none): 43 -> 56 registers at
                    # 32000 bf16, still one 1024-thread block per SM. Measured only together with exp2.
                    keeps = keep and not log
                    kept = T.alloc_local((iters * vec if keeps else 1,), f32)
                    stat[1] = T.float32(0.0)
                    if shifted:
                        if has_edge(geo, lane):
                            stat[1] = exp(value(ebuf[0]) - shift_of(stat[0]))
                    for it in T.unroll(iters):
                        if it * tpr + lane < accesses(geo):
                            for v in T.unroll(vec):
                                if keeps:
                                    kept[it * vec + v] = exp(value(buf[it * vec + v]) - shift_of(stat[0]))
                                    stat[1] = stat[1] + kept[it * vec + v]
                                else:
                                    stat[1] = stat[1] + exp(value(buf[it * vec + v]) - shift_of(stat[0]))
                    reduce(stat, 1, False, red, tx)
                    finish_statistics(stat)
                    if row < m:
                        for it in T.unroll(iters):
                            if it * tpr + lane < accesses(geo):
                                for v in T.unroll(vec):
                                    if keeps:
                                        out[v] = T.cast(kept[it * vec + v] * stat[2], odt)
                                    else:
                                        out[v] = T.cast(forward_value(value(buf[it * vec + v]), stat), odt)
                                for v in lanes(vec):
                                    yf[(first_access(geo, row) + it * tpr + lane) * vec + v] = out[v]
                        if shifted:
                            if has_edge(geo, lane):
                                yf[edge(geo, row, lane)] = T.cast(forward_value(value(ebuf[0]), stat), odt)

            return main

        @T.prim_func
        def main(dy: T.Tensor((m, n), dt), y: T.Tensor((m, n), dt), dx: T.Tensor((m, n), dt)):
            with T.Kernel(T.ceildiv(m, rows), threads=threads) as bx:
                dyf, yf, dxf = T.reshape(dy, (m * n,)), T.reshape(y, (m * n,)), T.reshape(dx, (m * n,))
                tx = T.get_thread_binding()
                lane = tx % tpr
                row = row_index(bx, tx)
                src = T.min(row, m - 1)
                geo = T.alloc_local((GEOMETRY,), "int64")
                gbuf = T.alloc_local((iters * vec,), dt)
                ybuf = T.alloc_local((iters * vec,), dt)
                edges = T.alloc_local((2,), dt)  # the thread's edge element of dy and of y (shifted)
                out = T.alloc_local((vec,), dt)
                stat = T.alloc_local((3,), f32)
                red = T.alloc_shared((2 * max(1, threads // 32),), f32)
                locate(geo, src)
                for it in T.unroll(iters):
                    if it * tpr + lane < accesses(geo):
                        for v in lanes(vec):
                            gbuf[it * vec + v] = dyf[(first_access(geo, src) + it * tpr + lane) * vec + v]
                        for v in lanes(vec):
                            ybuf[it * vec + v] = yf[(first_access(geo, src) + it * tpr + lane) * vec + v]
                stat[1] = T.float32(0.0)
                if shifted:
                    if has_edge(geo, lane):
                        edges[0] = dyf[edge(geo, src, lane)]
                        edges[1] = yf[edge(geo, src, lane)]
                        stat[1] = _gradient_term(T, log, edges[0], edges[1])
                for it in T.unroll(iters):
                    if it * tpr + lane < accesses(geo):
                        for v in T.unroll(vec):
                            stat[1] = stat[1] + _gradient_term(T, log, gbuf[it * vec + v], ybuf[it * vec + v])
                reduce(stat, 1, False, red, tx)
                if row < m:
                    for it in T.unroll(iters):
                        if it * tpr + lane < accesses(geo):
                            for v in T.unroll(vec):
                                out[v] = T.cast(_gradient(T, log, gbuf[it * vec + v], ybuf[it * vec + v], stat[1]), dt)
                            for v in lanes(vec):
                                dxf[(first_access(geo, row) + it * tpr + lane) * vec + v] = out[v]
                    if shifted:
                        if has_edge(geo, lane):
                            dxf[edge(geo, row, lane)] = T.cast(_gradient(T, log, edges[0], edges[1], stat[1]), dt)

        return main

    # -- streamed: one block per row (phase "whole") or per (row, chunk) (the split phases) --------
    # A chunk's accesses are counted from the row's first; the first chunk also takes the edges.
    per_chunk = math.ceil(nv / chunks)  # accesses per chunk
    steps = math.ceil(per_chunk / (threads * unroll))
    hinted = cache_priorities and vec * dtype.itemsize == 16

    @T.macro
    def load(dst, di, src, index, priority):
        """vec elements of flat ``src`` from ``index`` (an access's first) into dst[di:]."""
        if hinted:
            T.call_extern("handle", f"tileops_load_{priority}", T.address_of(dst[di]), T.address_of(src[index]))
        else:
            for v in lanes(vec):
                dst[di + v] = src[index + v]

    def access(chunk, st, u, tx):
        return chunk * per_chunk + (st * unroll + u) * threads + tx

    def at(geo, row, chunk, st, u, tx):
        """The flat index of the access's first element."""
        return (first_access(geo, row) + access(chunk, st, u, tx)) * vec

    def in_chunk(geo, chunk, st, u, tx):
        local = (st * unroll + u) * threads + tx
        if chunks == 1:
            return local < accesses(geo)
        return T.And(local < per_chunk, chunk * per_chunk + local < accesses(geo))

    def edge_thread(geo, chunk, tx):
        return T.And(chunk == 0, has_edge(geo, tx))

    @T.macro
    def block_statistics(stat, red, tx):
        """Every thread's (running max, rescaled sum) in stat[0:2] made the block's."""
        stat[2] = stat[0]
        reduce(stat, 0, True, red, tx)
        stat[1] = stat[1] * rescale(stat[2], stat[0])
        reduce(stat, 1, False, red, tx)

    @T.macro
    def forward_pass1(xf, geo, row, chunk, tx, buf, stat, red):
        stat[0] = neg_inf
        stat[1] = T.float32(0.0)
        if shifted:
            if edge_thread(geo, chunk, tx):
                buf[0] = xf[edge(geo, row, tx)]
                stat[0] = value(buf[0])
                stat[1] = exp(stat[0] - shift_of(stat[0]))  # 1, or 0 for -inf (as the loop adds it)
        for st in T.serial(steps):
            for u in T.unroll(unroll):
                if in_chunk(geo, chunk, st, u, tx):
                    load(buf, u * vec, xf, at(geo, row, chunk, st, u, tx), "evict_last")
            stat[2] = stat[0]
            for u in T.unroll(unroll):
                if in_chunk(geo, chunk, st, u, tx):
                    for v in T.unroll(vec):
                        stat[2] = T.max(stat[2], value(buf[u * vec + v]))
            stat[1] = stat[1] * rescale(stat[0], stat[2])
            for u in T.unroll(unroll):
                if in_chunk(geo, chunk, st, u, tx):
                    for v in T.unroll(vec):
                        stat[1] = stat[1] + exp(value(buf[u * vec + v]) - shift_of(stat[2]))
            stat[0] = stat[2]
        block_statistics(stat, red, tx)

    @T.macro
    def forward_pass2(xf, yf, geo, row, chunk, tx, buf, out, stat):
        finish_statistics(stat)
        for st in T.serial(steps):
            for u in T.unroll(unroll):
                if in_chunk(geo, chunk, st, u, tx):
                    load(buf, u * vec, xf, at(geo, row, chunk, st, u, tx), "evict_first")
            for u in T.unroll(unroll):
                if in_chunk(geo, chunk, st, u, tx):
                    for v in T.unroll(vec):
                        out[v] = T.cast(forward_value(value(buf[u * vec + v]), stat), odt)
                    for v in lanes(vec):
                        yf[at(geo, row, chunk, st, u, tx) + v] = out[v]
        if shifted:
            if edge_thread(geo, chunk, tx):
                yf[edge(geo, row, tx)] = T.cast(forward_value(value(xf[edge(geo, row, tx)]), stat), odt)

    @T.macro
    def backward_pass1(dyf, yf, geo, row, chunk, tx, gbuf, ybuf, stat, red):
        stat[1] = T.float32(0.0)
        if shifted:
            if edge_thread(geo, chunk, tx):
                stat[1] = _gradient_term(T, log, dyf[edge(geo, row, tx)], yf[edge(geo, row, tx)])
        for st in T.serial(steps):
            for u in T.unroll(unroll):
                if in_chunk(geo, chunk, st, u, tx):
                    load(gbuf, u * vec, dyf, at(geo, row, chunk, st, u, tx), "evict_last")
                    if not log:
                        load(ybuf, u * vec, yf, at(geo, row, chunk, st, u, tx), "evict_last")
            for u in T.unroll(unroll):
                if in_chunk(geo, chunk, st, u, tx):
                    for v in T.unroll(vec):
                        stat[1] = stat[1] + _gradient_term(T, log, gbuf[u * vec + v], ybuf[u * vec + v])
        reduce(stat, 1, False, red, tx)

    @T.macro
    def backward_pass2(dyf, yf, dxf, geo, row, chunk, tx, gbuf, ybuf, out, stat):
        for st in T.serial(steps):
            for u in T.unroll(unroll):
                if in_chunk(geo, chunk, st, u, tx):
                    load(gbuf, u * vec, dyf, at(geo, row, chunk, st, u, tx), "evict_first")
                    load(ybuf, u * vec, yf, at(geo, row, chunk, st, u, tx), "evict_first")
            for u in T.unroll(unroll):
                if in_chunk(geo, chunk, st, u, tx):
                    for v in T.unroll(vec):
                        out[v] = T.cast(_gradient(T, log, gbuf[u * vec + v], ybuf[u * vec + v], stat[1]), dt)
                    for v in lanes(vec):
                        dxf[at(geo, row, chunk, st, u, tx) + v] = out[v]
        if shifted:
            if edge_thread(geo, chunk, tx):
                dxf[edge(geo, row, tx)] = T.cast(
                    _gradient(T, log, dyf[edge(geo, row, tx)], yf[edge(geo, row, tx)], stat[1]), dt
                )

    @T.macro
    def combine_chunks(ws, row, tx, stat, red):
        """The row's statistics from its chunks' pairs in the workspace (every thread gets them)."""
        stat[0] = neg_inf
        stat[1] = T.float32(0.0)
        for c0 in T.serial(math.ceil(chunks / threads)):
            if c0 * threads + tx < chunks:
                if backward:
                    stat[1] = stat[1] + ws[row, c0 * threads + tx, 1]
                else:
                    stat[2] = T.max(stat[0], ws[row, c0 * threads + tx, 0])
                    stat[1] = stat[1] * rescale(stat[0], stat[2]) + ws[row, c0 * threads + tx, 1] * rescale(
                        ws[row, c0 * threads + tx, 0], stat[2]
                    )
                    stat[0] = stat[2]
        if backward:
            reduce(stat, 1, False, red, tx)
        else:
            block_statistics(stat, red, tx)

    @T.macro
    def store_partial(ws, row, chunk, tx, stat):
        if tx == 0:
            ws[row, chunk, 0] = stat[0]
            ws[row, chunk, 1] = stat[1]

    def prelude():
        if hinted:
            T.import_source(PRIORITY_LOADS)

    red_size = 2 * max(1, threads // 32)
    if not backward:
        if phase == "whole":

            @T.prim_func
            def main(x: T.Tensor((m, n), dt), y: T.Tensor((m, n), odt)):
                with T.Kernel(m, threads=threads) as bx:
                    prelude()
                    xf, yf = T.reshape(x, (m * n,)), T.reshape(y, (m * n,))
                    tx = T.get_thread_binding()
                    row = T.cast(bx, "int64")
                    geo = T.alloc_local((GEOMETRY,), "int64")
                    buf = T.alloc_local((unroll * vec,), dt)
                    out = T.alloc_local((vec,), odt)
                    stat = T.alloc_local((3,), f32)
                    red = T.alloc_shared((red_size,), f32)
                    locate(geo, row)
                    forward_pass1(xf, geo, row, 0, tx, buf, stat, red)
                    forward_pass2(xf, yf, geo, row, 0, tx, buf, out, stat)

            return main

        if phase == "partial":

            @T.prim_func
            def main(x: T.Tensor((m, n), dt), ws: T.Tensor((m, chunks, 2), f32)):
                with T.Kernel(m, chunks, threads=threads) as (bx, by):
                    prelude()
                    xf = T.reshape(x, (m * n,))
                    tx = T.get_thread_binding()
                    row = T.cast(bx, "int64")
                    geo = T.alloc_local((GEOMETRY,), "int64")
                    buf = T.alloc_local((unroll * vec,), dt)
                    stat = T.alloc_local((3,), f32)
                    red = T.alloc_shared((red_size,), f32)
                    locate(geo, row)
                    forward_pass1(xf, geo, row, by, tx, buf, stat, red)
                    store_partial(ws, row, by, tx, stat)

            return main

        @T.prim_func
        def main(x: T.Tensor((m, n), dt), ws: T.Tensor((m, chunks, 2), f32), y: T.Tensor((m, n), odt)):
            with T.Kernel(m, chunks, threads=threads) as (bx, by):
                prelude()
                xf, yf = T.reshape(x, (m * n,)), T.reshape(y, (m * n,))
                tx = T.get_thread_binding()
                row = T.cast(bx, "int64")
                geo = T.alloc_local((GEOMETRY,), "int64")
                buf = T.alloc_local((unroll * vec,), dt)
                out = T.alloc_local((vec,), odt)
                stat = T.alloc_local((3,), f32)
                red = T.alloc_shared((red_size,), f32)
                locate(geo, row)
                combine_chunks(ws, row, tx, stat, red)
                forward_pass2(xf, yf, geo, row, by, tx, buf, out, stat)

        return main

    if phase == "whole":

        @T.prim_func
        def main(dy: T.Tensor((m, n), dt), y: T.Tensor((m, n), dt), dx: T.Tensor((m, n), dt)):
            with T.Kernel(m, threads=threads) as bx:
                prelude()
                dyf, yf, dxf = T.reshape(dy, (m * n,)), T.reshape(y, (m * n,)), T.reshape(dx, (m * n,))
                tx = T.get_thread_binding()
                row = T.cast(bx, "int64")
                geo = T.alloc_local((GEOMETRY,), "int64")
                gbuf = T.alloc_local((unroll * vec,), dt)
                ybuf = T.alloc_local((unroll * vec,), dt)
                out = T.alloc_local((vec,), dt)
                stat = T.alloc_local((3,), f32)
                red = T.alloc_shared((red_size,), f32)
                locate(geo, row)
                backward_pass1(dyf, yf, geo, row, 0, tx, gbuf, ybuf, stat, red)
                backward_pass2(dyf, yf, dxf, geo, row, 0, tx, gbuf, ybuf, out, stat)

        return main

    if phase == "partial":

        @T.prim_func
        def main(dy: T.Tensor((m, n), dt), y: T.Tensor((m, n), dt), ws: T.Tensor((m, chunks, 2), f32)):
            with T.Kernel(m, chunks, threads=threads) as (bx, by):
                prelude()
                dyf, yf = T.reshape(dy, (m * n,)), T.reshape(y, (m * n,))
                tx = T.get_thread_binding()
                row = T.cast(bx, "int64")
                geo = T.alloc_local((GEOMETRY,), "int64")
                gbuf = T.alloc_local((unroll * vec,), dt)
                ybuf = T.alloc_local((unroll * vec,), dt)
                stat = T.alloc_local((3,), f32)
                red = T.alloc_shared((red_size,), f32)
                locate(geo, row)
                backward_pass1(dyf, yf, geo, row, by, tx, gbuf, ybuf, stat, red)
                stat[0] = T.float32(0.0)  # the backward's pair holds its sum only
                store_partial(ws, row, by, tx, stat)

        return main

    @T.prim_func
    def main(
        dy: T.Tensor((m, n), dt), y: T.Tensor((m, n), dt), ws: T.Tensor((m, chunks, 2), f32), dx: T.Tensor((m, n), dt)
    ):
        with T.Kernel(m, chunks, threads=threads) as (bx, by):
            prelude()
            dyf, yf, dxf = T.reshape(dy, (m * n,)), T.reshape(y, (m * n,)), T.reshape(dx, (m * n,))
            tx = T.get_thread_binding()
            row = T.cast(bx, "int64")
            geo = T.alloc_local((GEOMETRY,), "int64")
            gbuf = T.alloc_local((unroll * vec,), dt)
            ybuf = T.alloc_local((unroll * vec,), dt)
            out = T.alloc_local((vec,), dt)
            stat = T.alloc_local((3,), f32)
            red = T.alloc_shared((red_size,), f32)
            locate(geo, row)
            combine_chunks(ws, row, tx, stat, red)
            backward_pass2(dyf, yf, dxf, geo, row, by, tx, gbuf, ybuf, out, stat)

    return main


def _gradient_term(T, log, dy_element, y_element):
    """One element's term of the row's sum in the gradient, in float32: dy (log-softmax) or dy * y."""
    if log:
        return T.cast(dy_element, "float32")
    return T.cast(dy_element, "float32") * T.cast(y_element, "float32")


def _gradient(T, log, dy_element, y_element, total):
    """dx of one element, in float32: dy - exp(y) * sum(dy) (log-softmax) or y * (dy - sum(dy * y))."""
    g, y = T.cast(dy_element, "float32"), T.cast(y_element, "float32")
    if log:
        return g - T.exp2(y * _LOG2E) * total
    return y * (g - total)


def compile_program(kind, n, dtype, out_dtype, log, target, **config):
    """The compiled kernel of one configuration for ``target``, once per process (and on disk)."""
    identity = ("softmax", kind, n, dtype, out_dtype, bool(log), tuple(sorted(config.items())))
    priorities = has_cache_priorities(target)
    return compile_once(
        identity,
        lambda: make_program(kind, n, dtype, out_dtype, log, cache_priorities=priorities, **config),
        target,
        pass_configs=GUARDED_BY_THE_PROGRAM,
    )
