"""The loss family's cross-entropy ops: the reduced loss (``CrossEntropyFwdOp``), every row's loss
(``CrossEntropyPerRowFwdOp``) and their backward ops.

A forward runs the rows step (each row's loss and lse in one pass over the logits), reduces the
rows itself and checks the targets on the result (``check_targets``). A backward folds the
incoming gradients, the reduction, z-loss and the ignored rows into two per-row coefficients and
runs the grad step, one more pass over the logits writing the gradient once.

The reduced loss's call that records autograd history does better: its forward runs the fused
step, which writes the gradient of the loss for an incoming gradient of 1 in the pass that
computes the rows' losses, and saves it; the backward scales it in place by the incoming
gradient (nothing to do for ``loss.backward()``). The logits are then read once and the gradient
written once per training step, where the separate steps read the logits twice. Only where lse's
own gradient comes back does the backward compute the gradient from the logits again.
"""

from __future__ import annotations

import math
from importlib.resources import files

import torch

from tileops.core import Op, OpArgumentError

from ..compute_dtypes import compute_dtype
from ..vector_access import row_alignment
from .cpu import IMPLEMENTATIONS, capped
from .interfaces import (
    CrossEntropyFusedInterface,
    CrossEntropyGradInterface,
    CrossEntropyRowsInterface,
    CrossEntropyScaleInterface,
    grad_coefficients,
)

MANIFEST = files("tileops.ops") / "manifest" / "loss.yaml"


def check_targets(op_name: str, target_ids: torch.Tensor, vocab: int, ignore_index: int, losses: torch.Tensor) -> None:
    """Refuse a target that is neither ``ignore_index`` nor in [0, vocab), naming the op, the
    argument, the first bad value and the range.

    ``losses`` is what the call computed from these targets: the reduced loss, or every row's.
    Every implementation gives a row whose target is out of range a NaN loss (the interfaces'
    contract), so the targets are searched only where a loss is not finite: a good call costs one
    read back of the loss (a synchronisation on CUDA) and no pass over the targets, which on a
    small CPU call cost 10 us, more than the rows step. While a CUDA graph is being captured
    nothing can be read back, so the check is skipped there; such a target's row then keeps its
    NaN loss.
    """
    if target_ids.numel() == 0 or (target_ids.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    if math.isfinite(losses) if losses.dim() == 0 else bool(torch.isfinite(losses).all()):
        return
    bad = ((target_ids < 0) | (target_ids >= vocab)) & (target_ids != ignore_index)
    if not bool(bad.any()):
        return  # the logits themselves are not finite (or every row is ignored): torch's answer
    row = int(bad.nonzero()[0, 0])
    raise OpArgumentError(
        f"{op_name}: argument 'target_ids' holds {int(target_ids[row])} at row {row}; expected a class in [0, {vocab}) "
        f"(V = {vocab}) or ignore_index ({ignore_index})"
    )


def _no_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (loss, lse) of a call without rows: two empty tensors of the compute dtype."""
    empty = logits.new_empty((0,), dtype=compute_dtype(logits.dtype))
    return empty, empty.clone()


class _LossOp(Op):
    """What the cross-entropy ops share: the call spec, the kernels of both steps, the checks."""

    manifest_file = MANIFEST
    kernel_interfaces = (CrossEntropyRowsInterface, CrossEntropyGradInterface)
    in_tree_kernels = IMPLEMENTATIONS
    # The TileLang kernels, key -> class per interface, imported when an op is first built.
    kernel_tables = ("tileops.kernels.cuda.loss:KERNELS",)

    def call_spec(self, interface, device, dtype, vocab, target_dtype, is_aligned, pointers_aligned):
        """The call spec of ``kernel_for(interface, device, dtype, vocab, target_dtype, aligned,
        pointers_aligned)``: the loss options are the instance's params."""
        p = self.params
        return interface.call_spec(
            device, dtype, vocab, target_dtype, is_aligned,
            p.get("ignore_index", -100), p.get("label_smoothing", 0.0), p.get("lse_square_scale", 0.0), p.get("softcap"),
            pointers_aligned,
        )

    def call_specs(self, device, inputs):
        """The call specs a call with ``inputs`` (descriptions) gets, built as ``forward`` builds them."""
        logits, target_ids = inputs["logits"], inputs["target_ids"]
        vocab = logits.shape[-1]
        # A description may give every input the call's float dtype; targets are int64 then.
        target_dtype = target_ids.dtype if target_ids.dtype in (torch.int64, torch.int32) else torch.int64
        fields = (device, logits.dtype, vocab, target_dtype, *row_alignment(device, vocab, logits.dtype, logits))
        return {interface: self.call_spec(interface, *fields) for interface in self.kernel_interfaces}

    def kernel_of(self, interface, target_dtype: torch.dtype, *tensors: torch.Tensor):
        """The kernel of ``interface`` for a call on the (N, V) ``tensors``: the first gives the
        device, dtype and V; all of them the pointers' alignment."""
        first = tensors[0]
        device, vocab = first.device, first.shape[-1]
        return self.kernel_for(
            interface, device, first.dtype, vocab, target_dtype, *row_alignment(device, vocab, first.dtype, *tensors)
        )

    def rows(self, logits: torch.Tensor, target_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's loss and lse (``CrossEntropyRowsInterface``); the caller checks the targets
        on what it makes of the losses."""
        if logits.shape[0] == 0:
            return _no_rows(logits)
        return self.kernel_of(CrossEntropyRowsInterface, target_ids.dtype, logits).forward(logits, target_ids)

    def fused(self, logits: torch.Tensor, target_ids: torch.Tensor, unit: torch.Tensor, grad: torch.Tensor):
        """Each row's loss and lse, and the gradient of ``unit`` times their sum into ``grad``
        (``CrossEntropyFusedInterface``)."""
        if logits.shape[0] == 0:
            return _no_rows(logits)
        return self.kernel_of(CrossEntropyFusedInterface, target_ids.dtype, logits, grad).forward(logits, target_ids, unit, grad)

    def scaled(self, grad: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
        """``grad`` multiplied in place by the 0-dim ``factor`` (``CrossEntropyScaleInterface``)."""
        if grad.numel() == 0:
            return grad
        # The call spec's target dtype is any the kernels take: a scale reads no targets.
        return self.kernel_of(CrossEntropyScaleInterface, torch.int64, grad).forward(grad, factor)

    def gradient(self, logits, target_ids, lse, softmax_scale, target_scale, dlogits) -> torch.Tensor:
        """The grad step (``CrossEntropyGradInterface``) into ``dlogits``."""
        if logits.shape[0] == 0:
            return dlogits
        kernel = self.kernel_of(CrossEntropyGradInterface, target_ids.dtype, logits, dlogits)
        return kernel.forward(logits, target_ids, lse, softmax_scale, target_scale, dlogits)

    def kept(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Whether each row's target is not ``ignore_index``."""
        return target_ids != self.params["ignore_index"]

    def coefficients(self, row_gradient, dlse, keep, lse) -> tuple[torch.Tensor, torch.Tensor]:
        """(softmax_scale, target_scale) of the grad step (``grad_coefficients``) with this
        instance's z-loss."""
        return grad_coefficients(self.params["lse_square_scale"], row_gradient, keep, lse, dlse)

    def wide_lse(self, logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """The lse the grad step reads: the forward's float32 output, or for float64 logits lse
        computed again in float64 (the lse output is float32 by its signature, and float64 is
        there for gradcheck, whose finite differences a float32 lse would swamp)."""
        if logits.dtype == torch.float64:
            return torch.logsumexp(capped(logits, self.params["softcap"]), -1)
        return lse.float()


def reduce_rows(rows: torch.Tensor, count: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The rows' losses summed, or averaged over the ``count`` rows not ignored where it is given
    (0 / 0 = nan where every row is ignored, as torch gives), in ``dtype``. The sum is taken in
    the rows' dtype and rounded once; the mean's division writes ``dtype`` itself (a launch
    fewer than dividing, then casting)."""
    if count is None:
        return rows.sum().to(dtype)
    return torch.div(rows.sum(), count, out=torch.empty((), dtype=dtype, device=rows.device))


class _ReducedLossOp(_LossOp):
    """The constructor of the ops whose loss is reduced over the rows (mean or sum)."""

    def __init__(
        self,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        reduction: str = "mean",
        lse_square_scale: float = 0.0,
        softcap: float | None = None,
        *,
        target: str | None = None,
    ) -> None:
        super().__init__(
            ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction,
            lse_square_scale=lse_square_scale, softcap=softcap, target=target,
        )


class _PerRowLossOp(_LossOp):
    """The constructor of the ops that give every row's loss (torch's reduction 'none')."""

    def __init__(
        self,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        lse_square_scale: float = 0.0,
        softcap: float | None = None,
        *,
        target: str | None = None,
    ) -> None:
        super().__init__(
            ignore_index=ignore_index, label_smoothing=label_smoothing, lse_square_scale=lse_square_scale,
            softcap=softcap, target=target,
        )


class CrossEntropyFwdOp(_ReducedLossOp):
    """``torch.nn.functional.cross_entropy`` (reduction mean or sum) with z-loss and soft-capping:
    ``op(logits, target_ids) -> (loss, lse)``."""

    kernel_interfaces = (CrossEntropyRowsInterface, CrossEntropyFusedInterface)

    def forward(self, logits, target_ids):
        rows, lse = self.rows(logits, target_ids)
        return self.reduced(logits, target_ids, rows, lse, self.count(target_ids))

    def forward_saving(self, logits, target_ids):
        # The gradient for an incoming gradient of 1, computed in the pass over the logits.
        count = self.count(target_ids)
        wide = compute_dtype(logits.dtype)
        if count is None:
            unit = torch.ones((), dtype=wide, device=logits.device)
        else:  # the reciprocal of an integer count is float32: float64 logits take theirs in float64
            unit = count.reciprocal() if wide == torch.float32 else count.to(wide).reciprocal()
        grad_logits = torch.empty_like(logits)
        rows, lse = self.fused(logits, target_ids, unit, grad_logits)
        return self.reduced(logits, target_ids, rows, lse, count), (grad_logits,)

    def count(self, target_ids: torch.Tensor) -> torch.Tensor | None:
        """The rows a mean divides by (those not ignored); None for a sum."""
        return self.kept(target_ids).sum() if self.params["reduction"] == "mean" else None

    def reduced(self, logits, target_ids, rows, lse, count) -> tuple[torch.Tensor, torch.Tensor]:
        """The outputs from the rows' losses and lse, the targets checked on the loss."""
        loss = reduce_rows(rows, count, logits.dtype)
        check_targets(type(self).__name__, target_ids, logits.shape[-1], self.params["ignore_index"], loss)
        return loss, lse.float()


class CrossEntropyBwdOp(_ReducedLossOp):
    """Gradient of ``CrossEntropyFwdOp``: ``op(dloss, dlse, logits, target_ids, lse, grad_logits)
    -> dlogits``, ``grad_logits`` (the gradient for a unit ``dloss``, which the forward computed)
    scaled by ``dloss`` in place and returned; where ``dlse`` is given the gradient is computed
    again from the logits, into ``grad_logits``."""

    kernel_interfaces = (CrossEntropyGradInterface, CrossEntropyScaleInterface)

    def forward(self, dloss, dlse, logits, target_ids, lse, grad_logits):
        if dlse is None:
            return self.scaled(grad_logits, dloss)
        # lse's gradient is the softmax's, which the saved gradient cannot give: one more pass
        # over the logits, writing over the saved gradient.
        lse = self.wide_lse(logits, lse)
        row_gradient = dloss.to(lse.dtype)
        keep = self.kept(target_ids)
        if self.params["reduction"] == "mean":
            row_gradient = row_gradient / keep.sum()
        softmax_scale, target_scale = self.coefficients(row_gradient, dlse, keep, lse)
        return self.gradient(logits, target_ids, lse, softmax_scale, target_scale, grad_logits)


class CrossEntropyPerRowFwdOp(_PerRowLossOp):
    """``torch.nn.functional.cross_entropy(..., reduction='none')`` with z-loss and soft-capping:
    ``op(logits, target_ids) -> (loss, lse)``, one loss per row."""

    kernel_interfaces = (CrossEntropyRowsInterface,)

    def forward(self, logits, target_ids):
        rows, lse = self.rows(logits, target_ids)
        check_targets(type(self).__name__, target_ids, logits.shape[-1], self.params["ignore_index"], rows)
        return rows.to(logits.dtype), lse.float()

    def forward_saving(self, logits, target_ids):
        # Nothing to save: the backward reads the forward's lse output and its inputs. A gradient
        # saved here would need a pass of its own to be scaled by every row's incoming gradient.
        return self.forward(logits, target_ids), ()


class CrossEntropyPerRowBwdOp(_PerRowLossOp):
    """Gradient of ``CrossEntropyPerRowFwdOp``: ``op(dloss, dlse, logits, target_ids, lse) -> dlogits``."""

    kernel_interfaces = (CrossEntropyGradInterface,)

    def forward(self, dloss, dlse, logits, target_ids, lse):
        lse = self.wide_lse(logits, lse)
        softmax_scale, target_scale = self.coefficients(dloss.to(lse.dtype), dlse, self.kept(target_ids), lse)
        return self.gradient(logits, target_ids, lse, softmax_scale, target_scale, torch.empty_like(logits))
