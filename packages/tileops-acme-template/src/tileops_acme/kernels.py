"""The acme target's kernels. Written in plain torch so the template runs on any machine;
a real backend calls its own runtime here, keeping the same call convention.

A kernel is built once per distinct input layout and then called with the op's input
tensors in signature order, plus the caller's output buffers as keywords.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _filled(result: torch.Tensor, buffer: torch.Tensor | None) -> torch.Tensor:
    if buffer is None:
        return result
    buffer.copy_(result)
    return buffer


class AcmeRMSNorm:
    def __init__(self, normalized_shape: tuple[int, ...], eps: float | None, dtype: torch.dtype) -> None:
        self.normalized_shape = normalized_shape
        self.eps = torch.finfo(dtype).eps if eps is None else eps

    def __call__(self, x, weight, *, out=None):
        w = None if weight is None else weight.float()
        y = F.rms_norm(x.float(), self.normalized_shape, w, self.eps).to(x.dtype)
        return _filled(y, out)


class AcmeLayerNorm:
    def __init__(self, normalized_shape: tuple[int, ...], eps: float, dtype: torch.dtype) -> None:
        self.normalized_shape, self.eps = normalized_shape, eps

    def __call__(self, x, weight, bias, *, out=None):
        w = None if weight is None else weight.float()
        b = None if bias is None else bias.float()
        y = F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps).to(x.dtype)
        return _filled(y, out)


class AcmeFusedAddRMSNorm(AcmeRMSNorm):
    def __call__(self, x, residual, weight, *, out=None, residual_out=None):
        total = _filled(x + residual, residual_out)
        return super().__call__(total, weight, out=out), total


class AcmeFusedAddLayerNorm(AcmeLayerNorm):
    def __call__(self, x, residual, weight, bias, *, out=None, residual_out=None):
        total = _filled(x + residual, residual_out)
        return super().__call__(total, weight, bias, out=out), total
