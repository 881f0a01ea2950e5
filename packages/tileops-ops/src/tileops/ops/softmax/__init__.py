"""The softmax family: softmax and log-softmax over one dimension (``SoftmaxFwdOp``,
``LogSoftmaxFwdOp``) and their backward ops, their kernel interfaces and call spec.

``OPS`` lists the family's op classes, in the order ``tileops.ops.FAMILIES`` and the command
line show them; ``command_line`` holds the peer libraries ``tileops bench`` times beside them.
"""

from .interfaces import SoftmaxBwdInterface, SoftmaxCall, SoftmaxFwdInterface
from .ops import LogSoftmaxBwdOp, LogSoftmaxFwdOp, SoftmaxBwdOp, SoftmaxFwdOp

OPS = (SoftmaxFwdOp, LogSoftmaxFwdOp, SoftmaxBwdOp, LogSoftmaxBwdOp)

__all__ = [
    "OPS",
    "LogSoftmaxBwdOp",
    "LogSoftmaxFwdOp",
    "SoftmaxBwdInterface",
    "SoftmaxBwdOp",
    "SoftmaxCall",
    "SoftmaxFwdInterface",
    "SoftmaxFwdOp",
]
