"""The activation family's kernel interfaces and call specs: the contract every implementation
of an activation, forward or backward (in-tree or a backend's), is written against.

Kernels see contiguous tensors. The elementwise interfaces (``ActivationFwdInterface``,
``ActivationBwdInterface``, ``GatedFwdInterface``, ``GatedBwdInterface``,
``GatedInplaceBwdInterface``) take 1-D tensors of one length: the op flattens the caller's
tensors and gives the results their shape back. The packed interfaces take ``x`` as (m, 2 * d)
rows holding [gate | up] and ``dy``/``y`` as (m, d). An implementation that sets
``takes_any_shape = True`` receives the caller's tensors as they are instead (any rank; the
packed ones (..., 2 * d) and (..., d)) and returns results of that shape.

Row views: a call of the forward and two-tensor backward interfaces (not the in-place or packed
ones) whose tensors include a row view (``tileops.core.row_views``: rows of the last dimension
at a pitch, such as one half of a gate-up projection's output taken by ``chunk``) has a call
spec with ``width`` (the last dimension) and ``row_strides`` (each tensor's pitch, in the
interface's argument order). An implementation that sets ``takes_row_views = True`` then
receives every tensor as an (m, width) view at its pitch and returns (m, width) results; any
other receives contiguous 1-D copies, as for every other call.

Every implementation computes in float32 (float64 for float64 tensors) and rounds once.

``activation`` names the function: ``"silu"``, ``"gelu"`` (the exact, erf form) or
``"gelu_tanh"`` (torch's ``approximate="tanh"``). One interface serves SiLU and GELU (and
SwiGLU and GeGLU): an implementation that computes one function only refuses the others.
"""

from __future__ import annotations

import abc
import dataclasses

import torch

from tileops.core import CallSpec, KernelInterface

#: The activation functions, as ``ActivationCall.activation`` names them.
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


@dataclasses.dataclass(frozen=True)
class ActivationCall(CallSpec):
    """The facts of one elementwise activation call that select and build its kernel.

    ``aligned`` says that every tensor's data pointer is 16-byte aligned and the element count
    a multiple of 16 bytes' worth of elements (vectorised kernels need both; always True on
    the CPU, whose vector loads take any address). The element count itself is not part of the
    spec, so a call of another shape reuses the kernel built (a call on row views, one of the
    same width and pitches).
    """

    dtype: torch.dtype
    activation: str
    aligned: bool
    #: A call on row views (see the module): the rows' length, and each tensor's pitch in the
    #: interface's argument order; 0 and None for a call on contiguous tensors. ``aligned`` then
    #: also says that the width and every pitch are whole 16-byte accesses.
    width: int = 0
    row_strides: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class PackedCall(CallSpec):
    """The facts of one packed gated call: ``d`` is the width of each half of x's rows;
    ``aligned`` says that every data pointer is 16-byte aligned and ``d`` a multiple of 16
    bytes' worth of elements (so that both halves of every row are)."""

    dtype: torch.dtype
    activation: str
    d: int
    aligned: bool


class ActivationFwdInterface(KernelInterface):
    call_spec = ActivationCall

    @abc.abstractmethod
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``act(x)`` for a contiguous 1-D ``x``: a new tensor of x's shape and dtype."""


class ActivationBwdInterface(KernelInterface):
    call_spec = ActivationCall

    @abc.abstractmethod
    def forward(self, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``dy * act'(x)`` for contiguous 1-D ``dy`` and ``x`` of one length: dx, a new
        tensor of x's shape and dtype."""


class GatedFwdInterface(KernelInterface):
    call_spec = ActivationCall

    @abc.abstractmethod
    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` for contiguous 1-D ``gate`` and ``up`` of one length."""


class GatedBwdInterface(KernelInterface):
    call_spec = ActivationCall

    @abc.abstractmethod
    def forward(self, dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(dy * up * act'(gate), dy * act(gate))`` for contiguous 1-D tensors of one length:
        (dgate, dup), new tensors of gate's shape and dtype."""


class GatedInplaceBwdInterface(KernelInterface):
    call_spec = ActivationCall

    @abc.abstractmethod
    def forward(self, dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> None:
        """``GatedBwdInterface``'s gradients written over its inputs: ``gate`` becomes dgate and
        ``up`` becomes dup (contiguous 1-D tensors of one length, which the caller will not read
        again). Each element's inputs are read before either gradient is written."""


class PackedGatedFwdInterface(KernelInterface):
    call_spec = PackedCall

    @abc.abstractmethod
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``act(x[:, :d]) * x[:, d:]`` for contiguous (m, 2 * d) rows ``x``: y, a new (m, d)
        tensor of x's dtype."""


class PackedGatedBwdInterface(KernelInterface):
    call_spec = PackedCall

    @abc.abstractmethod
    def forward(self, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The gradient of x for contiguous (m, d) ``dy`` and (m, 2 * d) ``x``:
        dx = [dy * up * act'(gate) | dy * act(gate)], a new tensor of x's shape and dtype."""


class PackedGatedInplaceBwdInterface(KernelInterface):
    call_spec = PackedCall

    @abc.abstractmethod
    def forward(self, dy: torch.Tensor, x: torch.Tensor) -> None:
        """``PackedGatedBwdInterface``'s gradient written over its input: ``x`` (contiguous
        (m, 2 * d) rows, which the caller will not read again) becomes [dgate | dup]. Each
        element pair's gate and up are read before either gradient is written."""
