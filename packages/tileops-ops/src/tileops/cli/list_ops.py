"""``tileops ops``: every op, the implementations of each of its kernel interfaces (in-tree and
registered, with the distribution each comes from) and the targets that serve it whole."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from tileops.core import registry
from tileops.core.errors import TileOpsError
from tileops.core.kernel import Kernel, KernelInterface
from tileops.core.op import Op
from tileops.core.targets import registered_targets
from tileops.ops import FAMILIES

from .call_flags import op_class_named
from .output import columns, print_json
from .provenance import distribution_of


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "ops",
        description=(
            "List every op by family: for each kernel interface, every implementation key (in-tree "
            "or registered by a backend), the distribution it comes from and whether it is "
            "installed; and the targets whose kernel builder serves the whole op. Exits 1 when an "
            "op cannot be constructed (a registered implementation breaks its contract)."
        ),
    )
    parser.add_argument("ops", nargs="*", metavar="OP", help="op class names (default: every op)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.set_defaults(handler=run)


def describe_ops(names: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Every op, or the ones named (a UsageError for a name that is no op)."""
    wanted = {op_class_named(name) for name in names}
    return [
        describe_op(op_class, family)
        for family, op_classes in FAMILIES.items()
        for op_class in op_classes
        if not wanted or op_class in wanted
    ]


def describe_op(op_class: type[Op], family: str) -> dict[str, Any]:
    name = op_class.__name__
    described: dict[str, Any] = {
        "op": name,
        "family": family,
        "summary": None,
        "targets": registered_targets(name),
        "interfaces": [],
        "error": None,
    }
    try:
        entry = op_class.manifest_entry()
        described["summary"] = entry.summary
        # Construction is where the op checks and groups its implementations; any valid params
        # do, and the manifest's first workload has some.
        op = op_class(**entry.workloads[0].params)
    except TileOpsError as error:  # a manifest that does not load, or a broken registration
        described["error"] = f"{type(error).__name__}: {error}"
        return described
    registered = registry.kernel_types(name)
    for interface, implementations in op.implementations().items():
        described["interfaces"].append(
            {
                "interface": interface.__name__,
                "implementations": [
                    _describe_implementation(op_class, interface, key, cls, registered.get(key))
                    for key, cls in sorted(implementations.classes.items())
                ],
            }
        )
    return described


def _describe_implementation(
    op_class: type[Op],
    interface: type[KernelInterface],
    key: str,
    cls: type[Kernel],
    registration: registry.Registration | None,
) -> dict[str, Any]:
    missing_because = getattr(cls, "missing_because", None) or None
    if registration is not None:
        origin, module, qualname = "registered", cls.__module__, cls.__qualname__
    elif missing_because is None:
        origin, module, qualname = "in-tree", cls.__module__, cls.__qualname__
    else:
        # A kernel table whose module is not installed stands as one key, the module's name.
        module, qualname, origin = key, "KERNELS", "in-tree"
    return {
        "key": key,
        "origin": origin,
        "registered_by": registration.module if registration is not None else None,
        "class": f"{module}.{qualname}",
        "distribution": None if missing_because else distribution_of(module),
        "installed": missing_because is None,
        "missing_because": missing_because,
        "devices": sorted(cls.devices),
        "supported_archs": None if cls.supported_archs is None else sorted(cls.supported_archs),
        "general": cls.general,
        "preferred_over": sorted(cls.preferred_over),
    }


def run(args: argparse.Namespace) -> int:
    ops = describe_ops(args.ops)
    if args.json:
        print_json(ops)
    else:
        print("\n\n".join("\n".join(_text(op)) for op in ops))
    return 1 if any(op["error"] for op in ops) else 0


def _text(op: dict[str, Any]) -> list[str]:
    lines = [f"{op['op']} (family {op['family']})" + (f": {op['summary']}" if op["summary"] else "")]
    lines.append(f"  targets with a kernel builder: {', '.join(op['targets']) or 'none'}")
    if op["error"]:
        lines.append(f"  cannot be constructed: {op['error']}")
    for interface in op["interfaces"]:
        lines.append(f"  {interface['interface']}:")
        rows = [
            [impl["key"], _source(impl), ", ".join(impl["devices"]) or "-", _origin(impl), impl["class"]]
            for impl in interface["implementations"]
        ]
        lines.extend(columns(rows, indent="    "))
        lines.extend(
            f"    {impl['key']} is not installed: {impl['missing_because']}"
            for impl in interface["implementations"]
            if not impl["installed"]
        )
    return lines


def _origin(impl: dict[str, Any]) -> str:
    return impl["origin"] if impl["registered_by"] is None else f"registered by {impl['registered_by']}"


def _source(impl: dict[str, Any]) -> str:
    if not impl["installed"]:
        return "not installed"
    return impl["distribution"] or "no distribution"
