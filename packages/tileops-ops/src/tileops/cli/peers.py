"""Peers: the libraries users would pick instead of TileOPs, timed beside it by ``tileops bench``.

A family lists them in ``PEERS`` of its ``command_line`` module
(``tileops.ops.<family>.command_line``): op class name -> {column: ("module:attribute",
adapter)}. ``adapter(function, inputs, params)`` returns a function of no arguments that calls
the peer as the op is called (its outputs in the op's order, differentiable as the op is), or a
short reason where the peer cannot take the call; a None callable means the library has no such
op, and the adapter is then the reason. The libraries come through an optional extra
(``pip install 'tileops-ops[bench]'``), never as a dependency.

No peer is dropped from a table: a cell is the peer's GPU time, ``absent`` where its library
does not import here, or ``refused: reason`` where it cannot take the call (the family's
adapter says so, or the peer's first call raises). An op without a peer in a column gets None
(shown as ``-``). Nothing here knows a family, an op or a library by name.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from . import call_flags

ABSENT = "absent"
REFUSED = "refused: "
FAILED = "failed: "
INSTALL = "pip install 'tileops-ops[bench]'"



class LoopTime(float):
    """A peer's time in µs measured by loops of eager calls, host included, because the peer
    cannot be captured in a CUDA graph (it synchronises with the host, as Liger-Kernel's
    cross-entropy does to count the targets): the cost a user of it pays per call. The table
    marks it with ``*``."""


#: A peer's cell: its GPU time in µs (a ``LoopTime`` where it could not be captured), a text
#: saying why there is none, or None (no such peer).
Cell = float | str | None
LOOP_MARK = "*"
LOOP_NOTE = (
    f"{LOOP_MARK} timed by loops of eager calls, host included: the peer cannot be captured in a CUDA graph"
    " (it waits for the GPU inside a call)"
)


def describe(error: BaseException, limit: int = 200) -> str:
    """``Type: first line of the message``, at most ``limit`` characters."""
    text = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}".rstrip(": ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


class Peers:
    """The peers the families declare, resolved once per run.

    ``tables`` maps a family to its peer table (default: every family's ``PEERS``);
    ``importer`` imports a module by name (tests pass a fake one).
    """

    def __init__(
        self,
        tables: Mapping[str, Mapping[str, Mapping[str, tuple]]] | None = None,
        importer: Callable[[str], ModuleType] = importlib.import_module,
    ) -> None:
        if tables is None:
            tables = {family: getattr(module, "PEERS", {}) for family, module in call_flags.family_adapters().items()}
        self.tables = tables
        self.importer = importer
        self.absent: dict[str, str] = {}  # column -> why its library is absent here
        self._resolved: dict[str, tuple[Any, str | None]] = {}

    @property
    def columns(self) -> list[str]:
        """Every column some family declares, in the order they are first declared."""
        columns: list[str] = []
        for table in self.tables.values():
            for peers in table.values():
                columns += [column for column in peers if column not in columns]
        return columns

    def declared(self, op_name: str) -> Mapping[str, tuple]:
        for table in self.tables.values():
            if op_name in table:
                return table[op_name]
        return {}

    def resolve(self, column: str, where: str) -> tuple[Any, str | None]:
        """The callable ``module:attribute`` names, or None and the cell saying why not."""
        if where not in self._resolved:
            module_name, _, attribute = where.partition(":")
            try:
                module = self.importer(module_name)
            except ImportError as error:
                self.absent.setdefault(column, f"{describe(error)} ({INSTALL})")
                self._resolved[where] = None, ABSENT
            except Exception as error:  # noqa: BLE001 - a library that fails to import is absent, said why
                self.absent.setdefault(column, f"importing {module_name} failed: {describe(error)}")
                self._resolved[where] = None, ABSENT
            else:
                function = getattr(module, attribute, None)
                reason = None if function is not None else f"{ABSENT}: {module_name} has no {attribute} (an older version?)"
                self._resolved[where] = function, reason
        return self._resolved[where]

    def prepare(self, op_name: str, inputs: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Callable[[], Any] | str | None]:
        """Per column: a function of no arguments calling the peer on ``inputs``, or the cell's
        text (``absent``, ``refused: ...``), or None where the op has no peer in that column."""
        declared = self.declared(op_name)
        prepared: dict[str, Callable[[], Any] | str | None] = {}
        for column in self.columns:
            if column not in declared:
                prepared[column] = None
                continue
            where, adapter = declared[column]
            if where is None:
                prepared[column] = REFUSED + str(adapter)
                continue
            function, reason = self.resolve(column, where)
            if reason is not None:
                prepared[column] = reason
                continue
            try:
                call = adapter(function, dict(inputs), dict(params))
            except Exception as error:  # noqa: BLE001 - an adapter that cannot build the call refuses it
                call = describe(error)
            prepared[column] = REFUSED + call if isinstance(call, str) else call
        return prepared

    def notes(self) -> list[str]:
        """One line per column whose library is absent, saying why and how to install it."""
        return [f"{column}: absent here ({why})" for column, why in self.absent.items()]


def time_cell(prepared: Callable[[], Any] | str | None, timer: Callable[[Callable[[], Any]], float]) -> Cell:
    """The cell of one peer: ``prepared`` as it is where it is not a call; otherwise the call is
    made once (a peer refuses a shape, dtype or option by raising) and then timed by ``timer``."""
    if not callable(prepared):
        return prepared
    try:
        prepared()
    except Exception as error:  # noqa: BLE001 - whatever the peer raises is its refusal, shown in the cell
        return REFUSED + describe(error)
    try:
        return timer(prepared)
    except Exception as error:  # noqa: BLE001 - a peer that runs but cannot be timed is shown so, not dropped
        return FAILED + describe(error)


def time_cells(prepared: Mapping[str, Callable[[], Any] | str | None], timer) -> dict[str, Cell]:
    return {column: time_cell(call, timer) for column, call in prepared.items()}


def ratio(cell: Cell, ours: float | None) -> float | None:
    """The peer's time over ours (above 1: TileOPs is faster), where both are times."""
    return cell / ours if isinstance(cell, float) and ours else None


def cell_text(cell: Cell, width: int) -> str:
    """A cell as the table shows it: a time with two decimals, or its text cut to ``width``."""
    if cell is None:
        return "-"
    if isinstance(cell, float):
        return f"{cell:.2f}" + (LOOP_MARK if isinstance(cell, LoopTime) else "")
    return cell if len(cell) <= width else cell[: width - 1] + "…"
