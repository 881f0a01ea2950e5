"""The softmax family's kernel interfaces and call spec: the contract every implementation of
softmax and log-softmax, forward and backward (in-tree or a backend's), is written against.

Kernels see contiguous (m, n) rows and work over the last dimension: the op moves another
``dim`` last and views the caller's tensor as rows. Every implementation accumulates a row in
float32 (float64 for float64 tensors). ``log`` in the call spec says log-softmax: one interface
serves both functions, and an implementation that computes one only refuses the other.
"""

from __future__ import annotations

import abc
import dataclasses

import torch

from tileops.core import CallSpec, KernelInterface


@dataclasses.dataclass(frozen=True)
class SoftmaxCall(CallSpec):
    """The facts of one call that select and build its kernel.

    ``n`` is the row length; ``dtype`` the input's dtype (x forward, dy and y backward);
    ``out_dtype`` y's dtype forward (the op's ``dtype`` param, else x's), dy's backward;
    ``log`` whether it is log-softmax; ``aligned`` whether every tensor's data pointer is 16-byte
    aligned and a row fills whole 16-byte accesses (``n * itemsize`` a multiple of 16), as
    vectorised kernels need (always True on the CPU, whose vector loads take any address);
    ``pointers_aligned`` whether every tensor's data pointer is 16-byte aligned whatever the row
    length (True where ``aligned`` is), so that a kernel may reach the aligned middle of each
    row in 16-byte accesses and its ends one element at a time. The row count is not part of
    the spec, so a call with another batch reuses the kernel built.
    """

    n: int
    dtype: torch.dtype
    out_dtype: torch.dtype
    log: bool
    aligned: bool
    pointers_aligned: bool = False


class SoftmaxFwdInterface(KernelInterface):
    call_spec = SoftmaxCall

    @abc.abstractmethod
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Softmax (log-softmax where ``log``) of every row of contiguous (m, n) ``x``: a new
        (m, n) tensor of ``out_dtype``. x is converted to ``out_dtype`` first where that is
        narrower than x (as torch does), and each row is accumulated in float32."""


class SoftmaxBwdInterface(KernelInterface):
    call_spec = SoftmaxCall

    @abc.abstractmethod
    def forward(self, dy: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The gradient of x from contiguous (m, n) ``dy`` and the forward's output ``y``:
        ``y * (dy - sum(dy * y))`` per row, or ``dy - exp(y) * sum(dy)`` where ``log``; a new
        (m, n) tensor of dy's dtype, each row's sum accumulated in float32."""
