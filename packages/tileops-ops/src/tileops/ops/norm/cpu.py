"""CPU implementations of the norm interfaces, in plain torch.

They compute in float32 and round once, like the manifest's reference, and are ``general``:
they serve every CPU call, and any narrower implementation a backend adds beats them. Like
every implementation of these forward-only ops, they record no autograd history.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tileops.core import Kernel

from .interfaces import (
    FusedAddLayerNormFwdInterface,
    FusedAddRMSNormFwdInterface,
    LayerNormFwdInterface,
    NormCall,
    RMSNormFwdInterface,
)


class _TorchCpuNorm(Kernel):
    devices = frozenset({"cpu"})
    general = True
    takes_leading_dims = True  # torch's functions normalise the last dimension of any rank

    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.n, self.eps = n, eps

    @classmethod
    def entry_for(cls, call: NormCall):
        return (call.n, call.eps), lambda: cls(call.n, call.eps)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        w = None if weight is None else weight.float()
        return F.rms_norm(x.float(), (self.n,), w, self.eps).to(x.dtype)

    def _layer(self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
        w = None if weight is None else weight.float()
        b = None if bias is None else bias.float()
        return F.layer_norm(x.float(), (self.n,), w, b, self.eps).to(x.dtype)


class TorchCpuRMSNorm(_TorchCpuNorm, RMSNormFwdInterface):
    @torch.no_grad()
    def forward(self, x, weight):
        return self._rms(x, weight)


class TorchCpuLayerNorm(_TorchCpuNorm, LayerNormFwdInterface):
    @torch.no_grad()
    def forward(self, x, weight, bias):
        return self._layer(x, weight, bias)


class TorchCpuFusedAddRMSNorm(_TorchCpuNorm, FusedAddRMSNormFwdInterface):
    @torch.no_grad()
    def forward(self, x, residual, weight):
        total = x + residual
        return self._rms(total, weight), total


class TorchCpuFusedAddLayerNorm(_TorchCpuNorm, FusedAddLayerNormFwdInterface):
    @torch.no_grad()
    def forward(self, x, residual, weight, bias):
        total = x + residual
        return self._layer(total, weight, bias), total
