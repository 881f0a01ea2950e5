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
    PackedGatedInplaceBwdInterface,
)
from .ops import (
    GeGLUBwdOp,
    GeGLUFwdOp,
    GeGLUInplaceBwdOp,
    GELUBwdOp,
    GELUFwdOp,
    PackedGeGLUBwdOp,
    PackedGeGLUFwdOp,
    PackedGeGLUInplaceBwdOp,
    PackedSwiGLUBwdOp,
    PackedSwiGLUFwdOp,
    PackedSwiGLUInplaceBwdOp,
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
    PackedSwiGLUInplaceBwdOp,
    PackedGeGLUInplaceBwdOp,
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
    "PackedGatedInplaceBwdInterface",
    "PackedGeGLUBwdOp",
    "PackedGeGLUFwdOp",
    "PackedGeGLUInplaceBwdOp",
    "PackedSwiGLUBwdOp",
    "PackedSwiGLUFwdOp",
    "PackedSwiGLUInplaceBwdOp",
    "SiLUBwdOp",
    "SiLUFwdOp",
    "SwiGLUBwdOp",
    "SwiGLUFwdOp",
    "SwiGLUInplaceBwdOp",
]
