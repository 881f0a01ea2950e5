"""The first way of joining: an added implementation of ``RMSNormFwdInterface``.

It serves short rows only (n <= 256), on the CPU only: a reference backend demonstrates where
installing it changes no in-tree GPU result, so the in-tree CUDA kernels keep every CUDA call.
On the CPU it wins over the in-tree ``torch_cpu`` without declaring anything, since that one is
``general`` (a catch-all ranks last). An implementation for your device that beats a specific
in-tree kernel there declares it: ``preferred_over = frozenset({"rms_norm"})``. Every call it
refuses still goes to the in-tree implementations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tileops.backend import Kernel, register_kernel_type
from tileops.ops.norm import RMSNormCall, RMSNormFwdInterface

MAX_ROW = 256


class AcmeShortRowRMSNorm(Kernel, RMSNormFwdInterface):
    """RMSNorm over rows of at most 256 elements, in plain torch."""

    devices = frozenset({"cpu"})

    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.n, self.eps = n, eps

    @classmethod
    def refusal(cls, call: RMSNormCall) -> str | None:
        if call.n <= MAX_ROW:
            return None
        return f"serves rows of at most {MAX_ROW} elements, this call's rows have {call.n}"

    @classmethod
    def entry_for(cls, call: RMSNormCall):
        return (call.n, call.eps), lambda: cls(call.n, call.eps)

    def forward(self, x, weight):
        # Accumulate in float32, or in float64 for float64 calls (gradcheck runs in float64).
        wide = torch.float64 if x.dtype == torch.float64 else torch.float32
        w = None if weight is None else weight.to(wide)
        return F.rms_norm(x.to(wide), (self.n,), w, self.eps).to(x.dtype)


register_kernel_type("RMSNormFwdOp", "acme_short_rows", AcmeShortRowRMSNorm)
