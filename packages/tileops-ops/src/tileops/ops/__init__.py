"""TileOPs ops: every op class, importable as ``tileops.ops.<OpName>``.

Families live in submodules (``tileops.ops.norm``) with their kernel interfaces and call
specs. Importing this package never imports tilelang.
"""

from .norm import FusedAddLayerNormFwdOp, FusedAddRMSNormFwdOp, LayerNormFwdOp, RMSNormFwdOp

#: Every op class, by family.
FAMILIES = {"norm": (RMSNormFwdOp, LayerNormFwdOp, FusedAddRMSNormFwdOp, FusedAddLayerNormFwdOp)}

__all__ = ["FAMILIES", "FusedAddLayerNormFwdOp", "FusedAddRMSNormFwdOp", "LayerNormFwdOp", "RMSNormFwdOp"]
