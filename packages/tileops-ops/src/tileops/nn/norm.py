"""The norm modules of ``tileops.nn``: ``RMSNorm``, ``LayerNorm`` and their fused residual-add forms.

Each module holds the parameters torch's module of the same name holds, under the same
``state_dict`` keys (``weight``, ``bias``), so that a checkpoint saved from ``torch.nn.RMSNorm`` or
``torch.nn.LayerNorm`` loads into these modules and back. Their constructors take what torch's
take, plus ``target=`` (the target the module's op binds, as for any op). They are
differentiable, ``torch.compile``-able and copy and pickle like any module.

A parameter whose dtype differs from the input's (float32 parameters beside bfloat16
activations, as mixed-precision training keeps them) is cast to the input's dtype for the call
(the cast is differentiable): the result has the input's dtype, as under ``torch.autocast``,
where torch's modules would promote it to the parameter's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tileops.nn._dtypes import like as _like
from tileops.ops import FusedAddLayerNormFwdOp, FusedAddRMSNormFwdOp, LayerNormFwdOp, RMSNormFwdOp

__all__ = ["FusedAddLayerNorm", "FusedAddRMSNorm", "LayerNorm", "RMSNorm"]


def _shape(normalized_shape: int | Sequence[int]) -> tuple[int, ...]:
    return (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)


class _Norm(torch.nn.Module):
    """What the four norm modules share: the affine parameters and their initialisation."""

    def __init__(self, normalized_shape, eps, elementwise_affine: bool, bias: bool, device, dtype) -> None:
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        factory = {"device": device, "dtype": dtype}
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.empty(self.normalized_shape, **factory))
            self.bias = torch.nn.Parameter(torch.empty(self.normalized_shape, **factory)) if bias else None
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Ones for the weight, zeros for the bias, as torch's modules start."""
        if self.weight is not None:
            torch.nn.init.ones_(self.weight)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, target={self.op.requested_target}"


class RMSNorm(_Norm):
    """``torch.nn.RMSNorm`` on ``RMSNormFwdOp``: ``RMSNorm(normalized_shape, eps=None,
    elementwise_affine=True, device=None, dtype=None, *, target=None)``."""

    def __init__(self, normalized_shape, eps: float | None = None, elementwise_affine: bool = True,
                 device=None, dtype=None, *, target: str | None = None) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, False, device, dtype)
        self.op = RMSNormFwdOp(self.normalized_shape, eps, target=target)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, _like(self.weight, x))


class LayerNorm(_Norm):
    """``torch.nn.LayerNorm`` on ``LayerNormFwdOp``: ``LayerNorm(normalized_shape, eps=1e-5,
    elementwise_affine=True, bias=True, device=None, dtype=None, *, target=None)``."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None, *, target: str | None = None) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        self.op = LayerNormFwdOp(self.normalized_shape, eps, target=target)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, _like(self.weight, x), _like(self.bias, x))


class FusedAddRMSNorm(_Norm):
    """A residual add and RMSNorm in one pass (``FusedAddRMSNormFwdOp``), with ``RMSNorm``'s
    parameters: ``forward(x, residual) -> (rms_norm(x + residual), x + residual)``, the second
    being the next layer's residual in a pre-norm block."""

    def __init__(self, normalized_shape, eps: float | None = None, elementwise_affine: bool = True,
                 device=None, dtype=None, *, target: str | None = None) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, False, device, dtype)
        self.op = FusedAddRMSNormFwdOp(self.normalized_shape, eps, target=target)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.op(x, residual, _like(self.weight, x))


class FusedAddLayerNorm(_Norm):
    """A residual add and LayerNorm in one pass (``FusedAddLayerNormFwdOp``), with
    ``LayerNorm``'s parameters: ``forward(x, residual) -> (layer_norm(x + residual), x + residual)``."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None, *, target: str | None = None) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        self.op = FusedAddLayerNormFwdOp(self.normalized_shape, eps, target=target)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.op(x, residual, _like(self.weight, x), _like(self.bias, x))
