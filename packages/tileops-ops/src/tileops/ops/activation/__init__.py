"""The activation family: SiLU, GELU, SwiGLU and GeGLU (from two tensors, or packed in one as
[gate | up]), forward and backward; their kernel interfaces and call specs.

``OPS`` lists the family's op classes, in the order ``tileops.ops.FAMILIES`` and the command
line show them; ``command_line`` holds the peer libraries ``tileops bench`` times beside them.
"""

from .interfaces import (
    ACTIVATIONS,
    ActivationBwdInterface,
    ActivationCall,
    ActivationFwdInterface,
    GatedBwdInterface,
    GatedFwdInterface,
    PackedCall,
    PackedGatedBwdInterface,
    PackedGatedFwdInterface,
)
from .ops import (
    GeGLUBwdOp,
    GeGLUFwdOp,
    GELUBwdOp,
    GELUFwdOp,
    PackedGeGLUBwdOp,
    PackedGeGLUFwdOp,
    PackedSwiGLUBwdOp,
    PackedSwiGLUFwdOp,
    SiLUBwdOp,
    SiLUFwdOp,
    SwiGLUBwdOp,
    SwiGLUFwdOp,
)

OPS = (
    SiLUFwdOp,
    GELUFwdOp,
    SwiGLUFwdOp,
    GeGLUFwdOp,
    PackedSwiGLUFwdOp,
    PackedGeGLUFwdOp,
    SiLUBwdOp,
    GELUBwdOp,
    SwiGLUBwdOp,
    GeGLUBwdOp,
    PackedSwiGLUBwdOp,
    PackedGeGLUBwdOp,
)

__all__ = [
    "ACTIVATIONS",
    "OPS",
    "ActivationBwdInterface",
    "ActivationCall",
    "ActivationFwdInterface",
    "GELUBwdOp",
    "GELUFwdOp",
    "GatedBwdInterface",
    "GatedFwdInterface",
    "GeGLUBwdOp",
    "GeGLUFwdOp",
    "PackedCall",
    "PackedGatedBwdInterface",
    "PackedGatedFwdInterface",
    "PackedGeGLUBwdOp",
    "PackedGeGLUFwdOp",
    "PackedSwiGLUBwdOp",
    "PackedSwiGLUFwdOp",
    "SiLUBwdOp",
    "SiLUFwdOp",
    "SwiGLUBwdOp",
    "SwiGLUFwdOp",
]
