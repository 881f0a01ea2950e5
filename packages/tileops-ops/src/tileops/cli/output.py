"""What the subcommands share: the usage error, JSON printing and text in aligned columns."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


class UsageError(Exception):
    """The command line names something that does not exist; ``main`` prints it and exits 2."""


def print_json(data: Any) -> None:
    # default=str: dtypes, devices and paths print as their usual text
    print(json.dumps(data, indent=2, default=str))


def columns(rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    """``rows`` of cells as lines whose columns line up (the last column is not padded)."""
    if not rows:
        return []
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return [
        indent + "  ".join([*(cell.ljust(width) for cell, width in zip(row, widths)), row[-1]]).rstrip()
        for row in rows
    ]
