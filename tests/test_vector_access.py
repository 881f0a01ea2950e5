"""The ``aligned`` fact every family's call spec carries, the row families' ``pointers_aligned``, and
aligned copies (``tileops.ops.vector_access``)."""

from __future__ import annotations

import pytest
import torch

from tileops.core.tensor_description import TensorDescription
from tileops.ops.vector_access import aligned_copies, row_alignment, vector_ready

GPU = torch.device("cuda", 0)


def described(address: int, device: torch.device = GPU) -> TensorDescription:
    return TensorDescription(device, torch.bfloat16, (4, 64), address)


@pytest.mark.parametrize(
    ("row_elements", "addresses", "ready"),
    [
        (64, (0, 256), True),
        (0, (0, 16), True),  # a row length of 0: the kernels take any row length
        (64, (0, 8), False),  # one pointer off the 16-byte grid
        (3, (0, 0), False),  # rows of 6 bytes are not whole 16-byte accesses
        (8, (), True),  # no tensor (a fresh allocation): the row alone decides
        (7, (), False),
    ],
)
def test_on_a_gpu_every_pointer_and_the_row_length_decide(row_elements, addresses, ready):
    assert vector_ready(GPU, row_elements, torch.bfloat16, *(described(a) for a in addresses)) is ready


def test_rows_that_are_not_whole_accesses_still_have_aligned_pointers_where_every_pointer_is():
    assert row_alignment(GPU, 64, torch.bfloat16, described(0), described(32)) == (True, True)
    assert row_alignment(GPU, 1001, torch.bfloat16, described(0), described(32)) == (False, True)
    assert row_alignment(GPU, 1001, torch.bfloat16, described(0), described(2)) == (False, False)
    assert row_alignment(GPU, 1001, torch.bfloat16) == (False, True)  # fresh allocations


def test_optional_inputs_not_given_are_skipped():
    assert vector_ready(GPU, 0, torch.bfloat16, described(0), None, described(32)) is True
    assert vector_ready(GPU, 0, torch.bfloat16, None, described(2)) is False


def test_on_the_cpu_the_call_is_ready_without_reading_a_pointer():
    class Unreadable:
        def data_ptr(self):
            raise AssertionError("a CPU call read a data pointer")

    assert vector_ready(torch.device("cpu"), 3, torch.bfloat16, Unreadable()) is True
    view = torch.randn(65)[1:]  # 4 bytes past the allocation's alignment
    assert view.data_ptr() % 16 and vector_ready(view.device, 64, view.dtype, view) is True


def test_a_gpu_call_gets_copies_of_the_tensors_off_the_16_byte_grid_only():
    flat = torch.randn(4 * 64 + 1, dtype=torch.bfloat16)
    shifted = flat[1:].view(4, 64)  # contiguous, 2 bytes past the allocation's alignment
    aligned = torch.randn(4, 64, dtype=torch.bfloat16)
    assert shifted.data_ptr() % 16 and not aligned.data_ptr() % 16
    first, second, absent = aligned_copies(GPU, shifted, aligned, None)
    assert not first.data_ptr() % 16 and torch.equal(first, shifted)
    assert second is aligned and absent is None


def test_a_cpu_call_gets_its_tensors_as_they_are():
    shifted = torch.randn(65)[1:]
    assert aligned_copies(torch.device("cpu"), shifted)[0] is shifted
