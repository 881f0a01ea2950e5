"""Whether a call suits 16-byte vector accesses: the ``aligned`` field of the families' call specs.

The TileLang kernels move 16 bytes per access, which CUDA allows only at 16-byte aligned
addresses; a kernel that vectorises a row also needs the row to be a whole number of accesses.
Every family's forward asks this once per call, and its ``call_specs`` asks it of descriptions.
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
