"""The attention family: ``AttentionFwdOp`` (scaled dot-product attention of prefill and
training, flash-attn's semantics, with each row's log-sum-exp) and its backward op
``AttentionBwdOp``; their kernel interfaces and call spec. ``DecodeAttentionFwdOp`` (``decode``) is
attention of a few new tokens per sequence over a KV cache, contiguous or paged.
``VarlenAttentionFwdOp`` and ``VarlenAttentionBwdOp`` (``varlen``) are attention over packed
batches of variable-length sequences (flash-attn's varlen form, ``cu_seqlens``).

``OPS`` lists the family's op classes, in the order ``tileops.ops.FAMILIES`` and the command
line show them; ``command_line`` holds the peer libraries ``tileops bench`` times beside them.
"""

from .decode import DecodeAttentionFwdOp
from .decode_interfaces import DecodeAttentionCall, DecodeAttentionFwdInterface
from .interfaces import LAYOUTS, AttentionBwdInterface, AttentionCall, AttentionFwdInterface
from .ops import AttentionBwdOp, AttentionFwdOp
from .varlen import VarlenAttentionBwdOp, VarlenAttentionFwdOp
from .varlen_interfaces import VarlenAttentionBwdInterface, VarlenAttentionCall, VarlenAttentionFwdInterface

OPS = (
    AttentionFwdOp,
    AttentionBwdOp,
    DecodeAttentionFwdOp,
    VarlenAttentionFwdOp,
    VarlenAttentionBwdOp,
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
    "VarlenAttentionBwdInterface",
    "VarlenAttentionBwdOp",
    "VarlenAttentionCall",
    "VarlenAttentionFwdInterface",
    "VarlenAttentionFwdOp",
]
