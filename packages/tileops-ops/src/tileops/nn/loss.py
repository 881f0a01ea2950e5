"""The loss modules of ``tileops.nn``: ``CrossEntropyLoss`` (``torch.nn.CrossEntropyLoss`` on the
cross-entropy ops) and ``LinearCrossEntropyLoss`` (the lm-head projection and the cross-entropy
fused, never holding the whole logits).

Both take torch's options (``ignore_index``, ``reduction``, ``label_smoothing``) and two of LLM
training: z-loss (``lse_square_scale``: ``lse_square_scale * lse**2`` added to the loss of each
row not ignored) and logit soft-capping (``softcap``: the logits become ``softcap * tanh(logits /
softcap)`` first). Their ``forward`` takes torch's ``(input, target)``: there ``target`` is the
class indices, as in torch; the backend target is the constructor's keyword ``target=``.
"""

from __future__ import annotations

from typing import NoReturn

import torch

from tileops.nn._dtypes import like
from tileops.ops import CrossEntropyFwdOp, CrossEntropyPerRowFwdOp, LinearCrossEntropyFwdOp

__all__ = ["CrossEntropyLoss", "LinearCrossEntropyLoss"]

REDUCTIONS = ("mean", "sum", "none")


def _check_reduction(module: str, reduction: str, allowed: tuple[str, ...]) -> None:
    if reduction not in allowed:
        raise ValueError(f"{module}: reduction must be one of {', '.join(map(repr, allowed))}, got {reduction!r}")


def _check_class_indices(module: str, target: torch.Tensor) -> None:
    if target.is_floating_point():
        raise TypeError(f"{module}: target must hold class indices (int64 or int32), got {target.dtype}: "
                        "class probabilities are not supported")


def _refuse_target_shape(module: str, target: torch.Tensor, expected: tuple[int, ...], of: str) -> NoReturn:
    """Refuse a target whose shape is not ``expected`` (the caller has compared them), saying the
    shape it must have: flattened, it would pair rows and classes wrongly (or torch refuses it)."""
    raise ValueError(f"{module}: target must have the shape of {of}, {expected}; got {tuple(target.shape)}")


class CrossEntropyLoss(torch.nn.Module):
    """``torch.nn.CrossEntropyLoss`` on ``CrossEntropyFwdOp`` (reductions ``"mean"`` and
    ``"sum"``) and ``CrossEntropyPerRowFwdOp`` (``"none"``): ``CrossEntropyLoss(weight=None,
    size_average=None, ignore_index=-100, reduce=None, reduction="mean", label_smoothing=0.0, *,
    lse_square_scale=0.0, softcap=None, target=None)``. ``forward(input, target)``: input (N, C)
    or (N, C, d1, ...) logits (classes in dimension 1, as torch) or (C,), target the class
    indices of input's shape without C. Class weights (``weight``) and the deprecated
    ``size_average`` / ``reduce`` are refused; class probabilities as the target too."""

    def __init__(self, weight: torch.Tensor | None = None, size_average=None, ignore_index: int = -100, reduce=None,
                 reduction: str = "mean", label_smoothing: float = 0.0, *, lse_square_scale: float = 0.0,
                 softcap: float | None = None, target: str | None = None) -> None:
        super().__init__()
        if weight is not None:
            raise ValueError("CrossEntropyLoss: class weights (weight=) are not supported")
        if size_average is not None or reduce is not None:
            raise ValueError("CrossEntropyLoss: size_average and reduce are deprecated in torch; pass reduction= instead")
        _check_reduction("CrossEntropyLoss", reduction, REDUCTIONS)
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.lse_square_scale, self.softcap = lse_square_scale, softcap
        options = {"ignore_index": ignore_index, "label_smoothing": label_smoothing, "lse_square_scale": lse_square_scale,
                   "softcap": softcap, "target": target}
        self.op = CrossEntropyPerRowFwdOp(**options) if reduction == "none" else CrossEntropyFwdOp(**options, reduction=reduction)

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        _check_class_indices("CrossEntropyLoss", target)
        if input.dim() == 1:  # one sample of C classes
            if target.numel() != 1 or target.dim() > 1:  # torch takes () and (1,)
                _refuse_target_shape("CrossEntropyLoss", target, (), f"one sample's class index for input {tuple(input.shape)}")
            logits, target_ids = input.unsqueeze(0), target.reshape(1)
        else:
            expected = (input.shape[0], *input.shape[2:])  # torch's: classes in dimension 1
            if target.shape != expected:
                _refuse_target_shape("CrossEntropyLoss", target, expected,
                                    f"input {tuple(input.shape)} without its class dimension (dim 1, as in torch)")
            logits = input.movedim(1, -1).reshape(-1, input.shape[1]) if input.dim() > 2 else input
            target_ids = target.reshape(-1)
        loss, _ = self.op(logits, target_ids)
        if self.reduction != "none":
            return loss
        return loss.reshape(() if input.dim() == 1 else target.shape)  # torch's () for one sample

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, label_smoothing={self.label_smoothing}, "
                f"lse_square_scale={self.lse_square_scale}, softcap={self.softcap}, target={self.op.requested_target}")


class LinearCrossEntropyLoss(torch.nn.Module):
    """The cross-entropy of ``hidden_states @ weight.T (+ bias)`` against class indices, on
    ``LinearCrossEntropyFwdOp``: a chunk of rows at a time, so the (tokens, vocabulary) logits
    are never held whole. ``LinearCrossEntropyLoss(ignore_index=-100, reduction="mean",
    label_smoothing=0.0, *, lse_square_scale=0.0, softcap=None, target=None)``;
    ``forward(hidden_states, weight, target, bias=None)``: hidden_states (..., H), weight (V,
    H) (an lm-head's), target the class indices of hidden_states' shape without H. The weight
    and bias are cast to hidden_states' dtype where they differ (float32 master weights beside
    bfloat16 activations). Reductions ``"mean"`` (over the rows not ignored) and ``"sum"``."""

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0, *,
                 lse_square_scale: float = 0.0, softcap: float | None = None, target: str | None = None) -> None:
        super().__init__()
        _check_reduction("LinearCrossEntropyLoss", reduction, ("mean", "sum"))
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.lse_square_scale, self.softcap = lse_square_scale, softcap
        self.op = LinearCrossEntropyFwdOp(ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction,
                                          lse_square_scale=lse_square_scale, softcap=softcap, target=target)

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        _check_class_indices("LinearCrossEntropyLoss", target)
        if target.shape != hidden_states.shape[:-1]:
            _refuse_target_shape("LinearCrossEntropyLoss", target, tuple(hidden_states.shape[:-1]),
                                f"hidden_states {tuple(hidden_states.shape)} without H")
        rows = hidden_states.reshape(-1, hidden_states.shape[-1])
        return self.op(rows, like(weight, rows), like(bias, rows), target.reshape(-1))

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, label_smoothing={self.label_smoothing}, "
                f"lse_square_scale={self.lse_square_scale}, softcap={self.softcap}, target={self.op.requested_target}")
