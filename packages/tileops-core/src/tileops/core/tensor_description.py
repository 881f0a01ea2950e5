"""``TensorDescription``: a tensor described without data, as ``Op.call_specs`` reads it.

It answers what an op's forward asks of its tensors when it chooses a kernel (``device``,
``dtype``, ``shape``, ``data_ptr()``), so that a rule written over tensors reads descriptions
unchanged, and a call can be explained without allocating it.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class TensorDescription:
    device: torch.device
    dtype: torch.dtype
    shape: tuple[int, ...]
    #: Where the data starts, as far as alignment goes: 0 for a tensor at the start of an
    #: allocation (torch aligns those to at least 64 bytes), the byte offset of a view into one.
    address: int = 0

    def data_ptr(self) -> int:
        return self.address
