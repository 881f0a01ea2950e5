"""Plain-torch implementations of the norm interfaces, forward and backward.

They accumulate in float32 (float64 for float64 inputs) and round once, like the manifest's
reference. The ``torch_cpu`` ones are ``general``: they serve every CPU call, and any narrower
implementation a backend adds beats them. The ``torch_float64`` ones serve float64 calls on
CUDA, which the TileLang kernels do not take (float64 is there for ``gradcheck`` and reference
work, not for speed). They record no autograd history: the ops' autograd node calls the backward
op, which runs the backward implementations below.
"""

from __future__ import annotations

import torch

from tileops.core import Kernel

from ..compute_dtypes import COMPUTE_DTYPES, as_dtype, widened
from ..float64_on_cuda import float64_on_cuda
from .interfaces import (
    FusedAddLayerNormBwdInterface,
    FusedAddLayerNormFwdInterface,
    FusedAddRMSNormBwdInterface,
    FusedAddRMSNormFwdInterface,
    LayerNormBwdInterface,
    LayerNormFwdInterface,
    NormBwdCall,
    NormCall,
    RMSNormBwdInterface,
    RMSNormFwdInterface,
)


class _TorchNorm(Kernel):
    devices = frozenset({"cpu"})
    general = True
    takes_any_shape = True  # every function below works on the last dimension of any rank
    takes_row_views = True  # and on any strides (torch's own kernels copy where they need to)

    def __init__(self, n: int, eps: float, parameter_gradients: bool = True) -> None:
        super().__init__()
        self.n, self.eps = n, eps
        #: Backward: whether the parameter gradients are summed (``NormBwdCall``'s).
        self.parameter_gradients = parameter_gradients
        self.shape = (n,)
        self._units: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def entry_for(cls, call: NormCall):
        return (call.n, call.eps), lambda: cls(call.n, call.eps)

    # -- forward: y alone (no statistics saved) ---------------------------------------------
    def _rms_y(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        # torch._fused_rms_norm is what torch.rms_norm computes, rstd included, without the
        # dispatch torch.rms_norm adds: on a (1, 4096) CPU call it takes 1.3 us less than
        # F.rms_norm, which keeps the op within its overhead budget over F.rms_norm. (Its rstd
        # is not squeezed here: a view costs about 1 us on such a call.)
        if x.dtype in COMPUTE_DTYPES:  # weight has x's dtype (the signature checked it)
            return torch._fused_rms_norm(x, self.shape, weight, self.eps)[0]
        return as_dtype(torch._fused_rms_norm(x.float(), self.shape, widened(weight), self.eps)[0], x.dtype)

    def _layer_y(self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
        # torch.layer_norm is what F.layer_norm calls after its own Python checks, which cost
        # 0.8 us of its 4.6 us on a (2, 64) CPU input; the signature has checked the arguments.
        if x.dtype in COMPUTE_DTYPES:  # weight and bias have x's dtype (the signature checked it)
            return torch.layer_norm(x, self.shape, weight, bias, self.eps)
        return as_dtype(torch.layer_norm(widened(x), self.shape, widened(weight), widened(bias), self.eps), x.dtype)

    # -- forward: (y, statistics) --------------------------------------------------------
    def _rms(self, x: torch.Tensor, weight: torch.Tensor | None):
        y, rstd = torch._fused_rms_norm(widened(x), self.shape, widened(weight), self.eps)
        return as_dtype(y, x.dtype), (rstd.squeeze(-1),)  # its rstd keeps the normalised dimension

    def _layer(self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None):
        y, mean, rstd = torch.native_layer_norm(widened(x), (self.n,), widened(weight), widened(bias), self.eps)
        return as_dtype(y, x.dtype), (mean.squeeze(-1), rstd.squeeze(-1))

    # -- backward --------------------------------------------------------------------------
    def _gradients(self, dy, x, weight, mean, rstd, dresidual=None):
        """(dx, dweight, dbias) of y = (x - mean) * rstd * weight + bias; mean None for RMSNorm,
        whose dbias is None; dweight None where there is no weight (the sum is not taken), and
        both None where the parameter gradients are not wanted. dbias is otherwise always summed
        (the instance serves calls with and without a bias; the op drops it)."""
        dy_w, x_w, weight_w, rstd = widened(dy), widened(x), widened(weight), rstd.unsqueeze(-1)
        sums = self.parameter_gradients
        if mean is None:
            dx, dweight, dbias = *self._rms_gradients(dy_w, x_w, weight_w, rstd, sums and weight is not None), None
        else:
            # torch's own CPU kernel for LayerNorm's backward: 42 us on (512, 256) float32, against
            # 145 us for the same formula in a dozen elementwise ops. It needs a weight and a bias
            # to give their gradients, and neither changes dx.
            ones, zeros = self._unit_parameters(x_w)
            dx, dweight, dbias = torch.ops.aten.native_layer_norm_backward(
                dy_w, x_w, self.shape, mean.unsqueeze(-1), rstd, ones if weight is None else weight_w, zeros,
                [True, sums and weight is not None, sums],
            )
        if dresidual is not None:
            dx = dx.add_(dresidual)  # dx is the kernel's own, in the compute dtype
        dtype = dy.dtype
        return (as_dtype(dx, dtype), None if dweight is None else as_dtype(dweight, dtype),
                None if dbias is None else as_dtype(dbias, dtype))

    def _rms_gradients(self, dy, x, weight, rstd, sum_weight: bool):
        """(dx, dweight) of y = x * rstd * weight, in as few passes as torch allows (torch has no
        CPU kernel for it): dx = rstd * (g - xhat * mean(g * xhat)), g = dy * weight; dweight
        None unless ``sum_weight``."""
        xhat = x * rstd
        g = dy if weight is None else dy * weight
        projection = torch.linalg.vecdot(g, xhat).unsqueeze(-1).div_(self.n)
        # Products over temporaries of this function's own where there is one (g, unless it
        # is the caller's dy; then xhat, once dx has read it): no fresh tensor a step.
        dx = (torch.addcmul(g, xhat, projection, value=-1) if g is dy else g.addcmul_(xhat, projection, value=-1)).mul_(rstd)
        return dx, xhat.mul_(dy).reshape(-1, self.n).sum(0) if sum_weight else None

    def _unit_parameters(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A weight of ones and a bias of zeros, (n,) in ``like``'s dtype and on its device, made
        once for each."""
        key = (like.dtype, like.device)
        units = self._units.get(key)
        if units is None:
            units = self._units[key] = (like.new_ones(self.n), like.new_zeros(self.n))
        return units


class TorchCpuRMSNorm(_TorchNorm, RMSNormFwdInterface):
    def forward(self, x, weight):
        return self._rms_y(x, weight)

    def forward_saving(self, x, weight):
        return self._rms(x, weight)


class TorchCpuLayerNorm(_TorchNorm, LayerNormFwdInterface):
    def forward(self, x, weight, bias):
        return self._layer_y(x, weight, bias)

    def forward_saving(self, x, weight, bias):
        return self._layer(x, weight, bias)


class TorchCpuFusedAddRMSNorm(_TorchNorm, FusedAddRMSNormFwdInterface):
    def forward(self, x, residual, weight):
        total = x + residual
        return self._rms_y(total, weight), total

    def forward_saving(self, x, residual, weight):
        total = x + residual
        y, saved = self._rms(total, weight)
        return (y, total), saved


class TorchCpuFusedAddLayerNorm(_TorchNorm, FusedAddLayerNormFwdInterface):
    def forward(self, x, residual, weight, bias):
        total = x + residual
        return self._layer_y(total, weight, bias), total

    def forward_saving(self, x, residual, weight, bias):
        total = x + residual
        y, saved = self._layer(total, weight, bias)
        return (y, total), saved


class _TorchNormBwd(_TorchNorm):
    """The backward implementations: an instance per row length, eps and whether the call sums
    the parameter gradients."""

    @classmethod
    def entry_for(cls, call: NormBwdCall):
        key = (call.n, call.eps, call.parameter_gradients)
        return key, lambda: cls(*key)


class TorchCpuRMSNormBwd(_TorchNormBwd, RMSNormBwdInterface):
    def forward(self, dy, x, weight, rstd):
        dx, dweight, _ = self._gradients(dy, x, weight, None, rstd)
        return dx, dweight


class TorchCpuLayerNormBwd(_TorchNormBwd, LayerNormBwdInterface):
    def forward(self, dy, x, weight, mean, rstd):
        return self._gradients(dy, x, weight, mean, rstd)


class TorchCpuFusedAddRMSNormBwd(_TorchNormBwd, FusedAddRMSNormBwdInterface):
    def forward(self, dy, dresidual_sum, residual_sum, weight, rstd):
        dx, dweight, _ = self._gradients(dy, residual_sum, weight, None, rstd, dresidual_sum)
        return dx, dweight


class TorchCpuFusedAddLayerNormBwd(_TorchNormBwd, FusedAddLayerNormBwdInterface):
    def forward(self, dy, dresidual_sum, residual_sum, weight, mean, rstd):
        return self._gradients(dy, residual_sum, weight, mean, rstd, dresidual_sum)


#: key -> class per interface: the CPU implementations, and the float64 ones on CUDA.
IMPLEMENTATIONS = {
    interface: {"torch_cpu": cpu_class, "torch_float64": float64_on_cuda(cpu_class)}
    for interface, cpu_class in (
        (RMSNormFwdInterface, TorchCpuRMSNorm),
        (LayerNormFwdInterface, TorchCpuLayerNorm),
        (FusedAddRMSNormFwdInterface, TorchCpuFusedAddRMSNorm),
        (FusedAddLayerNormFwdInterface, TorchCpuFusedAddLayerNorm),
        (RMSNormBwdInterface, TorchCpuRMSNormBwd),
        (LayerNormBwdInterface, TorchCpuLayerNormBwd),
        (FusedAddRMSNormBwdInterface, TorchCpuFusedAddRMSNormBwd),
        (FusedAddLayerNormBwdInterface, TorchCpuFusedAddLayerNormBwd),
    )
}
