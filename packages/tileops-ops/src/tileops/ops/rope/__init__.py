"""The rotary position embedding family: ``RotaryEmbeddingFwdOp`` (q and k rotated in one call)
and its backward op, their kernel interfaces and call specs.

``OPS`` lists the family's op classes, in the order ``tileops.ops.FAMILIES`` and the command
line show them; ``command_line`` holds the peer library ``tileops bench`` times beside them.
"""

from .interfaces import STYLES, RopeBwdCall, RopeCall, RotaryEmbeddingBwdInterface, RotaryEmbeddingFwdInterface
from .ops import RotaryEmbeddingBwdOp, RotaryEmbeddingFwdOp

OPS = (RotaryEmbeddingFwdOp, RotaryEmbeddingBwdOp)

__all__ = [
    "STYLES",
    "OPS",
    "RopeBwdCall",
    "RopeCall",
    "RotaryEmbeddingBwdInterface",
    "RotaryEmbeddingBwdOp",
    "RotaryEmbeddingFwdInterface",
    "RotaryEmbeddingFwdOp",
]
