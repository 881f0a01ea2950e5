"""The softmax family's ``streamed`` programs (CUDA), forward and backward: one block per row, or
per (row, chunk) in the split phases (see ``programs``, whose ``make_program`` checks a
configuration and calls ``make_streamed``). Pass 1 reads the row keeping a running max and a
running sum rescaled to it (the online softmax), the block combines its threads' pairs, and
pass 2 reads the row again and writes: forwards, or from the row's end with ``from_end`` (starting
on what pass 1 read last, the part of a row L2 holds longest). Importing this module does not
import tilelang; building a program does.
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func's annotations.

import math

import torch

from tileops.ops.vector_access import VECTOR_BYTES

from ..cache_hints import PRIORITY_LOADS
from ..row_layout import GEOMETRY
from .row_math import row_math


def make_streamed(
    kind: str, n: int, dtype: torch.dtype, out_dtype: torch.dtype, log: bool, *, vec: int, threads: int, unroll: int,
    chunks: int, phase: str, cache_priorities: bool, shifted: bool, from_end: bool,
):
    """The streamed program of a checked configuration (``programs.make_program``'s keywords)."""
    import tilelang.language as T

    rm = row_math(dtype, out_dtype, log, n=n, vec=vec, shifted=shifted, threads=threads, tpr=threads)
    dt, odt, f32, lanes, m, nv = rm.dt, rm.odt, "float32", rm.lanes, rm.m, rm.nv
    locate, first_access, accesses, edge, has_edge = rm.locate, rm.first_access, rm.accesses, rm.edge, rm.has_edge
    neg_inf, value, exp, rescale, shift_of, reduce = rm.neg_inf, rm.value, rm.exp, rm.rescale, rm.shift_of, rm.reduce
    forward_value, finish_statistics = rm.forward_value, rm.finish_statistics
    gradient_term, gradient = rm.gradient_term, rm.gradient
    backward = kind == "backward"

    # One block per row (phase "whole") or per (row, chunk) (the split phases). A chunk's accesses
    # are counted from the row's first; the first chunk also takes the edges.
    per_chunk = math.ceil(nv / chunks)  # accesses per chunk
    steps = math.ceil(per_chunk / (threads * unroll))
    hinted = cache_priorities and vec * dtype.itemsize == VECTOR_BYTES

    @T.macro
    def load(dst, di, src, index, priority):
        """vec elements of flat ``src`` from ``index`` (an access's first) into dst[di:]."""
        if hinted:
            T.call_extern("handle", f"tileops_load_{priority}", T.address_of(dst[di]), T.address_of(src[index]))
        else:
            for v in lanes(vec):
                dst[di + v] = src[index + v]

    def group(st, u, second_pass=False):
        """Which of the chunk's groups of ``threads`` accesses step ``st`` takes at ``u``: in order,
        or from the last with ``from_end`` in the second pass."""
        index = st * unroll + u
        return steps * unroll - 1 - index if from_end and second_pass else index

    def at(geo, row, chunk, g, tx):
        """The flat index of the first element of thread ``tx``'s access in group ``g``."""
        return (first_access(geo, row) + chunk * per_chunk + g * threads + tx) * vec

    def in_chunk(geo, chunk, g, tx):
        local = g * threads + tx
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
                if in_chunk(geo, chunk, group(st, u), tx):
                    load(buf, u * vec, xf, at(geo, row, chunk, group(st, u), tx), "evict_last")
            stat[2] = stat[0]
            for u in T.unroll(unroll):
                if in_chunk(geo, chunk, group(st, u), tx):
                    for v in T.unroll(vec):
                        stat[2] = T.max(stat[2], value(buf[u * vec + v]))
            stat[1] = stat[1] * rescale(stat[0], stat[2])
            for u in T.unroll(unroll):
                if in_chunk(geo, chunk, group(st, u), tx):
                    for v in T.unroll(vec):
                        stat[1] = stat[1] + exp(value(buf[u * vec + v]) - shift_of(stat[2]))
            stat[0] = stat[2]
        block_statistics(stat, red, tx)

    @T.macro
    def forward_pass2(xf, yf, geo, row, chunk, tx, buf, out, stat):
        finish_statistics(stat)
        for st in T.serial(steps):
            for u in T.unroll(unroll):
                if in_chunk(geo, chunk, group(st, u, True), tx):
                    load(buf, u * vec, xf, at(geo, row, chunk, group(st, u, True), tx), "evict_first")
            for u in T.unroll(unroll):
                if in_chunk(geo, chunk, group(st, u, True), tx):
                    for v in T.unroll(vec):
                        out[v] = T.cast(forward_value(value(buf[u * vec + v]), stat), odt)
                    for v in lanes(vec):
                        yf[at(geo, row, chunk, group(st, u, True), tx) + v] = out[v]
        if shifted:
            if edge_thread(geo, chunk, tx):
                yf[edge(geo, row, tx)] = T.cast(forward_value(value(xf[edge(geo, row, tx)]), stat), odt)

    @T.macro
    def backward_pass1(dyf, yf, geo, row, chunk, tx, gbuf, ybuf, stat, red):
        stat[1] = T.float32(0.0)
        if shifted:
            if edge_thread(geo, chunk, tx):
                stat[1] = gradient_term(dyf[edge(geo, row, tx)], yf[edge(geo, row, tx)])
        for st in T.serial(steps):
            for u in T.unroll(unroll):
                if in_chunk(geo, chunk, group(st, u), tx):
                    load(gbuf, u * vec, dyf, at(geo, row, chunk, group(st, u), tx), "evict_last")
                    if not log:
                        load(ybuf, u * vec, yf, at(geo, row, chunk, group(st, u), tx), "evict_last")
            for u in T.unroll(unroll):
                if in_chunk(geo, chunk, group(st, u), tx):
                    for v in T.unroll(vec):
                        stat[1] = stat[1] + gradient_term(gbuf[u * vec + v], ybuf[u * vec + v])
        reduce(stat, 1, False, red, tx)

    @T.macro
    def backward_pass2(dyf, yf, dxf, geo, row, chunk, tx, gbuf, ybuf, out, stat):
        for st in T.serial(steps):
            for u in T.unroll(unroll):
                if in_chunk(geo, chunk, group(st, u, True), tx):
                    load(gbuf, u * vec, dyf, at(geo, row, chunk, group(st, u, True), tx), "evict_first")
                    load(ybuf, u * vec, yf, at(geo, row, chunk, group(st, u, True), tx), "evict_first")
            for u in T.unroll(unroll):
                if in_chunk(geo, chunk, group(st, u, True), tx):
                    for v in T.unroll(vec):
                        out[v] = T.cast(gradient(gbuf[u * vec + v], ybuf[u * vec + v], stat[1]), dt)
                    for v in lanes(vec):
                        dxf[at(geo, row, chunk, group(st, u, True), tx) + v] = out[v]
        if shifted:
            if edge_thread(geo, chunk, tx):
                dxf[edge(geo, row, tx)] = T.cast(
                    gradient(dyf[edge(geo, row, tx)], yf[edge(geo, row, tx)], stat[1]), dt
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
