"""The activation family's ops: SiLU and GELU, SwiGLU and GeGLU from two tensors, and the packed
forms of the gated ops (one tensor holding [gate | up]), forward and backward.

Each op builds the call spec its interface takes, runs the implementation selection picks, and
hands it the inputs as it takes them: flattened to 1-D for the elementwise interfaces, as (m,
2 * d) rows for the packed ones, the results given the caller's shape back; an implementation
that takes any shape gets the caller's tensors as they are. A row view (the manifest lets them
through uncopied: one half of a gate-up projection's output taken by chunk) reaches an
implementation that takes row views as (m, width) rows at its pitch, any other as a contiguous
copy. The forward ops are
differentiable: they save nothing (``saves: []``), and core's autograd wiring calls the backward
op their manifest entry names with the incoming gradient and the forward's inputs.
"""

from __future__ import annotations

import math
from importlib.resources import files

import torch

from tileops.core import Op, row_pitch

from ..vector_access import vector_ready
from .cpu import IMPLEMENTATIONS
from .interfaces import (
    ActivationBwdInterface,
    ActivationFwdInterface,
    GatedBwdInterface,
    GatedFwdInterface,
    GatedInplaceBwdInterface,
    PackedGatedBwdInterface,
    PackedGatedFwdInterface,
    PackedGatedInplaceBwdInterface,
)


def _count(tensor) -> int:
    count = 1
    for size in tensor.shape:
        count *= size
    return count


def _activation(name: str, approximate: str = "none") -> str:
    if name == "silu":
        return "silu"
    return "gelu_tanh" if approximate == "tanh" else "gelu"


def _deliver(result, like: torch.Tensor | None, out: torch.Tensor | None):
    """A kernel's 1-D ``result`` in the shape of ``like`` (None: a result of an implementation
    that takes any shape, which has the caller's shape already), written to ``out`` if given. A
    result that breaks the implementation's contract is returned as it is, for the op's result
    check to report: one that cannot take the caller's shape, or (before a copy into ``out``,
    which would convert it) one of another dtype or device."""
    if out is None:
        if like is None:
            return result
        try:
            return result.view_as(like)  # a third of the cost of view(like.shape) on a CPU call
        except (AttributeError, TypeError, RuntimeError):  # not a tensor, or not like's size
            return result
    # out has the caller's shape, dtype and device (the call path checked it).
    if not (
        isinstance(result, torch.Tensor)
        and result.numel() == out.numel()
        and result.dtype == out.dtype
        and result.device == out.device
    ):
        return result
    out.copy_(result.view_as(out))
    return out


def _pair(result, like: torch.Tensor | None):
    """A two-result kernel's ``result`` with each given ``like``'s shape (``_deliver``); a
    result that is not a pair is returned as it is, for the op's result check to report."""
    if type(result) is not tuple or len(result) != 2:
        return result
    return _deliver(result[0], like, None), _deliver(result[1], like, None)


class _ActivationOp(Op):
    manifest_file = files("tileops.ops") / "manifest" / "activation.yaml"
    # The TileLang kernels, key -> class per interface, imported when an op is first built.
    kernel_tables = ("tileops.kernels.cuda.activation:KERNELS",)
    #: The function the op computes (``interfaces.ACTIVATIONS``), set by each constructor.
    activation: str

    def call_specs(self, device, inputs):
        """The call spec a call with ``inputs`` (descriptions) gets, built as ``forward`` builds it."""
        (interface,) = self.kernel_interfaces
        tensors = [inputs[t.name] for t in self.manifest_entry().inputs]
        first = tensors[0]
        return {interface: self.call_spec(interface, device, first.dtype, self._ready(device, tensors))}

    def _ready(self, device, tensors) -> bool:
        """``vector_ready`` of a call's tensors, which the kernels take as one flat row each."""
        return vector_ready(device, _count(tensors[0]), tensors[0].dtype, *tensors)

    def call_spec(self, interface, device, dtype, aligned, width=0, row_strides=None):
        """The call spec of ``kernel_for(interface, device, dtype, aligned[, width,
        row_strides])``: the function is the instance's."""
        return interface.call_spec(device, dtype, self.activation, aligned, width, row_strides)

    def _row_view_call(self, interface, tensors: tuple) -> tuple:
        """``(kernel, tensors as it takes them, like)`` for a call with a row view among
        ``tensors``: (m, width) rows at their pitches for a kernel that takes row views, else
        contiguous copies (1-D, or of the caller's shape for one that takes any shape); ``like``
        is the tensor whose shape the results take (None: they have it already)."""
        first = tensors[0]
        device, dtype, width = first.device, first.dtype, first.shape[-1]
        pitches = tuple(row_pitch(t, 1) for t in tensors)
        # 16-byte accesses need the width and every pitch to be whole accesses: so is their gcd.
        aligned = vector_ready(device, math.gcd(width, *pitches), dtype, *tensors)
        kernel = self.kernel_for(interface, device, dtype, aligned, width, pitches)
        if kernel.takes_row_views:
            return kernel, tuple(t.view(-1, width) for t in tensors), first
        if kernel.takes_any_shape:
            return kernel, tuple(t.contiguous() for t in tensors), None
        return kernel, tuple(t.contiguous().view(-1) for t in tensors), first

    def forward_saving(self, *inputs, **outs):
        # The activations save nothing: their backward reads the forward's inputs.
        return self.forward(*inputs, **outs), ()


class _UnaryFwdOp(_ActivationOp):
    kernel_interfaces = (ActivationFwdInterface,)
    in_tree_kernels = {ActivationFwdInterface: IMPLEMENTATIONS[ActivationFwdInterface]}

    def forward(self, x, *, out=None):
        if not x.is_contiguous():
            kernel, (rows,), like = self._row_view_call(ActivationFwdInterface, (x,))
            return _deliver(kernel.forward(rows), like, out)
        device = x.device
        kernel = self.kernel_for(ActivationFwdInterface, device, x.dtype, vector_ready(device, x.numel(), x.dtype, x))
        if kernel.takes_any_shape:
            return _deliver(kernel.forward(x), None, out)
        return _deliver(kernel.forward(x.view(-1)), x, out)


class _UnaryBwdOp(_ActivationOp):
    kernel_interfaces = (ActivationBwdInterface,)
    in_tree_kernels = {ActivationBwdInterface: IMPLEMENTATIONS[ActivationBwdInterface]}

    def forward(self, dy, x):
        if not (x.is_contiguous() and dy.is_contiguous()):
            kernel, rows, like = self._row_view_call(ActivationBwdInterface, (dy, x))
            return _deliver(kernel.forward(*rows), like, None)
        device = dy.device
        kernel = self.kernel_for(ActivationBwdInterface, device, dy.dtype, vector_ready(device, dy.numel(), dy.dtype, dy, x))
        if kernel.takes_any_shape:
            return kernel.forward(dy, x)
        return _deliver(kernel.forward(dy.view(-1), x.view(-1)), dy, None)


class _GatedFwdOp(_ActivationOp):
    kernel_interfaces = (GatedFwdInterface,)
    in_tree_kernels = {GatedFwdInterface: IMPLEMENTATIONS[GatedFwdInterface]}

    def forward(self, gate, up, *, out=None):
        if not (gate.is_contiguous() and up.is_contiguous()):
            kernel, rows, like = self._row_view_call(GatedFwdInterface, (gate, up))
            return _deliver(kernel.forward(*rows), like, out)
        device = gate.device
        kernel = self.kernel_for(GatedFwdInterface, device, gate.dtype, vector_ready(device, gate.numel(), gate.dtype, gate, up))
        if kernel.takes_any_shape:
            return _deliver(kernel.forward(gate, up), None, out)
        return _deliver(kernel.forward(gate.view(-1), up.view(-1)), gate, out)


class _GatedBwdOp(_ActivationOp):
    kernel_interfaces = (GatedBwdInterface,)
    in_tree_kernels = {GatedBwdInterface: IMPLEMENTATIONS[GatedBwdInterface]}

    def forward(self, dy, gate, up):
        if not (gate.is_contiguous() and up.is_contiguous() and dy.is_contiguous()):
            kernel, rows, like = self._row_view_call(GatedBwdInterface, (dy, gate, up))
            return _pair(kernel.forward(*rows), like)
        device = dy.device
        kernel = self.kernel_for(GatedBwdInterface, device, dy.dtype, vector_ready(device, dy.numel(), dy.dtype, dy, gate, up))
        if kernel.takes_any_shape:
            return kernel.forward(dy, gate, up)
        return _pair(kernel.forward(dy.view(-1), gate.view(-1), up.view(-1)), dy)


class _GatedInplaceBwdOp(_ActivationOp):
    kernel_interfaces = (GatedInplaceBwdInterface,)
    in_tree_kernels = {GatedInplaceBwdInterface: IMPLEMENTATIONS[GatedInplaceBwdInterface]}

    def forward(self, dy, gate, up):
        # gate and up are contiguous (the signature refuses others), so their flat views write
        # through to them.
        device = dy.device
        kernel = self.kernel_for(
            GatedInplaceBwdInterface, device, dy.dtype, vector_ready(device, dy.numel(), dy.dtype, dy, gate, up)
        )
        if kernel.takes_any_shape:
            kernel.forward(dy, gate, up)
        else:
            kernel.forward(dy.view(-1), gate.view(-1), up.view(-1))
        return gate, up


class _PackedOp(_ActivationOp):
    def _ready(self, device, tensors) -> bool:
        """``vector_ready`` of a call's tensors, whose rows are d (y) and 2d (x) wide."""
        return vector_ready(device, self.params["d"], tensors[0].dtype, *tensors)

    def call_spec(self, interface, device, dtype, aligned):
        return interface.call_spec(device, dtype, self.activation, self.params["d"], aligned)


class _PackedFwdOp(_PackedOp):
    kernel_interfaces = (PackedGatedFwdInterface,)
    in_tree_kernels = {PackedGatedFwdInterface: IMPLEMENTATIONS[PackedGatedFwdInterface]}

    def forward(self, x, *, out=None):
        d = self.params["d"]
        device = x.device
        kernel = self.kernel_for(PackedGatedFwdInterface, device, x.dtype, vector_ready(device, d, x.dtype, x))
        if kernel.takes_any_shape:
            return _deliver(kernel.forward(x), None, out)
        y = kernel.forward(x.view(-1, 2 * d))
        if not (isinstance(y, torch.Tensor) and y.numel() * 2 == x.numel() and y.dtype == x.dtype and y.device == x.device):
            return y
        return _deliver(y.view(*x.shape[:-1], d), None, out)


class _PackedBwdOp(_PackedOp):
    kernel_interfaces = (PackedGatedBwdInterface,)
    in_tree_kernels = {PackedGatedBwdInterface: IMPLEMENTATIONS[PackedGatedBwdInterface]}

    def forward(self, dy, x):
        d = self.params["d"]
        device = dy.device
        kernel = self.kernel_for(PackedGatedBwdInterface, device, dy.dtype, vector_ready(device, d, dy.dtype, dy, x))
        if kernel.takes_any_shape:
            return kernel.forward(dy, x)
        return _deliver(kernel.forward(dy.view(-1, d), x.view(-1, 2 * d)), x, None)


class _PackedInplaceBwdOp(_PackedOp):
    kernel_interfaces = (PackedGatedInplaceBwdInterface,)
    in_tree_kernels = {PackedGatedInplaceBwdInterface: IMPLEMENTATIONS[PackedGatedInplaceBwdInterface]}

    def forward(self, dy, x):
        # x is contiguous (the signature refuses others), so its rows view writes through to it.
        d = self.params["d"]
        device = dy.device
        kernel = self.kernel_for(PackedGatedInplaceBwdInterface, device, dy.dtype, vector_ready(device, d, dy.dtype, dy, x))
        if kernel.takes_any_shape:
            kernel.forward(dy, x)
        else:
            kernel.forward(dy.view(-1, d), x.view(-1, 2 * d))
        return x


class SiLUFwdOp(_UnaryFwdOp):
    """``torch.nn.functional.silu`` as an op: ``op(x, *, out=None)``."""

    activation = "silu"

    def __init__(self, *, target: str | None = None) -> None:
        super().__init__(target=target)


class GELUFwdOp(_UnaryFwdOp):
    """``torch.nn.functional.gelu`` as an op: ``op(x, *, out=None)``."""

    def __init__(self, approximate: str = "none", *, target: str | None = None) -> None:
        super().__init__(approximate=approximate, target=target)
        self.activation = _activation("gelu", self.params["approximate"])


class SwiGLUFwdOp(_GatedFwdOp):
    """``silu(gate) * up`` as an op: ``op(gate, up, *, out=None)``. Built with
    ``consume_inputs=True``, its backward writes the gradients over gate and up where they are
    the graph's temporaries (``SwiGLUInplaceBwdOp``)."""

    activation = "silu"

    def __init__(self, consume_inputs: bool = False, *, target: str | None = None) -> None:
        super().__init__(consume_inputs=consume_inputs, target=target)


class GeGLUFwdOp(_GatedFwdOp):
    """``gelu(gate, approximate) * up`` as an op: ``op(gate, up, *, out=None)``;
    ``consume_inputs`` as ``SwiGLUFwdOp``'s."""

    def __init__(self, approximate: str = "none", consume_inputs: bool = False, *, target: str | None = None) -> None:
        super().__init__(approximate=approximate, consume_inputs=consume_inputs, target=target)
        self.activation = _activation("gelu", self.params["approximate"])


class PackedSwiGLUFwdOp(_PackedFwdOp):
    """``silu(x[..., :d]) * x[..., d:]`` as an op: ``op(x, *, out=None)``, x holding [gate | up]
    (vLLM's ``SiluAndMul``). Built with ``consume_inputs=True``, its backward writes the gradient
    over x where it is the graph's temporary (``PackedSwiGLUInplaceBwdOp``)."""

    activation = "silu"

    def __init__(self, d: int, consume_inputs: bool = False, *, target: str | None = None) -> None:
        super().__init__(d=d, consume_inputs=consume_inputs, target=target)


class PackedGeGLUFwdOp(_PackedFwdOp):
    """``gelu(x[..., :d], approximate) * x[..., d:]`` as an op: ``op(x, *, out=None)``;
    ``consume_inputs`` as ``PackedSwiGLUFwdOp``'s."""

    def __init__(
        self, d: int, approximate: str = "none", consume_inputs: bool = False, *, target: str | None = None
    ) -> None:
        super().__init__(d=d, approximate=approximate, consume_inputs=consume_inputs, target=target)
        self.activation = _activation("gelu", self.params["approximate"])


# -- backward ops: each takes its forward's params and returns the gradients its entry declares.


class SiLUBwdOp(_UnaryBwdOp):
    """Gradient of ``SiLUFwdOp``: ``op(dy, x) -> dx``."""

    activation = "silu"

    def __init__(self, *, target: str | None = None) -> None:
        super().__init__(target=target)


class GELUBwdOp(_UnaryBwdOp):
    """Gradient of ``GELUFwdOp``: ``op(dy, x) -> dx``."""

    def __init__(self, approximate: str = "none", *, target: str | None = None) -> None:
        super().__init__(approximate=approximate, target=target)
        self.activation = _activation("gelu", self.params["approximate"])


class SwiGLUBwdOp(_GatedBwdOp):
    """Gradients of ``SwiGLUFwdOp``: ``op(dy, gate, up) -> (dgate, dup)``."""

    activation = "silu"

    def __init__(self, *, target: str | None = None) -> None:
        super().__init__(target=target)


class GeGLUBwdOp(_GatedBwdOp):
    """Gradients of ``GeGLUFwdOp``: ``op(dy, gate, up) -> (dgate, dup)``."""

    def __init__(self, approximate: str = "none", *, target: str | None = None) -> None:
        super().__init__(approximate=approximate, target=target)
        self.activation = _activation("gelu", self.params["approximate"])


class SwiGLUInplaceBwdOp(_GatedInplaceBwdOp):
    """Gradients of ``SwiGLUFwdOp`` written over its inputs: ``op(dy, gate, up) -> (gate, up)``,
    gate holding dgate and up dup."""

    activation = "silu"

    def __init__(self, *, target: str | None = None) -> None:
        super().__init__(target=target)


class GeGLUInplaceBwdOp(_GatedInplaceBwdOp):
    """Gradients of ``GeGLUFwdOp`` written over its inputs: ``op(dy, gate, up) -> (gate, up)``."""

    def __init__(self, approximate: str = "none", *, target: str | None = None) -> None:
        super().__init__(approximate=approximate, target=target)
        self.activation = _activation("gelu", self.params["approximate"])


class PackedSwiGLUBwdOp(_PackedBwdOp):
    """Gradient of ``PackedSwiGLUFwdOp``: ``op(dy, x) -> dx`` (x's shape, [dgate | dup])."""

    activation = "silu"

    def __init__(self, d: int, *, target: str | None = None) -> None:
        super().__init__(d=d, target=target)


class PackedGeGLUBwdOp(_PackedBwdOp):
    """Gradient of ``PackedGeGLUFwdOp``: ``op(dy, x) -> dx`` (x's shape, [dgate | dup])."""

    def __init__(self, d: int, approximate: str = "none", *, target: str | None = None) -> None:
        super().__init__(d=d, approximate=approximate, target=target)
        self.activation = _activation("gelu", self.params["approximate"])


class PackedSwiGLUInplaceBwdOp(_PackedInplaceBwdOp):
    """Gradient of ``PackedSwiGLUFwdOp`` written over its input: ``op(dy, x) -> x``, x holding
    [dgate | dup]."""

    activation = "silu"

    def __init__(self, d: int, *, target: str | None = None) -> None:
        super().__init__(d=d, target=target)


class PackedGeGLUInplaceBwdOp(_PackedInplaceBwdOp):
    """Gradient of ``PackedGeGLUFwdOp`` written over its input: ``op(dy, x) -> x``."""

    def __init__(self, d: int, approximate: str = "none", *, target: str | None = None) -> None:
        super().__init__(d=d, approximate=approximate, target=target)
        self.activation = _activation("gelu", self.params["approximate"])
