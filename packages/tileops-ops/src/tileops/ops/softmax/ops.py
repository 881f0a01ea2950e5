"""The softmax family's ops: softmax and log-softmax over one dimension, forward and backward.

Each op hands its kernel the caller's tensor as (m, n) rows over the dimension ``row_dim``: a view
when ``row_dim`` is the last one (the common call), else a contiguous copy with ``row_dim`` moved last,
and the result moved back to the caller's layout (two more passes over the data, as torch pays
for its own non-last softmax). The forward ops are differentiable: they save nothing
(``saves: []``), and core's autograd wiring calls the backward op their manifest entry names
with the incoming gradient and the forward's output y.
"""

from __future__ import annotations

from importlib.resources import files
from typing import ClassVar

import torch

from tileops.core import Op

from ..vector_access import row_alignment
from .cpu import IMPLEMENTATIONS
from .interfaces import SoftmaxBwdInterface, SoftmaxFwdInterface


def _matrix(rows: torch.Tensor, n: int) -> torch.Tensor:
    """``rows`` as the (m, n) matrix the kernels take: itself where it is one already (a view
    costs 0.7 us of a CPU call)."""
    return rows if rows.dim() == 2 else rows.view(-1, n)


class _SoftmaxOp(Op):
    manifest_file = files("tileops.ops") / "manifest" / "softmax.yaml"
    # The TileLang kernels, key -> class per interface, imported when an op is first built.
    kernel_tables = ("tileops.kernels.cuda.softmax:KERNELS",)
    #: True for log-softmax, set by each class.
    log: ClassVar[bool]

    def __init__(self, row_dim: int = -1, out_dtype: torch.dtype | None = None, *, target: str | None = None) -> None:
        super().__init__(row_dim=row_dim, out_dtype=out_dtype, target=target)
        self._dim = self.params["row_dim"]

    def _moved_dim(self, rank: int) -> int | None:
        """``row_dim`` as a non-negative index where it is not the last dimension, else None (the
        manifest's constraint has checked that it names a dimension)."""
        dim = self._dim + rank if self._dim < 0 else self._dim
        return None if dim == rank - 1 else dim

    def _rows(self, tensor: torch.Tensor, moved: int | None) -> torch.Tensor:
        """``tensor`` with ``row_dim`` last, contiguous (a copy where it moves)."""
        return tensor if moved is None else tensor.movedim(moved, -1).contiguous()

    @staticmethod
    def _read_as_given(moved: int | None, *tensors):
        """Of ``tensors`` (descriptions), those a kernel reads as given: all where ``row_dim`` is
        last, none where it moves (the kernel then reads ``_rows``' copies, aligned allocations)."""
        return tensors if moved is None else ()

    def _deliver(self, result, rows: torch.Tensor, moved: int | None, dtype: torch.dtype, out: torch.Tensor | None):
        """A kernel's (m, n) ``result`` in the caller's layout, written to ``out`` if given. A
        result of another size, dtype or device (a backend's implementation breaking its
        contract; the in-tree ones' fit, and the op does not check them) is returned as it is,
        for the op's result check to report."""
        if self._check_results and not (
            isinstance(result, torch.Tensor)
            and result.numel() == rows.numel()
            and result.dtype == dtype
            and result.device == rows.device
        ):
            return result
        if rows.dim() != 2:  # (m, n) rows are the kernel's own shape: no view (0.7 us on a CPU call)
            result = result.view_as(rows)
        if moved is not None:
            # Contiguous as torch's own result is (torch.compile relies on the declared layout).
            result = result.movedim(-1, moved).contiguous()
        if out is None:
            return result
        out.copy_(result)
        return out

    def forward_saving(self, *inputs, **outs):
        # Nothing is saved: the backward reads the forward's output y.
        return self.forward(*inputs, **outs), ()


class _SoftmaxFwdOp(_SoftmaxOp):
    kernel_interfaces = (SoftmaxFwdInterface,)
    in_tree_kernels = {SoftmaxFwdInterface: IMPLEMENTATIONS[SoftmaxFwdInterface]}

    def call_specs(self, device, inputs):
        """The call spec a call with ``inputs`` (descriptions) gets, built as ``forward`` builds it."""
        x = inputs["x"]
        moved = self._moved_dim(len(x.shape))
        n = x.shape[-1 if moved is None else moved]
        out_dtype = self.params["out_dtype"] or x.dtype
        alignment = row_alignment(device, n, x.dtype, *self._read_as_given(moved, x))
        return {SoftmaxFwdInterface: self.call_spec(SoftmaxFwdInterface, device, n, x.dtype, out_dtype, self.log, *alignment)}

    def forward(self, x, *, out=None):
        moved = self._moved_dim(x.dim())
        rows = self._rows(x, moved)
        n = rows.shape[-1]
        out_dtype = self.params["out_dtype"] or x.dtype
        device = x.device
        kernel = self.kernel_for(SoftmaxFwdInterface, device, n, x.dtype, out_dtype, self.log, *row_alignment(device, n, x.dtype, rows))
        return self._deliver(kernel.forward(_matrix(rows, n)), rows, moved, out_dtype, out)


class _SoftmaxBwdOp(_SoftmaxOp):
    kernel_interfaces = (SoftmaxBwdInterface,)
    in_tree_kernels = {SoftmaxBwdInterface: IMPLEMENTATIONS[SoftmaxBwdInterface]}

    def call_specs(self, device, inputs):
        """The call spec a call with ``inputs`` (descriptions) gets, built as ``forward`` builds it."""
        dy, y = inputs["dy"], inputs["y"]
        moved = self._moved_dim(len(dy.shape))
        n = dy.shape[-1 if moved is None else moved]
        alignment = row_alignment(device, n, dy.dtype, *self._read_as_given(moved, dy, y))
        return {SoftmaxBwdInterface: self.call_spec(SoftmaxBwdInterface, device, n, dy.dtype, dy.dtype, self.log, *alignment)}

    def forward(self, dy, y):
        moved = self._moved_dim(dy.dim())
        dy_rows, y_rows = self._rows(dy, moved), self._rows(y, moved)
        n = dy_rows.shape[-1]
        device = dy.device
        kernel = self.kernel_for(
            SoftmaxBwdInterface, device, n, dy.dtype, dy.dtype, self.log, *row_alignment(device, n, dy.dtype, dy_rows, y_rows)
        )
        dx = kernel.forward(_matrix(dy_rows, n), _matrix(y_rows, n))
        return self._deliver(dx, dy_rows, moved, dy.dtype, None)


class SoftmaxFwdOp(_SoftmaxFwdOp):
    """``torch.softmax(x, dim, dtype)`` as an op: ``SoftmaxFwdOp(row_dim=dim, out_dtype=dtype)(x, *, out=None)``."""

    log = False

    def __init__(self, row_dim: int = -1, out_dtype: torch.dtype | None = None, *, target: str | None = None) -> None:
        super().__init__(row_dim, out_dtype, target=target)


class LogSoftmaxFwdOp(_SoftmaxFwdOp):
    """``torch.log_softmax(x, dim, dtype)`` as an op: ``LogSoftmaxFwdOp(row_dim=dim, out_dtype=dtype)(x, *, out=None)``."""

    log = True

    def __init__(self, row_dim: int = -1, out_dtype: torch.dtype | None = None, *, target: str | None = None) -> None:
        super().__init__(row_dim, out_dtype, target=target)


class SoftmaxBwdOp(_SoftmaxBwdOp):
    """Gradient of ``SoftmaxFwdOp``: ``op(dy, y) -> dx = y * (dy - sum(dy * y, dim))``."""

    log = False

    def __init__(self, row_dim: int = -1, out_dtype: torch.dtype | None = None, *, target: str | None = None) -> None:
        super().__init__(row_dim, out_dtype, target=target)


class LogSoftmaxBwdOp(_SoftmaxBwdOp):
    """Gradient of ``LogSoftmaxFwdOp``: ``op(dy, y) -> dx = dy - exp(y) * sum(dy, dim)``."""

    log = True

    def __init__(self, row_dim: int = -1, out_dtype: torch.dtype | None = None, *, target: str | None = None) -> None:
        super().__init__(row_dim, out_dtype, target=target)
