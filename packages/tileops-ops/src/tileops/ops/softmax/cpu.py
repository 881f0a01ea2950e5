"""Plain-torch implementations of the softmax interfaces, forward and backward.

They accumulate in float32 (float64 for float64 tensors) and round once, like the manifest's
reference. The ``torch_cpu`` ones are ``general``: they serve every CPU call, and any narrower
implementation a backend adds beats them. The ``torch_float64`` ones serve calls on CUDA with
a float64 input or output, which the TileLang kernels do not take (float64 is there for
``gradcheck``, not for speed). They record no autograd history: the ops' autograd node calls
the backward op.
"""

from __future__ import annotations

import torch

from tileops.core import Kernel

from ..compute_dtypes import COMPUTE_DTYPES, as_dtype, widened
from ..float64_on_cuda import float64_on_cuda
from .interfaces import SoftmaxBwdInterface, SoftmaxCall, SoftmaxFwdInterface


class _TorchSoftmax(Kernel):
    devices = frozenset({"cpu"})
    general = True

    def __init__(self, call: SoftmaxCall) -> None:
        super().__init__()
        self.log, self.out_dtype = call.log, call.out_dtype
        self.function = torch.log_softmax if call.log else torch.softmax
        # A float32 or float64 call into its own dtype computes as it is: no dtype to test or
        # convert (0.3 us of a 2.6 us CPU call on a short row).
        self.as_is = call.dtype is call.out_dtype and call.dtype in COMPUTE_DTYPES

    @classmethod
    def entry_for(cls, call: SoftmaxCall):
        return (call.log, call.dtype, call.out_dtype), lambda: cls(call)


class TorchCpuSoftmax(_TorchSoftmax, SoftmaxFwdInterface):
    def forward(self, x):
        if self.as_is:
            return self.function(x, -1)
        # x in y's dtype first (torch's order: a narrower dtype rounds x), then widened to compute.
        wide = widened(as_dtype(x, self.out_dtype))
        return as_dtype(self.function(wide, -1), self.out_dtype)


class TorchCpuSoftmaxBwd(_TorchSoftmax, SoftmaxBwdInterface):
    def forward(self, dy, y):
        # torch's own backward kernels: dx = y * (dy - sum(dy * y)) (softmax) and dx = dy -
        # exp(y) * sum(dy) (log-softmax) in one pass, where the formulas' elementwise ops took
        # 2.8 and 3.5 ms on (512, 2000) float32 (76 and 210 us this way).
        dy_w, y_w = widened(dy), widened(y)
        backward = torch._log_softmax_backward_data if self.log else torch._softmax_backward_data
        return as_dtype(backward(dy_w, y_w, -1, dy_w.dtype), dy.dtype)


def _float64_in_or_out(call: SoftmaxCall) -> bool:
    return torch.float64 in (call.dtype, call.out_dtype)


def _dtypes(call: SoftmaxCall) -> str:
    return f"{call.dtype} -> {call.out_dtype}"


#: key -> class per interface: the CPU implementations, and the float64 ones on CUDA.
IMPLEMENTATIONS = {
    interface: {
        "torch_cpu": cpu_class,
        "torch_float64": float64_on_cuda(cpu_class, _float64_in_or_out, _dtypes),
    }
    for interface, cpu_class in ((SoftmaxFwdInterface, TorchCpuSoftmax), (SoftmaxBwdInterface, TorchCpuSoftmaxBwd))
}
