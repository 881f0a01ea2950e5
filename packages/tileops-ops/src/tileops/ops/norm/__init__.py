"""The normalization family: ops, their kernel interfaces and call specs."""

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
    "RMSNormCall",
    "RMSNormFwdInterface",
    "RMSNormFwdOp",
]
