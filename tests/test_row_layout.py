"""The flat row layout of the row kernels (``tileops.kernels.cuda.row_layout``): which rows take
16-byte accesses over a shifted middle, and what a layout refuses."""

from __future__ import annotations

import pytest
import torch

from tileops.kernels.cuda.row_layout import RowLayout, shifts


@pytest.mark.parametrize(
    ("n", "dtype", "aligned", "pointers_aligned", "shifted"),
    [
        (50257, torch.bfloat16, False, True, True),  # an odd vocabulary in aligned tensors
        (30522, torch.float16, False, True, True),  # even, but not whole 16-byte accesses
        (1001, torch.float32, False, True, True),
        (32000, torch.bfloat16, True, True, False),  # whole accesses: the plain layout
        (50257, torch.bfloat16, False, False, False),  # a pointer off the grid: one element per access
        (15, torch.bfloat16, False, True, False),  # under two accesses: no aligned middle with edges around it
        (16, torch.bfloat16, False, True, True),
        (7, torch.float32, False, True, False),
        (9, torch.float32, False, True, True),
    ],
)
def test_rows_shift_where_they_are_not_whole_accesses_in_aligned_tensors_and_hold_two_accesses(
    n, dtype, aligned, pointers_aligned, shifted
):
    assert shifts(n, dtype, aligned, pointers_aligned) is shifted


def test_a_layout_refuses_what_its_programs_could_not_address():
    pytest.importorskip("tilelang")
    with pytest.raises(ValueError, match="shifted row layout needs vec > 1 and n >= 2 \\* vec: vec=8, n=15"):
        RowLayout(15, 8, True)
    with pytest.raises(ValueError, match="shifted row layout needs vec > 1"):
        RowLayout(1001, 1, True)
    with pytest.raises(ValueError, match="rows of 1001 elements are not whole accesses of 8"):
        RowLayout(1001, 8, False)


def test_an_unshifted_layout_places_row_r_at_access_r_times_the_row_s_accesses():
    pytest.importorskip("tilelang")
    layout = RowLayout(4096, 8, False)
    # No geometry registers are read: the row's accesses are a compile-time constant.
    assert layout.accesses(None) == 512 and layout.first_access(None, 3) == 1536
    assert RowLayout(50257, 8, True).most == 6282
