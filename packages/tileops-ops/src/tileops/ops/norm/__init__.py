"""The normalization family: ops, their kernel interfaces and call specs.

``OPS`` lists the family's op classes, in the order ``tileops.ops.FAMILIES`` and the command
line show them; ``command_line`` holds the family's shorthand flags for the ``tileops`` command.
"""

from .interfaces import (
    FusedAddLayerNormBwdCall,
    FusedAddLayerNormBwdInterface,
    FusedAddLayerNormCall,
    FusedAddLayerNormFwdInterface,
    FusedAddRMSNormBwdCall,
    FusedAddRMSNormBwdInterface,
    FusedAddRMSNormCall,
    FusedAddRMSNormFwdInterface,
    LayerNormBwdCall,
    LayerNormBwdInterface,
    LayerNormCall,
    LayerNormFwdInterface,
    NormBwdCall,
    NormCall,
    RMSNormBwdCall,
    RMSNormBwdInterface,
    RMSNormCall,
    RMSNormFwdInterface,
)
from .ops import (
    FusedAddLayerNormBwdOp,
    FusedAddLayerNormFwdOp,
    FusedAddRMSNormBwdOp,
    FusedAddRMSNormFwdOp,
    LayerNormBwdOp,
    LayerNormFwdOp,
    RMSNormBwdOp,
    RMSNormFwdOp,
)

OPS = (
    RMSNormFwdOp,
    LayerNormFwdOp,
    FusedAddRMSNormFwdOp,
    FusedAddLayerNormFwdOp,
    RMSNormBwdOp,
    LayerNormBwdOp,
    FusedAddRMSNormBwdOp,
    FusedAddLayerNormBwdOp,
)

__all__ = [
    "FusedAddLayerNormBwdCall",
    "FusedAddLayerNormBwdInterface",
    "FusedAddLayerNormBwdOp",
    "FusedAddLayerNormCall",
    "FusedAddLayerNormFwdInterface",
    "FusedAddLayerNormFwdOp",
    "FusedAddRMSNormBwdCall",
    "FusedAddRMSNormBwdInterface",
    "FusedAddRMSNormBwdOp",
    "FusedAddRMSNormCall",
    "FusedAddRMSNormFwdInterface",
    "FusedAddRMSNormFwdOp",
    "LayerNormBwdCall",
    "LayerNormBwdInterface",
    "LayerNormBwdOp",
    "LayerNormCall",
    "LayerNormFwdInterface",
    "LayerNormFwdOp",
    "NormBwdCall",
    "NormCall",
    "OPS",
    "RMSNormBwdCall",
    "RMSNormBwdInterface",
    "RMSNormBwdOp",
    "RMSNormCall",
    "RMSNormFwdInterface",
    "RMSNormFwdOp",
]
