"""The dtype a plain-torch implementation computes in, and the conversions to and from it.

Every family's CPU (and float64) implementation accumulates 16-bit inputs in float32 and keeps
float32 and float64 as they come; these helpers say so once. The conversions return a tensor that
already has the dtype without calling into torch: on a small CPU call each ``.float()`` or
``.to()`` costs 0.7-1 us, as much as the op layer's checks.
"""

from __future__ import annotations

import torch

#: The dtypes that are their own compute dtype.
COMPUTE_DTYPES = (torch.float32, torch.float64)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, float32 for every other floating dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def widened(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """``tensor`` in its compute dtype (None, an optional input not given, passes through)."""
    if tensor is None or tensor.dtype in COMPUTE_DTYPES:
        return tensor
    return tensor.float()


def as_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in ``dtype``: rounded where it has another, itself where it has that one."""
    return tensor if tensor.dtype is dtype else tensor.to(dtype)
