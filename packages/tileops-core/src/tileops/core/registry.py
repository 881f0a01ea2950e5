"""The process-wide registrations backends make: kernel types, detectors, kernel builders.

Every ``register_*`` call checks everything first and changes the registry last, so a
refused registration leaves nothing behind. While a backend's entry point is being imported,
each registration also records how to undo itself in ``journal``; discovery replays those
undo steps if the import fails.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

from .errors import BackendError

#: The name of the in-tree implementations, usable wherever a target is named.
BUILTIN = "builtin"

_lock = threading.RLock()


class _Scope:
    """One open (or closed) scope of the journal: its owner, its undo steps, how it ended."""

    __slots__ = ("owner", "steps", "threads", "closed", "undone")

    def __init__(self, owner: Any, threads: bool) -> None:
        self.owner, self.threads = owner, threads
        self.steps: list[Callable[[], None]] = []
        self.closed = self.undone = False


class _Journal:
    """Undo steps of registrations, per thread and per open scope (a backend being imported,
    a test).

    Scopes belong to the thread that opened them: a registration is recorded in the innermost
    scope open on the registering thread only, so a backend whose import fails undoes what its
    import registered and never what another thread (the application, another test) registered
    meanwhile. Scopes nest: a backend imported while an outer scope is open stays registered
    when the outer scope is undone. A scope may name the backend it imports (``owner``), which
    each registration made in it records.

    A scope opened with ``threads=True`` (a backend's import) also takes in the threads started
    while it is open by its thread, and by those threads in turn: what they register is the
    backend's, undone with it if its import fails, and a registration they attempt after that
    failure is undone at once and refused with a ``BackendError`` naming the backend. Python
    records no thread's parent, so while such a scope is open ``threading.Thread.start`` notes
    the scope of the starting thread on the thread it starts.
    """

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        # A thread started inside a ``threads=True`` scope -> that scope.
        self._adopted: weakref.WeakKeyDictionary[threading.Thread, _Scope] = weakref.WeakKeyDictionary()
        self._watching = 0  # open ``threads=True`` scopes: Thread.start is wrapped while > 0
        self._thread_start = threading.Thread.start

    def _scopes(self) -> list[_Scope]:
        scopes = getattr(self._local, "scopes", None)
        if scopes is None:
            scopes = self._local.scopes = []
        return scopes

    def _innermost(self) -> _Scope | None:
        """The scope a registration on this thread goes to: its own innermost one, or else the
        one the thread was started in."""
        scopes = self._scopes()
        if scopes:
            return scopes[-1]
        with self._lock:
            return self._adopted.get(threading.current_thread())

    def open(self, owner: Any = None, *, threads: bool = False) -> None:
        self._scopes().append(_Scope(owner, threads))
        if threads:
            with self._lock:
                self._watching += 1
                if self._watching == 1:
                    self._thread_start = threading.Thread.start
                    threading.Thread.start = _start_in_scope

    def _adopt(self, thread: threading.Thread) -> None:
        """Called by the wrapped ``Thread.start``: ``thread`` joins the starting thread's scope
        when that scope takes in threads and is still open."""
        scope = self._innermost()
        if scope is not None and scope.threads:
            with self._lock:
                if not scope.closed:
                    self._adopted[thread] = scope

    def record(self, undo: Callable[[], None]) -> None:
        scope = self._innermost()
        if scope is None:
            return
        with self._lock:
            if not scope.closed:
                scope.steps.append(undo)
                return
            refused = scope.undone
        if refused:  # a thread of a backend whose import failed: its registration does not stay
            undo()
            raise BackendError(
                f"a registration by thread {threading.current_thread().name!r} was undone and refused: the thread "
                f"was started during the import of {_describe_owner(scope.owner)}, which failed, so what it "
                "registers is undone with it"
            )

    def owner(self) -> Any:
        """The owner of the innermost scope on this thread that names one (or of the scope the
        thread was started in), or None."""
        owned = next((scope.owner for scope in reversed(self._scopes()) if scope.owner is not None), None)
        if owned is None:
            with self._lock:
                adopted = self._adopted.get(threading.current_thread())
            owned = adopted.owner if adopted is not None else None
        return owned

    def close(self, *, undo: bool) -> None:
        scope = self._scopes().pop()
        with self._lock:
            # Closed and its steps taken under the lock, so a step recorded by a thread of the
            # scope is either taken here or sees the scope closed.
            scope.closed, scope.undone = True, undo
            steps, scope.steps = scope.steps, []
            if scope.threads:
                self._watching -= 1
                if self._watching == 0 and threading.Thread.start is _start_in_scope:
                    threading.Thread.start = self._thread_start
        if undo:
            for step in reversed(steps):
                step()


def _start_in_scope(thread: threading.Thread) -> None:
    """``threading.Thread.start`` while a ``threads=True`` scope is open."""
    journal._adopt(thread)
    journal._thread_start(thread)


def _describe_owner(owner: Any) -> str:
    if owner is None:
        return "a scope of registrations"
    distribution = f" of distribution {owner.distribution}" if getattr(owner, "distribution", None) else ""
    return f"backend {getattr(owner, 'name', owner)!r}{distribution}"


journal = _Journal()


def registrant() -> str:
    """The module that called the public ``register_*`` function."""
    frame = sys._getframe(2)  # 0: here, 1: register_*, 2: its caller
    return frame.f_globals.get("__name__", "<unknown>")


@dataclasses.dataclass(frozen=True)
class Registration:
    """One registered object, the module that registered it and, when a backend's import made
    it, that backend (``discovery.LoadedBackend``: entry point and distribution)."""

    value: Any
    module: str
    backend: Any = None

    def registrant(self) -> str:
        """Who registered it, for messages: the module, and the backend and distribution."""
        if self.backend is None:
            return self.module
        distribution = f" of distribution {self.backend.distribution}" if self.backend.distribution else ""
        return f"{self.module} (backend {self.backend.name!r}{distribution})"


# op class name -> key -> kernel type
_kernel_types: dict[str, dict[str, Registration]] = {}
# target -> detector
_detectors: dict[str, Registration] = {}
# (op class name, target) -> build_kernel
_builders: dict[tuple[str, str], Registration] = {}


def _check_name(what: str, value: Any, caller: str) -> None:
    if not isinstance(value, str) or not value.isidentifier():
        raise BackendError(f"{caller}: {what} must be a Python identifier string, got {value!r}")


def register_kernel_type(op: str, key: str, kernel_type: type) -> None:
    """Add ``kernel_type`` under ``key`` to every instance of ``op`` constructed afterwards.

    ``kernel_type`` subclasses :class:`Kernel` and one of the op's kernel interfaces; the
    interface it inherits decides where it joins. Its contract is checked when the op is
    constructed, where the op's interfaces are known.
    """
    caller = f"register_kernel_type({op!r}, {key!r}, ...)"
    _check_name("op", op, caller)
    _check_name("key", key, caller)
    if not isinstance(kernel_type, type):
        raise BackendError(f"{caller}: kernel_type must be a class, got {kernel_type!r}")
    module = registrant()
    with _lock:
        existing = _kernel_types.get(op, {}).get(key)
        if existing is not None:
            raise BackendError(
                f"{caller}: {op} already has a registered kernel type under key {key!r} "
                f"({existing.value.__qualname__}, registered by {existing.registrant()}); choose another key"
            )
        registration = _kernel_types.setdefault(op, {})[key] = Registration(kernel_type, module, journal.owner())
    journal.record(lambda: _remove(_kernel_types.get(op, {}), key, registration))


def register_detector(target: str, detect: Callable[[Any], bool]) -> None:
    """Let ``target`` claim devices: ``detect(device)`` returns True for the devices it serves."""
    caller = f"register_detector(target={target!r})"
    _check_target_name(target, caller)
    if not callable(detect):
        raise BackendError(f"{caller}: detect must be callable, got {detect!r}")
    module = registrant()
    with _lock:
        existing = _detectors.get(target)
        if existing is not None:
            raise BackendError(
                f"{caller}: target {target!r} already has a detector, registered by {existing.registrant()} "
                f"({describe_callable(existing.value)}); the second one comes from {module} "
                f"({describe_callable(detect)}). One backend owns a target: rename one of them"
            )
        registration = _detectors[target] = Registration(detect, module, journal.owner())
    journal.record(lambda: _remove(_detectors, target, registration))


def register_kernel_builder(op: str, target: str, build_kernel: Callable[..., Any]) -> None:
    """Make ``target`` serve every call of ``op``: ``build_kernel`` builds its kernels."""
    caller = f"register_kernel_builder(op={op!r}, target={target!r})"
    _check_name("op", op, caller)
    _check_target_name(target, caller)
    if not callable(build_kernel):
        raise BackendError(f"{caller}: build_kernel must be callable, got {build_kernel!r}")
    module = registrant()
    with _lock:
        existing = _builders.get((op, target))
        if existing is not None:
            raise BackendError(
                f"{caller}: a builder for {op} on target {target!r} is already registered by "
                f"{existing.registrant()} ({describe_callable(existing.value)}); the second one comes from "
                f"{module} ({describe_callable(build_kernel)})"
            )
        registration = _builders[(op, target)] = Registration(build_kernel, module, journal.owner())
    journal.record(lambda: _remove(_builders, (op, target), registration))


def _check_target_name(target: Any, caller: str) -> None:
    _check_name("target", target, caller)
    if target == BUILTIN:
        raise BackendError(f"{caller}: {BUILTIN!r} names the in-tree implementations; choose another target name")


def _remove(table: dict, key: Any, registration: Registration) -> None:
    """Undo one registration: only that one, never a later registration under the same key."""
    with _lock:
        if table.get(key) is registration:
            del table[key]


def describe_callable(fn: Any) -> str:
    """``module.qualname`` of a function, or its repr."""
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None)
    if module and name:
        return f"{module}.{name}"
    return repr(fn)


def kernel_types(op: str) -> dict[str, Registration]:
    """The kernel types registered for ``op``, by key (a copy)."""
    with _lock:
        return dict(_kernel_types.get(op, {}))


def detectors() -> dict[str, Registration]:
    with _lock:
        return dict(_detectors)


def builder(op: str, target: str) -> Registration | None:
    with _lock:
        return _builders.get((op, target))


def targets_with_builder(op: str) -> list[str]:
    with _lock:
        return sorted(t for (o, t) in _builders if o == op)


def all_targets() -> list[str]:
    with _lock:
        return sorted(set(_detectors) | {t for (_, t) in _builders})


def all_kernel_types() -> dict[str, dict[str, Registration]]:
    with _lock:
        return {op: dict(keys) for op, keys in _kernel_types.items()}


def all_builders() -> dict[tuple[str, str], Registration]:
    with _lock:
        return dict(_builders)
