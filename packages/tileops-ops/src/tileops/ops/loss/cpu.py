"""Plain-torch implementations of the loss family's kernel interfaces.

They compute in float32 (float64 for float64 logits), as the TileLang kernels do. The
``torch_cpu`` ones are ``general``: they serve every CPU call, and any narrower implementation a
backend adds beats them. The ``torch_float64`` ones serve float64 calls on CUDA, which the
TileLang kernels do not take (float64 is there for ``gradcheck``, not for speed). They record no
autograd history: the ops' autograd node calls the backward op.
"""

from __future__ import annotations

import torch

from tileops.core import Kernel

from ..compute_dtypes import compute_dtype
from ..float64_on_cuda import float64_on_cuda
from .interfaces import (
    CrossEntropyCall,
    CrossEntropyFusedInterface,
    CrossEntropyGradInterface,
    CrossEntropyRowsInterface,
    CrossEntropyScaleInterface,
    grad_coefficients,
)


def capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """The logits in their compute dtype, soft-capped where ``softcap`` is given."""
    z = logits.to(compute_dtype(logits.dtype))
    return z if softcap is None else softcap * torch.tanh(z / softcap)


def safe_targets(target_ids: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(target_ids clamped into [0, V) as int64, whether each one was in range): what a row reads."""
    in_range = (target_ids >= 0) & (target_ids < vocab)
    return torch.where(in_range, target_ids, 0).long(), in_range


class _TorchLoss(Kernel):
    devices = frozenset({"cpu"})
    general = True

    def __init__(self, call: CrossEntropyCall) -> None:
        super().__init__()
        self.call = call

    @classmethod
    def entry_for(cls, call: CrossEntropyCall):
        # Everything but the device and dtype is read per call from the spec the kernel keeps.
        return call, lambda: cls(call)


def row_lse(z: torch.Tensor) -> torch.Tensor:
    """Each row's log-sum-exp, through torch's log_softmax kernel: its largest entry is
    -log(sum(exp(z - max))), so lse = max(z) - max(log_softmax(z)). On the CPU torch.logsumexp and
    exp over z take twice as long as log_softmax (557 and 487 against 290 us on (512, 2000)
    float32), whose exponentials are vectorised. A row whose maximum is not finite (a row of
    -inf, a +inf, a NaN) gets that maximum, as torch.logsumexp gives."""
    top = z.amax(-1)
    lse = top - torch.log_softmax(z, -1).amax(-1)
    return torch.where(top.isfinite(), lse, top)


def rows_step(call: CrossEntropyCall, logits: torch.Tensor, target_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``CrossEntropyRowsInterface.forward`` in plain torch."""
    z = capped(logits, call.softcap)
    lse = row_lse(z)
    index, in_range = safe_targets(target_ids, z.shape[-1])
    picked = z.gather(-1, index[:, None])[:, 0]
    loss = lse - (1.0 - call.label_smoothing) * picked
    if call.label_smoothing:
        loss = loss - call.label_smoothing / z.shape[-1] * z.sum(-1)
    if call.lse_square_scale:
        loss = loss + call.lse_square_scale * lse.square()
    ignored = target_ids == call.ignore_index
    loss = torch.where(ignored, 0.0, torch.where(in_range, loss, float("nan")))
    return loss, lse


def grad_step(call: CrossEntropyCall, logits, target_ids, lse, softmax_scale, target_scale, dlogits) -> torch.Tensor:
    """``CrossEntropyGradInterface.forward`` in plain torch."""
    # Written in place, into dlogits itself where it has the compute dtype (a new tensor per
    # step of the formula took 1.56 ms on (512, 2000) float32; this, 0.3 ms). exp(z - lse) is
    # the softmax of z, which torch's softmax kernel computes twice as fast as exp over z;
    # where dlogits is the logits themselves it is computed element by element instead.
    wide = compute_dtype(logits.dtype)
    z = capped(logits, call.softcap)
    vocab = z.shape[-1]
    a, b = softmax_scale.to(wide)[:, None], target_scale.to(wide)[:, None]
    into = dlogits if dlogits.dtype == wide else torch.empty_like(z)
    if into is z:
        grad = torch.sub(z, lse.to(wide)[:, None], out=into).exp_()
    else:
        grad = torch.ops.aten._softmax.out(z, -1, False, out=into)
    grad.mul_(a)
    if call.label_smoothing:
        grad.sub_(b * (call.label_smoothing / vocab))
    index, in_range = safe_targets(target_ids, vocab)
    hit = b[:, 0] * (1.0 - call.label_smoothing) * in_range
    grad.scatter_add_(-1, index[:, None], -hit[:, None])
    if call.softcap is not None:  # z is a tensor of its own here, not dlogits
        grad.mul_(1.0 - (z / call.softcap).square())
    return dlogits if grad is dlogits else dlogits.copy_(grad)


class TorchCpuCrossEntropyRows(_TorchLoss, CrossEntropyRowsInterface):
    def forward(self, logits, target_ids):
        return rows_step(self.call, logits, target_ids)


class TorchCpuCrossEntropyGrad(_TorchLoss, CrossEntropyGradInterface):
    def forward(self, logits, target_ids, lse, softmax_scale, target_scale, dlogits):
        return grad_step(self.call, logits, target_ids, lse, softmax_scale, target_scale, dlogits)


class TorchCpuCrossEntropyFused(_TorchLoss, CrossEntropyFusedInterface):
    def forward(self, logits, target_ids, unit, grad):
        # The two steps one after the other: the CPU gains nothing from one pass of its own.
        call = self.call
        loss, lse = rows_step(call, logits, target_ids)
        coefficients = grad_coefficients(call.lse_square_scale, unit, target_ids != call.ignore_index, lse)
        grad_step(call, logits, target_ids, lse, *coefficients, grad)
        return loss, lse


class TorchCpuCrossEntropyScale(_TorchLoss, CrossEntropyScaleInterface):
    def forward(self, grad, factor):
        return grad.mul_(factor)


#: key -> class per interface: the CPU implementations, and the float64 ones on CUDA. A key names
#: one implementation across an op's interfaces, so the grad step's keys end in ``_grad``.
IMPLEMENTATIONS = {
    interface: {
        f"torch_cpu{suffix}": cpu_class,
        f"torch_float64{suffix}": float64_on_cuda(cpu_class),
    }
    for interface, cpu_class, suffix in (
        (CrossEntropyRowsInterface, TorchCpuCrossEntropyRows, ""),
        (CrossEntropyGradInterface, TorchCpuCrossEntropyGrad, "_grad"),
        (CrossEntropyFusedInterface, TorchCpuCrossEntropyFused, "_fused"),
        (CrossEntropyScaleInterface, TorchCpuCrossEntropyScale, "_scale"),
    )
}
