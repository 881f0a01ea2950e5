"""Quoting values in error messages, bounded.

A message about a manifest or a stored file quotes what it found; a value there can be any
size (a megabyte-long string, a list of a million items), so every quote is cut to a few
dozen characters, saying how long the whole was.
"""

from __future__ import annotations

from typing import Any

#: The most characters of one quoted value a message shows.
LIMIT = 80


def shown(value: Any, limit: int = LIMIT) -> str:
    """``repr(value)``, cut to ``limit`` characters (the length of the whole said)."""
    try:
        text = repr(value)
    except RecursionError:  # a structure nested deeper than repr goes
        return f"<a deeply nested {type(value).__name__}>"
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def shown_text(text: str, limit: int = LIMIT) -> str:
    """``text`` itself (not its repr), cut like ``shown``."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
