"""What an implementation is: ``Kernel`` (declarations + build), ``KernelInterface`` (an op's
call site) and ``CallSpec`` (the facts of one call that select and build an implementation).
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from collections.abc import Callable, Hashable
from typing import Any, ClassVar

import torch

from .errors import BackendError

#: Value types a call spec may hold: hashable and immutable, so a spec can key a cache.
_ATOMIC_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, enum.Enum)


def _immutable_problem(value: Any) -> str | None:
    """Why ``value`` cannot sit in a call spec, or None when it can."""
    if isinstance(value, _ATOMIC_TYPES):
        return None
    if isinstance(value, (tuple, frozenset)):
        for item in value:
            problem = _immutable_problem(item)
            if problem is not None:
                return problem
        return None
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if not value.__dataclass_params__.frozen:  # type: ignore[attr-defined]
            return f"{type(value).__name__} is a dataclass that is not frozen"
        for field in dataclasses.fields(value):
            problem = _immutable_problem(getattr(value, field.name))
            if problem is not None:
                return problem
        return None
    return f"{type(value).__name__} is mutable or unhashable"


@dataclasses.dataclass(frozen=True)
class CallSpec:
    """The facts of one call that select an implementation and decide what is built.

    Subclass it per interface as a frozen dataclass (``@dataclass(frozen=True)``) holding
    shapes, dtypes, params and flags. ``device`` is the call's device. Every value must be
    hashable and immutable (ints, floats, strings, dtypes, devices, tuples of those...): a
    spec keys the op's cache of built kernels, so a list or a tensor in it is refused by
    :meth:`validate` with the field's name.
    """

    device: torch.device

    def validate(self) -> None:
        """Raise ``BackendError`` naming the first field whose value cannot key a cache."""
        if not dataclasses.is_dataclass(type(self)) or not type(self).__dataclass_params__.frozen:  # type: ignore[attr-defined]
            raise BackendError(f"{type(self).__name__} must be declared with @dataclass(frozen=True)")
        for field in dataclasses.fields(self):
            problem = _immutable_problem(getattr(self, field.name))
            if problem is not None:
                raise BackendError(
                    f"{type(self).__name__}.{field.name} = {getattr(self, field.name)!r}: a call spec "
                    f"holds only hashable, immutable values ({problem}); use a tuple, a frozenset "
                    "or a plain number instead"
                )


class KernelInterface(abc.ABC):
    """An op's call site: what every implementation of one step of the op must do.

    A subclass names the ``call_spec`` type the op builds for each call and declares an
    abstract ``forward`` whose parameters and docstring are the contract an implementation
    (in-tree or a backend's) is written against.
    """

    call_spec: ClassVar[type[CallSpec]]
    #: An implementation sets it True when ``forward`` takes the caller's tensors in their own
    #: shape (the rank and leading dimensions the caller gave) instead of the flattened form
    #: its interface documents, and returns results of that shape. The op then hands them over
    #: without views: each costs about a microsecond of host time, a third of a small CPU
    #: call's budget. Each interface states what its tensors' own shape is.
    takes_any_shape: ClassVar[bool] = False
    #: An implementation sets it True when ``forward`` reads the inputs its op declares
    #: ``row_views`` as row views (``tileops.core.row_views``: dense rows at a pitch, a slice of
    #: a wider tensor) as well as contiguous; every other one receives them contiguous, the op
    #: copying a row view first. Each interface says which of its tensors may come so.
    takes_row_views: ClassVar[bool] = False

    @abc.abstractmethod
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the kernel; each interface states its own arguments and results."""


class Kernel:
    """Base class of every implementation. Subclass it together with one kernel interface.

    Declarations, read by selection (the defaults are what a bare subclass gets):

    ``devices``
        Device types the class runs on. Default: ``{"cuda"}``.
    ``supported_archs``
        Architectures (``major * 10 + minor`` on CUDA, e.g. 90) the class runs on, checked
        against the call's device facts. Default ``None``: any architecture.
    ``refusal(call)``
        ``None`` when the class serves ``call``, else a reason a user can act on.
        Default: serves every call.
    ``general``
        True for a catch-all implementation: it ranks below every non-general one.
        Default: False.
    ``preferred_over``
        Keys this class beats wherever both serve a call; transitive. Default: none.

    Building: ``entry_for(call)`` (a class method) returns ``(identity, factory)``; the op
    builds one kernel per identity with ``factory()`` and reuses it for every call spec that
    maps to that identity.

    Tuning: ``config`` is the configuration the kernel runs with (None when it has none), and
    ``request_tune()`` asks it to tune itself on its next call.
    """

    devices: ClassVar[frozenset[str]] = frozenset({"cuda"})
    supported_archs: ClassVar[frozenset[int] | None] = None
    general: ClassVar[bool] = False
    preferred_over: ClassVar[frozenset[str]] = frozenset()

    def __init__(self) -> None:
        self.config: Any = None

    @classmethod
    def refusal(cls, call: CallSpec) -> str | None:
        return None

    @classmethod
    def entry_for(cls, call: CallSpec) -> tuple[Hashable, Callable[[], Kernel]]:
        raise NotImplementedError(f"{cls.__qualname__} must define the class method entry_for(call)")

    def request_tune(self) -> None:
        """Ask for tuning on the next call. Kernels without tunable parameters ignore it."""
