"""The norm family's ops: RMSNorm and LayerNorm, alone and fused with a residual add, forward
and backward.

Each op builds the call spec its interface takes, runs the implementation selection picks,
and hands it the input as it takes it: as the caller passed it (the in-tree implementations
take any leading dimensions) or flattened to (m, n) rows, with the per-row statistics as (m,).
Constructors take what torch's functional API takes; a backward op takes its forward's params.
The forward ops are differentiable: core's autograd wiring calls ``forward_saving`` and then
the backward op their manifest entry names.
"""

from __future__ import annotations

import math
from importlib.resources import files
from typing import Any

import torch

from tileops.core import Op, derive_input, row_pitch

from ..vector_access import vector_ready
from .cpu import IMPLEMENTATIONS
from .interfaces import (
    FusedAddLayerNormBwdInterface,
    FusedAddLayerNormFwdInterface,
    FusedAddRMSNormBwdInterface,
    FusedAddRMSNormFwdInterface,
    LayerNormBwdInterface,
    LayerNormFwdInterface,
    RMSNormBwdInterface,
    RMSNormFwdInterface,
)


class _NormOp(Op):
    manifest_file = files("tileops.ops") / "manifest" / "norm.yaml"
    #: The inputs whose alignment the call spec's ``aligned`` covers, as each forward passes
    #: them to ``_select``: those kernels read with vector accesses (not the per-row statistics).
    vector_inputs = ("x", "residual", "weight", "bias")
    # The TileLang kernels, key -> class per interface, imported when an op is first built.
    kernel_tables = ("tileops.kernels.cuda.norm:KERNELS",)

    def __init__(self, *, target: str | None, **params: Any) -> None:
        super().__init__(target=target, **params)
        self.n = math.prod(self.params["normalized_shape"])
        # With a 1-D normalized_shape a 2-D input is already the (m, n) rows kernels take, and
        # weight and bias are already (n,): the common call reshapes nothing.
        self._one_dim = len(self.params["normalized_shape"]) == 1
        given = self.params["eps"]
        # Resolved once for every dtype x may have; call specs are built with it on a miss.
        self._eps = {
            dtype: torch.finfo(dtype).eps if given is None else given
            for dtype in self.manifest_entry().inputs[0].dtypes
        }

    def call_spec(self, interface, device, dtype, has_weight, has_bias, aligned, row_strides=None):
        """The call spec ``kernel_for(interface, device, dtype, has_weight, has_bias, aligned[,
        row_strides])`` stands for: the forwards pass only what varies between calls; ``n`` and
        ``eps`` are the instance's."""
        return interface.call_spec(device, self.n, dtype, self.eps_for(dtype), has_weight, has_bias, aligned, row_strides)

    def _select(self, interface, has_weight: bool, has_bias: bool, first: torch.Tensor, *vectors: torch.Tensor | None):
        """The implementation of ``interface`` serving a call whose rows are ``first``'s, with
        ``first`` and ``vectors`` (this op's ``vector_inputs``, None where not given) read with
        vector accesses. Norm kernels take any row length: only the addresses count.

        The four forward ops spell this and ``_rows`` out on their common path, an inference
        call's: the two method calls cost 0.22 us of the op layer's 3 us budget on a CPU call."""
        device, dtype = first.device, first.dtype
        return self.kernel_for(interface, device, dtype, has_weight, has_bias, vector_ready(device, 0, dtype, first, *vectors))

    def _select_rows(self, interface, has_weight: bool, has_bias: bool, row_inputs: tuple, *vectors):
        """``(kernel, row_inputs as it takes them)`` for a forward call with a row view among
        ``row_inputs`` (x, and residual: the manifest lets row views through uncopied): (m, n)
        views at their pitch for a kernel that takes row views, else contiguous (m, n) copies.
        A row starts 16-byte aligned only where its pitch is a whole number of vectors too."""
        first = row_inputs[0]
        device, dtype = first.device, first.dtype
        rank = len(self.params["normalized_shape"])
        pitches = tuple(row_pitch(t, rank) for t in row_inputs)
        aligned = vector_ready(device, 0, dtype, *vectors) and all(
            vector_ready(device, pitch, dtype, t) for pitch, t in zip(pitches, row_inputs)
        )
        kernel = self.kernel_for(interface, device, dtype, has_weight, has_bias, aligned, pitches)
        if kernel.takes_row_views:
            return kernel, tuple(t.view(-1, self.n) for t in row_inputs)
        return kernel, tuple(t.contiguous().view(-1, self.n) for t in row_inputs)

    def _backward_rows(self, interface, has_bias: bool, dy: torch.Tensor, x: torch.Tensor, weight):
        """``(kernel, dy, x)`` as a backward call's kernel takes them, where x may be a row view
        (the forward's input, saved as the caller passed it): as they are where x is contiguous,
        else both as (m, n) rows, x at its pitch for a kernel that takes row views."""
        if x.is_contiguous():
            kernel = self._select(interface, weight is not None, has_bias, dy, x, weight)
            return kernel, self._rows(dy, kernel), self._rows(x, kernel)
        kernel, (x_rows,) = self._select_rows(interface, weight is not None, has_bias, (x,), dy, weight)
        return kernel, dy.view(-1, self.n), x_rows

    def call_specs(self, device, inputs):
        """The call spec a call with ``inputs`` (descriptions, the omitted optional ones absent)
        gets, built from the facts each forward passes ``kernel_for``."""
        (interface,) = self.kernel_interfaces
        has_weight, has_bias = "weight" in inputs, "bias" in inputs
        first = inputs[self.manifest_entry().inputs[0].name]
        aligned = vector_ready(device, 0, first.dtype, *[inputs[name] for name in self.vector_inputs if name in inputs])
        spec = self.call_spec(interface, device, first.dtype, has_weight, has_bias, aligned)
        return {interface: spec}

    def eps_for(self, dtype: torch.dtype) -> float:
        """The eps a call in ``dtype`` uses: the given one, else torch's default for dtype."""
        return self._eps[dtype]

    def _rows(self, x: torch.Tensor, kernel) -> torch.Tensor:
        """``x`` (or residual) as ``kernel`` takes it: as it is when the kernel takes leading
        dimensions or x is already (m, n) rows, else viewed as (m, n) rows."""
        if self._one_dim and (kernel.takes_any_shape or x.dim() == 2):
            return x
        return x.view(-1, self.n)

    def _vector(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """A weight or bias of shape normalized_shape as the (n,) vector kernels take."""
        return tensor if self._one_dim or tensor is None else tensor.view(self.n)

    def _statistics(self, x: torch.Tensor, rows: torch.Tensor, statistics: tuple) -> tuple:
        """Per-row statistics as the caller's leading dimensions (``rows`` is x as the kernel
        took it), None left as it is."""
        if rows is x:
            return statistics
        leading = x.shape[: x.dim() - len(self.params["normalized_shape"])]
        return tuple(None if s is None else s.view(leading) for s in statistics)

    def _row_statistic(self, statistic: torch.Tensor, rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """A per-row statistic as a kernel takes it: like ``rows`` without its last dimension."""
        return statistic if rows is x else statistic.view(-1)

    def _parameter(self, gradient: torch.Tensor | None, parameter: torch.Tensor | None) -> torch.Tensor | None:
        """A kernel's (n,) gradient of ``parameter`` in the shape of normalized_shape; None where
        the call has no such parameter, or the kernel skipped it (the op skips it: core puts
        None there whatever the kernel returned)."""
        if parameter is None or gradient is None:
            return None
        return gradient if self._one_dim else gradient.view(self.params["normalized_shape"])

    @staticmethod
    def _deliver(result: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, out: torch.Tensor | None):
        """The kernel's ``result`` (shaped like ``rows``) in the caller's shape, written to ``out``
        if given.

        A result of another shape, dtype or device (a backend's implementation breaking the
        interface's contract) is returned as it is, for the op's result check to report:
        reshaping it would raise a bare RuntimeError, and copying it into ``out`` could
        broadcast, cast or move it silently.
        """
        if not (
            isinstance(result, torch.Tensor)
            and result.shape == rows.shape
            and result.dtype == x.dtype
            and result.device == x.device
        ):
            return result
        if rows is not x:
            result = result.view_as(x)  # a third of the cost of view(x.shape)
        if out is None:
            return result
        out.copy_(result)
        return out

    def _deliver_pair(self, result, x, rows, out, residual_out):
        """A fused kernel's (y, x + residual) delivered as ``_deliver`` does; anything but a pair
        is returned as it is, for the op's result check to report."""
        if type(result) is not tuple or len(result) != 2:
            return result
        y, total = result
        return self._deliver(y, x, rows, out), self._deliver(total, x, rows, residual_out)


class RMSNormFwdOp(_NormOp):
    """``torch.nn.functional.rms_norm`` as an op: ``op(x, weight=None, *, out=None)``."""

    kernel_interfaces = (RMSNormFwdInterface,)
    in_tree_kernels = {RMSNormFwdInterface: IMPLEMENTATIONS[RMSNormFwdInterface]}

    def __init__(self, normalized_shape, eps: float | None = None, *, target: str | None = None) -> None:
        super().__init__(normalized_shape=normalized_shape, eps=eps, target=target)

    def forward(self, x, weight=None, *, out=None):
        if not x.is_contiguous():
            kernel, (rows,) = self._select_rows(RMSNormFwdInterface, weight is not None, False, (x,), weight)
            return self._deliver(kernel.forward(rows, self._vector(weight)), x, rows, out)
        device, dtype = x.device, x.dtype  # _select and _rows spelled out (see _select)
        kernel = self.kernel_for(RMSNormFwdInterface, device, dtype, weight is not None, False, vector_ready(device, 0, dtype, x, weight))
        if out is None and self._one_dim and (kernel.takes_any_shape or x.dim() == 2):
            return kernel.forward(x, weight)
        rows = self._rows(x, kernel)
        return self._deliver(kernel.forward(rows, self._vector(weight)), x, rows, out)

    def forward_saving(self, x, weight=None):
        if x.is_contiguous():
            kernel = self._select(RMSNormFwdInterface, weight is not None, False, x, weight)
            rows = self._rows(x, kernel)
        else:
            kernel, (rows,) = self._select_rows(RMSNormFwdInterface, weight is not None, False, (x,), weight)
        y, saved = kernel.forward_saving(rows, self._vector(weight))
        return self._deliver(y, x, rows, None), self._statistics(x, rows, saved)


class LayerNormFwdOp(_NormOp):
    """``torch.nn.functional.layer_norm`` as an op: ``op(x, weight=None, bias=None, *, out=None)``."""

    kernel_interfaces = (LayerNormFwdInterface,)
    in_tree_kernels = {LayerNormFwdInterface: IMPLEMENTATIONS[LayerNormFwdInterface]}

    def __init__(self, normalized_shape, eps: float = 1e-5, *, target: str | None = None) -> None:
        super().__init__(normalized_shape=normalized_shape, eps=eps, target=target)

    def forward(self, x, weight=None, bias=None, *, out=None):
        if not x.is_contiguous():
            kernel, (rows,) = self._select_rows(LayerNormFwdInterface, weight is not None, bias is not None, (x,), weight, bias)
            return self._deliver(kernel.forward(rows, self._vector(weight), self._vector(bias)), x, rows, out)
        device, dtype = x.device, x.dtype  # _select and _rows spelled out (see _select)
        kernel = self.kernel_for(
            LayerNormFwdInterface, device, dtype, weight is not None, bias is not None, vector_ready(device, 0, dtype, x, weight, bias)
        )
        if out is None and self._one_dim and (kernel.takes_any_shape or x.dim() == 2):
            return kernel.forward(x, weight, bias)
        rows = self._rows(x, kernel)
        return self._deliver(kernel.forward(rows, self._vector(weight), self._vector(bias)), x, rows, out)

    def forward_saving(self, x, weight=None, bias=None):
        if x.is_contiguous():
            kernel = self._select(LayerNormFwdInterface, weight is not None, bias is not None, x, weight, bias)
            rows = self._rows(x, kernel)
        else:
            kernel, (rows,) = self._select_rows(LayerNormFwdInterface, weight is not None, bias is not None, (x,), weight, bias)
        y, saved = kernel.forward_saving(rows, self._vector(weight), self._vector(bias))
        return self._deliver(y, x, rows, None), self._statistics(x, rows, saved)


class FusedAddRMSNormFwdOp(_NormOp):
    """``rms_norm(x + residual)`` and ``x + residual`` in one pass:
    ``op(x, residual, weight=None, *, out=None, residual_out=None) -> (y, residual_sum)``."""

    kernel_interfaces = (FusedAddRMSNormFwdInterface,)
    in_tree_kernels = {FusedAddRMSNormFwdInterface: IMPLEMENTATIONS[FusedAddRMSNormFwdInterface]}

    def __init__(self, normalized_shape, eps: float | None = None, *, target: str | None = None) -> None:
        super().__init__(normalized_shape=normalized_shape, eps=eps, target=target)

    def forward(self, x, residual, weight=None, *, out=None, residual_out=None):
        if not (x.is_contiguous() and residual.is_contiguous()):
            kernel, rows = self._select_rows(FusedAddRMSNormFwdInterface, weight is not None, False, (x, residual), weight)
            return self._deliver_pair(kernel.forward(*rows, self._vector(weight)), x, rows[0], out, residual_out)
        device, dtype = x.device, x.dtype  # _select and _rows spelled out (see _select)
        kernel = self.kernel_for(
            FusedAddRMSNormFwdInterface, device, dtype, weight is not None, False, vector_ready(device, 0, dtype, x, residual, weight)
        )
        if out is None and residual_out is None and self._one_dim and (kernel.takes_any_shape or x.dim() == 2):
            return kernel.forward(x, residual, weight)
        rows = self._rows(x, kernel)
        result = kernel.forward(rows, self._rows(residual, kernel), self._vector(weight))
        return self._deliver_pair(result, x, rows, out, residual_out)

    def forward_saving(self, x, residual, weight=None):
        if x.is_contiguous() and residual.is_contiguous():
            kernel = self._select(FusedAddRMSNormFwdInterface, weight is not None, False, x, residual, weight)
            rows, residual_rows = self._rows(x, kernel), self._rows(residual, kernel)
        else:
            kernel, (rows, residual_rows) = self._select_rows(
                FusedAddRMSNormFwdInterface, weight is not None, False, (x, residual), weight
            )
        result, saved = kernel.forward_saving(rows, residual_rows, self._vector(weight))
        return self._deliver_pair(result, x, rows, None, None), self._statistics(x, rows, saved)


class FusedAddLayerNormFwdOp(_NormOp):
    """``layer_norm(x + residual)`` and ``x + residual`` in one pass:
    ``op(x, residual, weight=None, bias=None, *, out=None, residual_out=None) -> (y, residual_sum)``."""

    kernel_interfaces = (FusedAddLayerNormFwdInterface,)
    in_tree_kernels = {FusedAddLayerNormFwdInterface: IMPLEMENTATIONS[FusedAddLayerNormFwdInterface]}

    def __init__(self, normalized_shape, eps: float = 1e-5, *, target: str | None = None) -> None:
        super().__init__(normalized_shape=normalized_shape, eps=eps, target=target)

    def forward(self, x, residual, weight=None, bias=None, *, out=None, residual_out=None):
        if not (x.is_contiguous() and residual.is_contiguous()):
            kernel, rows = self._select_rows(
                FusedAddLayerNormFwdInterface, weight is not None, bias is not None, (x, residual), weight, bias
            )
            result = kernel.forward(*rows, self._vector(weight), self._vector(bias))
            return self._deliver_pair(result, x, rows[0], out, residual_out)
        device, dtype = x.device, x.dtype  # _select and _rows spelled out (see _select)
        kernel = self.kernel_for(
            FusedAddLayerNormFwdInterface, device, dtype, weight is not None, bias is not None,
            vector_ready(device, 0, dtype, x, residual, weight, bias),
        )
        if out is None and residual_out is None and self._one_dim and (kernel.takes_any_shape or x.dim() == 2):
            return kernel.forward(x, residual, weight, bias)
        rows = self._rows(x, kernel)
        result = kernel.forward(rows, self._rows(residual, kernel), self._vector(weight), self._vector(bias))
        return self._deliver_pair(result, x, rows, out, residual_out)

    def forward_saving(self, x, residual, weight=None, bias=None):
        if x.is_contiguous() and residual.is_contiguous():
            kernel = self._select(FusedAddLayerNormFwdInterface, weight is not None, bias is not None, x, residual, weight, bias)
            rows, residual_rows = self._rows(x, kernel), self._rows(residual, kernel)
        else:
            kernel, (rows, residual_rows) = self._select_rows(
                FusedAddLayerNormFwdInterface, weight is not None, bias is not None, (x, residual), weight, bias
            )
        result, saved = kernel.forward_saving(rows, residual_rows, self._vector(weight), self._vector(bias))
        return self._deliver_pair(result, x, rows, None, None), self._statistics(x, rows, saved)



# -- backward ops ------------------------------------------------------------------------------
# Each takes its forward's params and returns the gradients its manifest entry declares. A
# statistic the caller does not give (a target's forward saved none) is computed again from
# the manifest's derive expression; the autograd wiring always gives them. Built with
# skip_outputs (the autograd wiring's, for frozen parameters), it returns None for those.


class _NormBwdOp(_NormOp):
    """A norm backward op: its call spec (``NormBwdCall``) also says whether the kernel sums the
    parameter gradients, which it does unless the op skips every one of them (the sums over the
    rows are as much work as dx again on a frozen norm)."""

    def __init__(self, *, target: str | None, **params: Any) -> None:
        super().__init__(target=target, **params)
        skippable = set(self.signature().skippable)
        self._parameter_gradients = bool(skippable - set(self.params["skip_outputs"]))

    def call_spec(self, interface, device, dtype, has_weight, has_bias, aligned, row_strides=None):
        return interface.call_spec(
            device, self.n, dtype, self.eps_for(dtype), has_weight, has_bias, aligned, row_strides,
            self._parameter_gradients,
        )


class RMSNormBwdOp(_NormBwdOp):
    """Gradients of ``RMSNormFwdOp``: ``op(dy, x, weight=None, rstd=None) -> (dx, dweight)``."""

    vector_inputs = ("dy", "x", "weight")
    kernel_interfaces = (RMSNormBwdInterface,)
    in_tree_kernels = {RMSNormBwdInterface: IMPLEMENTATIONS[RMSNormBwdInterface]}

    def __init__(
        self, normalized_shape, eps: float | None = None, *, skip_outputs=(), target: str | None = None
    ) -> None:
        super().__init__(normalized_shape=normalized_shape, eps=eps, skip_outputs=skip_outputs, target=target)

    def forward(self, dy, x, weight=None, rstd=None):
        if rstd is None:
            rstd = derive_input(self, "rstd", {"dy": dy, "x": x})
        kernel, rows, x_rows = self._backward_rows(RMSNormBwdInterface, False, dy, x, weight)
        dx, dweight = kernel.forward(rows, x_rows, self._vector(weight), self._row_statistic(rstd, rows, dy))
        return self._deliver(dx, dy, rows, None), self._parameter(dweight, weight)


class LayerNormBwdOp(_NormBwdOp):
    """Gradients of ``LayerNormFwdOp``:
    ``op(dy, x, weight=None, bias=None, mean=None, rstd=None) -> (dx, dweight, dbias)``."""

    vector_inputs = ("dy", "x", "weight")
    kernel_interfaces = (LayerNormBwdInterface,)
    in_tree_kernels = {LayerNormBwdInterface: IMPLEMENTATIONS[LayerNormBwdInterface]}

    def __init__(self, normalized_shape, eps: float = 1e-5, *, skip_outputs=(), target: str | None = None) -> None:
        super().__init__(normalized_shape=normalized_shape, eps=eps, skip_outputs=skip_outputs, target=target)

    def forward(self, dy, x, weight=None, bias=None, mean=None, rstd=None):
        if mean is None or rstd is None:
            mean, rstd = (derive_input(self, name, {"dy": dy, "x": x}) for name in ("mean", "rstd"))
        kernel, rows, x_rows = self._backward_rows(LayerNormBwdInterface, bias is not None, dy, x, weight)
        dx, dweight, dbias = kernel.forward(
            rows, x_rows, self._vector(weight),
            self._row_statistic(mean, rows, dy), self._row_statistic(rstd, rows, dy),
        )
        return self._deliver(dx, dy, rows, None), self._parameter(dweight, weight), self._parameter(dbias, bias)


class FusedAddRMSNormBwdOp(_NormBwdOp):
    """Gradients of ``FusedAddRMSNormFwdOp``:
    ``op(dy, dresidual_sum, residual_sum, weight=None, rstd=None) -> (dsum, dweight)``; dsum is
    the gradient of both x and residual."""

    vector_inputs = ("dy", "dresidual_sum", "residual_sum", "weight")
    kernel_interfaces = (FusedAddRMSNormBwdInterface,)
    in_tree_kernels = {FusedAddRMSNormBwdInterface: IMPLEMENTATIONS[FusedAddRMSNormBwdInterface]}

    def __init__(
        self, normalized_shape, eps: float | None = None, *, skip_outputs=(), target: str | None = None
    ) -> None:
        super().__init__(normalized_shape=normalized_shape, eps=eps, skip_outputs=skip_outputs, target=target)

    def forward(self, dy, dresidual_sum, residual_sum, weight=None, rstd=None):
        kernel = self._select(FusedAddRMSNormBwdInterface, weight is not None, False, dy, dresidual_sum, residual_sum, weight)
        if rstd is None:
            rstd = derive_input(self, "rstd", {"dy": dy, "residual_sum": residual_sum})
        rows = self._rows(dy, kernel)
        dsum, dweight = kernel.forward(
            rows, self._rows(dresidual_sum, kernel), self._rows(residual_sum, kernel), self._vector(weight),
            self._row_statistic(rstd, rows, dy),
        )
        return self._deliver(dsum, dy, rows, None), self._parameter(dweight, weight)


class FusedAddLayerNormBwdOp(_NormBwdOp):
    """Gradients of ``FusedAddLayerNormFwdOp``:
    ``op(dy, dresidual_sum, residual_sum, weight=None, bias=None, mean=None, rstd=None)
    -> (dsum, dweight, dbias)``; dsum is the gradient of both x and residual."""

    vector_inputs = ("dy", "dresidual_sum", "residual_sum", "weight")
    kernel_interfaces = (FusedAddLayerNormBwdInterface,)
    in_tree_kernels = {FusedAddLayerNormBwdInterface: IMPLEMENTATIONS[FusedAddLayerNormBwdInterface]}

    def __init__(self, normalized_shape, eps: float = 1e-5, *, skip_outputs=(), target: str | None = None) -> None:
        super().__init__(normalized_shape=normalized_shape, eps=eps, skip_outputs=skip_outputs, target=target)

    def forward(self, dy, dresidual_sum, residual_sum, weight=None, bias=None, mean=None, rstd=None):
        kernel = self._select(FusedAddLayerNormBwdInterface, weight is not None, bias is not None, dy, dresidual_sum, residual_sum, weight)
        if mean is None or rstd is None:
            mean, rstd = (derive_input(self, name, {"dy": dy, "residual_sum": residual_sum}) for name in ("mean", "rstd"))
        rows = self._rows(dy, kernel)
        dsum, dweight, dbias = kernel.forward(
            rows, self._rows(dresidual_sum, kernel), self._rows(residual_sum, kernel), self._vector(weight),
            self._row_statistic(mean, rows, dy), self._row_statistic(rstd, rows, dy),
        )
        return self._deliver(dsum, dy, rows, None), self._parameter(dweight, weight), self._parameter(dbias, bias)
