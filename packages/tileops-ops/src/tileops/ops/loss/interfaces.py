"""The loss family's kernel interfaces and call specs: the contract every implementation of the
cross-entropy row kernels (in-tree or a backend's) is written against.

Four steps serve the family's ops, the fused linear cross-entropy included:

- ``CrossEntropyRowsInterface``: each row's loss and log-sum-exp from (N, V) logits and (N,)
  target_ids, in float32 (float64 for float64 logits). The op reduces the rows (mean or sum) itself,
  which costs a few microseconds on N floats and keeps one kernel for every reduction.
- ``CrossEntropyGradInterface``: the gradient of the logits from per-row coefficients, written
  into a tensor the caller gives (a new one, or the logits themselves when the caller no longer
  needs them: the fused linear cross-entropy computes each chunk's gradient in place).
- ``CrossEntropyFusedInterface``: the rows step and the gradient of a unit loss in one pass over
  the logits, for a reduced loss's call that records autograd history: the backward then only
  scales that gradient by the incoming one.
- ``CrossEntropyScaleInterface``: that scaling, in place, which a kernel may skip where the
  incoming gradient is 1 (a training step's ``loss.backward()``) without a round trip to the host.

Kernels see contiguous tensors; the targets are int64 or int32 as the caller gave them, unchecked.
For a target that is neither ignore_index nor in [0, V) an implementation must never read out of
bounds and must give its row a NaN loss: the op finds such targets through that NaN and refuses
the call (outside CUDA-graph capture, see docs/loss.md).
"""

from __future__ import annotations

import abc
import dataclasses

import torch

from tileops.core import CallSpec, KernelInterface


@dataclasses.dataclass(frozen=True)
class CrossEntropyCall(CallSpec):
    """The facts of one cross-entropy kernel call that select and build its kernel.

    ``vocab`` is V (a compile-time constant of the TileLang programs; a model has one);
    ``target_dtype`` the targets' dtype; ``aligned`` says that the logits' data pointer is
    16-byte aligned and a row is a whole number of 16-byte accesses (V * itemsize % 16 == 0),
    which the vectorised programs need (always True on the CPU); ``pointers_aligned`` that the
    data pointers of the tensors of V-wide rows are 16-byte aligned whatever V (True where
    ``aligned`` is), so that a kernel may move each row's aligned middle in 16-byte accesses and
    its ends one element at a time. The row count is not part of
    the spec: every N reuses the kernel built. The loss options are the op's params;
    ``ignore_index`` and ``lse_square_scale`` matter to the rows step only, and the grad step
    receives them as per-row coefficients.
    """

    dtype: torch.dtype
    vocab: int
    target_dtype: torch.dtype
    aligned: bool
    ignore_index: int
    label_smoothing: float
    lse_square_scale: float
    softcap: float | None
    pointers_aligned: bool = False


def grad_coefficients(
    lse_square_scale: float, row_gradient: torch.Tensor, keep: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax_scale, target_scale), the grad step's a and b per row, for rows whose loss has
    the gradient ``row_gradient`` (0-dim, or one per row): b is it, zero on the rows ``keep``
    leaves out (ignored targets), and a is b times z-loss's factor (1 + 2 lse_square_scale lse)
    plus lse's own gradient ``dlse`` where given. In lse's dtype."""
    target_scale = torch.where(keep, row_gradient.to(lse.dtype), 0.0)
    softmax_scale = target_scale * (1.0 + 2.0 * lse_square_scale * lse) if lse_square_scale else target_scale
    if dlse is not None:
        softmax_scale = softmax_scale + dlse.to(lse.dtype)
    return softmax_scale, target_scale


class CrossEntropyRowsInterface(KernelInterface):
    call_spec = CrossEntropyCall

    @abc.abstractmethod
    def forward(self, logits: torch.Tensor, target_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, lse)`` for contiguous (N, V) ``logits`` and (N,) ``target_ids``, two new (N,)
        float32 tensors (float64 for float64 logits).

        With z = softcap * tanh(logits / softcap) (z = logits without softcap) and
        lse = logsumexp(z) per row, a row whose target t is not ignore_index has
        loss = lse - (1 - label_smoothing) * z[t] - label_smoothing / V * sum(z)
        + lse_square_scale * lse**2, and 0 where it is ignored. lse is given for every row.
        """


class CrossEntropyGradInterface(KernelInterface):
    call_spec = CrossEntropyCall

    @abc.abstractmethod
    def forward(
        self,
        logits: torch.Tensor,
        target_ids: torch.Tensor,
        lse: torch.Tensor,
        softmax_scale: torch.Tensor,
        target_scale: torch.Tensor,
        dlogits: torch.Tensor,
    ) -> torch.Tensor:
        """Write the gradient of the logits into ``dlogits`` and return it.

        For contiguous (N, V) ``logits`` and ``dlogits`` (of the logits' dtype; ``dlogits`` may be
        ``logits`` itself: each element is read before it is written), (N,) ``target_ids``, and (N,)
        float32 ``lse``, ``softmax_scale`` (a) and ``target_scale`` (b):
        dlogits[r, j] = (a[r] * exp(z[r, j] - lse[r]) - b[r] * ((1 - label_smoothing) * (j == t[r])
        + label_smoothing / V)) * dz/dlogits[r, j], z and dz/dlogits as soft-capping makes them
        (1 without softcap). The op folds the reduction, the incoming gradients, z-loss and the
        ignored rows (b = 0) into a and b, so this step needs neither ignore_index nor
        lse_square_scale.
        """


class CrossEntropyFusedInterface(KernelInterface):
    call_spec = CrossEntropyCall

    @abc.abstractmethod
    def forward(
        self, logits: torch.Tensor, target_ids: torch.Tensor, unit: torch.Tensor, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, lse)`` as ``CrossEntropyRowsInterface`` gives them, and the gradient of
        ``unit`` times the sum of the rows' losses written into ``grad``.

        ``unit`` is a 0-dim tensor of the loss's compute dtype (float32; float64 for float64
        logits): 1 for a sum, 1 / the kept rows for a mean, the gradient of the reduced loss for
        an incoming gradient of 1 per row. ``grad`` is a contiguous (N, V)
        tensor of the logits' dtype. ``grad`` receives ``CrossEntropyGradInterface``'s formula
        with b = unit and a = unit * (1 + 2 * lse_square_scale * lse) on rows whose target is not
        ignore_index, a = b = 0 on the others.
        """


class CrossEntropyScaleInterface(KernelInterface):
    call_spec = CrossEntropyCall

    @abc.abstractmethod
    def forward(self, grad: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
        """Multiply the contiguous (N, V) ``grad`` (of the logits' dtype) in place by the 0-dim
        ``factor`` (of its dtype) and return it. Where ``factor`` is 1 the product is ``grad``
        itself, so an implementation may leave it unread, as long as it learns that without
        reading ``factor`` back to the host (a CUDA graph may replay the call)."""
