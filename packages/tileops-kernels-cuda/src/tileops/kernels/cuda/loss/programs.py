"""The TileLang programs of the cross-entropy kernels, and their compilation.

Five kinds (``KINDS``), over contiguous (n, V) logits with n symbolic (one compiled program
serves every row count) and V a compile-time constant:

- ``partial``: each block reduces one span of one row, ``splits`` spans per row (grid n x
  splits): it streams the span once in accesses of ``vec`` elements (16 bytes where the call is
  aligned), keeping per thread an online maximum m and sum s of exp(z - m) of the soft-capped
  logits z in float32, and the sum of z (label smoothing needs it); the block then combines its
  threads (warp shuffles, one round through shared memory) and writes (m, s, sum z) to
  partial[row, split]. One split per row when rows are many; several when they are too few to
  fill the GPU (the launch policy's choice).
- ``finish``: one thread per row combines the row's spans into lse = m + log(s), reads the
  target's logit (a guarded read: a target outside [0, V) reads nothing and gives NaN), and
  writes the row's loss (0 where the target is ignore_index) and lse, float32.
- ``grad``: elementwise over (n, V), rows on the grid's x dimension: dlogits = (a * exp(z - lse) - b *
  ((1 - smoothing) * [j == t] + smoothing / V)) * dz/dx, with a, b, lse per row (float32) and dz/dx
  = 1 - (z / softcap)**2 under soft-capping; it reads each element before writing it, so dlogits
  may be the logits themselves.
- ``fused``: ``partial`` (one span per row), ``finish`` and ``grad`` in one block per row, for a
  reduced loss's training step: the row is read a second time for its gradient right after its
  statistics, from L2 where the rows in flight fit there. Its 16-byte loads carry eviction
  priorities (``cache_hints``) where the target has them: the first pass's "evict last", the
  second's "evict first".
- ``scale``: a gradient multiplied in place by the incoming gradient of the loss, skipped where
  that is 1.

The streaming programs address the logits as one flat array (``row_layout``): with
``shifted``, rows that are not whole 16-byte accesses in aligned tensors (an odd V) move their
aligned middle in 16-byte accesses, and the first span's (the first block's) threads take the
elements around it one by one.

exp is computed as exp2 of a pre-scaled argument (one multiply-add and the hardware's exp2).
Importing this module does not import tilelang; building a program does.
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func's annotations.

import math

import torch

from tileops.ops.vector_access import VECTOR_BYTES

from ..cache_hints import PRIORITY_LOADS, has_cache_priorities
from ..compile import GUARDED_BY_THE_PROGRAM, compile_once
from ..row_layout import GEOMETRY, RowLayout

_TL_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_TL_INDEX = {torch.int64: "int64", torch.int32: "int32"}
KINDS = ("partial", "finish", "grad", "fused", "scale")
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


def _capper(softcap):
    """z from a float32 logit: soft-capped where ``softcap`` is given."""
    import tilelang.language as T

    if softcap is None:
        return lambda x: x
    return lambda x: softcap * T.tanh(x * (1.0 / softcap))


def _span_statistics(dt, layout, softcap, *, vec, threads, unroll, span, sums_logits, priority=None):
    """The macros of the online pass over one span of ``span`` accesses of a row (``partial``'s
    and ``fused``'s), loading with eviction ``priority`` where it is given (a 16-byte access and
    ``PRIORITY_LOADS`` imported): ``fold(flat, geo, row, first, tx, buf, z, m, s, sz, top, shift)`` leaves
    each thread's maximum m, sum s of exp(z - m) and sum sz of z over the span that starts at
    access ``first`` (the row's edges too, where ``first`` is 0); ``combine(m, s, sz, top, red,
    tx)`` gives every thread the block's maximum in top and its sums, rescaled to it, in s and sz."""
    import tilelang.language as T

    f32 = "float32"
    steps = math.ceil(span / (threads * unroll))
    warps = threads // 32
    width = unroll * vec
    cap = _capper(softcap)
    load = _access_loader(vec, priority)

    @T.macro
    def fold(flat, geo, row, first, tx, buf, z, m, s, sz, top, shift):
        m[0] = -T.infinity(f32)
        s[0] = 0.0
        sz[0] = 0.0
        if layout.shifted:
            # The first span's threads start from the row's edge elements, one each.
            if first == 0:
                if layout.has_edge(geo, tx):
                    m[0] = cap(T.cast(flat[layout.edge(geo, row, tx)], f32))
                    s[0] = T.if_then_else(m[0] == -T.infinity(f32), 0.0, 1.0)  # exp(z - z), nothing for -inf
                    if sums_logits:
                        sz[0] = T.if_then_else(m[0] == -T.infinity(f32), 0.0, m[0])
        end = T.min(first + span, layout.accesses(geo))
        for step in T.serial(steps):
            for u in T.unroll(unroll):
                access = first + (step * unroll + u) * threads + tx
                if access < end:
                    load(buf, u * vec, flat, (layout.first_access(geo, row) + access) * vec)
            top[0] = m[0]
            for u in T.unroll(unroll):
                access = first + (step * unroll + u) * threads + tx
                for k in T.unroll(vec):
                    # An access past the span counts as -inf: it adds nothing below.
                    z[u * vec + k] = T.if_then_else(access < end, cap(T.cast(buf[u * vec + k], f32)), -T.infinity(f32))
                    top[0] = T.max(top[0], z[u * vec + k])
            # exp(z - top) as exp2(z * log2(e) - shift): one multiply-add and the hardware's exp2
            # per element. The per-element work, not the loads, set this kernel's time (59 % of
            # the copy bandwidth with a select, a subtract and a multiply more per element).
            # While the thread has seen only -inf the shift is 0, so that -inf still adds 0.
            shift[0] = T.if_then_else(top[0] == -T.infinity(f32), 0.0, top[0] * _LOG2E)
            s[0] = s[0] * T.exp2(m[0] * _LOG2E - shift[0])  # the running sum rescaled to the new maximum
            for i in T.unroll(width):
                s[0] = s[0] + T.exp2(z[i] * _LOG2E - shift[0])
                if sums_logits:
                    sz[0] = sz[0] + T.if_then_else(z[i] == -T.infinity(f32), 0.0, z[i])
            m[0] = top[0]

    @T.macro
    def combine(m, s, sz, top, red, tx):
        # The block's maximum, then every thread's sum rescaled to it and summed.
        top[0] = T.warp_reduce_max(m[0])
        if tx % 32 == 0:
            red[0, tx // 32] = top[0]
        T.sync_threads()
        top[0] = red[0, 0]
        for w in T.serial(warps - 1):
            top[0] = T.max(top[0], red[0, w + 1])
        s[0] = T.if_then_else(m[0] == -T.infinity(f32), 0.0, s[0] * T.exp2((m[0] - top[0]) * _LOG2E))
        s[0] = T.warp_reduce_sum(s[0])
        sz[0] = T.warp_reduce_sum(sz[0])
        if tx % 32 == 0:
            red[1, tx // 32] = s[0]
            red[2, tx // 32] = sz[0]
        T.sync_threads()
        s[0] = red[1, 0]
        sz[0] = red[2, 0]
        for w in T.serial(warps - 1):
            s[0] = s[0] + red[1, w + 1]
            sz[0] = sz[0] + red[2, w + 1]

    return fold, combine


def _access_loader(vec, priority):
    """The macro ``load(dst, di, src, index)``: the ``vec`` elements of flat ``src`` from
    ``index`` into dst[di:], as one load with eviction ``priority`` where that is given."""
    import tilelang.language as T

    lanes = T.vectorized if vec > 1 else T.serial

    @T.macro
    def load(dst, di, src, index):
        if priority is not None:
            T.call_extern("handle", f"tileops_load_{priority}", T.address_of(dst[di]), T.address_of(src[index]))
        else:
            for k in lanes(vec):
                dst[di + k] = src[index + k]

    return load


def make_partial(dtype, vocab, softcap, *, vec, threads, unroll, splits, sums_logits=True, shifted=False):
    """The ``partial`` program (see the module) for one dtype, V, soft-cap and configuration:
    each thread loads ``unroll`` accesses before it folds them in, so that that many 16-byte
    loads per thread are in flight. ``sums_logits``: whether it sums z (label smoothing reads
    the sum; without smoothing the third value of a span is 0)."""
    import tilelang.language as T

    dt, f32 = _TL_DTYPES[dtype], "float32"
    if (vocab % vec and not shifted) or threads % 32:
        raise ValueError(f"bad configuration vec={vec} threads={threads} for V={vocab}")
    layout = RowLayout(vocab, vec, shifted)
    n = T.dynamic("n", "int64")
    span = math.ceil(layout.most / splits)  # accesses per split
    width = unroll * vec
    fold, combine = _span_statistics(
        dt, layout, softcap, vec=vec, threads=threads, unroll=unroll, span=span, sums_logits=sums_logits
    )

    @T.prim_func
    def main(logits: T.Tensor((n, vocab), dt), partial: T.Tensor((n, splits, 3), f32)):
        # Rows on the grid's x dimension, whose limit (2**31 - 1) no row count reaches (y stops at 65535).
        with T.Kernel(n, splits, threads=threads) as (bx, split):
            # Two blocks of 512 threads per SM: a thread then gets 64 registers (no spill), where
            # TileLang's default of one block let ptxas take 95 and left the SM 16 warps to keep
            # loads in flight with while each folds in what it loaded.
            T.annotate_min_blocks_per_sm(max(1, 1024 // threads))
            tx = T.get_thread_binding()
            flat = T.reshape(logits, (n * vocab,))
            row = T.cast(bx, "int64")
            geo = T.alloc_local((GEOMETRY,), "int64")
            buf = T.alloc_local((width,), dt)
            z = T.alloc_local((width,), f32)
            m = T.alloc_local((1,), f32)
            s = T.alloc_local((1,), f32)
            sz = T.alloc_local((1,), f32)
            top = T.alloc_local((1,), f32)
            shift = T.alloc_local((1,), f32)
            red = T.alloc_shared((3, threads // 32), f32)
            layout.locate(geo, row)
            fold(flat, geo, row, split * span, tx, buf, z, m, s, sz, top, shift)
            combine(m, s, sz, top, red, tx)
            if tx == 0:
                partial[row, split, 0] = top[0]
                partial[row, split, 1] = s[0]
                partial[row, split, 2] = sz[0]

    return main


def make_finish(dtype, vocab, target_dtype, softcap, *, splits, ignore_index, smoothing, z_scale, threads=128):
    """The ``finish`` program (see the module): each row's loss and lse from its partials."""
    import tilelang.language as T

    dt, f32, it = _TL_DTYPES[dtype], "float32", _TL_INDEX[target_dtype]
    n = T.dynamic("n")
    cap = _capper(softcap)

    @T.prim_func
    def main(
        logits: T.Tensor((n, vocab), dt), target_ids: T.Tensor((n,), it), partial: T.Tensor((n, splits, 3), f32),
        loss: T.Tensor((n,), f32), lse: T.Tensor((n,), f32),
    ):
        with T.Kernel(T.ceildiv(n, threads), threads=threads) as bx:
            tx = T.get_thread_binding()
            row = bx * threads + tx
            m = T.alloc_local((1,), f32)
            s = T.alloc_local((1,), f32)
            sz = T.alloc_local((1,), f32)
            picked = T.alloc_local((1,), f32)
            if row < n:
                m[0] = partial[row, 0, 0]
                for j in T.serial(splits - 1):
                    m[0] = T.max(m[0], partial[row, j + 1, 0])
                s[0] = 0.0
                sz[0] = 0.0
                for j in T.serial(splits):
                    s[0] = s[0] + T.if_then_else(
                        partial[row, j, 0] == -T.infinity(f32), 0.0, partial[row, j, 1] * T.exp2((partial[row, j, 0] - m[0]) * _LOG2E)
                    )
                    sz[0] = sz[0] + partial[row, j, 2]
                m[0] = m[0] + T.log2(s[0]) * _LN2
                target = target_ids[row]
                inside = target >= 0 and target < vocab
                # A guarded read: a target outside [0, V) reads row's first logit and is NaN below.
                picked[0] = cap(T.cast(logits[row, T.if_then_else(inside, target, 0)], f32))
                s[0] = m[0] - (1.0 - smoothing) * picked[0] - (smoothing / vocab) * sz[0] + z_scale * m[0] * m[0]
                loss[row] = T.if_then_else(target == ignore_index, 0.0, T.if_then_else(inside, s[0], T.float32(math.nan)))
                lse[row] = m[0]

    return main


def _gradient_macro(vocab, softcap, smoothing):
    """The macro ``gradient(g, z, a, b, shift, target, element, column)``: g[0] = the gradient of
    one logit (``element``, at ``column`` of its row) in float32, from its row's a, b, target and
    shift = lse * log2(e) (see the module)."""
    import tilelang.language as T

    f32 = "float32"
    cap = _capper(softcap)
    uniform = smoothing / vocab

    @T.macro
    def gradient(g, z, a, b, shift, target, element, column):
        z[0] = cap(T.cast(element, f32))
        g[0] = a[0] * T.exp2(z[0] * _LOG2E - shift[0]) - b[0] * uniform
        g[0] = g[0] - T.if_then_else(column == target, b[0] * (1.0 - smoothing), 0.0)
        if softcap is not None:
            g[0] = g[0] * (1.0 - z[0] * z[0] * (1.0 / (softcap * softcap)))

    return gradient


def make_grad(dtype, vocab, target_dtype, softcap, *, vec, threads, per_thread, smoothing, shifted=False):
    """The ``grad`` program (see the module) for one dtype, V, soft-cap and configuration."""
    import tilelang.language as T

    dt, f32, it = _TL_DTYPES[dtype], "float32", _TL_INDEX[target_dtype]
    if vocab % vec and not shifted:
        raise ValueError(f"vec={vec} does not divide V={vocab}")
    layout = RowLayout(vocab, vec, shifted)
    n = T.dynamic("n", "int64")
    accesses = layout.most
    chunk = threads * per_thread  # accesses per block
    lanes = T.vectorized if vec > 1 else T.serial
    gradient = _gradient_macro(vocab, softcap, smoothing)

    @T.prim_func
    def main(
        logits: T.Tensor((n, vocab), dt), target_ids: T.Tensor((n,), it), lse: T.Tensor((n,), f32),
        softmax_scale: T.Tensor((n,), f32), target_scale: T.Tensor((n,), f32), dlogits: T.Tensor((n, vocab), dt),
    ):
        # Rows on the grid's x dimension (limit 2**31 - 1); a row's blocks on y (V / chunk, far below 65535).
        with T.Kernel(n, T.ceildiv(accesses, chunk), threads=threads) as (bx, by):
            tx = T.get_thread_binding()
            flat, dflat = T.reshape(logits, (n * vocab,)), T.reshape(dlogits, (n * vocab,))
            row = T.cast(bx, "int64")
            geo = T.alloc_local((GEOMETRY,), "int64")
            buf = T.alloc_local((vec,), dt)
            out = T.alloc_local((vec,), dt)
            shift = T.alloc_local((1,), f32)
            a = T.alloc_local((1,), f32)
            b = T.alloc_local((1,), f32)
            z = T.alloc_local((1,), f32)
            g = T.alloc_local((1,), f32)
            shift[0] = lse[row] * _LOG2E
            a[0] = softmax_scale[row]
            b[0] = target_scale[row]
            target = target_ids[row]
            layout.locate(geo, row)
            for step in T.unroll(per_thread):
                access = (by * per_thread + step) * threads + tx
                if access < layout.accesses(geo):
                    start = (layout.first_access(geo, row) + access) * vec
                    for k in lanes(vec):
                        buf[k] = flat[start + k]
                    for k in T.unroll(vec):
                        gradient(g, z, a, b, shift, target, buf[k], start + k - row * vocab)
                        out[k] = T.cast(g[0], dt)
                    for k in lanes(vec):
                        dflat[start + k] = out[k]
            if shifted:
                # The first block's threads take the row's edge elements, one each.
                if T.And(by == 0, layout.has_edge(geo, tx)):
                    buf[0] = flat[layout.edge(geo, row, tx)]
                    gradient(g, z, a, b, shift, target, buf[0], layout.edge(geo, row, tx) - row * vocab)
                    dflat[layout.edge(geo, row, tx)] = T.cast(g[0], dt)

    return main


def make_fused(
    dtype, vocab, target_dtype, softcap, *, vec, threads, unroll, ignore_index, smoothing, z_scale, shifted=False,
    from_end=False, cache_priorities=False,
):
    """The ``fused`` program (see the module): one block per row streams it once for its online
    maximum and sum (as ``partial`` with one split), writes the row's loss and lse (as
    ``finish``), then streams the row again to write the gradient of ``unit[0]`` times the row's
    loss (0 on an ignored row), as ``grad`` with a = b (1 + 2 z_scale lse), b = unit[0]. The
    second read of a row follows the first within the block, so it is served by L2 where the
    rows in flight (a block's per SM slot) fit in it: the logits are then read once from memory.
    With ``from_end`` the second pass walks the row backwards, from the accesses the first pass
    made last: where the rows in flight do not fit in L2, those are the ones still there.
    ``cache_priorities``: whether the target has loads with eviction priorities (used for
    16-byte accesses)."""
    import tilelang.language as T

    dt, f32, it = _TL_DTYPES[dtype], "float32", _TL_INDEX[target_dtype]
    if (vocab % vec and not shifted) or threads % 32:
        raise ValueError(f"bad configuration vec={vec} threads={threads} for V={vocab}")
    layout = RowLayout(vocab, vec, shifted)
    n = T.dynamic("n", "int64")
    steps = math.ceil(layout.most / (threads * unroll))
    width = unroll * vec
    cap = _capper(softcap)
    hinted = cache_priorities and vec * dtype.itemsize == VECTOR_BYTES
    fold, combine = _span_statistics(
        dt, layout, softcap, vec=vec, threads=threads, unroll=unroll, span=layout.most, sums_logits=smoothing != 0,
        priority="evict_last" if hinted else None,
    )
    gradient = _gradient_macro(vocab, softcap, smoothing)
    lanes = T.vectorized if vec > 1 else T.serial
    load_again = _access_loader(vec, "evict_first" if hinted else None)

    def second_pass_access(step, u, tx):
        """The access thread ``tx`` makes at the second pass's (step, u): the first pass's
        order, or with ``from_end`` its reverse (by groups of ``threads`` accesses)."""
        group = step * unroll + u
        if from_end:
            group = steps * unroll - 1 - group
        return group * threads + tx

    @T.prim_func
    def main(
        logits: T.Tensor((n, vocab), dt), target_ids: T.Tensor((n,), it), unit: T.Tensor((1,), f32),
        grad: T.Tensor((n, vocab), dt), loss: T.Tensor((n,), f32), lse: T.Tensor((n,), f32),
    ):
        with T.Kernel(n, threads=threads) as bx:
            T.annotate_min_blocks_per_sm(max(1, 1024 // threads))  # as ``partial``
            if hinted:
                T.import_source(PRIORITY_LOADS)
            tx = T.get_thread_binding()
            flat, gflat = T.reshape(logits, (n * vocab,)), T.reshape(grad, (n * vocab,))
            row = T.cast(bx, "int64")
            geo = T.alloc_local((GEOMETRY,), "int64")
            buf = T.alloc_local((width,), dt)
            out = T.alloc_local((vec,), dt)
            z = T.alloc_local((width,), f32)
            m = T.alloc_local((1,), f32)
            s = T.alloc_local((1,), f32)
            sz = T.alloc_local((1,), f32)
            top = T.alloc_local((1,), f32)
            shift = T.alloc_local((1,), f32)
            a = T.alloc_local((1,), f32)
            b = T.alloc_local((1,), f32)
            g = T.alloc_local((1,), f32)
            red = T.alloc_shared((3, threads // 32), f32)
            layout.locate(geo, row)
            end = layout.accesses(geo)
            target = target_ids[row]
            # Pass 1: the row's statistics, as ``partial``'s of one span.
            fold(flat, geo, row, 0, tx, buf, z, m, s, sz, top, shift)
            combine(m, s, sz, top, red, tx)
            m[0] = top[0] + T.log2(s[0]) * _LN2  # the row's lse
            b[0] = T.if_then_else(target == ignore_index, 0.0, unit[0])
            a[0] = b[0] * (1.0 + 2.0 * z_scale * m[0])  # z-loss's factor (1 without it)
            shift[0] = m[0] * _LOG2E
            if tx == 0:
                inside = target >= 0 and target < vocab
                # A guarded read, as ``finish``'s: a target outside [0, V) gives its row a NaN loss.
                top[0] = cap(T.cast(flat[row * vocab + T.if_then_else(inside, target, 0)], f32))
                s[0] = m[0] - (1.0 - smoothing) * top[0] - (smoothing / vocab) * sz[0] + z_scale * m[0] * m[0]
                loss[row] = T.if_then_else(target == ignore_index, 0.0, T.if_then_else(inside, s[0], T.float32(math.nan)))
                lse[row] = m[0]
            # Pass 2: the gradient, as ``grad``'s.
            for step in T.serial(steps):
                for u in T.unroll(unroll):
                    access = second_pass_access(step, u, tx)
                    if access < end:
                        load_again(buf, u * vec, flat, (layout.first_access(geo, row) + access) * vec)
                for u in T.unroll(unroll):
                    access = second_pass_access(step, u, tx)
                    if access < end:
                        start = (layout.first_access(geo, row) + access) * vec
                        for k in T.unroll(vec):
                            gradient(g, top, a, b, shift, target, buf[u * vec + k], start + k - row * vocab)
                            out[k] = T.cast(g[0], dt)
                        for k in lanes(vec):
                            gflat[start + k] = out[k]
            if shifted:
                if layout.has_edge(geo, tx):
                    buf[0] = flat[layout.edge(geo, row, tx)]
                    gradient(g, top, a, b, shift, target, buf[0], layout.edge(geo, row, tx) - row * vocab)
                    gflat[layout.edge(geo, row, tx)] = T.cast(g[0], dt)

    return main


def make_scale(dtype, *, vec, threads, per_thread, blocks):
    """The ``scale`` program: grad (of ``total`` elements, a multiple of ``vec``) multiplied in
    place by factor[0], in float32, by ``blocks`` blocks striding over it. Every block reads the
    factor first and, where it is 1, returns without touching grad: a loss's backward called with
    1 costs a launch, not a pass. The grid is one wave (``blocks``, a few per SM), since a block
    per chunk made that launch cost as much as its blocks: an H100 took 37.7 us to run 7630
    blocks that each read the factor and returned (2048 x 30522 bf16)."""
    import tilelang.language as T

    dt, f32 = _TL_DTYPES[dtype], "float32"
    total = T.dynamic("total", "int64")
    chunk = threads * per_thread * vec  # elements per block and round
    lanes = T.vectorized if vec > 1 else T.serial

    @T.prim_func
    def main(grad: T.Tensor((total,), dt), factor: T.Tensor((1,), dt)):
        with T.Kernel(blocks, threads=threads) as bx:
            tx = T.get_thread_binding()
            buf = T.alloc_local((vec,), dt)
            f = T.alloc_local((1,), f32)
            f[0] = T.cast(factor[0], f32)
            if f[0] != 1.0:
                for rnd in T.serial(T.ceildiv(total, blocks * chunk)):
                    for step in T.unroll(per_thread):
                        start = (rnd * blocks + bx) * chunk + (step * threads + tx) * vec
                        if start < total:
                            for k in lanes(vec):
                                buf[k] = grad[start + k]
                            for k in T.unroll(vec):
                                buf[k] = T.cast(T.cast(buf[k], f32) * f[0], dt)
                            for k in lanes(vec):
                                grad[start + k] = buf[k]

    return main


def compile_program(kind, dtype, vocab, target_dtype, softcap, target, **config):
    """The compiled program of ``kind`` for one call spec's facts and configuration, once per
    process (and on disk)."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
    identity = ("loss", kind, dtype, vocab, target_dtype, softcap, tuple(sorted(config.items())))
    priorities = has_cache_priorities(target)
    makers = {
        "partial": lambda: make_partial(dtype, vocab, softcap, **config),
        "finish": lambda: make_finish(dtype, vocab, target_dtype, softcap, **config),
        "grad": lambda: make_grad(dtype, vocab, target_dtype, softcap, **config),
        "fused": lambda: make_fused(dtype, vocab, target_dtype, softcap, cache_priorities=priorities, **config),
        "scale": lambda: make_scale(dtype, **config),
    }
    return compile_once(identity, makers[kind], target, pass_configs=GUARDED_BY_THE_PROGRAM)
