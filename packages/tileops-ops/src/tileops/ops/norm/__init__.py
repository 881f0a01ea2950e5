"""The normalization family: ops, their kernel interfaces and call specs.

``OPS`` lists the family's op classes, in the order ``tileops.ops.FAMILIES`` and the command
line show them; ``command_line`` holds the family's shorthand flags for the ``tileops`` command.
"""

from .interfaces import (
    FusedAddLayerNormCall,
    FusedAddLayerNormFwdInterface,
    FusedAddRMSNormCall,
    FusedAddRMSNormFwdInterface,
    LayerNormCall,
    LayerNormFwdInterface,
    NormCall,
    RMSNormCall,
    RMSNormFwdInterface,
)
from .ops import FusedAddLayerNormFwdOp, FusedAddRMSNormFwdOp, LayerNormFwdOp, RMSNormFwdOp

OPS = (RMSNormFwdOp, LayerNormFwdOp, FusedAddRMSNormFwdOp, FusedAddLayerNormFwdOp)

__all__ = [
    "FusedAddLayerNormCall",
    "FusedAddLayerNormFwdInterface",
    "FusedAddLayerNormFwdOp",
    "FusedAddRMSNormCall",
    "FusedAddRMSNormFwdInterface",
    "FusedAddRMSNormFwdOp",
    "LayerNormCall",
    "LayerNormFwdInterface",
    "LayerNormFwdOp",
    "NormCall",
    "OPS",
    "RMSNormCall",
    "RMSNormFwdInterface",
    "RMSNormFwdOp",
]
