"""Targets: choosing which one serves an op instance, and what a target's builder is given.

A target is a backend's name for a set of kernels (a detector that claims devices, plus one
kernel builder per op). An op instance binds its target on its first call that runs an
implementation: ``target=`` at construction, else the process default, else the detectors
on the call's device; no claim means the in-tree implementations (``BUILTIN``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from . import registry
from .discovery import failed_backends_note, load_backends
from .errors import AmbiguousTargetError, BackendError, OpNotAvailableError, UnknownTargetError
from .registry import BUILTIN, describe_callable

_default: dict[str, str | None] = {"target": None}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """What a kernel builder knows of one input tensor: where it lives and its layout, no data."""

    device: torch.device
    dtype: torch.dtype
    shape: tuple[int, ...]

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(tensor.device, tensor.dtype, tuple(tensor.shape))


def check_target_name(target: Any, caller: str) -> str:
    """``target`` itself when it is BUILTIN or a registered target, else UnknownTargetError."""
    if target == BUILTIN:
        return BUILTIN
    if not isinstance(target, str):
        raise UnknownTargetError(f"{caller}: a target is named by a str, got {target!r}")
    load_backends()
    known = registry.all_targets()
    if target not in known:
        raise UnknownTargetError(
            f"{caller}: no backend registered target {target!r}; known targets: "
            f"{', '.join([BUILTIN, *known])}. Is the backend installed? `tileops backends` lists "
            "installed backends and the ones that failed to load." + failed_backends_note()
        )
    return target


def set_default_target(target: str | None) -> None:
    """Make ``target`` the process default for op instances constructed without ``target=``.

    ``None`` restores detection; ``BUILTIN`` forces the in-tree implementations. The default
    is read when an instance binds, on its first call that runs an implementation.
    """
    _default["target"] = None if target is None else check_target_name(target, "set_default_target")


def default_target() -> str | None:
    """The process default target, or None when targets are detected per device."""
    return _default["target"]


def registered_targets(op: str | None = None) -> list[str]:
    """Targets known in this process; with ``op``, those that registered a builder for it."""
    load_backends()
    return registry.targets_with_builder(op) if op is not None else registry.all_targets()


def choose_target(op: str, chosen_at_construction: str | None, device: torch.device) -> tuple[str, str]:
    """The target an instance of ``op`` binds for a call on ``device``, and why."""
    if chosen_at_construction is not None:
        return chosen_at_construction, f"target={chosen_at_construction!r} was given when the op was constructed"
    default = _default["target"]
    if default is not None:
        return default, f"set_default_target({default!r}) is the process default"
    claims = []
    for target, registration in sorted(registry.detectors().items()):
        detect = registration.value
        detector = f"the detector of target {target!r} ({describe_callable(detect)}, registered by {registration.registrant()})"
        try:
            claimed = detect(device)
        # A detector that calls sys.exit() is as faulty as one that raises, and must not end the program.
        except (Exception, SystemExit) as error:
            raise BackendError(
                f"{op}: {detector} raised {type(error).__name__}: {error} while inspecting {device}. "
                "This is a fault of that backend; report it to its authors, or uninstall it"
            ) from error
        # Truthiness would count "no", a tensor or a non-empty list as a claim: only a bool answers.
        if not isinstance(claimed, bool):
            raise BackendError(
                f"{op}: {detector} returned {_short_repr(claimed)} ({type(claimed).__name__}) for {device}; "
                "a detector returns True or False. This is a fault of that backend; report it to its "
                "authors, or uninstall it"
            )
        if claimed:
            claims.append(target)
    if not claims:
        return BUILTIN, f"no target's detector claims {device}, so the in-tree implementations serve it"
    if len(claims) > 1:
        raise AmbiguousTargetError(
            f"{op}: targets {', '.join(map(repr, claims))} all claim {device}. Choose one: pass "
            f"target=... when constructing the op, or call tileops.backend.set_default_target(...)"
            + failed_backends_note()
        )
    return claims[0], f"the detector of target {claims[0]!r} claims {device}"


def _short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def bind_target(op: str, chosen_at_construction: str | None, device: torch.device, *, has_own_kernels: bool) -> tuple[str, str]:
    """What a call of an ``op`` instance on ``device`` binds, and why: ``choose_target``, then
    the rule for a target without a builder for ``op`` — ``OpNotAvailableError`` when the op
    holds kernels of its own (never a fall back), else the op's own forward (``BUILTIN``)."""
    target, reason = choose_target(op, chosen_at_construction, device)
    if target == BUILTIN or registry.builder(op, target) is not None:
        return target, reason
    if has_own_kernels:
        serving = registry.targets_with_builder(op)
        raise OpNotAvailableError(
            f"{op}: target {target!r} is bound ({reason}) but registers no kernel builder for {op}, "
            f"and the op does not fall back to its in-tree implementations. Targets that serve {op}: "
            f"{', '.join(serving) or 'none'}; or pass target={BUILTIN!r} to use the in-tree implementations"
            + failed_backends_note()
        )
    return BUILTIN, f"{reason}; target {target!r} has no builder for {op}, which has no kernels to fall back from"
