"""Rows addressed as one flat array: where a row's vector accesses and its edge elements lie.

A row kernel over contiguous (m, n) rows may read them as one flat view of m * n elements. Where
n is a whole number of ``vec``-element accesses, row r's accesses start at access r * n / vec.
Where it is not but the tensors' data pointers are 16-byte aligned (a *shifted* layout), a row
starts anywhere on the 16-byte grid: its accesses cover the aligned middle of the row, and its
*edges*, the fewer than ``2 * vec`` elements before and after that middle, are read one by one
(by the row's first threads, one element each). Counting the flat view in whole accesses is what
lets TileLang prove the middle's accesses aligned and vectorise them; such programs compile with
``compile.GUARDED_BY_THE_PROGRAM``, as TileLang's own bounds checks would stop it.

One element per access (the only way to read such rows otherwise) moved 1000 rows of 30001
bfloat16 elements at 0.71x Liger-Kernel's speed on an H100: eight times the instructions per byte.

Importing this module does not import tilelang; building a layout does.
"""

from __future__ import annotations

import torch

from tileops.ops.vector_access import VECTOR_BYTES

#: int64 registers a shifted layout keeps per row (``RowLayout.locate``).
GEOMETRY = 4


def vector_width(dtype: torch.dtype, aligned: bool = True) -> int:
    """The elements of one access: 16 bytes' worth where the call is aligned, else 1."""
    return VECTOR_BYTES // dtype.itemsize if aligned else 1


def shifts(n: int, dtype: torch.dtype, aligned: bool, pointers_aligned: bool) -> bool:
    """Whether rows of ``n`` elements take the shifted layout: they are not whole 16-byte
    accesses, the pointers are aligned, and a row has room for edges on both sides of an access."""
    return not aligned and pointers_aligned and n >= 2 * vector_width(dtype)


class RowLayout:
    """The accesses and edges of rows of ``n`` elements in ``vec``-element accesses, ``shifted``
    or not, as TileLang expressions of a row's geometry registers (``geo``: ``GEOMETRY`` int64,
    filled by ``locate``; an unshifted layout computes nothing into them)."""

    def __init__(self, n: int, vec: int, shifted: bool) -> None:
        import tilelang.language as T

        if shifted and (vec == 1 or n < 2 * vec):
            raise ValueError(f"a shifted row layout needs vec > 1 and n >= 2 * vec: vec={vec}, n={n}")
        if not shifted and n % vec:
            raise ValueError(f"rows of {n} elements are not whole accesses of {vec}: they need a shifted layout")
        self._T = T
        self.n, self.vec, self.shifted = n, vec, shifted
        #: The accesses of the longest row (a shifted row has this many or one fewer).
        self.most = n // vec

        @T.macro
        def locate(geo, row):
            """Fill ``geo`` for ``row`` (int64): [0] its first access, counted from the flat
            view's start, [1] its accesses, [2] its edge elements, [3] those before the first access."""
            if shifted:
                geo[0] = (row * n + (vec - 1)) // vec
                geo[1] = (row * n + n) // vec - geo[0]
                geo[2] = n - geo[1] * vec
                geo[3] = geo[0] * vec - row * n

        self.locate = locate

    def first_access(self, geo, row):
        """The row's first access, counted in accesses from the flat view's start."""
        return geo[0] if self.shifted else row * self.most

    def accesses(self, geo):
        """The row's accesses."""
        return geo[1] if self.shifted else self.most

    def has_edge(self, geo, e):
        """Whether the row has an edge element ``e`` (a shifted layout's, read by thread e)."""
        return e < geo[2]

    def edge(self, geo, row, e):
        """The flat index of the row's edge element ``e``: those before its accesses, then after."""
        n = self.n
        return self._T.if_then_else(e < geo[3], row * n + e, row * n + (n - geo[2]) + e)
