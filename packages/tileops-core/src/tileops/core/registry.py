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
    """Undo steps of registrations, per open scope (a backend being imported, a test).

    Scopes nest: a registration is recorded in the innermost open scope only, so a backend
    imported while an outer scope is open stays registered when the outer scope is undone.
    """

    def __init__(self) -> None:
        self._scopes: list[list[Callable[[], None]]] = []

    def open(self) -> None:
        self._scopes.append([])

    def record(self, undo: Callable[[], None]) -> None:
        if self._scopes:
            self._scopes[-1].append(undo)

    def close(self, *, undo: bool) -> None:
        steps = self._scopes.pop()
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
    """One registered object and the module that registered it."""

    value: Any
    module: str


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
                f"({existing.value.__qualname__}, registered by {existing.module}); choose another key"
            )
        _kernel_types.setdefault(op, {})[key] = Registration(kernel_type, module)
    journal.record(lambda: _remove(_kernel_types.get(op, {}), key))


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
                f"{caller}: target {target!r} already has a detector, registered by {existing.module} "
                f"({describe_callable(existing.value)}); the second one comes from {module} "
                f"({describe_callable(detect)}). One backend owns a target: rename one of them"
            )
        _detectors[target] = Registration(detect, module)
    journal.record(lambda: _remove(_detectors, target))


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
                f"{existing.module} ({describe_callable(existing.value)}); the second one comes from "
                f"{module} ({describe_callable(build_kernel)})"
            )
        _builders[(op, target)] = Registration(build_kernel, module)
    journal.record(lambda: _remove(_builders, (op, target)))


def _check_target_name(target: Any, caller: str) -> None:
    _check_name("target", target, caller)
    if target == BUILTIN:
        raise BackendError(f"{caller}: {BUILTIN!r} names the in-tree implementations; choose another target name")


def _remove(table: dict, key: Any) -> None:
    with _lock:
        table.pop(key, None)


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
