"""The softmax family's ``register`` programs (CUDA), forward and backward: ``tpr`` threads per row,
``rows`` rows per block, each thread holding its slice of the row in registers, so the row is read
once: a max and a sum reduction (one sum backward), then the write (see ``programs``, whose
``make_program`` checks a configuration and calls ``make_register``). Importing this module does
not import tilelang; building a program does.
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func's annotations.

import math

import torch

from ..row_layout import GEOMETRY
from .row_math import row_math

#: Threads an SM runs at once where each takes 64 registers (its 64K 32-bit registers).
_THREADS_AT_64_REGISTERS = 1024


def make_register(
    kind: str, n: int, dtype: torch.dtype, out_dtype: torch.dtype, log: bool, *, vec: int, threads: int, rows: int,
    keep: bool, shifted: bool,
):
    """The register program of a checked configuration (``programs.make_program``'s keywords)."""
    import tilelang.language as T

    tpr = threads // rows
    rm = row_math(dtype, out_dtype, log, n=n, vec=vec, shifted=shifted, threads=threads, tpr=tpr)
    dt, odt, f32, lanes, m, nv = rm.dt, rm.odt, "float32", rm.lanes, rm.m, rm.nv
    locate, first_access, accesses, edge, has_edge = rm.locate, rm.first_access, rm.accesses, rm.edge, rm.has_edge
    neg_inf, value, exp, shift_of, reduce = rm.neg_inf, rm.value, rm.exp, rm.shift_of, rm.reduce
    forward_value, finish_statistics = rm.forward_value, rm.finish_statistics
    gradient_term, gradient = rm.gradient_term, rm.gradient
    backward = kind == "backward"

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
                    stat[1] = gradient_term(edges[0], edges[1])
            for it in T.unroll(iters):
                if it * tpr + lane < accesses(geo):
                    for v in T.unroll(vec):
                        stat[1] = stat[1] + gradient_term(gbuf[it * vec + v], ybuf[it * vec + v])
            reduce(stat, 1, False, red, tx)
            if row < m:
                for it in T.unroll(iters):
                    if it * tpr + lane < accesses(geo):
                        for v in T.unroll(vec):
                            out[v] = T.cast(gradient(gbuf[it * vec + v], ybuf[it * vec + v], stat[1]), dt)
                        for v in lanes(vec):
                            dxf[(first_access(geo, row) + it * tpr + lane) * vec + v] = out[v]
                if shifted:
                    if has_edge(geo, lane):
                        dxf[edge(geo, row, lane)] = T.cast(gradient(edges[0], edges[1], stat[1]), dt)

    return main
