"""Choosing one implementation of a kernel interface for a call, and checking the
declarations that choice relies on.

A call keeps the implementations that are available on its device (``devices``,
``supported_archs``) and do not refuse it, then drops every survivor another survivor beats
(``general`` ranks last; ``preferred_over`` is transitive). Exactly one must remain.
Declaration order decides nothing. Contract mistakes are found once, when an op is built.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from .device_facts import DeviceFacts, facts_for, has_facts_reader
from .discovery import failed_backends_note
from .errors import BackendError, KernelSelectionError
from .kernel import CallSpec, Kernel, KernelInterface

FactsSource = Callable[[CallSpec], "DeviceFacts | None"]


def facts_of_call_device(call: CallSpec) -> DeviceFacts | None:
    return facts_for(call.device)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What selection decided about one key for one call."""

    key: str
    outcome: str  # "selected", "unavailable", "refused" or "beaten"
    reason: str

    def __str__(self) -> str:
        return f"{self.key}: {self.outcome}" + (f" ({self.reason})" if self.reason else "")


@dataclasses.dataclass(frozen=True)
class InterfaceImplementations:
    """The implementations of one kernel interface that one op holds, checked and ranked."""

    op_name: str
    interface: type[KernelInterface]
    classes: Mapping[str, type[Kernel]]
    beats: Mapping[str, frozenset[str]]  # key -> keys it beats by preferred_over, transitively

    def unavailability(self, key: str, call: CallSpec, facts: FactsSource) -> str | None:
        cls = self.classes[key]
        missing = getattr(cls, "missing_because", None)  # an in-tree module that is not installed
        if missing:
            return missing
        device_type = call.device.type
        if device_type not in cls.devices:
            return f"runs on {_listing(cls.devices)}, not {device_type}"
        if cls.supported_archs is None:
            return None
        device_facts = facts(call)
        if device_facts is None:
            if not has_facts_reader(device_type):
                return (
                    f"declares supported_archs but no device facts are registered for device type "
                    f"{device_type!r}; the backend must call register_device_facts({device_type!r}, ...)"
                )
            return f"the facts of {call.device} are unknown"
        if device_facts.arch not in cls.supported_archs:
            return (
                f"needs architecture {_listing(str(a) for a in cls.supported_archs)}, "
                f"{call.device} is {device_facts.arch}"
            )
        return None

    def verdicts(self, call: CallSpec, facts: FactsSource = facts_of_call_device) -> list[Verdict]:
        """Every key's verdict for ``call``, in key order."""
        verdicts: dict[str, Verdict] = {}
        survivors = []
        for key in sorted(self.classes):
            reason = self.unavailability(key, call, facts)
            if reason is not None:
                verdicts[key] = Verdict(key, "unavailable", reason)
                continue
            cls = self.classes[key]
            try:
                reason = cls.refusal(call)
            except Exception as error:
                raise BackendError(
                    f"{self.op_name} / {self.interface.__name__}: refusal() of implementation {key!r} "
                    f"({cls.__module__}.{cls.__qualname__}) raised {type(error).__name__}: {error} for {call}. "
                    "This is a fault of that implementation; report it to its authors, or uninstall it"
                ) from error
            if reason is not None:
                verdicts[key] = Verdict(key, "refused", str(reason))
                continue
            survivors.append(key)
        for key in survivors:
            winners = [other for other in survivors if other != key and self._beats(other, key)]
            if winners:
                verdicts[key] = Verdict(key, "beaten", "beaten by " + ", ".join(winners))
            else:
                verdicts[key] = Verdict(key, "selected", "")
        return [verdicts[key] for key in sorted(verdicts)]

    def _beats(self, winner: str, loser: str) -> bool:
        if loser in self.beats[winner]:
            return True
        return self.classes[loser].general and not self.classes[winner].general

    def select(self, call: CallSpec, facts: FactsSource = facts_of_call_device) -> str:
        """The one key that serves ``call``; ``KernelSelectionError`` when none or several do."""
        verdicts = self.verdicts(call, facts)
        selected = [v.key for v in verdicts if v.outcome == "selected"]
        if len(selected) == 1:
            return selected[0]
        where = f"{self.op_name} / {self.interface.__name__}"
        listing = "\n".join(f"  - {v}" for v in verdicts) or "  (the op holds no implementation of it)"
        if not selected:
            raise KernelSelectionError(
                f"{where}: no implementation serves {call}.\n{listing}\n"
                "Pass inputs one of them accepts, or install/register an implementation that "
                "serves this call." + failed_backends_note()
            )
        first, *rest = selected
        raise KernelSelectionError(
            f"{where}: {len(selected)} implementations serve {call} and none beats the others: "
            f"{', '.join(selected)}.\n{listing}\n"
            f"Settle it with a declaration: e.g. preferred_over = frozenset({{{rest[0]!r}}}) on the "
            f"class under {first!r}, a refusal(call) that turns one of them down, or general = True "
            "on the catch-all one." + failed_backends_note()
        )


def _listing(items) -> str:
    return ", ".join(sorted(items)) or "nothing"


def _forward_parameters(cls: type) -> tuple[str, ...] | None:
    """Names of ``forward``'s positional parameters after self; None when it takes *args."""
    return _positional_parameters(cls.forward)


# Cached by the function (a class whose forward is replaced gets the new one's): every op
# construction checks each implementation's forward, and inspect.signature took 85 % of it. A
# differentiable op with four backward ops took 2.2 ms to construct uncached, 0.74 ms cached.
@functools.cache
def _positional_parameters(forward: Callable[..., Any]) -> tuple[str, ...] | None:
    params = list(inspect.signature(forward).parameters.values())[1:]
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return None
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def check_implementations(
    op_name: str,
    interfaces: tuple[type[KernelInterface], ...],
    in_tree: Mapping[str, type[Kernel]],
    registered: Mapping[str, type[Kernel]],
    registrants: Mapping[str, str] | None = None,
) -> dict[type[KernelInterface], InterfaceImplementations]:
    """Check every implementation's contract and group them by interface.

    Raises ``BackendError`` naming the class and the fix for: a registered key equal to an
    in-tree key, a class that inherits none of the op's interfaces, ``entry_for`` not a class
    method, a ``forward`` that does not take the interface's arguments, two ``general``
    implementations of one interface on one device type, an unknown key in ``preferred_over``, and a cycle.
    ``registrants`` (key -> who registered it) puts the registering module and backend into
    the message of a registered class, so that a user knows which distribution to blame.
    """
    implementations, problems = _admit(op_name, interfaces, in_tree, registered, registrants or {})
    if problems:
        raise BackendError(next(iter(problems.values())))
    return implementations


def registered_kernel_type_problems(
    op_name: str,
    interfaces: tuple[type[KernelInterface], ...],
    in_tree: Mapping[str, type[Kernel]],
    registered: Mapping[str, type[Kernel]],
    registrants: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """What ``check_implementations`` would raise about each registered key, by key (empty
    when the op can be constructed): ``tileops check`` and ``tileops backends`` report them."""
    return _admit(op_name, interfaces, in_tree, registered, registrants or {})[1]


def _admit(
    op_name: str,
    interfaces: tuple[type[KernelInterface], ...],
    in_tree: Mapping[str, type[Kernel]],
    registered: Mapping[str, type[Kernel]],
    registrants: Mapping[str, str],
) -> tuple[dict[type[KernelInterface], InterfaceImplementations], dict[str, str]]:
    """The checked implementations, and a problem per registered key that breaks the contract.

    A problem of an in-tree class is TileOPs' own bug and raises at once.
    """
    problems: dict[str, str] = {}
    reused = sorted(set(in_tree) & set(registered))
    for key in reused:
        by = f", by {registrants[key]}" if key in registrants else ""
        problems[key] = (
            f"{op_name}: registered kernel types reuse keys it has: {', '.join(map(repr, reused))} "
            f"(registered {', '.join(registered[k].__qualname__ for k in reused)}{by}); register it under a new key"
        )
    grouped: dict[type[KernelInterface], dict[str, type[Kernel]]] = {i: {} for i in interfaces}
    for key, cls in in_tree.items():
        interface, problem = _contract(op_name, interfaces, key, cls, "")
        if problem is not None:
            raise BackendError(problem)
        grouped[interface][key] = cls
    for key in sorted(set(registered) - set(reused)):
        by = f", registered by {registrants[key]}" if key in registrants else ""
        interface, problem = _contract(op_name, interfaces, key, registered[key], by)
        if problem is not None:
            problems[key] = problem
        else:
            grouped[interface][key] = registered[key]
    implementations = {}
    for interface, classes in grouped.items():
        try:
            implementations[interface] = _rank(op_name, interface, classes)
        except _RankingError as error:
            blamed = [key for key in error.keys if key in registered]
            if not blamed:
                raise
            for key in blamed:
                by = f" (registered by {registrants[key]})" if key in registrants else ""
                problems.setdefault(key, f"{error}; {key!r} is a registered kernel type{by}")
    return implementations, problems


def _contract(
    op_name: str, interfaces: tuple[type[KernelInterface], ...], key: str, cls: type, by: str
) -> tuple[type[KernelInterface] | None, str | None]:
    """The interface ``cls`` implements, or the contract problem that keeps it out."""
    where = f"{op_name}: implementation {key!r} ({cls.__module__}.{cls.__qualname__}{by})"
    if not issubclass(cls, Kernel):
        return None, f"{where} does not subclass tileops.backend.Kernel"
    owned = [i for i in interfaces if issubclass(cls, i)]
    if not owned:
        return None, (
            f"{where} inherits none of the op's kernel interfaces "
            f"({', '.join(i.__name__ for i in interfaces)}); subclass the one it implements"
        )
    if len(owned) > 1:
        return None, f"{where} inherits several of the op's interfaces; an implementation serves one"
    interface = owned[0]
    if not isinstance(inspect.getattr_static(cls, "entry_for"), classmethod):
        return None, f"{where}: entry_for must be a @classmethod taking the call spec"
    if getattr(cls.entry_for, "__func__", None) is Kernel.entry_for.__func__ and not getattr(cls, "missing_because", None):
        return None, f"{where} does not define entry_for(call), the class method that builds it"
    if not isinstance(inspect.getattr_static(cls, "refusal"), classmethod):
        return None, f"{where}: refusal must be a @classmethod taking the call spec"
    expected = _forward_parameters(interface)
    actual = _forward_parameters(cls)
    if expected is not None and actual is not None and actual != expected:
        return None, (
            f"{where}: forward takes ({', '.join(actual)}) but {interface.__name__}.forward takes "
            f"({', '.join(expected)}); match the interface's arguments"
        )
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        return None, f"{where} leaves abstract methods undefined: {missing}"
    return interface, None


class _RankingError(BackendError):
    """A ranking problem, with the keys it involves (to blame a registered one)."""

    def __init__(self, message: str, keys: tuple[str, ...]) -> None:
        super().__init__(message)
        self.keys = keys


def _rank(
    op_name: str, interface: type[KernelInterface], classes: dict[str, type[Kernel]]
) -> InterfaceImplementations:
    where = f"{op_name} / {interface.__name__}"
    general = sorted(k for k, c in classes.items() if c.general)
    for i, first in enumerate(general):
        for second in general[i + 1 :]:
            shared = classes[first].devices & classes[second].devices
            if shared:
                raise _RankingError(
                    f"{where}: {first!r} and {second!r} both declare general = True on "
                    f"{_listing(shared)}; one catch-all per interface and device type: make one of "
                    "them refuse what the other serves and drop its general flag",
                    (first, second),
                )
    # A kernel table whose distribution is not installed stands as one unavailable key: the keys
    # it holds are unknown here, so a backend's preference over one of them is not a mistake
    # (it is checked wherever that distribution is installed).
    table_missing = any(getattr(cls, "missing_because", None) for cls in classes.values())
    for key, cls in classes.items():
        unknown = sorted(set(cls.preferred_over) - set(classes))
        if unknown and not table_missing:
            raise _RankingError(
                f"{where}: {key!r} is preferred_over {', '.join(map(repr, unknown))}, which "
                f"{'is' if len(unknown) == 1 else 'are'} not an implementation of this interface "
                f"(known: {', '.join(sorted(classes))})",
                (key,),
            )
    beats = {key: _reachable(key, classes) for key in classes}
    for key in sorted(classes):
        if key in beats[key]:
            cycle = tuple(sorted(k for k in classes if key in beats[k] and k in beats[key])) or (key,)
            raise _RankingError(f"{where}: preferred_over forms a cycle through {key!r}; remove one edge", cycle)
    return InterfaceImplementations(op_name, interface, dict(classes), beats)


def _reachable(start: str, classes: Mapping[str, type[Kernel]]) -> frozenset[str]:
    seen: set[str] = set()
    stack = list(classes[start].preferred_over)
    while stack:
        key = stack.pop()
        if key not in seen:
            seen.add(key)
            if key in classes:  # else a key of a kernel table that is not installed
                stack.extend(classes[key].preferred_over)
    return frozenset(seen)
