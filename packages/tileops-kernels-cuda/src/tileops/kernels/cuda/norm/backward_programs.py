"""TileLang programs for the backward pass of row normalisations (CUDA).

With xhat = (x - mean) * rstd (rms kinds: x * rstd) and g = dy * weight (dy without weight):

* dx = rstd * (g - mean(g) - xhat * mean(g * xhat))   (rms kinds: no mean(g) term)
  (+ dresidual_sum for the fused kinds, whose x is the saved residual sum s)
* dweight = sum over rows of dy * xhat, dbias = sum over rows of dy.

Two kernels per call. The row kernel makes one pass over the rows, reading dy, x (and
dresidual_sum) and the saved statistics: the forward's mean and rstd are never recomputed. Its
blocks are persistent: ``partial_rows`` row slots, each a group of threads that owns a fixed
set of columns, walk the rows slot, slot + S, ... and sum dy * xhat (and dy) for their columns
in float32; each slot writes its own row of the float32 partials (parts, S, n) - no atomics.
The reduce kernel sums the partials over the slots and casts dweight (and dbias) to the dtype.
A call of one row runs one kernel: the row kernel built ``direct`` writes slot 0's sums,
the only ones with a row, as dweight (and dbias). A call with no weight and no bias has no
parameter gradient to sum: its row kernel writes dx alone (``column_sums=False``), one kernel.

The modes of the row kernel and the rules that pick a configuration are ``backward_policy``'s;
``make_program`` builds the one a configuration names.

Kernel call convention (positional, caller-allocated outputs, rank-2 rows, no out_idx)::

    row kernel     (dy, [dresidual_sum], x, [weight], [mean], rstd, dx, [partials])
    direct         (dy, [dresidual_sum], x, [weight], [mean], rstd, dx, dweight, [dbias])
    reduce kernel  (partials, dweight, [dbias])

Importing this module does not import tilelang; only building a program does.
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations.

import math

import torch

from ..compile import compile_once
from .backward_policy import parts_of
from .policy import MAX_THREADS

_TL_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def make_program(kind, n, dtype, has_weight, *, vec, tpr, rows, mode, acc, unroll, prefetch=False, direct=False,
                 x_pitch=None, column_sums=True):
    """The row kernel's PrimFunc for one configuration (see ``backward_policy.launch_config``);
    ``direct``: for calls of one row, one block whose slot 0 writes dweight (and dbias)
    in the dtype instead of a row of partials (the sums must be on chip: ``acc`` not "global");
    ``column_sums``: False for a call with no parameter to differentiate (no weight, no bias),
    whose kernel writes dx alone: no partials, and no reduce kernel after it;
    ``x_pitch``: read x (the single norms' forward input) as a row view whose rows are that many
    elements apart, a compile-time pitch that keeps each row start a whole number of vectors."""
    if (n % vec or tpr & (tpr - 1) or tpr * rows > MAX_THREADS or (prefetch and mode != "register")
            or (acc == "register" and mode != "register") or (direct and acc == "global")
            or (direct and not column_sums)):
        raise ValueError(f"bad launch configuration vec={vec} tpr={tpr} rows={rows} mode={mode} acc={acc} "
                         f"prefetch={prefetch} direct={direct} column_sums={column_sums} for N={n}")
    if x_pitch is not None and (kind.startswith("add_") or x_pitch < n or x_pitch % vec):
        raise ValueError(
            f"x_pitch={x_pitch} for {kind} N={n} vec={vec}: the single norms' x only, at least N and a whole "
            "number of vectors"
        )
    import tilelang.language as T

    # Without column sums a slot has one row (below): there is no next row to load ahead.
    prefetch = prefetch and column_sums
    fused, layer, parts = kind.startswith("add_"), kind.endswith("layer_norm"), parts_of(kind)
    dt, f32 = _TL_DTYPES[dtype], "float32"
    threads, nv = tpr * rows, n // vec
    cached = mode == "register"
    step = unroll  # vectors per thread in one step: all of them in the register mode
    steps = 1 if cached else math.ceil(nv / (tpr * unroll))
    held = steps * step  # vectors whose column sums a thread keeps (acc "register" or "shared")
    warps = max(1, tpr // 32)
    lanes = T.vectorized if vec > 1 else T.serial
    wide = min(vec, 4)  # float32 partials move in 16-byte pieces
    part_list = list(range(parts))  # a Python list: unrolled as the program is built
    m = T.dynamic("m")
    # Slots: direct, the one block's; with partials, their count (the partials' rows); without
    # column sums, one a row (nothing to sum across rows, so no block needs to stay for more).
    s = rows if direct else T.dynamic("s") if column_sums else m
    absent = 0  # a non-buffer annotation: the parameter is left out of the kernel's signature
    dy_t, dx_t = T.Tensor((m, n), dt), T.Tensor((m, n), dt)
    x_t = T.Tensor((m, n), dt) if x_pitch is None else T.StridedTensor((m, n), (x_pitch, 1), dt)
    dr_t = T.Tensor((m, n), dt) if fused else absent
    w_t = T.Tensor((n,), dt) if has_weight else absent
    mean_t = T.Tensor((m,), f32) if layer else absent
    rstd_t = T.Tensor((m,), f32)
    p_t = T.Tensor((parts, s, n), f32) if column_sums and not direct else absent
    dw_t = T.Tensor((n,), dt) if direct else absent
    db_t = T.Tensor((n,), dt) if direct and layer else absent

    def f(e):
        return T.cast(e, f32)

    def at(p, u, v, tx):
        """Where a thread's column sum p of element v of its vector u (of ``held``) is. In shared
        memory the threads' 16-byte pieces of a vector lie side by side, so that a warp's
        vectorised access to them is free of bank conflicts."""
        if acc == "register":
            return (p * step + u) * vec + v
        return (((p * held + u) * (vec // wide) + v // wide) * threads + tx) * wide + v % wide

    @T.macro
    def row_sums(acc_, red, tx):
        """acc_[0:parts] summed over each row's threads (shuffles, then shared memory)."""
        if tpr <= 32:
            for i in part_list:
                for off in [1 << k for k in reversed(range(tpr.bit_length() - 1))]:
                    acc_[i] = acc_[i] + T.shfl_xor(acc_[i], off)
        else:
            for i in part_list:
                acc_[i] = T.warp_reduce_sum(acc_[i])
                if tx % 32 == 0:
                    red[(i * rows + tx // tpr) * warps + (tx % tpr) // 32] = acc_[i]
            T.sync_threads()
            for i in part_list:
                acc_[i] = f(0)
                for k in T.unroll(warps):
                    acc_[i] = acc_[i] + red[(i * rows + tx // tpr) * warps + k]
            T.sync_threads()  # red is written again for the next row

    @T.macro
    def load_row(r, lane, pairs):
        """A thread's vectors of row r of each (tensor, buffer) of ``pairs``, all of them
        (register mode), the tensors' loads of a vector side by side. (The pairs are indexed,
        not unpacked: TileLang's builder would name the kernel's parameters after the names.)"""
        for u in T.unroll(step):
            if u * tpr + lane < nv:
                for pair in pairs:
                    for v in lanes(vec):
                        pair[1][u * vec + v] = pair[0][r, (u * tpr + lane) * vec + v]

    @T.prim_func
    def main(dy: dy_t, dr: dr_t, x: x_t, w: w_t, mean: mean_t, rstd: rstd_t, dx: dx_t, partial: p_t, dw: dw_t, db: db_t):
        with T.Kernel(T.ceildiv(s, rows), threads=threads) as bx:
            tx = T.get_thread_binding()
            lane = tx % tpr
            slot = bx * rows + tx // tpr
            xb = T.alloc_local((step * vec,), dt)
            gb = T.alloc_local((step * vec,), dt)
            if prefetch:  # the next row's x and dy, loaded while this one is reduced and written
                xn = T.alloc_local((step * vec,), dt)
                gn = T.alloc_local((step * vec,), dt)
            wb = T.alloc_local((step * vec,), dt)  # weight
            early_dr = fused and prefetch  # the row's dresidual_sum, loaded before its reduction
            if early_dr:
                rb = T.alloc_local((step * vec,), dt)
            if column_sums and acc == "shared":
                sums = T.alloc_shared((parts * held * threads * vec,), f32)
            elif column_sums and acc == "register":
                sums = T.alloc_local((parts * step * vec,), f32)
            red = T.alloc_shared((parts * rows * warps,), f32)
            tot = T.alloc_local((2,), f32)
            mu = T.alloc_local((1,), f32)
            rs = T.alloc_local((1,), f32)


            if column_sums and acc != "global":
                for p in part_list:
                    for u in T.unroll(held):
                        for v in T.unroll(vec):
                            sums[at(p, u, v, tx)] = f(0)
            elif column_sums:  # each slot owns its partial row: zero its columns
                for st in T.serial(steps):
                    for u in T.unroll(step):
                        vi = (st * step + u) * tpr + lane
                        if vi < nv:
                            for p in part_list:
                                for h in T.unroll(vec // wide):
                                    for v in lanes(wide):
                                        partial[p, slot, vi * vec + h * wide + v] = f(0)
            if cached and has_weight:  # the weight of the thread's columns, for every row
                for u in T.unroll(step):
                    if u * tpr + lane < nv:
                        for v in lanes(vec):
                            wb[u * vec + v] = w[(u * tpr + lane) * vec + v]
            if prefetch:
                load_row(T.min(slot, m - 1), lane, [(x, xb), (dy, gb)])
            for k in T.serial(T.ceildiv(m, s)):
                row = slot + k * s
                src = T.min(row, m - 1)  # past the last row: read a valid row, store nothing
                mu[0] = mean[src] if layer else f(0)
                rs[0] = rstd[src]
                if prefetch:  # this row was loaded ahead; load the next
                    if row + s < m:
                        load_row(row + s, lane, [(x, xn), (dy, gn)])
                    if early_dr and row < m:
                        load_row(row, lane, [(dr, rb)])
                elif cached:
                    load_row(src, lane, [(x, xb), (dy, gb)])
                tot[0] = f(0)
                tot[1] = f(0)
                for st in T.serial(steps):
                    if not cached:  # the streamed mode loads a step's vectors (and weight) at a time
                        for u in T.unroll(step):
                            vi = (st * step + u) * tpr + lane
                            if vi < nv:
                                for v in lanes(vec):
                                    xb[u * vec + v] = x[src, vi * vec + v]
                                for v in lanes(vec):
                                    gb[u * vec + v] = dy[src, vi * vec + v]
                                if has_weight:
                                    for v in lanes(vec):
                                        wb[u * vec + v] = w[vi * vec + v]
                    for u in T.unroll(step):
                        vi = (st * step + u) * tpr + lane
                        if vi < nv:
                            for v in T.unroll(vec):
                                xh = (f(xb[u * vec + v]) - mu[0]) * rs[0]
                                g = f(gb[u * vec + v]) * f(wb[u * vec + v]) if has_weight else f(gb[u * vec + v])
                                tot[0] = tot[0] + g * xh
                                if layer:
                                    tot[1] = tot[1] + g
                            if column_sums and row < m:
                                if acc != "global":
                                    own = u if cached else st * step + u  # which of the thread's held vectors
                                    for v in T.unroll(vec):
                                        xh = (f(xb[u * vec + v]) - mu[0]) * rs[0]
                                        sums[at(0, own, v, tx)] = sums[at(0, own, v, tx)] + f(gb[u * vec + v]) * xh
                                        if layer:
                                            sums[at(1, own, v, tx)] = sums[at(1, own, v, tx)] + f(gb[u * vec + v])
                                else:
                                    for h in T.unroll(vec // wide):
                                        for v in lanes(wide):
                                            c, e = vi * vec + h * wide + v, u * vec + h * wide + v
                                            partial[0, slot, c] = partial[0, slot, c] + f(gb[e]) * (
                                                (f(xb[e]) - mu[0]) * rs[0])
                                            if layer:
                                                partial[1, slot, c] = partial[1, slot, c] + f(gb[e])
                row_sums(tot, red, tx)
                c1 = tot[0] * (1.0 / n)
                c2 = tot[1] * (1.0 / n)
                if row < m:
                    for st in T.serial(steps):
                        for u in T.unroll(step):
                            vi = (st * step + u) * tpr + lane
                            if vi < nv:
                                if not cached:
                                    for v in lanes(vec):
                                        xb[u * vec + v] = x[row, vi * vec + v]
                                    for v in lanes(vec):
                                        gb[u * vec + v] = dy[row, vi * vec + v]
                                    if has_weight:
                                        for v in lanes(vec):
                                            wb[u * vec + v] = w[vi * vec + v]
                                for v in lanes(vec):
                                    col = vi * vec + v
                                    xh = (f(xb[u * vec + v]) - mu[0]) * rs[0]
                                    g = f(gb[u * vec + v]) * f(wb[u * vec + v]) if has_weight else f(gb[u * vec + v])
                                    d = (g - c2 - xh * c1) * rs[0] if layer else (g - xh * c1) * rs[0]
                                    if early_dr:
                                        dx[row, col] = T.cast(d + f(rb[u * vec + v]), dt)
                                    elif fused:
                                        dx[row, col] = T.cast(d + f(dr[row, col]), dt)
                                    else:
                                        dx[row, col] = T.cast(d, dt)
                if prefetch:
                    for e in T.unroll(step * vec):
                        xb[e] = xn[e]
                        gb[e] = gn[e]
            if direct:  # the call's one row is slot 0's: its sums are dweight (and dbias)
                if slot == 0:
                    for u in T.unroll(held):
                        vi = u * tpr + lane
                        if vi < nv:
                            for v in lanes(vec):
                                dw[vi * vec + v] = T.cast(sums[at(0, u, v, tx)], dt)
                                if layer:
                                    db[vi * vec + v] = T.cast(sums[at(1, u, v, tx)], dt)
            elif column_sums and acc != "global":  # the slot's column sums, written once
                for u in T.unroll(held):
                    vi = u * tpr + lane
                    if vi < nv:
                        for p in part_list:
                            for h in T.unroll(vec // wide):
                                for v in lanes(wide):
                                    partial[p, slot, vi * vec + h * wide + v] = sums[at(p, u, h * wide + v, tx)]

    return main


def make_reduce_program(n, dtype, parts, *, columns=32, lanes=8):
    """The reduce kernel: (parts, S, n) float32 partials summed over S, cast to the dtype.
    A block of ``columns`` x ``lanes`` threads sums ``columns`` adjacent columns (coalesced
    128-byte rows of partials), each lane a stride of the slots, then the lanes in shared memory."""
    import tilelang.language as T

    dt, f32 = _TL_DTYPES[dtype], "float32"
    s = T.dynamic("s")
    p_t, dw_t = T.Tensor((parts, s, n), f32), T.Tensor((n,), dt)
    db_t = T.Tensor((n,), dt) if parts == 2 else 0
    part_list = list(range(parts))

    @T.prim_func
    def main(partial: p_t, dw: dw_t, db: db_t):
        with T.Kernel(T.ceildiv(n, columns), threads=columns * lanes) as bx:
            tx = T.get_thread_binding()
            c, r = tx % columns, tx // columns
            col = T.min(bx * columns + c, n - 1)
            red = T.alloc_shared((parts * lanes * columns,), f32)
            acc = T.alloc_local((parts,), f32)
            for p in part_list:
                acc[p] = T.cast(0, f32)
            for i in T.serial(T.ceildiv(s, lanes)):
                if i * lanes + r < s:
                    for p in part_list:
                        acc[p] = acc[p] + partial[p, i * lanes + r, col]
            for p in part_list:
                red[(p * lanes + r) * columns + c] = acc[p]
            T.sync_threads()
            if r == 0:
                if bx * columns + c < n:
                    for p in part_list:
                        for k in T.unroll(lanes - 1):
                            acc[p] = acc[p] + red[(p * lanes + k + 1) * columns + c]
                    dw[col] = T.cast(acc[0], dt)
                    if parts == 2:
                        db[col] = T.cast(acc[1], dt)

    return main


def compile_row_kernel(kind, n, dtype, has_weight, target, **config):
    """The row kernel of one configuration (``column_sums`` among its keywords, where False)
    for a TileLang target, once per process."""
    identity = ("norm_bwd", kind, n, dtype, bool(has_weight), tuple(sorted(config.items())))
    return compile_once(identity, lambda: make_program(kind, n, dtype, has_weight, **config), target)


def compile_reduce_kernel(n, dtype, parts, target):
    """The reduce kernel of (n, dtype, parts) for a TileLang target, once per process."""
    return compile_once(("norm_bwd_reduce", n, dtype, parts), lambda: make_reduce_program(n, dtype, parts), target)
