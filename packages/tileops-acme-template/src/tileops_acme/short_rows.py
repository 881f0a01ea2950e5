"""The first way of joining: an added implementation of ``LayerNormFwdInterface``.

It serves short rows only (n <= 256), on CPU and CUDA, and wins over the in-tree
``layer_norm`` kernel there (``preferred_over``); every other call still goes in-tree.
"""

from __future__ import annotations

import torch.nn.functional as F

from tileops.backend import Kernel, register_kernel_type
from tileops.ops.norm import LayerNormCall, LayerNormFwdInterface

MAX_ROW = 256


class AcmeShortRowLayerNorm(Kernel, LayerNormFwdInterface):
    """LayerNorm over rows of at most 256 elements, in plain torch."""

    devices = frozenset({"cpu", "cuda"})
    preferred_over = frozenset({"layer_norm"})

    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.n, self.eps = n, eps

    @classmethod
    def refusal(cls, call: LayerNormCall) -> str | None:
        return None if call.n <= MAX_ROW else f"serves rows of at most {MAX_ROW} elements, this call's rows have {call.n}"

    @classmethod
    def entry_for(cls, call: LayerNormCall):
        return (call.n, call.eps), lambda: cls(call.n, call.eps)

    def forward(self, x, weight, bias):
        w = None if weight is None else weight.float()
        b = None if bias is None else bias.float()
        return F.layer_norm(x.float(), (self.n,), w, b, self.eps).to(x.dtype)


register_kernel_type("LayerNormFwdOp", "acme_short_rows", AcmeShortRowLayerNorm)
