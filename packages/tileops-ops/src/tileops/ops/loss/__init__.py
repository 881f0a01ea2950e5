"""The loss family: cross-entropy over logits (the reduced loss and every row's), forward and
backward, and the fused linear cross-entropy; their kernel interfaces and call specs, and the
grad step's per-row coefficients (``grad_coefficients``), which every implementation computes alike.

``OPS`` lists the family's op classes, in the order ``tileops.ops.FAMILIES`` and the command line
show them; ``command_line`` holds the peer libraries ``tileops bench`` times beside them.
"""

from .interfaces import (
    CrossEntropyCall,
    CrossEntropyFusedInterface,
    CrossEntropyGradInterface,
    CrossEntropyRowsInterface,
    CrossEntropyScaleInterface,
    grad_coefficients,
)
from .linear import LinearCrossEntropyBwdOp, LinearCrossEntropyFwdOp
from .ops import CrossEntropyBwdOp, CrossEntropyFwdOp, CrossEntropyPerRowBwdOp, CrossEntropyPerRowFwdOp

OPS = (
    CrossEntropyFwdOp,
    CrossEntropyPerRowFwdOp,
    LinearCrossEntropyFwdOp,
    CrossEntropyBwdOp,
    CrossEntropyPerRowBwdOp,
    LinearCrossEntropyBwdOp,
)

__all__ = [
    "OPS",
    "CrossEntropyBwdOp",
    "CrossEntropyCall",
    "CrossEntropyFusedInterface",
    "CrossEntropyFwdOp",
    "CrossEntropyGradInterface",
    "CrossEntropyPerRowBwdOp",
    "CrossEntropyPerRowFwdOp",
    "CrossEntropyRowsInterface",
    "CrossEntropyScaleInterface",
    "LinearCrossEntropyBwdOp",
    "LinearCrossEntropyFwdOp",
    "grad_coefficients",
]
