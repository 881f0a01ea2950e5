"""How ``tileops.nn``'s modules meet parameters whose dtype is not the input's."""

from __future__ import annotations

import torch


def like(parameter: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """``parameter`` in ``x``'s dtype (no cast where it has it). The cast is differentiable: a
    float32 parameter beside bfloat16 activations, as mixed-precision training keeps it, gets a
    float32 gradient."""
    if parameter is None or parameter.dtype == x.dtype:
        return parameter
    return parameter.to(x.dtype)
