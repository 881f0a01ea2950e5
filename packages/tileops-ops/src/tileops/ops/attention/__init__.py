"""The attention family: ``AttentionFwdOp`` (scaled dot-product attention of prefill and
training, flash-attn's semantics, with each row's log-sum-exp) and its backward op
``AttentionBwdOp``; their kernel interfaces and call spec. ``DecodeAttentionFwdOp`` (``decode``) is
attention of a few new tokens per sequence over a KV cache, contiguous or paged.

``OPS`` lists the family's op classes, in the order ``tileops.ops.FAMILIES`` and the command
line show them; ``command_line`` holds the peer libraries ``tileops bench`` times beside them.
"""

from .decode import DecodeAttentionFwdOp
from .decode_interfaces import DecodeAttentionCall, DecodeAttentionFwdInterface
from .interfaces import LAYOUTS, AttentionBwdInterface, AttentionCall, AttentionFwdInterface
from .ops import AttentionBwdOp, AttentionFwdOp

OPS = (
    AttentionFwdOp,
    AttentionBwdOp,
    DecodeAttentionFwdOp,
)

__all__ = [
    "LAYOUTS",
    "OPS",
    "AttentionBwdInterface",
    "AttentionBwdOp",
    "AttentionCall",
    "AttentionFwdInterface",
    "AttentionFwdOp",
    "DecodeAttentionCall",
    "DecodeAttentionFwdInterface",
    "DecodeAttentionFwdOp",
]
