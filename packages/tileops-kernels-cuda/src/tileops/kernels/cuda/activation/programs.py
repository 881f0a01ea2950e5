"""The TileLang programs of the activation kernels, and their compilation.

Every program is elementwise. Its index space is cut into chunks of ``threads * per_thread``
accesses, one block per chunk; in each of a thread's ``per_thread`` steps the block's threads
take consecutive accesses, so a warp reads consecutive memory; a thread makes all its loads,
then its arithmetic, then its stores (see ``gather``). An access is ``vec`` elements:
16 bytes (8 half-precision or 4 float32 elements) for the vector builds, which the launch rule
gives only to calls whose pointers are 16-byte aligned and whose lengths fill whole accesses;
1 for the scalar builds, which serve every call. An access loads its elements into registers
with one vectorised load per tensor, computes each element in float32, rounds once and stores
with one vectorised store. The 1-D programs state that the length is a multiple of ``vec``
(``T.assume``), which lets TileLang emit whole 16-byte accesses guarded once per access.

The kinds (``KINDS``), each a function of the activation ``act`` (silu, exact gelu or tanh gelu):

- ``act``: y = act(x), over 1-D x and y of a symbolic length n;
- ``act_bwd``: dx = dy * act'(x), 1-D;
- ``gated``: y = act(gate) * up, 1-D;
- ``gated_bwd``: dgate = dy * up * act'(gate) and dup = dy * act(gate), 1-D;
- ``gated_bwd_inplace``: gated_bwd's gradients written over gate and up (a thread loads all its
  elements before it stores any, and no other thread touches them);
- ``packed``: y[r, c] = act(x[r, c]) * x[r, d + c], x of (m, 2 * d) rows, y of (m, d);
- ``packed_bwd``: dx[r, c] and dx[r, d + c] as gated_bwd's dgate and dup, from dy of (m, d);
- ``packed_bwd_inplace``: packed_bwd's gradient written over x (a thread loads both halves of
  its elements before it stores either, and no other thread touches them).

The lengths are symbolic, so one compiled program serves every length (the packed kinds' d is a
compile-time constant, part of the call spec); lengths and element indices are 64-bit, so a
tensor may hold more than 2**31 elements.

Row views: ``act``, ``act_bwd``, ``gated`` and ``gated_bwd`` built with ``pitches`` (one per tensor
they read, in their argument order) and ``d`` take every tensor as (m, d) rows, m symbolic: each
tensor read at its own compile-time pitch (a slice of wider rows, such as one half of a gate-up
projection's output), the results written as contiguous (m, d) rows. They address an access as
the packed kinds do (row i // (d / vec)); a compile-time pitch keeps every row's start a
provable multiple of the access.

Importing this module does not import tilelang; building a program does.
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func's annotations.

import torch

from ..compile import compile_once

_TL_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
KINDS = ("act", "act_bwd", "gated", "gated_bwd", "gated_bwd_inplace", "packed", "packed_bwd", "packed_bwd_inplace")
#: The kinds that may read row views, and how many tensors each reads (one pitch each).
ROW_VIEW_READS = {"act": 1, "act_bwd": 2, "gated": 2, "gated_bwd": 3}
_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")

_SQRT1_2 = 0.7071067811865476  # 1 / sqrt(2)
_INV_SQRT_2PI = 0.3989422804014327  # 1 / sqrt(2 * pi)
_SQRT_2_OVER_PI = 0.7978845608028654  # sqrt(2 / pi)
_TANH_CUBIC = 0.044715
#: exp(-g) is computed as exp2(g * -log2(e)): one multiply and the hardware's exp2, where CUDA's
#: precise expf spends about ten instructions; at 16 elements per thread and access the
#: arithmetic is a large part of a memory-bound kernel's issue slots. The sigmoid's 1 / (1 + e)
#: is the hardware's approximate reciprocal (``fast_rcp``, within 1 ulp; Triton's default float
#: division is approximate too), not the IEEE division's instruction sequence; not measured
#: on its own yet.
_MINUS_LOG2E = -1.4426950408889634


def _functions(activation: str):
    """(act, act_and_derivative) as builders of float32 TileLang expressions: ``act(g)`` and
    ``act_and_derivative(g)`` -> (act(g), act'(g))."""
    import tilelang.language as T

    if activation == "silu":

        def sigmoid(g):
            return T.fast_rcp(1.0 + T.exp2(g * _MINUS_LOG2E))

        def act(g):
            return g * sigmoid(g)

        def both(g):
            s = sigmoid(g)
            return g * s, s * (1.0 + g * (1.0 - s))

    elif activation == "gelu":

        def act(g):
            return 0.5 * g * (1.0 + T.erf(g * _SQRT1_2))

        def both(g):
            cdf = 0.5 * (1.0 + T.erf(g * _SQRT1_2))
            return g * cdf, cdf + g * _INV_SQRT_2PI * T.exp(-0.5 * g * g)

    elif activation == "gelu_tanh":

        def act(g):
            return 0.5 * g * (1.0 + T.tanh(_SQRT_2_OVER_PI * (g + _TANH_CUBIC * g * g * g)))

        def both(g):
            t = T.tanh(_SQRT_2_OVER_PI * (g + _TANH_CUBIC * g * g * g))
            derivative = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _TANH_CUBIC * g * g)
            return 0.5 * g * (1.0 + t), derivative

    else:
        raise ValueError(f"unknown activation {activation!r}; expected one of {', '.join(_ACTIVATIONS)}")
    return act, both


def make_program(
    kind: str, activation: str, dtype: torch.dtype, *, vec: int, threads: int, per_thread: int, d: int = 0,
    pitches: tuple[int, ...] | None = None,
):
    """The TileLang PrimFunc of one kind (see the module) for one activation, dtype and launch
    configuration; ``d`` is the packed kinds' half width and the row views' width, ``pitches``
    the row views' pitches (each a multiple of ``vec`` of at least ``d``)."""
    import tilelang.language as T

    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
    if (kind.startswith("packed") or pitches is not None) and (d < 1 or d % vec):
        raise ValueError(f"the packed kinds and row views need d >= 1 and a multiple of vec={vec}, got d={d}")
    if pitches is not None and (
        len(pitches) != ROW_VIEW_READS.get(kind) or any(pitch < d or pitch % vec for pitch in pitches)
    ):
        raise ValueError(
            f"pitches={pitches} for {kind} d={d} vec={vec}: the kinds {', '.join(ROW_VIEW_READS)} read row views, "
            "one pitch per tensor read, each at least d and a multiple of vec"
        )
    dt, f32 = _TL_DTYPES[dtype], "float32"
    act, both = _functions(activation)
    lanes = T.vectorized if vec > 1 else T.serial
    chunk = threads * per_thread  # accesses per block

    def wide(value):
        return T.cast(value, f32)

    def narrow(value):
        return T.cast(value, dt)

    def wide_index(block):
        # 64-bit element indices: a tensor may hold more than 2**31 elements.
        return T.cast(block, "int64")

    def first_access(bx, step, tx):
        return (wide_index(bx) * per_thread + step) * threads + tx

    # Every kind moves its data in three phases: all of a thread's loads (per_thread x inputs
    # 16-byte loads in flight at once, where a load-compute-store per access left one), the
    # arithmetic on registers, then the stores. A thread's registers hold per_thread accesses of
    # each tensor; past the end nothing is loaded or stored, and what is computed there is dropped.
    @T.macro
    def gather(source, registers, bx, tx, n):
        for step in T.unroll(per_thread):
            base = first_access(bx, step, tx) * vec
            if base < n:
                for v in lanes(vec):
                    registers[step * vec + v] = source[base + v]

    @T.macro
    def scatter(registers, target, bx, tx, n):
        for step in T.unroll(per_thread):
            base = first_access(bx, step, tx) * vec
            if base < n:
                for v in lanes(vec):
                    target[base + v] = registers[step * vec + v]

    # The packed kinds address (rows, columns) tensors: access i is row i // dv, columns
    # (i % dv) * vec + offset onwards (offset d for the up half).
    dv = d // vec  # accesses per row of each half
    @T.macro
    def gather_rows(source, registers, bx, tx, accesses, offset):
        for step in T.unroll(per_thread):
            i = first_access(bx, step, tx)
            if i < accesses:
                for v in lanes(vec):
                    registers[step * vec + v] = source[i // dv, offset + (i % dv) * vec + v]

    @T.macro
    def scatter_rows(registers, target, bx, tx, accesses, offset):
        for step in T.unroll(per_thread):
            i = first_access(bx, step, tx)
            if i < accesses:
                for v in lanes(vec):
                    target[i // dv, offset + (i % dv) * vec + v] = registers[step * vec + v]

    held = per_thread * vec  # elements a thread holds of each tensor
    rows = pitches is not None
    if kind.startswith("packed") or rows:
        m = T.dynamic("m", "int64")
    else:
        n = T.dynamic("n", "int64")

    # The elementwise kinds' tensors: 1-D of n elements, or (m, d) rows (the read ones at their
    # pitches), and their loads and stores by access.
    def read(position):
        return T.StridedTensor((m, d), (pitches[position], 1), dt) if rows else T.Tensor((n,), dt)

    def written():
        return T.Tensor((m, d), dt) if rows else T.Tensor((n,), dt)

    def blocks():
        return T.ceildiv(m * dv, chunk) if rows else T.ceildiv(n, chunk * vec)

    @T.macro
    def promise_whole_accesses():
        if not rows:
            T.assume(n % vec == 0)  # the launch rule's promise: an access never straddles n

    @T.macro
    def load(source, registers, bx, tx):
        if rows:
            gather_rows(source, registers, bx, tx, m * dv, 0)
        else:
            gather(source, registers, bx, tx, n)

    @T.macro
    def store(registers, target, bx, tx):
        if rows:
            scatter_rows(registers, target, bx, tx, m * dv, 0)
        else:
            scatter(registers, target, bx, tx, n)

    if kind == "act":

        @T.prim_func
        def main(x: read(0), y: written()):
            with T.Kernel(blocks(), threads=threads) as bx:
                tx = T.get_thread_binding()
                promise_whole_accesses()
                a = T.alloc_local((held,), dt)
                o = T.alloc_local((held,), dt)
                load(x, a, bx, tx)
                for e in T.unroll(held):
                    o[e] = narrow(act(wide(a[e])))
                store(o, y, bx, tx)

        return main

    if kind == "act_bwd":

        @T.prim_func
        def main(dy: read(0), x: read(1), dx: written()):
            with T.Kernel(blocks(), threads=threads) as bx:
                tx = T.get_thread_binding()
                promise_whole_accesses()
                g = T.alloc_local((held,), dt)
                a = T.alloc_local((held,), dt)
                o = T.alloc_local((held,), dt)
                load(dy, g, bx, tx)
                load(x, a, bx, tx)
                for e in T.unroll(held):
                    o[e] = narrow(wide(g[e]) * both(wide(a[e]))[1])
                store(o, dx, bx, tx)

        return main

    if kind == "gated":

        @T.prim_func
        def main(gate: read(0), up: read(1), y: written()):
            with T.Kernel(blocks(), threads=threads) as bx:
                tx = T.get_thread_binding()
                promise_whole_accesses()
                a = T.alloc_local((held,), dt)
                b = T.alloc_local((held,), dt)
                o = T.alloc_local((held,), dt)
                load(gate, a, bx, tx)
                load(up, b, bx, tx)
                for e in T.unroll(held):
                    o[e] = narrow(act(wide(a[e])) * wide(b[e]))
                store(o, y, bx, tx)

        return main

    @T.macro
    def gated_gradients(dy, gate, up, dgate, dup):
        # The in-place kind passes gate and up as dgate and dup: every load precedes every store.
        with T.Kernel(blocks(), threads=threads) as bx:
            tx = T.get_thread_binding()
            promise_whole_accesses()
            g = T.alloc_local((held,), dt)
            a = T.alloc_local((held,), dt)
            b = T.alloc_local((held,), dt)
            da = T.alloc_local((held,), dt)
            db = T.alloc_local((held,), dt)
            load(dy, g, bx, tx)
            load(gate, a, bx, tx)
            load(up, b, bx, tx)
            for e in T.unroll(held):
                value, derivative = both(wide(a[e]))
                da[e] = narrow(wide(g[e]) * wide(b[e]) * derivative)
                db[e] = narrow(wide(g[e]) * value)
            store(da, dgate, bx, tx)
            store(db, dup, bx, tx)

    if kind == "gated_bwd":

        @T.prim_func
        def main(dy: read(0), gate: read(1), up: read(2), dgate: written(), dup: written()):
            gated_gradients(dy, gate, up, dgate, dup)

        return main

    if kind == "gated_bwd_inplace":

        @T.prim_func
        def main(dy: T.Tensor((n,), dt), gate: T.Tensor((n,), dt), up: T.Tensor((n,), dt)):
            gated_gradients(dy, gate, up, gate, up)

        return main

    if kind == "packed":

        @T.prim_func
        def main(x: T.Tensor((m, 2 * d), dt), y: T.Tensor((m, d), dt)):
            with T.Kernel(T.ceildiv(m * dv, chunk), threads=threads) as bx:
                tx = T.get_thread_binding()
                a = T.alloc_local((held,), dt)
                b = T.alloc_local((held,), dt)
                o = T.alloc_local((held,), dt)
                gather_rows(x, a, bx, tx, m * dv, 0)
                gather_rows(x, b, bx, tx, m * dv, d)
                for e in T.unroll(held):
                    o[e] = narrow(act(wide(a[e])) * wide(b[e]))
                scatter_rows(o, y, bx, tx, m * dv, 0)

        return main

    @T.macro
    def packed_gradients(dy, x, dx):
        # The in-place kind passes x as dx: every load precedes every store.
        with T.Kernel(T.ceildiv(m * dv, chunk), threads=threads) as bx:
            tx = T.get_thread_binding()
            g = T.alloc_local((held,), dt)
            a = T.alloc_local((held,), dt)
            b = T.alloc_local((held,), dt)
            da = T.alloc_local((held,), dt)
            db = T.alloc_local((held,), dt)
            gather_rows(dy, g, bx, tx, m * dv, 0)
            gather_rows(x, a, bx, tx, m * dv, 0)
            gather_rows(x, b, bx, tx, m * dv, d)
            for e in T.unroll(held):
                value, derivative = both(wide(a[e]))
                da[e] = narrow(wide(g[e]) * wide(b[e]) * derivative)
                db[e] = narrow(wide(g[e]) * value)
            scatter_rows(da, dx, bx, tx, m * dv, 0)
            scatter_rows(db, dx, bx, tx, m * dv, d)

    if kind == "packed_bwd":

        @T.prim_func
        def main(dy: T.Tensor((m, d), dt), x: T.Tensor((m, 2 * d), dt), dx: T.Tensor((m, 2 * d), dt)):
            packed_gradients(dy, x, dx)

        return main

    @T.prim_func
    def main(dy: T.Tensor((m, d), dt), x: T.Tensor((m, 2 * d), dt)):
        packed_gradients(dy, x, x)

    return main


def compile_program(kind: str, activation: str, dtype: torch.dtype, target: dict[str, str], **config):
    """The compiled kernel of one configuration for ``target``, once per process (and on disk)."""
    identity = ("activation", kind, activation, dtype, tuple(sorted(config.items())))
    return compile_once(identity, lambda: make_program(kind, activation, dtype, **config), target)
