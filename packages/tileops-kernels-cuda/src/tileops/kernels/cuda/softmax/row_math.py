"""What every softmax program shares (``row_math``): the row layout and TileLang names it is written
in, and the arithmetic per row: an input element as float32, exp as exp2, the online maximum's
rescaling, a statistic reduced over a row's threads, and y and dx of one element from the row's
statistics. Importing this module does not import tilelang; calling ``row_math`` does.
"""

# No `from __future__ import annotations`: TileLang evaluates the macros' annotations.

from types import SimpleNamespace

import torch

from ..row_layout import RowLayout

TL_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
#: exp(d) is computed as exp2(d * log2(e)): one MUFU instruction where CUDA's precise expf spends
#: about ten; the per-element exponentials were the register kernel's bottleneck on rows of 32000
#: (compute, not memory, set its time with one 1024-thread block per SM). d = x - max is formed
#: first, so the rounding of the product is relative to d, not to x.
LOG2E = 1.4426950408889634


def rounds_input(dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Whether x is rounded to ``out_dtype`` before the math: torch converts x to the requested
    dtype first, which changes values only where that dtype is not wider."""
    return out_dtype != dtype and out_dtype.itemsize <= dtype.itemsize


def row_math(
    dtype: torch.dtype, out_dtype: torch.dtype, log: bool, *, n: int, vec: int, shifted: bool, threads: int, tpr: int
) -> SimpleNamespace:
    """What a program of rows of ``n`` elements needs beside its own loops, for ``threads``
    threads a block and ``tpr`` threads a row, reading ``dtype`` and writing ``out_dtype``
    (softmax, or log-softmax with ``log``) in accesses of ``vec`` elements: TileLang's dtype
    names (``dt``, ``odt``), the access loop (``lanes``), the symbolic row count ``m``, the
    accesses per row ``nv`` (a shifted row has nv or nv - 1), the row layout's functions
    (``row_layout.RowLayout``), and the shared functions and macros below. A row's statistics
    live in a float32 ``stat`` of three: the maximum, the sum, and 1 / sum (softmax) or log(sum)
    (log-softmax) once ``finish_statistics`` has run."""
    import tilelang.language as T

    dt, odt, f32 = TL_DTYPES[dtype], TL_DTYPES[out_dtype], "float32"
    m = T.dynamic("m", "int64")
    layout = RowLayout(n, vec, shifted)
    rounded = rounds_input(dtype, out_dtype)
    warps = max(1, tpr // 32)  # warps per row
    neg_inf = -T.infinity(f32)

    def value(element):
        """An input element as float32, rounded to out_dtype first where torch would round it."""
        if rounded:
            return T.cast(T.cast(element, odt), f32)
        return T.cast(element, f32)

    def exp(d):
        return T.exp2(d * LOG2E)

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


    def gradient_term(dy_element, y_element):
        """One element's term of the row's sum in the gradient, in float32: dy (log-softmax) or dy * y."""
        if log:
            return T.cast(dy_element, f32)
        return T.cast(dy_element, f32) * T.cast(y_element, f32)

    def gradient(dy_element, y_element, total):
        """dx of one element, in float32: dy - exp(y) * sum(dy) (log-softmax) or y * (dy - sum(dy * y))."""
        g, y = T.cast(dy_element, f32), T.cast(y_element, f32)
        if log:
            return g - T.exp2(y * LOG2E) * total
        return y * (g - total)

    return SimpleNamespace(
        dt=dt, odt=odt, lanes=T.vectorized if vec > 1 else T.serial, m=m, nv=n // vec, locate=layout.locate,
        first_access=layout.first_access, accesses=layout.accesses, edge=layout.edge, has_edge=layout.has_edge,
        neg_inf=neg_inf, value=value, exp=exp, rescale=rescale, shift_of=shift_of, reduce=reduce,
        forward_value=forward_value, finish_statistics=finish_statistics, gradient_term=gradient_term,
        gradient=gradient,
    )
