"""Finding and importing installed backends (the ``tileops.backends`` entry-point group).

Backends are imported once per process, when the first op is constructed (or when a public
query needs them). A backend whose import fails has every registration it made undone, a
``RuntimeWarning`` is emitted, and the failure is kept for ``load_failures()``.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import threading
import traceback
import warnings

from .registry import journal

ENTRY_POINT_GROUP = "tileops.backends"


@dataclasses.dataclass(frozen=True)
class LoadFailure:
    """A backend entry point whose import raised."""

    name: str
    value: str
    distribution: str | None
    error: BaseException
    traceback: str

    def __str__(self) -> str:
        dist = f" (distribution {self.distribution})" if self.distribution else ""
        return f"backend {self.name!r} = {self.value!r}{dist} failed to import: {type(self.error).__name__}: {self.error}"


@dataclasses.dataclass(frozen=True)
class LoadedBackend:
    name: str
    value: str
    distribution: str | None


_lock = threading.RLock()
_state = {"done": False, "loading": False}
_failures: list[LoadFailure] = []
_loaded: list[LoadedBackend] = []


def _distribution_name(entry_point: importlib.metadata.EntryPoint) -> str | None:
    dist = getattr(entry_point, "dist", None)
    return dist.metadata["Name"] if dist is not None else None


def load_backends() -> None:
    """Import every installed backend once, in entry-point name order.

    Re-entrant calls (a backend constructing an op while it is imported) return at once. An
    interrupt (KeyboardInterrupt) undoes the backend being imported and propagates; the next
    call resumes with the backends not imported yet.
    """
    if _state["done"]:
        return
    with _lock:
        if _state["done"] or _state["loading"]:
            return
        _state["loading"] = True
        try:
            tried = {(b.name, b.value) for b in _loaded} | {(f.name, f.value) for f in _failures}
            for entry_point in sorted(
                importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name
            ):
                if (entry_point.name, entry_point.value) not in tried:
                    _load_one(entry_point)
            _state["done"] = True
        finally:
            _state["loading"] = False


def _load_one(entry_point: importlib.metadata.EntryPoint) -> None:
    distribution = _distribution_name(entry_point)
    journal.open()
    try:
        entry_point.load()
    except Exception as error:  # noqa: BLE001 - a broken backend must not break TileOPs for everyone else
        journal.close(undo=True)
        failure = LoadFailure(
            entry_point.name, entry_point.value, distribution, error, traceback.format_exc()
        )
        _failures.append(failure)
        warnings.warn(
            f"TileOPs: {failure}; its registrations were undone. "
            "See tileops.backend.load_failures() or `tileops backends` for the traceback.",
            RuntimeWarning,
            stacklevel=4,
        )
    except BaseException:
        journal.close(undo=True)
        raise
    else:
        journal.close(undo=False)
        _loaded.append(LoadedBackend(entry_point.name, entry_point.value, distribution))


def failed_backends_note() -> str:
    """A sentence for dispatch errors when some backend failed to load, else ''."""
    if not _failures:
        return ""
    names = ", ".join(repr(f.name) for f in _failures)
    return (
        f" Note: {len(_failures)} installed backend(s) failed to load ({names}), so what they register is "
        "missing; see tileops.backend.load_failures() or `tileops backends`."
    )


def load_failures() -> list[LoadFailure]:
    """The backends whose import failed in this process, in the order they were tried."""
    load_backends()
    return list(_failures)


def loaded_backends() -> list[LoadedBackend]:
    load_backends()
    return list(_loaded)
