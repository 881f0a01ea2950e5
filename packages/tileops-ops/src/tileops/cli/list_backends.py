"""``tileops backends``: the installed backends (``tileops.backends`` entry points), what each
registered, and every backend that failed to load with its reason."""

from __future__ import annotations

import argparse
from typing import Any

from tileops.core import registry
from tileops.core.discovery import ENTRY_POINT_GROUP, LoadedBackend, load_failures, loaded_backends
from tileops.core.registry import describe_callable

from .output import columns, print_json
from .provenance import distribution_of


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "backends",
        help="list installed backends, what each registered, and the ones that failed to load",
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

    def record(kind: str, registrant: str, described: dict[str, Any]) -> None:
        registrations[_registrant_backend(registrant, backends)][kind].append({**described, "module": registrant})

    for target, registration in sorted(registry.detectors().items()):
        record("detectors", registration.module, {"target": target, "detector": describe_callable(registration.value)})
    for (op, target), registration in sorted(registry.all_builders().items()):
        record(
            "kernel_builders",
            registration.module,
            {"op": op, "target": target, "builder": describe_callable(registration.value)},
        )
    for op, keys in sorted(registry.all_kernel_types().items()):
        for key, registration in sorted(keys.items()):
            kernel_type = registration.value
            record(
                "kernel_types",
                registration.module,
                {"op": op, "key": key, "class": f"{kernel_type.__module__}.{kernel_type.__qualname__}"},
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
    return 1 if described["load_failures"] else 0


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
        lines.append(f"  {failure['name']} = {failure['value']}{distribution}: {failure['error']}")
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
    return columns(rows) or ["  (registered nothing)"]
