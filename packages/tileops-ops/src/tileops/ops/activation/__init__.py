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
    GatedInplaceBwdInterface,
    PackedCall,
    PackedGatedBwdInterface,
    PackedGatedFwdInterface,
)
from .ops import (
    GeGLUBwdOp,
    GeGLUFwdOp,
    GeGLUInplaceBwdOp,
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
    SwiGLUInplaceBwdOp,
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
    SwiGLUInplaceBwdOp,
    GeGLUInplaceBwdOp,
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
    "GatedInplaceBwdInterface",
    "GeGLUBwdOp",
    "GeGLUFwdOp",
    "GeGLUInplaceBwdOp",
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
    "SwiGLUInplaceBwdOp",
]
