"""The manifest's shape-pattern language: a pattern parsed once, and what can be done with it.

A pattern lists a tensor's dimensions. Each entry is an int (that size), a name (one
dimension: bound by the first tensor that has it, or given by a param), ``*name`` (a group of
dimensions: given by a shape param, or bound by the first tensor that has it) or ``...`` (a
group that binds nothing). A group whose sizes are not known when a tensor is matched is the
pattern's *free* group: it takes whatever dimensions the other entries leave, so a pattern
may have at most one. ``ShapePattern`` is the one representation of a pattern; the loader
parses it, the reference bind matches and expands it, the generated call path and
``tileops.testing`` ask it for its layout (each entry's width and the free group).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

_NAME = re.compile(r"^(\*?)([A-Za-z_][A-Za-z0-9_]*)$")


@dataclasses.dataclass(frozen=True)
class PatternEntry:
    """One entry of a pattern: a size, a named dimension, a named group or ``...``."""

    written: int | str  # as the manifest writes it
    size: int | None = None  # a fixed size; None for names and groups
    name: str | None = None  # what a dimension or group binds; None for sizes and '...'
    group: bool = False  # covers any number of dimensions ('*name' or '...')

    @classmethod
    def parse(cls, dim: Any, position: int) -> PatternEntry:
        """The entry ``dim`` at ``position``; ValueError saying what is wrong with it."""
        if isinstance(dim, bool) or not isinstance(dim, (int, str)):
            raise ValueError(f"dimension {position} is {dim!r}; expected an int, a name, '*name' or '...'")
        if isinstance(dim, int):
            if dim < 0:
                raise ValueError(f"dimension {position} is negative: {dim}")
            return cls(dim, size=dim)
        if dim == "...":
            return cls(dim, group=True)
        match = _NAME.match(dim)
        if not match:
            raise ValueError(f"dimension {position} is {dim!r}; expected a name, '*name' or '...'")
        return cls(dim, name=match.group(2), group=bool(match.group(1)))


def given(name: str, dims: Mapping[str, Any], scope: Mapping[str, Any]) -> Any:
    """What ``name`` stands for: the param in ``scope`` (unless it is None), else the dimension
    bound in ``dims``, else None."""
    value = scope.get(name)
    return dims.get(name) if value is None else value


@dataclasses.dataclass(frozen=True)
class ShapePattern:
    """A validated shape pattern. Iterating it gives its entries as the manifest writes them."""

    entries: tuple[PatternEntry, ...]

    @classmethod
    def parse(cls, value: Sequence[Any], shape_params: set[str]) -> ShapePattern:
        """The pattern of the list ``value``, where ``shape_params`` name the shape params (the
        groups they name have known sizes); ValueError saying what is wrong with it."""
        entries = tuple(PatternEntry.parse(dim, i) for i, dim in enumerate(value))
        unbound = sum(1 for e in entries if e.group and e.name not in shape_params)
        if unbound > 1:
            raise ValueError(f"{value!r} has {unbound} variadic groups not bound by a param; at most one can be matched")
        return cls(entries)

    def __iter__(self) -> Iterator[int | str]:
        return (entry.written for entry in self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __str__(self) -> str:
        return "[" + ", ".join(str(entry.written) for entry in self.entries) + "]"

    @property
    def names(self) -> set[str]:
        """Every name the pattern binds or reads (dimensions and groups)."""
        return {entry.name for entry in self.entries if entry.name is not None}

    @property
    def has_rest(self) -> bool:
        """Whether the pattern has a ``...``, which binds nothing and so cannot be expanded."""
        return any(entry.group and entry.name is None for entry in self.entries)

    # -- layout ------------------------------------------------------------------------------
    def widths(self, group_sizes: Callable[[str], Sequence[int] | None]) -> tuple[int | None, ...]:
        """How many dimensions each entry covers: 1 for a size or a name, the length of a
        group's sizes where ``group_sizes(name)`` knows them, None for a group it does not know
        (the free group) and for ``...``."""
        widths: list[int | None] = []
        for entry in self.entries:
            if not entry.group:
                widths.append(1)
                continue
            sizes = None if entry.name is None else group_sizes(entry.name)
            widths.append(None if sizes is None else len(sizes))
        return tuple(widths)

    def row_width(self, group_sizes: Callable[[str], Sequence[int] | None]) -> int | None:
        """How many trailing dimensions a row covers in a pattern that begins with a group of
        leading dimensions (``...`` or ``*name``): the width of every later entry (``widths``),
        or None where the pattern does not begin with a group or has a later group
        ``group_sizes`` does not know. A pattern of the group alone (``["..."]``: any shape, an
        elementwise op's) takes the last dimension as its row. (That the leading group is the
        free one, not a param's, is the loader's check.)"""
        if not self.entries or not self.entries[0].group:
            return None
        if len(self.entries) == 1:
            return 1
        later = self.widths(group_sizes)[1:]
        return None if None in later else sum(later)

    @staticmethod
    def arity(widths: Sequence[int | None]) -> tuple[int, int | None]:
        """(the dimensions the entries of known width cover, the position of the free group or
        None): a shape fits when its rank is that many, or at least that many with a free group."""
        fixed = sum(w for w in widths if w is not None)
        free_at = next((i for i, w in enumerate(widths) if w is None), None)
        return fixed, free_at

    @staticmethod
    def rank_problem(rank: int, fixed: int, free_at: int | None) -> str | None:
        """Why a shape of ``rank`` dimensions cannot fit a pattern of that ``arity``, or None."""
        if rank == fixed or (free_at is not None and rank > fixed):
            return None
        return f"expected {'at least ' if free_at is not None else ''}{fixed} dimension(s), got {rank}"

    def place(self, shape: Sequence[int], widths: Sequence[int | None]) -> list[tuple[int, tuple[int, ...]]] | str:
        """Each entry's (first dimension, its part of ``shape``), the free group taking what
        the others leave; or, when the rank does not fit, the problem."""
        fixed, free_at = self.arity(widths)
        problem = self.rank_problem(len(shape), fixed, free_at)
        if problem is not None:
            return problem
        placed = []
        cursor = 0
        for width in widths:
            width = len(shape) - fixed if width is None else width
            placed.append((cursor, tuple(shape[cursor:cursor + width])))
            cursor += width
        return placed

    def known_shape(self, params: Mapping[str, Any]) -> tuple[int, ...] | None:
        """The whole shape when sizes and ``params`` fix every entry, else None."""
        known: list[int] = []
        for entry in self.entries:
            value = entry.size if entry.name is None else params.get(entry.name)
            if value is None:
                return None
            if entry.group:
                known.extend(value)
            else:
                known.append(value)
        return tuple(known)

    # -- the reference bind ------------------------------------------------------------------
    def match(self, shape: Sequence[int], dims: dict[str, Any], scope: Mapping[str, Any]) -> str | None:
        """Bind this pattern against ``shape``: names that neither ``scope`` (the params) nor
        ``dims`` give are bound into ``dims``; the others are compared. A description of the
        first mismatch, or None."""
        placed = self.place(shape, self.widths(lambda name: given(name, dims, scope)))
        if isinstance(placed, str):
            return placed
        for entry, (start, part) in zip(self.entries, placed):
            if entry.size is not None:
                if part[0] != entry.size:
                    return f"dimension {start} must be {entry.size}"
                continue
            if entry.name is None:  # '...' binds nothing
                continue
            bound = given(entry.name, dims, scope)
            if entry.group:
                if bound is None:
                    dims[entry.name] = part
                elif tuple(bound) != part:
                    return f"dimensions {start}..{start + len(part) - 1} are {part}, {entry.name} is {tuple(bound)}"
            elif bound is None:
                dims[entry.name] = part[0]
            elif part[0] != bound:
                return f"dimension {start} ({entry.name}) must be {bound}"
        return None

    def bindings_text(self, dims: Mapping[str, Any], scope: Mapping[str, Any]) -> str:
        """`` with name=value, ...`` for the names of this pattern that are known, or ""."""
        known = []
        for entry in self.entries:
            value = None if entry.name is None else given(entry.name, dims, scope)
            if value is not None:
                known.append(f"{entry.name}={value!r}")
        return f" with {', '.join(known)}" if known else ""

    def expand(self, value_of: Callable[[str], Any], rest: tuple[int, ...] = ()) -> tuple[int, ...]:
        """The concrete shape, each name's value from ``value_of`` (None: not known, a
        ``KeyError`` of that name) and ``...`` standing for ``rest``."""
        shape: list[int] = []
        for entry in self.entries:
            if entry.size is not None:
                shape.append(entry.size)
                continue
            if entry.name is None:
                shape.extend(rest)
                continue
            value = value_of(entry.name)
            if value is None:
                raise KeyError(entry.name)
            if entry.group:
                shape.extend(value)
            else:
                shape.append(value)
        return tuple(shape)
