"""The norm family's kernel interfaces and call specs: the contract every implementation of
a normalization, forward or backward (in-tree or a backend's), is written against.

Kernels see row-major, contiguous tensors: ``x`` of shape (m, n) where n is the product of
``normalized_shape`` and m of every leading dimension; ``weight`` and ``bias`` of shape (n,) or
None. The op reshapes its inputs and outputs around them, except for an implementation that
sets ``takes_any_shape = True``: when ``normalized_shape`` has one dimension, it receives x
(and residual) as the caller passed them, (..., n) with any number of leading dimensions (the
statistics of shape (...)), and returns outputs of that shape.

Row views. The forward ops take x and residual as row views uncopied (the manifest's
``row_views``), and so do the backward ops of RMSNorm and LayerNorm their x (the forward's
input, saved as the caller passed it): an implementation that sets ``takes_row_views = True``
receives such a call's x (and residual) as (m, n) views whose rows are ``row_strides``
elements apart (a pitch of n: contiguous), the call spec saying so, and a backward's other
row inputs as (m, n) rows too; any other receives contiguous copies. Results are always new
contiguous tensors.

Saved statistics. A forward that is differentiated is called through ``forward_saving``: its
result and the per-row statistics its backward reads (``rstd``, and ``mean`` for LayerNorm), of
shape (m,) in float32 (float64 for float64 inputs), computed by the same pass. The default
returns None for them: the backward op then computes them again, which a backend's forward may
accept; the in-tree ones never leave them to it.
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
    resolved), ``aligned`` whether every row the kernel reads starts 16-byte aligned (vectorised
    kernels refuse unaligned calls; always True on the CPU, whose vector loads take any
    address). ``row_strides``: None where x (and residual) are contiguous, else the pitch of
    each, in elements, for a call with a row view among them. The batch size is not
    part of the spec, so a new batch size reuses the kernel already chosen.
    """

    n: int
    dtype: torch.dtype
    eps: float
    has_weight: bool
    has_bias: bool
    aligned: bool
    row_strides: tuple[int, ...] | None = None


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


@dataclasses.dataclass(frozen=True)
class NormBwdCall(NormCall):
    """The facts of one backward call: a forward's, and ``parameter_gradients``, False where the
    op skips every parameter gradient (built with ``skip_outputs``: the parameters are frozen),
    so that none need be summed; the op's result is None for them whatever the kernel returns."""

    parameter_gradients: bool = True


@dataclasses.dataclass(frozen=True)
class RMSNormBwdCall(NormBwdCall):
    """A call of ``RMSNormBwdInterface`` (``has_bias`` is always False)."""


@dataclasses.dataclass(frozen=True)
class LayerNormBwdCall(NormBwdCall):
    """A call of ``LayerNormBwdInterface``."""


@dataclasses.dataclass(frozen=True)
class FusedAddRMSNormBwdCall(NormBwdCall):
    """A call of ``FusedAddRMSNormBwdInterface`` (``has_bias`` is always False)."""


@dataclasses.dataclass(frozen=True)
class FusedAddLayerNormBwdCall(NormBwdCall):
    """A call of ``FusedAddLayerNormBwdInterface``."""


class _NormFwdInterface(KernelInterface):
    """A forward norm interface: ``forward`` and ``forward_saving``."""

    def forward_saving(self, *args: torch.Tensor | None) -> tuple[object, tuple[torch.Tensor | None, ...]]:
        """``(forward(*args), statistics)``: the statistics the backward reads, each (m,) in
        float32 (float64 for float64 inputs), or None for each where this implementation
        does not compute them (the backward op then computes them again)."""
        return self.forward(*args), (None,) * self.saved_count

    #: How many statistics ``forward_saving`` returns: rstd, or mean and rstd.
    saved_count: ClassVar[int] = 1


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
    saved_count = 2  # mean, rstd

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
    saved_count = 2  # mean, rstd

    @abc.abstractmethod
    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(layer_norm(s), s)`` where ``s = x + residual`` rounded to x's dtype."""


# -- backward --------------------------------------------------------------------------------
# Every backward takes its forward's saved statistics (given: the op computes any the forward
# did not save before calling), accumulates in float32 and returns new tensors of dy's dtype:
# the (m, n) gradient and the (n,) parameter gradients, summed over every row. Where the call
# has no such parameter (the call spec's has_weight, has_bias), or wants none of their gradients
# (NormBwdCall.parameter_gradients), a gradient may be None, which spares summing it; one returned anyway
# is dropped by the op, whose result is None there.


class RMSNormBwdInterface(KernelInterface):
    call_spec = RMSNormBwdCall

    @abc.abstractmethod
    def forward(
        self, dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(dx, dweight)`` of ``y = x * rstd * weight``:
        ``dx = rstd * (g - xhat * mean(g * xhat))`` with ``xhat = x * rstd``, ``g = dy * weight``;
        ``dweight = sum over rows of dy * xhat``."""


class LayerNormBwdInterface(KernelInterface):
    call_spec = LayerNormBwdCall

    @abc.abstractmethod
    def forward(
        self,
        dy: torch.Tensor,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        mean: torch.Tensor,
        rstd: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return ``(dx, dweight, dbias)`` of ``y = (x - mean) * rstd * weight + bias``:
        ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`` with ``xhat = (x - mean) * rstd``,
        ``g = dy * weight``; ``dweight = sum of dy * xhat``, ``dbias = sum of dy`` over rows."""


class FusedAddRMSNormBwdInterface(KernelInterface):
    call_spec = FusedAddRMSNormBwdCall

    @abc.abstractmethod
    def forward(
        self,
        dy: torch.Tensor,
        dresidual_sum: torch.Tensor,
        residual_sum: torch.Tensor,
        weight: torch.Tensor | None,
        rstd: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(dsum, dweight)``: RMSNorm's ``(dx, dweight)`` of ``residual_sum``, with
        ``dresidual_sum`` added to dx in the same pass (x and residual both get dsum)."""


class FusedAddLayerNormBwdInterface(KernelInterface):
    call_spec = FusedAddLayerNormBwdCall

    @abc.abstractmethod
    def forward(
        self,
        dy: torch.Tensor,
        dresidual_sum: torch.Tensor,
        residual_sum: torch.Tensor,
        weight: torch.Tensor | None,
        mean: torch.Tensor,
        rstd: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return ``(dsum, dweight, dbias)``: LayerNorm's gradients of ``residual_sum``, with
        ``dresidual_sum`` added to dx in the same pass."""
