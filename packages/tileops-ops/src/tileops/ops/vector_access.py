"""Whether a call suits 16-byte vector accesses: the ``aligned`` (and ``pointers_aligned``) fields
of the families' call specs, and aligned copies for the kernels that take nothing else.

The TileLang kernels move 16 bytes per access, which CUDA allows only at 16-byte aligned
addresses; a kernel that vectorises a row also needs the row to be a whole number of accesses.
Every family's forward asks this once per call, and its ``call_specs`` asks it of descriptions.
The dense and varlen attention kernels have no unaligned build: their ops hand them
``aligned_copies``. Decode attention's kernels refuse misaligned caches instead (the plain-torch
implementation serves them): a copy of a whole cache each step would cost more than that.
"""

from __future__ import annotations

import torch

#: Bytes per vector access of the TileLang kernels (128-bit loads and stores).
VECTOR_BYTES = 16
# Compared with ``==`` (29 ns) rather than by ``device.type`` (240 ns: a new string per read).
_CPU = torch.device("cpu")


def vector_ready(device: torch.device, row_elements: int, dtype: torch.dtype, *tensors) -> bool:
    """Whether every tensor's data pointer is 16-byte aligned and a row of ``row_elements``
    elements of ``dtype`` is a whole number of 16-byte accesses (0 where the kernels take any
    row length). ``tensors`` may be descriptions of tensors (``call_specs``
    asks it too); None ones (optional inputs not given) are skipped.

    True on the CPU without reading the pointers: CPU vector loads take any address (x86 and
    Arm alike), so no CPU implementation needs the fact, and reading four data pointers cost
    0.37 us of the op layer's 3 us budget on a CPU call.
    """
    if device == _CPU:
        return True
    address = row_elements * dtype.itemsize
    for tensor in tensors:
        if tensor is not None:
            address |= tensor.data_ptr()
    return not address % VECTOR_BYTES


def row_alignment(device: torch.device, n: int, dtype: torch.dtype, *tensors) -> tuple[bool, bool]:
    """``(aligned, pointers_aligned)`` of a call on rows of ``n`` elements in ``tensors``:
    ``vector_ready`` of the rows, and whether every data pointer is 16-byte aligned whatever the
    row length (a kernel may then move each row's aligned middle in 16-byte accesses). The
    pointers are read a second time only where rows are not whole accesses."""
    aligned = vector_ready(device, n, dtype, *tensors)
    return aligned, aligned or vector_ready(device, 0, dtype, *tensors)


def aligned_copies(device: torch.device, *tensors):
    """``tensors`` with each one whose data pointer is off the 16-byte grid replaced by a copy (a
    fresh allocation is aligned; None passes). A misaligned address reaches a kernel only from a
    view that starts inside an element group (such as a flat buffer viewed from an odd offset):
    rare enough that copying costs less than a second build of every kernel, and a vector load
    there would fault, leaving the CUDA context unusable. The CPU's tensors pass as they are."""
    if device == _CPU:
        return tensors
    return tuple(t.clone() if t is not None and t.data_ptr() % VECTOR_BYTES else t for t in tensors)
