"""Finding and importing installed backends (the ``tileops.backends`` entry-point group).

Backends are imported once per process, when the first op is constructed (or when a public
query needs them). A backend whose import fails (any exception, ``SystemExit`` included) has
every registration its import made undone (those of threads the import started too), a
``RuntimeWarning`` is emitted, and the failure is kept for ``load_failures()``.

One thread imports the backends; a thread that needs them meanwhile waits for it, except a
thread started by the import under way: the import may be waiting for that thread, so after
``STARTED_DURING_IMPORT_WAIT_S`` it gets a ``BackendError`` naming the backend instead of a hang.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import re
import sys
import threading
import time
import traceback
import warnings

from .errors import BackendError
from .registry import journal

ENTRY_POINT_GROUP = "tileops.backends"


@dataclasses.dataclass(frozen=True)
class LoadFailure:
    """A backend entry point whose import raised, or (``name`` empty, ``value`` the file) a
    distribution whose entry points cannot be read, so its backends, if any, are unknown."""

    name: str
    value: str
    distribution: str | None
    error: BaseException
    traceback: str

    def __str__(self) -> str:
        dist = f" (distribution {self.distribution})" if self.distribution else ""
        if not self.name:
            return (
                f"the entry points of an installed distribution{dist} cannot be read ({self.value}), so the "
                f"backends it declares are not loaded: {type(self.error).__name__}: {self.error}"
            )
        return f"backend {self.name!r} = {self.value!r}{dist} failed to import: {type(self.error).__name__}: {self.error}"


@dataclasses.dataclass(frozen=True)
class LoadedBackend:
    name: str
    value: str
    distribution: str | None


#: How long a thread started while a backend is imported waits for that import before it is
#: refused: long enough for an application thread that merely happened to start then, short
#: enough that a backend joining the thread it started does not look like a hang.
STARTED_DURING_IMPORT_WAIT_S = 2.0

_lock = threading.RLock()
# "importing": the backend being imported, the thread importing it, and the threads that
# were alive when its import began (any other thread was started during the import).
_state: dict = {"done": False, "loading": False, "importing": None}
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
    _acquire()
    try:
        if _state["done"] or _state["loading"]:
            return
        _state["loading"] = True
        try:
            tried = {(b.name, b.value) for b in _loaded} | {(f.name, f.value) for f in _failures}
            for entry_point in sorted(_entry_points(), key=lambda ep: ep.name):
                if (entry_point.name, entry_point.value) not in tried:
                    _load_one(entry_point)
            _state["done"] = True
        finally:
            _state["loading"] = False
    finally:
        _lock.release()


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    """The group's entry points of every installed distribution (the first of a name on the
    path, as ``importlib.metadata.entry_points`` does).

    Read one distribution at a time: ``importlib.metadata.entry_points`` raises for the whole
    group when any distribution's ``entry_points.txt`` is corrupt (a line without ``=``, bytes
    that are not UTF-8), whichever package it belongs to; here that distribution becomes a load
    failure naming it and the others load.
    """
    found, seen = [], set()
    for dist in importlib.metadata.distributions():
        try:
            name = dist.metadata["Name"]
            normalized = re.sub(r"[-_.]+", "-", name).lower() if isinstance(name, str) else None
            if normalized is not None and normalized in seen:
                continue
            seen.add(normalized)
            found.extend(dist.entry_points.select(group=ENTRY_POINT_GROUP))
        except Exception as error:  # noqa: BLE001 - one broken distribution must not hide the others
            _record_unreadable(dist, error)
    return found


def _record_unreadable(dist: importlib.metadata.Distribution, error: Exception) -> None:
    try:
        name = dist.metadata["Name"]
    except Exception:  # noqa: BLE001 - its metadata may be what is broken
        name = None
    folder = getattr(dist, "_path", None)  # where a distribution on a path keeps its files
    where = os.path.join(str(folder), "entry_points.txt") if folder is not None else "entry_points.txt"
    if any((f.name, f.value) == ("", where) for f in _failures):
        return  # reported when discovery first read it
    failure = LoadFailure("", where, name, error, traceback.format_exc())
    _failures.append(failure)
    warnings.warn(f"TileOPs: {failure}", RuntimeWarning, stacklevel=_first_frame_outside_tileops())


def _acquire() -> None:
    """Take the discovery lock, waiting for another thread's discovery; refuse a thread that the
    import under way started (and may be waiting for) once it has waited long enough."""
    started_waiting = time.monotonic()
    while not _lock.acquire(timeout=0.05):
        importing = _state["importing"]
        if importing is None:
            continue
        backend, importer, alive_before = importing
        if threading.current_thread() in alive_before:
            continue
        if time.monotonic() - started_waiting < STARTED_DURING_IMPORT_WAIT_S:
            continue
        dist = f" (distribution {backend.distribution})" if backend.distribution else ""
        raise BackendError(
            f"TileOPs backends are still being imported: thread {threading.current_thread().name!r} "
            f"needs them (it constructs an op or asks for targets), but it was started while backend "
            f"{backend.name!r} = {backend.value!r}{dist} was being imported by thread {importer.name!r}, "
            f"which may be waiting for it. A backend's import must not wait for a thread that uses "
            f"TileOPs ops; construct ops after the import, or do not wait for that thread"
        )


def _load_one(entry_point: importlib.metadata.EntryPoint) -> None:
    backend = LoadedBackend(entry_point.name, entry_point.value, _distribution_name(entry_point))
    journal.open(owner=backend, threads=True)
    _state["importing"] = (backend, threading.current_thread(), frozenset(threading.enumerate()))
    try:
        entry_point.load()
    # A broken backend must not break TileOPs for everyone else, nor end the program: a
    # sys.exit() in its import is a load failure like any other.
    except (Exception, SystemExit) as error:  # noqa: BLE001
        journal.close(undo=True)
        failure = LoadFailure(backend.name, backend.value, backend.distribution, error, traceback.format_exc())
        _failures.append(failure)
        warnings.warn(
            f"TileOPs: {failure}; its registrations were undone. "
            "See tileops.backend.load_failures() or `tileops backends` for the traceback.",
            RuntimeWarning,
            stacklevel=_first_frame_outside_tileops(),
        )
    except BaseException:
        journal.close(undo=True)
        raise
    else:
        journal.close(undo=False)
        _loaded.append(backend)
    finally:
        _state["importing"] = None


def _first_frame_outside_tileops() -> int:
    """The ``stacklevel`` that makes a warning issued by this function's caller name the first
    caller outside TileOPs (the user's line that built the op), however deep the call into
    TileOPs was. Python 3.11 has no ``skip_file_prefixes``."""
    import tileops

    prefixes = tuple(os.path.join(folder, "") for folder in tileops.__path__)
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(prefixes):
        frame, level = frame.f_back, level + 1
    return level


def failed_backends_note() -> str:
    """A sentence for dispatch errors when some backend failed to load, else ''."""
    if not _failures:
        return ""
    names = ", ".join(repr(f.name) if f.name else f"the entry points of {f.distribution or f.value}" for f in _failures)
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
