"""``tileops backends``: the installed backends (``tileops.backends`` entry points), what each
registered, and every backend that failed to load with its reason."""

from __future__ import annotations

import argparse
from typing import Any

from tileops.core import registry
from tileops.core.discovery import ENTRY_POINT_GROUP, LoadedBackend, load_failures, loaded_backends
from tileops.core.registry import Registration, describe_callable
from tileops.ops import FAMILIES

from .output import columns, print_json
from .provenance import distribution_of


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "backends",
        description=(
            f"List the installed backends (entry points of the group {ENTRY_POINT_GROUP!r}): the "
            "detectors, kernel builders and kernel types each registered, and every backend whose "
            "import failed, with its reason. Exits 1 when a backend failed to load."
        ),
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--verbose", "-v", action="store_true", help="print the traceback of each load failure")
    parser.set_defaults(handler=run)


def describe_backends() -> dict[str, Any]:
    backends = loaded_backends()
    # By backend name; None collects what code outside any backend registered.
    registrations: dict[str | None, dict[str, list]] = {
        name: {"detectors": [], "kernel_builders": [], "kernel_types": []}
        for name in [*(b.name for b in backends), None]
    }

    def record(kind: str, registration: Registration, described: dict[str, Any]) -> None:
        # The backend whose import made it, where discovery knows; else guessed from the module.
        made_by = registration.backend
        backend = made_by.name if made_by in backends else _registrant_backend(registration.module, backends)
        registrations[backend][kind].append({**described, "module": registration.module})

    for target, registration in sorted(registry.detectors().items()):
        record("detectors", registration, {"target": target, "detector": describe_callable(registration.value)})
    for (op, target), registration in sorted(registry.all_builders().items()):
        record(
            "kernel_builders",
            registration,
            {"op": op, "target": target, "builder": describe_callable(registration.value)},
        )
    problems = _kernel_type_problems()
    for op, keys in sorted(registry.all_kernel_types().items()):
        for key, registration in sorted(keys.items()):
            kernel_type = registration.value
            record(
                "kernel_types",
                registration,
                {
                    "op": op,
                    "key": key,
                    "class": f"{kernel_type.__module__}.{kernel_type.__qualname__}",
                    "problem": problems.get((op, key)),
                },
            )
    return {
        "backends": [
            {"name": b.name, "value": b.value, "distribution": b.distribution, **registrations[b.name]}
            for b in backends
        ],
        "registered_elsewhere": registrations[None],
        "load_failures": [
            {
                "name": failure.name,
                "value": failure.value,
                "distribution": failure.distribution,
                "error": f"{type(failure.error).__name__}: {failure.error}",
                "traceback": failure.traceback,
            }
            for failure in load_failures()
        ],
    }


def _kernel_type_problems() -> dict[tuple[str, str], str]:
    """(op, key) -> the contract error of each registered kernel type that makes its op's
    construction raise."""
    return {
        (op_class.__name__, key): problem
        for op_classes in FAMILIES.values()
        for op_class in op_classes
        for key, problem in op_class.registered_kernel_type_problems().items()
    }


def _registrant_backend(module: str, backends: list[LoadedBackend]) -> str | None:
    """The backend whose import made a registration from ``module``, or None for code that is
    no backend (a script, a test). The registry records the module, not the backend."""
    for backend in backends:
        package = backend.value.partition(":")[0]
        if module == package or module.startswith(package + "."):
            return backend.name
    # A backend may register from a sibling package of its entry point: its distribution ships both.
    distribution = distribution_of(module)
    for backend in backends:
        if distribution is not None and backend.distribution == distribution:
            return backend.name
    return None


def run(args: argparse.Namespace) -> int:
    described = describe_backends()
    if args.json:
        print_json(described)
    else:
        print("\n".join(_text(described, verbose=args.verbose)))
    broken = any(t["problem"] for b in [*described["backends"], described["registered_elsewhere"]] for t in b["kernel_types"])
    return 1 if described["load_failures"] or broken else 0


def _text(described: dict[str, Any], *, verbose: bool) -> list[str]:
    lines = []
    if not described["backends"]:
        lines.append(f"no backends are installed (entry point group {ENTRY_POINT_GROUP!r})")
    for backend in described["backends"]:
        distribution = backend["distribution"] or "unknown"
        lines.append(f"{backend['name']} = {backend['value']}  (distribution {distribution})")
        lines.extend(_registration_lines(backend))
    elsewhere = described["registered_elsewhere"]
    if any(elsewhere.values()):
        lines.append("registered by code outside any backend:")
        lines.extend(_registration_lines(elsewhere))
    failures = described["load_failures"]
    lines.append(f"load failures: {len(failures) or 'none'}")
    for failure in failures:
        distribution = f" (distribution {failure['distribution']})" if failure["distribution"] else ""
        # A nameless failure is a distribution whose entry points could not be read at all.
        declared = f"{failure['name']} = {failure['value']}" if failure["name"] else f"entry points unreadable: {failure['value']}"
        lines.append(f"  {declared}{distribution}: {failure['error']}")
        if verbose:
            lines.extend("    " + line for line in failure["traceback"].rstrip().splitlines())
    if failures and not verbose:
        lines.append("  (--verbose prints each traceback)")
    return lines


def _registration_lines(registrations: dict[str, list]) -> list[str]:
    rows = [["detector", f"target {d['target']}", d["detector"]] for d in registrations["detectors"]]
    rows += [
        ["kernel builder", f"{b['op']} on target {b['target']}", b["builder"]]
        for b in registrations["kernel_builders"]
    ]
    rows += [["kernel type", f"{t['op']} key {t['key']}", t["class"]] for t in registrations["kernel_types"]]
    problems = [f"    BROKEN {t['op']} key {t['key']}: {t['problem']}" for t in registrations["kernel_types"] if t["problem"]]
    return (columns(rows) or ["  (registered nothing)"]) + problems
