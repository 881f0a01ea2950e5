"""The norm family's kernel interfaces and call specs: the contract every implementation of
a normalization (in-tree or a backend's) is written against.

Kernels see 2-D, row-major, contiguous tensors: ``x`` of shape (m, n) where n is the product
of ``normalized_shape`` and m of every leading dimension; ``weight`` and ``bias`` of shape
(n,) or None. The op reshapes its inputs and outputs around them.
"""

from __future__ import annotations

import abc
import dataclasses

import torch

from tileops.backend import CallSpec, KernelInterface


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


class RMSNormFwdInterface(KernelInterface):
    call_spec = RMSNormCall

    @abc.abstractmethod
    def forward(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """Return ``x * rsqrt(mean(x**2, -1) + eps) * weight`` for x of shape (m, n).

        Accumulate in float32 and return a new (m, n) tensor of x's dtype. ``weight`` is an
        (n,) tensor of x's dtype, or None for no scale. ``eps`` comes from the call spec.
        """


class LayerNormFwdInterface(KernelInterface):
    call_spec = LayerNormCall

    @abc.abstractmethod
    def forward(
        self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """Return ``(x - mean) * rsqrt(var + eps) * weight + bias`` per row of x (m, n).

        The variance is the biased one, as torch's. Accumulate in float32 and return a new
        (m, n) tensor of x's dtype. ``weight``/``bias`` are (n,) tensors of x's dtype or None.
        """


class FusedAddRMSNormFwdInterface(KernelInterface):
    call_spec = FusedAddRMSNormCall

    @abc.abstractmethod
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(rms_norm(s), s)`` where ``s = x + residual`` rounded to x's dtype.

        The norm is computed from the rounded sum, exactly as ``F.rms_norm(x + residual)``
        would; both results are new (m, n) tensors of x's dtype.
        """


class FusedAddLayerNormFwdInterface(KernelInterface):
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
