"""``tileops explain``: what an op would do with a call, and why, without running anything.

It builds the op, checks the described call against the op's signature (on meta tensors, so
no memory is touched), says which target would bind on the call's device and why, and gives
every implementation's verdict for each kernel interface: the selection a call runs, in the
text its dispatch errors use. No GPU is needed: ``--arch`` states the device's facts instead
of reading them. The call is read from the manifest (``call_flags``: ``--shape``, ``--param``,
``--omit``); the call spec of each kernel interface is the op's own (``Op.call_specs``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from tileops.core import registry
from tileops.core.device_facts import DeviceFacts, facts_for, stated_facts, stating
from tileops.core.errors import BackendError, KernelSelectionError, TileOpsError
from tileops.core.kernel import CallSpec, KernelInterface
from tileops.core.manifest import DTYPES
from tileops.core.op import Op
from tileops.core.registry import BUILTIN, describe_callable
from tileops.core.targets import bind_target, check_target_name
from tileops.core.tensor_description import TensorDescription

from . import call_flags
from .call_flags import CallFlags
from .output import UsageError, device_argument, print_json, shape_argument
from .provenance import distribution_of


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "explain",
        description=(
            "Describe a call of OP (shape, dtype, device, params, which optional inputs it passes) and say "
            "which target would bind and why, then every implementation's verdict for each "
            "kernel interface (unavailable, refused, beaten or selected) with its reason. Nothing "
            "is run and no GPU is needed: --arch states the device's architecture."
        ),
        epilog="Exit status: 0 when the call would be served, 1 when it would raise, 2 for a bad command line.",
    )
    parser.add_argument("op", metavar="OP", help="the op's class name, as `tileops ops` lists it")
    parser.add_argument(
        "--shape",
        required=True,
        type=shape_argument,
        help="shape of the op's first input, e.g. 8x4096 or 8,4096; the other inputs' shapes follow from the manifest",
    )
    parser.add_argument(
        "--dtype", default="bfloat16", choices=list(DTYPES), help="dtype of the inputs (default: bfloat16)"
    )
    parser.add_argument(
        "--device",
        type=device_argument,
        help="the call's device (default: cuda when --arch is given or a GPU is present, else cpu)",
    )
    parser.add_argument(
        "--arch",
        type=int,
        help="state the device's architecture instead of reading it (on CUDA major*10+minor, e.g. 90), "
        "to explain a device this machine does not have",
    )
    parser.add_argument("--target", help="explain as if the op were constructed with target=TARGET")
    call_flags.add_arguments(parser)
    parser.add_argument(
        "--misaligned",
        action="store_true",
        help="every tensor starts one element into its storage, as a view such as buffer[1:] of a flat buffer "
        "(default: at the start of an allocation); on the CPU the call spec still says aligned=True, since CPU "
        "vector loads take any address",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    report = explain(args)
    if args.json:
        print_json(report)
    else:
        print("\n".join(_text(report)))
    return 0 if report["served"] else 1


def explain(args: argparse.Namespace) -> dict[str, Any]:
    op_class = call_flags.op_class_named(args.op)
    entry = op_class.manifest_entry()
    workload = CallFlags.of(args).workload(op_class, shape=args.shape)
    device = args.device or torch.device("cuda" if args.arch is not None or torch.cuda.is_available() else "cpu")
    dtype = DTYPES[args.dtype]
    report: dict[str, Any] = {
        "op": entry.name,
        "family": entry.family,
        "params": None,
        "call": {"device": str(device), "dtype": args.dtype, "inputs": None, "aligned": not args.misaligned},
        "rejected": None,
        "writes_nothing": False,
        "device_facts": None,
        "target": None,
        "interfaces": [],
        "served": False,
    }
    try:
        op = op_class(**workload.params)
        report["params"] = op.params
        shapes = dict(workload.shapes)
        report["call"]["inputs"] = shapes
        # The call's own checks, on meta tensors: the same errors as a call, for any size, free.
        bound = op_class.signature().bind(op.params, (), call_flags.meta_inputs(entry, shapes, dtype))
    except TileOpsError as error:
        report["rejected"] = f"{type(error).__name__}: {error}"
        return report
    if op_class.signature().writes_nothing(bound):
        report["writes_nothing"] = report["served"] = True
        return report

    facts, facts_note = _device_facts(device, args.arch)
    report["device_facts"] = {"facts": None if facts is None else dataclasses.asdict(facts), "note": facts_note}
    report["target"] = _target(op, args.target, device)
    # As a view one element into its storage: aligned to the element size only.
    address = dtype.itemsize if args.misaligned else 0
    described = {name: TensorDescription(device, dtype, tuple(shape), address) for name, shape in shapes.items()}
    try:
        call_specs = op.call_specs(device, described)
    except TileOpsError as error:
        raise UsageError(f"explain cannot describe the call: {error}") from None
    # Stated facts are what every rule reads, those a refusal reads from the device included.
    with stating(facts) if args.arch is not None else contextlib.nullcontext():
        report["interfaces"] = [
            _interface_verdicts(op, interface, call_spec, lambda _call: facts)
            for interface, call_spec in call_specs.items()
        ]
    target = report["target"]
    # A target other than builtin serves the whole call through its kernel builder.
    report["served"] = target["error"] is None and (
        target["name"] != BUILTIN or all(interface["selected"] for interface in report["interfaces"])
    )
    return report


def _device_facts(device: torch.device, arch: int | None) -> tuple[DeviceFacts | None, str]:
    """The facts selection reads for ``device``, or None when unknown; and where they come from."""
    if arch is not None:
        facts = stated_facts(device.type, arch)
        limit = "" if facts.shared_memory_per_block is None else f", {facts.shared_memory_per_block} bytes of shared memory per block"
        return facts, f"stated by --arch: {device.type} architecture {arch}{limit}"
    present = torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()
    if device.type == "cuda" and not present:
        return None, (
            f"unknown: {device} is not present on this machine, so implementations that declare "
            "supported_archs are unavailable below. Pass --arch (e.g. --arch 90 for Hopper) to explain "
            "the call as if on such a device"
        )
    try:
        facts = facts_for(device)
    except Exception as error:  # noqa: BLE001 - a backend's facts reader may need its device present
        return None, f"unknown: reading them raised {type(error).__name__}: {error}. Pass --arch to state them"
    if facts is None:
        return None, (
            f"unknown: no device facts are registered for device type {device.type!r}. Pass --arch to state them"
        )
    known = ", ".join(
        f"{name} {value}"
        for name, value in dataclasses.asdict(facts).items()
        if name != "device_type" and value not in (None, "")
    )
    return facts, f"read from {device}: {known}"


def _target(op: Op, requested: str | None, device: torch.device) -> dict[str, Any]:
    """The target a call on ``device`` binds, and why; or the error the call raises instead."""
    op_name = type(op).__name__
    try:
        chosen = None if requested is None else check_target_name(requested, "--target")
        target, reason = bind_target(op_name, chosen, device, has_own_kernels=op.has_own_kernels)
    except BackendError as error:
        return {"name": None, "reason": None, "builder": None, "error": f"{type(error).__name__}: {error}"}
    builder = registry.builder(op_name, target)
    return {
        "name": target,
        "reason": reason,
        "builder": None if builder is None else describe_callable(builder.value),
        "error": None,
    }


def _interface_verdicts(
    op: Op,
    interface: type[KernelInterface],
    call_spec: CallSpec,
    facts_source: Callable[[CallSpec], DeviceFacts | None],
) -> dict[str, Any]:
    implementations = op.implementations()[interface]
    try:
        selected, error = implementations.select(call_spec, facts_source), None
    except KernelSelectionError as raised:
        selected, error = None, f"KernelSelectionError: {raised}"
    registration = None if selected is None else registry.kernel_types(type(op).__name__).get(selected)
    return {
        "interface": interface.__name__,
        "call_spec": repr(call_spec),
        "selected": selected,
        # Who registered the selected key; None for an in-tree one.
        "selected_registered_by": None if registration is None else _registrant(registration),
        "error": error,
        "verdicts": [
            {"key": v.key, "outcome": v.outcome, "reason": v.reason, "text": str(v)}
            for v in implementations.verdicts(call_spec, facts_source)
        ],
    }


def _registrant(registration: registry.Registration) -> str:
    """The distribution that registered a kernel type, or its module where no installed one did."""
    backend = registration.backend
    distribution = backend.distribution if backend is not None else distribution_of(registration.module)
    return distribution or registration.module


def _text(report: dict[str, Any]) -> list[str]:
    params = report["params"]
    shown = ", ".join(f"{name}={value!r}" for name, value in params.items()) if params is not None else "..."
    lines = [f"{report['op']}({shown})"]
    call = report["call"]
    inputs = ", ".join(f"{name} {tuple(shape)}" for name, shape in (call["inputs"] or {}).items())
    alignment = "" if call["aligned"] else ", misaligned"
    lines.append(f"call:         {inputs or '-'}; {call['dtype']} on {call['device']}{alignment}")
    if report["rejected"]:
        lines.append(f"result:       the call raises {report['rejected']}")
        return lines
    if report["writes_nothing"]:
        lines.append(
            "result:       the call writes only empty tensors: it returns at once, no target binds and nothing runs"
        )
        return lines
    lines.append(f"device facts: {report['device_facts']['note']}")
    target = report["target"]
    if target["error"] is not None:
        lines.append(f"target:       {target['error']}")
    else:
        lines.append(f"target:       {target['name']} ({target['reason']})")
    if target["builder"] is not None:
        lines.append(
            f"              its kernel builder {target['builder']} serves every call; the implementations "
            "below serve only with --target builtin"
        )
    for interface in report["interfaces"]:
        lines.append("")
        if interface["selected"] is not None:
            lines.append(f"{interface['interface']}: {interface['selected']} serves {interface['call_spec']}")
            lines.extend(f"  - {v['text']}" for v in interface["verdicts"])
        else:
            # The selection error lists every verdict itself, as a failing call shows it.
            lines.append(interface["error"])
    lines.append("")
    if target["error"] is not None:
        lines.append("result:       the call raises the target's error above")
    elif target["name"] != BUILTIN:
        lines.append(f"result:       served by target {target['name']}")
    elif not report["interfaces"]:
        lines.append("result:       computed by the op's own torch code (it calls no kernel interface)")
    elif report["served"]:
        served = ", ".join(
            f"{i['interface']} by {i['selected']}"
            + (f" (registered by {i['selected_registered_by']})" if i["selected_registered_by"] else "")
            for i in report["interfaces"]
        )
        in_tree = not any(i["selected_registered_by"] for i in report["interfaces"])
        lines.append(f"result:       served {'in-tree' if in_tree else 'on the builtin target'}: {served}")
    else:
        lines.append("result:       the call raises KernelSelectionError (above)")
    return lines
