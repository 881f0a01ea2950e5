"""``tileops check``: the manifest validator.

Without arguments it loads every manifest file ``tileops.ops`` ships, strictly, and checks
each op class against its entry: the constructor's params (names, order, defaults, keyword
use) and the family ``tileops.ops.FAMILIES`` lists it under; an entry no class implements is
a problem too, and so is a workload whose shapes, dtypes or params the entry's own signature
refuses, and a backend's registration (kernel type or kernel builder) for an op
name no class has, which would otherwise never be used and never be reported. With
``--manifest`` it validates the given files alone. The errors are the loader's own, naming the
file, the op and the field.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Iterable
from importlib.resources import files
from pathlib import Path
from typing import Any

import torch

from tileops.core import registry
from tileops.core.discovery import load_backends
from tileops.core.errors import TileOpsError
from tileops.core.manifest import OpEntry, Signature
from tileops.core.manifest import DTYPES, parse_manifest
from tileops.core.op import Op, constructor_mismatch
from tileops.ops import FAMILIES

from . import call_flags
from .call_flags import CallFlags
from .output import UsageError, print_json, shape_argument


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "check",
        description=(
            "Load every shipped manifest file strictly and check each op class against its "
            "entry; print one line per op and exit 1 on any problem. Naming OPs checks only "
            "those; --param, --omit, --shape and --dtype also check that the ops accept the call "
            "they describe (each manifest workload with those params and inputs, or the shapes "
            "given). With --manifest, validate those files instead (loading only: their entries "
            "are not checked against op classes)."
        ),
    )
    parser.add_argument("ops", nargs="*", metavar="OP", help="check only these ops (class names)")
    parser.add_argument(
        "--shape", action="append", type=shape_argument, help="check a call whose first input has this shape (repeatable)"
    )
    call_flags.add_arguments(parser)
    parser.add_argument("--dtype", action="append", choices=list(DTYPES), help="check calls in these dtypes (default: each workload's)")
    parser.add_argument(
        "--manifest",
        metavar="PATH",
        type=Path,
        nargs="+",
        action="extend",
        help="manifest files to validate instead of the shipped ones",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.set_defaults(handler=run)


def shipped_manifest_files() -> list[Any]:
    """The manifest files ``tileops.ops`` ships (``importlib.resources`` traversables)."""
    folder = files("tileops.ops") / "manifest"
    return sorted((f for f in folder.iterdir() if f.name.endswith(".yaml")), key=lambda f: f.name)


def _load(path: Any) -> tuple[dict[str, OpEntry], str | None]:
    """The validated entries of one file, or no entries and the error that stopped loading."""
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        return {}, f"{source}: cannot be read: {error}"
    except UnicodeDecodeError as error:
        return {}, f"{source}: is not UTF-8 text: {error}"
    try:
        return parse_manifest(text, source), None
    except TileOpsError as error:
        return {}, str(error)


def check_files(paths: Iterable[Any], *, against_op_classes: bool) -> dict[str, Any]:
    checked_files: list[dict[str, Any]] = []
    declared: list[OpEntry] = []
    for path in paths:
        file_entries, error = _load(path)
        checked_files.append({"file": str(path), "ops": sorted(file_entries), "error": error})
        declared.extend(file_entries.values())
    registrations: list[str] = []
    if against_op_classes:
        ops = _check_op_classes(declared)
        registrations = _registrations_for_unknown_ops(_class_names())
    else:
        ops = [_op_result(entry.name, entry.family, entry.source, _workload_problems(entry)) for entry in declared]
    return {
        "ok": not any(f["error"] for f in checked_files)
        and not any(op["problems"] for op in ops)
        and not registrations,
        "files": checked_files,
        "ops": ops,
        "registrations": registrations,
    }


def _class_names() -> set[str]:
    return {op_class.__name__ for op_classes in FAMILIES.values() for op_class in op_classes}


def _registrations_for_unknown_ops(op_names: set[str]) -> list[str]:
    """A problem for every installed backend's registration that names no op class."""
    load_backends()
    registered = [
        (op, f"kernel type {key!r}", registration.module)
        for op, keys in registry.all_kernel_types().items()
        for key, registration in keys.items()
    ]
    registered += [
        (op, f"kernel builder for target {target!r}", registration.module)
        for (op, target), registration in registry.all_builders().items()
    ]
    problems = []
    for op, what, module in sorted(registered):
        if op not in op_names:
            close = difflib.get_close_matches(op, op_names, n=1)
            hint = f"; the closest op name is {close[0]!r}" if close else f"; the ops are {', '.join(sorted(op_names))}"
            problems.append(f"{module} registered a {what} for {op!r}, which no op class is called{hint}")
    return problems


def _op_result(op: str, family: str, file: str, problems: list[str]) -> dict[str, Any]:
    return {"op": op, "family": family, "file": file, "problems": problems}


def _check_op_classes(declared: list[OpEntry]) -> list[dict[str, Any]]:
    ops = [
        _op_result(op_class.__name__, family, str(op_class.manifest_file), _problems(op_class, family))
        for family, op_classes in FAMILIES.items()
        for op_class in op_classes
    ]
    implemented = {op["op"] for op in ops}
    ops.extend(
        _op_result(
            entry.name,
            entry.family,
            entry.source,
            [f"{entry.source} declares {entry.name}, but tileops.ops.FAMILIES lists no op class of that name"],
        )
        for entry in declared
        if entry.name not in implemented
    )
    return ops


def _problems(op_class: type[Op], family: str) -> list[str]:
    try:
        problems = constructor_mismatch(op_class)
        declared_family = op_class.manifest_entry().family
    except TileOpsError as error:  # its manifest file does not load, or holds no entry for it
        return [str(error)]
    problems.extend(_workload_problems(op_class.manifest_entry()))
    # A backend's kernel type that breaks its contract makes every construction of the op raise.
    problems.extend(op_class.registered_kernel_type_problems().values())
    if declared_family != family:
        problems.append(
            f"tileops.ops.FAMILIES lists {op_class.__name__} under {family!r}, its manifest entry "
            f"says family {declared_family!r}"
        )
    return problems


def _workload_problems(entry: OpEntry) -> list[str]:
    """Every workload the entry's signature refuses, with the signature's own error. The
    tensors are shapes only (the meta device; CPU where an input is declared on the CPU)."""
    signature = Signature(entry)
    problems = []
    for workload in entry.workloads:
        try:
            params = signature.bind_params(workload.params)
            for dtype in workload.dtypes:
                tensors = {
                    name: torch.empty(shape, dtype=entry.input(name).dtype_in(dtype), device="cpu" if entry.input(name).cpu else "meta")
                    for name, shape in workload.shapes.items()
                }
                signature.bind(params, (), tensors)
        except TileOpsError as error:
            problems.append(f"workload {workload.name!r}: {error}")
    return problems


def run(args: argparse.Namespace) -> int:
    flags = CallFlags.of(args)
    describes_calls = bool(flags.params or flags.omitted or args.shape or args.dtype)
    if args.manifest:
        if args.ops or describes_calls:
            raise UsageError("--manifest validates files; OP, --param, --omit, --shape and --dtype check the shipped ops")
        result = check_files(args.manifest, against_op_classes=False)
    else:
        named = {call_flags.op_class_named(name).__name__ for name in args.ops}
        result = check_files(shipped_manifest_files(), against_op_classes=True)
        if named:
            result["ops"] = [op for op in result["ops"] if op["op"] in named]
        if describes_calls:
            for op in result["ops"]:
                op["problems"] += _call_problems(call_flags.op_class_named(op["op"]), flags, args.shape, args.dtype)
        result["ok"] = not any(f["error"] for f in result["files"]) and not any(op["problems"] for op in result["ops"])
        result["ok"] = result["ok"] and not result["registrations"]
    if args.json:
        print_json(result)
    else:
        print("\n".join(_text(result)))
    return 0 if result["ok"] else 1


def _call_problems(op_class: type[Op], flags: CallFlags, shapes: list | None, dtypes: list | None) -> list[str]:
    """Why ``op_class`` would refuse the calls the flags describe: each manifest workload with
    the flags' params and inputs, or one call per shape; in each dtype asked for, else each
    workload's own."""
    try:
        workloads = (
            [flags.workload(op_class, shape=shape) for shape in shapes]
            if shapes
            else [flags.workload(op_class, template=w) for w in op_class.manifest_entry().workloads]
        )
    except UsageError as error:
        return [str(error)]
    problems = []
    for workload in workloads:
        for dtype in [DTYPES[name] for name in dtypes] if dtypes else workload.dtypes:
            try:
                call_flags.check_call(op_class, workload, dtype)
            except UsageError as error:
                problems.append(f"{str(dtype).removeprefix('torch.')}: {error}")
    return problems


def _text(result: dict[str, Any]) -> list[str]:
    lines = [f"FAIL  {f['error']}" for f in result["files"] if f["error"]]
    lines += [f"FAIL  {problem}" for problem in result["registrations"]]
    for op in result["ops"]:
        if op["problems"]:
            lines.append(f"FAIL  {op['op']}: {'; '.join(op['problems'])}")
        else:
            lines.append(f"OK    {op['op']} ({Path(op['file']).name})")
    failed_ops = sum(1 for op in result["ops"] if op["problems"])
    failed_files = sum(1 for f in result["files"] if f["error"])
    lines.append(
        f"{len(result['files'])} manifest file(s), {len(result['ops'])} op(s): "
        + (
            "all OK"
            if result["ok"]
            else f"{failed_files} file(s) do not load, {failed_ops} op(s) have problems, "
            f"{len(result['registrations'])} registration(s) name no op"
        )
    )
    return lines
