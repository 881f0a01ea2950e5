"""The rotary position embedding family: ``RotaryEmbeddingFwdOp`` (q and k rotated in one call),
its backward op, and the in-place form ``RotaryEmbeddingInplaceFwdOp``; their kernel interfaces
and call specs.

``OPS`` lists the family's op classes, in the order ``tileops.ops.FAMILIES`` and the command
line show them; ``command_line`` holds the peer library ``tileops bench`` times beside them.
"""

from .interfaces import (
    STYLES,
    RopeBwdCall,
    RopeCall,
    RopeInplaceCall,
    RotaryEmbeddingBwdInterface,
    RotaryEmbeddingFwdInterface,
    RotaryEmbeddingInplaceInterface,
)
from .ops import RotaryEmbeddingBwdOp, RotaryEmbeddingFwdOp, RotaryEmbeddingInplaceFwdOp

OPS = (RotaryEmbeddingFwdOp, RotaryEmbeddingBwdOp, RotaryEmbeddingInplaceFwdOp)

__all__ = [
    "STYLES",
    "OPS",
    "RopeBwdCall",
    "RopeCall",
    "RopeInplaceCall",
    "RotaryEmbeddingBwdInterface",
    "RotaryEmbeddingBwdOp",
    "RotaryEmbeddingFwdInterface",
    "RotaryEmbeddingFwdOp",
    "RotaryEmbeddingInplaceFwdOp",
    "RotaryEmbeddingInplaceInterface",
]
