"""Powers of two, the thread counts the families' launch rules choose (pure Python)."""

from __future__ import annotations


def pow2_ceil(v: int) -> int:
    """The least power of two at or above ``v`` (1 for ``v`` <= 1)."""
    return 1 << max(0, (v - 1).bit_length())


def pow2_floor(v: int) -> int:
    """The greatest power of two at or below ``v`` (``v`` >= 1)."""
    return 1 << (v.bit_length() - 1)
