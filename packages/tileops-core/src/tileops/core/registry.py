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
from collections.abc import Callable
from typing import Any

from .errors import BackendError

#: The name of the in-tree implementations, usable wherever a target is named.
BUILTIN = "builtin"

_lock = threading.RLock()


class _Journal:
    """Undo steps of registrations, per thread and per open scope (a backend being imported,
    a test).

    Scopes belong to the thread that opened them: a registration is recorded in the innermost
    scope open on the registering thread only, so a backend whose import fails undoes what its
    import registered and never what another thread (the application, another test) registered
    meanwhile. Scopes nest: a backend imported while an outer scope is open stays registered
    when the outer scope is undone. A scope may name the backend it imports (``owner``), which
    each registration made in it records.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def _scopes(self) -> list[tuple[Any, list[Callable[[], None]]]]:
        scopes = getattr(self._local, "scopes", None)
        if scopes is None:
            scopes = self._local.scopes = []
        return scopes

    def open(self, owner: Any = None) -> None:
        self._scopes().append((owner, []))

    def record(self, undo: Callable[[], None]) -> None:
        scopes = self._scopes()
        if scopes:
            scopes[-1][1].append(undo)

    def owner(self) -> Any:
        """The owner of the innermost scope on this thread that names one, or None."""
        return next((owner for owner, _ in reversed(self._scopes()) if owner is not None), None)

    def close(self, *, undo: bool) -> None:
        _, steps = self._scopes().pop()
        if undo:
            for step in reversed(steps):
                step()


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
