"""The report of the transformers integration: what ``apply()`` replaced and what it left, and why."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Replaced:
    """A part apply() replaced: its path in the model, what it was (a class, or a function a
    class calls) and what replaced it (a TileOPs module's class, or an op)."""

    path: str
    original: str
    replacement: str


@dataclasses.dataclass(frozen=True)
class Left:
    """A part apply() left as it was: its path, its class (or function), its kind and why."""

    path: str
    original: str
    kind: str
    reason: str


@dataclasses.dataclass
class Report:
    """What ``apply()`` did to a model; ``print(report)`` lists it, by type."""

    model: str
    target: str | None = None
    replaced: list[Replaced] = dataclasses.field(default_factory=list)
    left: list[Left] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        target = "" if self.target is None else f" (target {self.target})"
        lines = [f"TileOPs in {self.model}{target}: {_count(self.replaced, 'part')} replaced, {_count(self.left, 'part')} left"]
        if self.replaced:
            lines.append("replaced:")
            groups = _grouped(self.replaced, lambda r: f"{r.original} -> {r.replacement}")
            lines += [f"  {key} ({len(paths)}): {', '.join(_compressed(paths))}" for key, paths in groups.items()]
        if self.left:
            lines.append("left:")
            groups = _grouped(self.left, lambda r: (f"{r.kind}: {r.original}", r.reason))
            lines += [f"  {key} ({len(paths)}): {', '.join(_compressed(paths))}: {reason}" for (key, reason), paths in groups.items()]
        return "\n".join(lines)


def _count(entries: list, noun: str) -> str:
    return f"{len(entries)} {noun}{'' if len(entries) == 1 else 's'}"


def _grouped(entries, key) -> dict[Any, list[str]]:
    groups: dict[Any, list[str]] = {}
    for entry in entries:
        groups.setdefault(key(entry), []).append(entry.path)
    return groups


def _compressed(paths: list[str]) -> list[str]:
    """Paths that differ in one index only, as one: ``model.layers.{0-31}.input_layernorm``."""
    groups: dict[tuple[str, ...], list[list[str]]] = {}
    for path in paths:
        parts = path.split(".")
        groups.setdefault(tuple("#" if part.isdigit() else part for part in parts), []).append(parts)
    lines = []
    for key, members in groups.items():
        varying = [i for i, part in enumerate(key) if part == "#" and len({m[i] for m in members}) > 1]
        if len(varying) != 1:
            lines += [".".join(m) for m in members]
            continue
        (i,) = varying
        parts = list(members[0])
        parts[i] = "{" + _ranges(sorted({int(m[i]) for m in members})) + "}"
        lines.append(".".join(parts))
    return lines


def _ranges(numbers: list[int]) -> str:
    runs: list[list[int]] = []
    for number in numbers:
        if runs and number == runs[-1][1] + 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)

