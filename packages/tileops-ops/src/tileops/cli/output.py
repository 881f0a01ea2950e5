"""What the subcommands share: the usage error, the shape and device syntax, installed versions,
JSON printing and text in aligned columns. It imports no torch (``tileops --help`` and
``--version`` use it), so the device syntax imports torch when it reads a device."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
from collections.abc import Sequence
from typing import Any


class UsageError(Exception):
    """The command line names something that does not exist; ``main`` prints it and exits 2."""


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution``; None where it is not installed (as when the
    packages run from a source tree on ``PYTHONPATH``)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def version() -> str:
    """TileOPs' version as ``--version`` and the demo print it."""
    return installed_version("tileops-ops") or "from a source tree (tileops-ops is not installed)"


def device_argument(text: str):
    """A ``torch.device`` as the command line spells it (``cpu``, ``cuda``, ``cuda:1``); for
    argparse's ``type=``, which reports torch's reason with the option's name."""
    import torch

    try:
        return torch.device(text)
    except RuntimeError as error:  # torch names the device types it knows
        raise argparse.ArgumentTypeError(f"torch knows no device {text!r}: {error}") from None


def shape_argument(text: str) -> tuple[int, ...]:
    """A shape as the command line spells it, sizes separated by 'x' or ',' (``8192x7168``,
    ``8,4096``), ``()`` for a 0-dim tensor; for argparse's ``type=``, which reports the error
    with the option's name."""
    if text.replace(" ", "") == "()":
        return ()
    parts = [part.strip() for part in text.replace(",", "x").split("x")]
    if all(part.isascii() and part.isdigit() for part in parts):
        return tuple(int(part) for part in parts)
    if all(part.removeprefix("-").isascii() and part.removeprefix("-").isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"sizes cannot be negative, got {text!r}")
    raise argparse.ArgumentTypeError(
        f"expected sizes separated by 'x' or ',', such as 8192x7168 or 8,4096 (or () for a 0-dim tensor), got {text!r}"
    )


def without_markup(docstring: str) -> str:
    """A module docstring as ``--help`` shows it: reST's literal quotes (double backticks) dropped."""
    return docstring.replace("``", "")


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
