"""The loss family's cross-entropy ops: the reduced loss (``CrossEntropyFwdOp``), every row's loss
(``CrossEntropyPerRowFwdOp``) and their backward ops.

A forward runs the rows step (each row's loss and lse in one pass over the logits), reduces the
rows itself and checks the targets on the result (``check_targets``); it saves nothing, since its backward reads
the forward's lse output. A backward folds the incoming gradients, the reduction, z-loss and the
ignored rows into two per-row coefficients and runs the grad step, one more pass over the logits
writing the gradient once.
"""

from __future__ import annotations

import math
from importlib.resources import files

import torch

from tileops.core import Op, OpArgumentError

from ..compute_dtypes import compute_dtype
from ..vector_access import row_alignment
from .cpu import IMPLEMENTATIONS, capped
from .interfaces import CrossEntropyGradInterface, CrossEntropyRowsInterface

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

    def rows(self, logits: torch.Tensor, target_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's loss and lse (``CrossEntropyRowsInterface``); the caller checks the targets
        on what it makes of the losses."""
        vocab = logits.shape[-1]
        if logits.shape[0] == 0:
            empty = logits.new_empty((0,), dtype=compute_dtype(logits.dtype))
            return empty, empty.clone()
        device = logits.device
        kernel = self.kernel_for(
            CrossEntropyRowsInterface, device, logits.dtype, vocab, target_ids.dtype, *row_alignment(device, vocab, logits.dtype, logits)
        )
        return kernel.forward(logits, target_ids)

    def gradient(self, logits, target_ids, lse, softmax_scale, target_scale, dlogits) -> torch.Tensor:
        """The grad step (``CrossEntropyGradInterface``) into ``dlogits``."""
        if logits.shape[0] == 0:
            return dlogits
        vocab = logits.shape[-1]
        device = logits.device
        kernel = self.kernel_for(
            CrossEntropyGradInterface, device, logits.dtype, vocab, target_ids.dtype,
            *row_alignment(device, vocab, logits.dtype, logits, dlogits),
        )
        return kernel.forward(logits, target_ids, lse, softmax_scale, target_scale, dlogits)

    def kept(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Whether each row's target is not ``ignore_index``."""
        return target_ids != self.params["ignore_index"]

    def coefficients(self, row_gradient, dlse, keep, lse) -> tuple[torch.Tensor, torch.Tensor]:
        """(softmax_scale, target_scale) of the grad step: ``row_gradient`` (each row's loss
        gradient, a tensor of one element or N) zeroed on the rows ``keep`` leaves out (ignored
        targets), then z-loss's factor and lse's own gradient on the softmax term."""
        target_scale = torch.where(keep, row_gradient.to(lse.dtype), 0.0)
        scale = self.params["lse_square_scale"]
        softmax_scale = target_scale * (1.0 + 2.0 * scale * lse) if scale else target_scale
        if dlse is not None:
            softmax_scale = softmax_scale + dlse.to(lse.dtype)
        return softmax_scale, target_scale

    def wide_lse(self, logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """The lse the grad step reads: the forward's float32 output, or for float64 logits lse
        computed again in float64 (the lse output is float32 by its signature, and float64 is
        there for gradcheck, whose finite differences a float32 lse would swamp)."""
        if logits.dtype == torch.float64:
            return torch.logsumexp(capped(logits, self.params["softcap"]), -1)
        return lse.float()

    def forward_saving(self, *inputs, **outs):
        # Nothing to save: the backward reads the forward's lse output and its inputs.
        return self.forward(*inputs, **outs), ()


def reduce_rows(rows: torch.Tensor, target_ids: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    """The rows' losses summed, or averaged over the rows not ignored (0 / 0 = nan where every
    row is ignored, as torch gives)."""
    total = rows.sum()
    if reduction == "sum":
        return total
    return total / (target_ids != ignore_index).sum()


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

    kernel_interfaces = (CrossEntropyRowsInterface,)

    def forward(self, logits, target_ids):
        rows, lse = self.rows(logits, target_ids)
        ignore_index = self.params["ignore_index"]
        loss = reduce_rows(rows, target_ids, ignore_index, self.params["reduction"])
        check_targets(type(self).__name__, target_ids, logits.shape[-1], ignore_index, loss)
        return loss.to(logits.dtype), lse.float()


class CrossEntropyBwdOp(_ReducedLossOp):
    """Gradient of ``CrossEntropyFwdOp``: ``op(dloss, dlse, logits, target_ids, lse) -> dlogits``."""

    kernel_interfaces = (CrossEntropyGradInterface,)

    def forward(self, dloss, dlse, logits, target_ids, lse):
        lse = self.wide_lse(logits, lse)
        row_gradient = dloss.to(lse.dtype)
        keep = self.kept(target_ids)  # once: a launch of its own on CUDA, as each op here is
        if self.params["reduction"] == "mean":
            row_gradient = row_gradient / keep.sum()
        softmax_scale, target_scale = self.coefficients(row_gradient, dlse, keep, lse)
        return self.gradient(logits, target_ids, lse, softmax_scale, target_scale, torch.empty_like(logits))


class CrossEntropyPerRowFwdOp(_PerRowLossOp):
    """``torch.nn.functional.cross_entropy(..., reduction='none')`` with z-loss and soft-capping:
    ``op(logits, target_ids) -> (loss, lse)``, one loss per row."""

    kernel_interfaces = (CrossEntropyRowsInterface,)

    def forward(self, logits, target_ids):
        rows, lse = self.rows(logits, target_ids)
        check_targets(type(self).__name__, target_ids, logits.shape[-1], self.params["ignore_index"], rows)
        return rows.to(logits.dtype), lse.float()


class CrossEntropyPerRowBwdOp(_PerRowLossOp):
    """Gradient of ``CrossEntropyPerRowFwdOp``: ``op(dloss, dlse, logits, target_ids, lse) -> dlogits``."""

    kernel_interfaces = (CrossEntropyGradInterface,)

    def forward(self, dloss, dlse, logits, target_ids, lse):
        lse = self.wide_lse(logits, lse)
        softmax_scale, target_scale = self.coefficients(dloss.to(lse.dtype), dlse, self.kept(target_ids), lse)
        return self.gradient(logits, target_ids, lse, softmax_scale, target_scale, torch.empty_like(logits))
