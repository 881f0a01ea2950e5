"""The TileLang implementations of the attention family's kernel interfaces, and their key table.

``KERNELS`` (interface -> key -> class) is the table the attention ops name. Importing this
module does not import tilelang; building a kernel does.
"""

from __future__ import annotations

from tileops.ops.attention import AttentionBwdInterface, AttentionFwdInterface

KERNELS: dict = {
    AttentionFwdInterface: {},
    AttentionBwdInterface: {},
}
