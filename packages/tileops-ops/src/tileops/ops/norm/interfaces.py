"""The norm family's kernel interfaces and call specs: the contract every implementation of
a normalization (in-tree or a backend's) is written against.

Kernels see row-major, contiguous tensors: ``x`` of shape (m, n) where n is the product of
``normalized_shape`` and m of every leading dimension; ``weight`` and ``bias`` of shape (n,) or
None. The op reshapes its inputs and outputs around them, except for an implementation that
sets ``takes_leading_dims = True``: when ``normalized_shape`` has one dimension, it receives x
(and residual) as the caller passed them, (..., n) with any number of leading dimensions, and
returns outputs of that shape.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar

import torch

from tileops.core import CallSpec, KernelInterface


@dataclasses.dataclass(frozen=True)
class NormCall(CallSpec):
    """The facts of one normalization call that select and build its kernel.

    ``n`` is the row length, ``eps`` the value actually used (torch's default already
    resolved), ``aligned`` whether every tensor's data pointer is 16-byte aligned (vectorised
    kernels refuse unaligned calls). The batch size is not part of the spec, so a new batch
    size reuses the kernel already chosen.
    """

    n: int
    dtype: torch.dtype
    eps: float
    has_weight: bool
    has_bias: bool
    aligned: bool


@dataclasses.dataclass(frozen=True)
class RMSNormCall(NormCall):
    """A call of ``RMSNormFwdInterface`` (``has_bias`` is always False)."""


@dataclasses.dataclass(frozen=True)
class LayerNormCall(NormCall):
    """A call of ``LayerNormFwdInterface``."""


@dataclasses.dataclass(frozen=True)
class FusedAddRMSNormCall(NormCall):
    """A call of ``FusedAddRMSNormFwdInterface`` (``has_bias`` is always False)."""


@dataclasses.dataclass(frozen=True)
class FusedAddLayerNormCall(NormCall):
    """A call of ``FusedAddLayerNormFwdInterface``."""


class _NormFwdInterface(KernelInterface):
    """What the four norm interfaces share: the leading-dimensions declaration."""

    #: True when ``forward`` takes x (and residual) of shape (..., n), any number of leading
    #: dimensions, and returns outputs of that shape: the op then passes the caller's tensors
    #: without a view (a view costs about a microsecond of host time on a decode call).
    takes_leading_dims: ClassVar[bool] = False


class RMSNormFwdInterface(_NormFwdInterface):
    call_spec = RMSNormCall

    @abc.abstractmethod
    def forward(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """Return ``x * rsqrt(mean(x**2, -1) + eps) * weight`` for x of shape (m, n).

        Accumulate in float32 and return a new (m, n) tensor of x's dtype. ``weight`` is an
        (n,) tensor of x's dtype, or None for no scale. ``eps`` comes from the call spec.
        """


class LayerNormFwdInterface(_NormFwdInterface):
    call_spec = LayerNormCall

    @abc.abstractmethod
    def forward(
        self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """Return ``(x - mean) * rsqrt(var + eps) * weight + bias`` per row of x (m, n).

        The variance is the biased one, as torch's. Accumulate in float32 and return a new
        (m, n) tensor of x's dtype. ``weight``/``bias`` are (n,) tensors of x's dtype or None.
        """


class FusedAddRMSNormFwdInterface(_NormFwdInterface):
    call_spec = FusedAddRMSNormCall

    @abc.abstractmethod
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(rms_norm(s), s)`` where ``s = x + residual`` rounded to x's dtype.

        The norm is computed from the rounded sum, exactly as ``F.rms_norm(x + residual)``
        would; both results are new (m, n) tensors of x's dtype.
        """


class FusedAddLayerNormFwdInterface(_NormFwdInterface):
    call_spec = FusedAddLayerNormCall

    @abc.abstractmethod
    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(layer_norm(s), s)`` where ``s = x + residual`` rounded to x's dtype."""
