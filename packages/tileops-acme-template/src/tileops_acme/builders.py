"""Kernel builders: one per op the ``acme`` target serves.

A builder receives a ``TensorSpec`` per input in the order of the op's signature (None for an
optional input that was not passed) and the op's params as keywords, and returns the kernel.
It runs when an op first needs a kernel for a new input layout, never at import.
"""

from __future__ import annotations

from tileops.backend import TensorSpec, register_kernel_builder

from .detect import TARGET
from .kernels import AcmeFusedAddLayerNorm, AcmeFusedAddRMSNorm, AcmeLayerNorm, AcmeRMSNorm


def build_rms_norm(x: TensorSpec, weight: TensorSpec | None, *, normalized_shape, eps):
    return AcmeRMSNorm(normalized_shape, eps, x.dtype)


def build_layer_norm(x: TensorSpec, weight: TensorSpec | None, bias: TensorSpec | None, *, normalized_shape, eps):
    return AcmeLayerNorm(normalized_shape, eps, x.dtype)


def build_fused_add_rms_norm(x: TensorSpec, residual: TensorSpec, weight: TensorSpec | None, *, normalized_shape, eps):
    return AcmeFusedAddRMSNorm(normalized_shape, eps, x.dtype)


def build_fused_add_layer_norm(
    x: TensorSpec, residual: TensorSpec, weight: TensorSpec | None, bias: TensorSpec | None, *, normalized_shape, eps
):
    return AcmeFusedAddLayerNorm(normalized_shape, eps, x.dtype)


register_kernel_builder(op="RMSNormFwdOp", target=TARGET, build_kernel=build_rms_norm)
register_kernel_builder(op="LayerNormFwdOp", target=TARGET, build_kernel=build_layer_norm)
register_kernel_builder(op="FusedAddRMSNormFwdOp", target=TARGET, build_kernel=build_fused_add_rms_norm)
register_kernel_builder(op="FusedAddLayerNormFwdOp", target=TARGET, build_kernel=build_fused_add_layer_norm)
