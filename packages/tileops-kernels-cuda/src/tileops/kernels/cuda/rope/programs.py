"""The TileLang program of the rope kernels, and its compilation.

One program rotates q and k in one launch. The work of a token is cut into units: per head, the
pairs of the rotated columns, ``vec`` pairs to a unit, and then the pass-through columns,
``vec`` to a unit (a unit of the in-place build has no pass-through columns: they stay). A
neox unit holds ``vec`` columns of each half (j and j + R/2, two 16-byte accesses); an
interleaved unit ``vec`` consecutive columns, ``vec / 2`` pairs (one access). The units of
q's heads come first, then k's; each block runs ``threads`` consecutive units of one token,
one per thread, and reads the token's position once per unit, then the cos and sin columns of
its unit at that row of the caches. With ``inverse`` (the backward) a pair (x1, x2) at columns
(j1, j2) becomes (c1 x1 + s2 x2, c2 x2 - s1 x1), else (c1 x1 - s1 x2, c2 x2 + s2 x1): the same
program with sin negated and read at the partner column.

The token count T and the caches' length are symbolic, so one compiled program serves every
batch; the head counts, the head size, the rotated width, the style, the dtypes and ``vec``
are compile-time constants. Every tensor is contiguous: q (T, Hq, D), k (T, Hkv, D), cos and
sin (P, R), position_ids (T,) int64, then (out of place) the outputs like q and k. Importing
this module does not import tilelang; building a program does.
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func's annotations.

import torch

from tileops.ops.vector_access import VECTOR_BYTES

from ..compile import compile_once

_TL_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def units_per_head(head_dim: int, rotary_dim: int, style: str, vec: int, pass_vec: int, inplace: bool) -> tuple[int, int]:
    """(rotating units, pass-through units) of one head."""
    rotating = rotary_dim // 2 // vec if style == "neox" else rotary_dim // vec
    passing = 0 if inplace else (head_dim - rotary_dim) // pass_vec
    return rotating, passing


def make_program(
    dtype: torch.dtype,
    cos_dtype: torch.dtype,
    heads_q: int,
    heads_k: int,
    head_dim: int,
    rotary_dim: int,
    style: str,
    inverse: bool,
    *,
    vec: int,
    pass_vec: int,
    threads: int,
    inplace: bool = False,
):
    """The TileLang PrimFunc ``main(q, k, cos, sin, position_ids[, q_rot, k_rot])``.

    vec: columns per access of each half (neox) or per access (interleaved, even), and
    pass_vec the pass-through columns per access: 16 bytes' worth for the vectorised build; 1
    (neox) or 2 (interleaved) and 1 for the general one, which serves any even rotated width,
    any head size and any alignment. threads: units per block. inplace: q and k are rotated
    where they are (each thread reads its unit's pairs whole before writing them, so no thread
    reads what another writes); there are no outputs.
    """
    half = rotary_dim // 2
    if style not in ("neox", "interleaved") or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"bad rope shape: style={style!r} rotary_dim={rotary_dim} head_dim={head_dim}")
    if (style == "neox" and half % vec) or (style == "interleaved" and (vec % 2 or rotary_dim % vec)):
        raise ValueError(f"vec={vec} does not divide the {style} pairs of rotary_dim={rotary_dim}")
    if (head_dim - rotary_dim) % pass_vec:
        raise ValueError(f"pass_vec={pass_vec} does not divide the {head_dim - rotary_dim} pass-through columns")
    import tilelang.language as T

    dt, ct, f32 = _TL_DTYPES[dtype], _TL_DTYPES[cos_dtype], "float32"
    rotating, passing = units_per_head(head_dim, rotary_dim, style, vec, pass_vec, inplace)
    per_head = rotating + passing
    per_token = (heads_q + heads_k) * per_head
    blocks_per_token = -(-per_token // threads)
    neox = style == "neox"
    pairs = vec if neox else vec // 2  # pairs in one unit
    # The slots in a unit's buffers of pair i's two columns: neox holds vec columns at j, then
    # vec at j + R/2; interleaved one run of vec columns whose pairs are its (even, odd) slots.
    slots = [(i, vec + i) if neox else (2 * i, 2 * i + 1) for i in range(pairs)]

    def runs(count: int, itemsize: int) -> list[tuple[int, int, object]]:
        """(start, length, loop) of the accesses that move ``count`` consecutive elements of
        ``itemsize`` bytes: 16-byte vectors where ``vec`` fills them, single elements otherwise."""
        if vec * dtype.itemsize != VECTOR_BYTES:
            return [(0, count, T.serial)]
        length = min(count, 16 // itemsize)
        return [(start, length, T.vectorized) for start in range(0, count, length)]

    x_runs, c_runs = runs(vec, dtype.itemsize), runs(vec, cos_dtype.itemsize)
    p_runs = [(0, pass_vec, T.vectorized if pass_vec * dtype.itemsize == VECTOR_BYTES else T.serial)]

    t = T.dynamic("t")
    p = T.dynamic("p")
    q_t, k_t = T.Tensor((t, heads_q, head_dim), dt), T.Tensor((t, heads_k, head_dim), dt)
    cos_t, sin_t = T.Tensor((p, rotary_dim), ct), T.Tensor((p, rotary_dim), ct)
    pos_t = T.Tensor((t,), "int64")
    absent = 0
    qo_t = absent if inplace else T.Tensor((t, heads_q, head_dim), dt)
    ko_t = absent if inplace else T.Tensor((t, heads_k, head_dim), dt)

    def f(e):
        return T.cast(e, f32)

    @T.macro
    def unit(src, dst, cos, sin, token, head, u, row, xs, cs, ss, ys):
        if u < rotating:
            first = u * vec  # the unit's first column (neox: of its first half)
            # The unit's columns: one run of vec (interleaved), or vec at j and vec at j + R/2.
            for base, column in [(0, 0), (vec, half)] if neox else [(0, 0)]:
                for start, length, loop in x_runs:
                    for v in loop(length):
                        xs[base + start + v] = src[token, head, first + column + start + v]
                for start, length, loop in c_runs:
                    for v in loop(length):
                        cs[base + start + v] = cos[row, first + column + start + v]
                    for v in loop(length):
                        ss[base + start + v] = sin[row, first + column + start + v]
            for a, b in slots:
                if inverse:
                    ys[a] = T.cast(f(cs[a]) * f(xs[a]) + f(ss[b]) * f(xs[b]), dt)
                    ys[b] = T.cast(f(cs[b]) * f(xs[b]) - f(ss[a]) * f(xs[a]), dt)
                else:
                    ys[a] = T.cast(f(cs[a]) * f(xs[a]) - f(ss[a]) * f(xs[b]), dt)
                    ys[b] = T.cast(f(cs[b]) * f(xs[b]) + f(ss[b]) * f(xs[a]), dt)
            for base, column in [(0, 0), (vec, half)] if neox else [(0, 0)]:
                for start, length, loop in x_runs:
                    for v in loop(length):
                        dst[token, head, first + column + start + v] = ys[base + start + v]
        elif passing > 0:
            column = rotary_dim + (u - rotating) * pass_vec
            for start, length, loop in p_runs:
                for v in loop(length):
                    xs[start + v] = src[token, head, column + start + v]
                for v in loop(length):
                    dst[token, head, column + start + v] = xs[start + v]

    @T.prim_func
    def main(q: q_t, k: k_t, cos: cos_t, sin: sin_t, position_ids: pos_t, q_rot: qo_t, k_rot: ko_t):
        with T.Kernel(t * blocks_per_token, threads=threads) as bx:
            tx = T.get_thread_binding()
            token = bx // blocks_per_token
            index = (bx % blocks_per_token) * threads + tx
            xs = T.alloc_local((2 * max(vec, pass_vec),), dt)
            ys = T.alloc_local((2 * vec,), dt)
            cs = T.alloc_local((2 * vec,), ct)
            ss = T.alloc_local((2 * vec,), ct)
            if index < per_token:
                row = T.cast(position_ids[token], "int32")
                head = index // per_head
                u = index % per_head
                if head < heads_q:
                    unit(q, q if inplace else q_rot, cos, sin, token, head, u, row, xs, cs, ss, ys)
                else:
                    unit(k, k if inplace else k_rot, cos, sin, token, head - heads_q, u, row, xs, cs, ss, ys)

    return main


def compile_program(
    dtype, cos_dtype, heads_q, heads_k, head_dim, rotary_dim, style, inverse, target: dict[str, str], **config
):
    """The compiled kernel of one build for ``target``, once per process (and on disk)."""
    identity = (
        "rope", dtype, cos_dtype, heads_q, heads_k, head_dim, rotary_dim, style, bool(inverse),
        tuple(sorted(config.items())),
    )
    return compile_once(
        identity,
        lambda: make_program(dtype, cos_dtype, heads_q, heads_k, head_dim, rotary_dim, style, inverse, **config),
        target,
    )
