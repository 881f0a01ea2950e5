"""The TileLang implementations of the attention family's kernel interfaces, and their key table.

``KERNELS`` (interface -> key -> class) is the table the attention ops name: the flash-attention
forward and backward kernels (``kernels``) for Hopper. ``DecodeAttentionFwdOp`` names its own
table, ``decode.KERNELS`` (split-KV flash decoding over a KV cache). Importing this module does not
import tilelang; building a kernel does.
"""

from __future__ import annotations

from tileops.ops.attention import AttentionBwdInterface, AttentionFwdInterface

from .kernels import AttentionBwdKernel, AttentionFwdKernel

KERNELS = {
    AttentionFwdInterface: {"tilelang": AttentionFwdKernel},
    AttentionBwdInterface: {"tilelang": AttentionBwdKernel},
}

__all__ = ["KERNELS", "AttentionBwdKernel", "AttentionFwdKernel"]
