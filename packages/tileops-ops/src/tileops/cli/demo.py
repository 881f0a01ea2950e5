"""``tileops demo``: run every op (or the named ones) once on the best device here, and print
which target and kernel served each call, how far its results are from the manifest's
reference (``ref_api``, within the entry's ``tolerance``), and what each target registered is;
then, on the whole tour, a small transformers model as built and as patched
(``tileops.integrations.transformers.side_by_side``)."""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch

from tileops.core import registry
from tileops.core.discovery import load_backends, load_failures
from tileops.ops import FAMILIES
from tileops.core.manifest import OpEntry
from tileops.testing import reference_outputs, smallest_workload, workload_inputs

from . import call_flags
from .call_flags import CallFlags
from .output import UsageError, device_argument, print_json, shape_argument, version
from .peers import describe
from .provenance import distribution_of


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "demo",
        description=(
            "Run every op (or the ones named) once on the best device present and print which target "
            "and kernel served each call, and its largest error against the manifest's reference."
        ),
        epilog=(
            "Exit status: 0 when every call ran and matched its reference within the manifest's tolerance, "
            "1 when a result did not (or the model part failed or gave results that are not finite), 2 for a bad command line "
            "(such as a device this machine lacks)."
        ),
    )
    parser.add_argument("ops", nargs="*", metavar="OP", help="op class names (default: every op)")
    parser.add_argument(
        "--device", type=device_argument, help="device to run on (default: cuda if a GPU is present, else cpu)"
    )
    parser.add_argument(
        "--shape", type=shape_argument, help="shape of each op's first input (default: its smallest manifest workload's)"
    )
    call_flags.add_arguments(parser)
    parser.add_argument(
        "--no-model",
        action="store_true",
        help="leave out the model part (run when no op or --shape is named: a small transformers model, "
        "as built and patched by tileops.integrations.transformers, timed side by side)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.set_defaults(handler=run)


def usable_device(device: torch.device | None) -> torch.device:
    """``device``, or the best one present when None; a UsageError for one the ops cannot run on here."""
    if device is None:
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "meta":
        raise UsageError(
            "--device meta: meta tensors hold no data, so no op can run on them; choose cpu or cuda "
            "(`tileops explain OP --shape ... --device meta` describes a call without running it)"
        )
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UsageError(f"--device {device}: no CUDA GPU is present on this machine; run on the CPU with --device cpu")
        if (device.index or 0) >= count:
            raise UsageError(f"--device {device}: this machine has {count} CUDA GPU(s), numbered from 0")
        return device
    try:
        torch.empty(0, device=device)
    except (RuntimeError, NotImplementedError) as error:  # torch's own reason, such as a backend not built in
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UsageError(f"--device {device}: torch cannot allocate on it here ({reason})") from None
    return device


def describe_targets(device: torch.device) -> list[dict[str, Any]]:
    """Each registered target: who registered it and whether it claims ``device``."""
    load_backends()
    described = []
    detectors = registry.detectors()
    for target in registry.all_targets():
        detector = detectors.get(target)
        claims: bool | None = None
        if detector is not None:
            try:
                claims = bool(detector.value(device))
            except Exception:  # noqa: BLE001 - a raising detector is the backend's fault; the calls below report it
                claims = None
        registration = detector or next(r for (_, t), r in registry.all_builders().items() if t == target)
        backend = registration.backend  # None where the module was imported before discovery ran
        described.append(
            {
                "target": target,
                "distribution": backend.distribution if backend is not None else distribution_of(registration.module),
                "module": registration.module,
                "claims_device": claims,
            }
        )
    return described


def _target_text(target: dict[str, Any], device: torch.device) -> str:
    source = target["distribution"] or target["module"]
    if target["claims_device"] is None:
        where = "its own devices"
    else:
        where = f"its own devices; it {'claims' if target['claims_device'] else 'does not claim'} {device}"
    return f"{target['target']} (a backend's target, from {source}: serves whole ops on {where})"


def reference_error(
    entry: OpEntry,
    dtype: torch.dtype,
    results: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
) -> dict[str, Any]:
    """How far ``results`` (each output, and each input the op writes, by name) are from the
    reference's ``expected`` values: the largest absolute difference, the output or written input
    where it is, the manifest's tolerance for ``dtype``, and whether every element is within it
    (``|result - reference| <= atol + rtol * |reference|``, equal infinities agreeing, as the
    conformance checks compare)."""
    atol, rtol = entry.tolerance[dtype]
    worst, where, within = 0.0, None, True
    for name, want in expected.items():
        got = results[name]
        if got is None or want is None:  # an absent output: both must be
            within = within and got is want
            continue
        if got.shape != want.shape or want.numel() == 0:
            within = within and got.shape == want.shape
            continue
        got, want = got.detach().float(), want.detach().float().to(got.device)
        # Equal infinities (the log-sum-exp of a row that sees no key is -inf) differ by nothing.
        difference = torch.where(got == want, 0.0, (got - want).abs())
        error = float(difference.max())
        if where is None or error > worst or math.isnan(error):  # a NaN stays the worst
            worst, where = error, name
        within = within and bool((difference <= atol + rtol * want.abs()).all())
    return {"max_error": worst, "where": where, "atol": atol, "rtol": rtol, "within_tolerance": within}


def _served_by(op_class: type, keys: list[str]) -> str:
    """What computed a call: the keys of the implementations it ran, or the op's own torch code
    for an op that calls no kernel interface."""
    if not op_class.kernel_interfaces:
        return "its own torch code"
    return ", ".join(keys) or "-"


def _error_text(error: dict[str, Any], outputs: int) -> str:
    where = f" ({error['where']})" if outputs > 1 and error["where"] else ""
    verdict = "within" if error["within_tolerance"] else "OUTSIDE"
    return f"max error {error['max_error']:.2g}{where}, {verdict} tolerance (atol {error['atol']:g}, rtol {error['rtol']:g})"


def run(args: argparse.Namespace) -> int:
    device = usable_device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    wanted = {call_flags.op_class_named(name) for name in args.ops}
    flags = CallFlags.of(args)
    calls = [
        (family, op_class, flags.workload(op_class, shape=args.shape, template=smallest_workload(op_class)))
        for family, ops in FAMILIES.items()
        for op_class in ops
        if not wanted or op_class in wanted
    ]
    # Every call is checked before any runs: a flag that does not fit an op stops the demo at once.
    for _, op_class, workload in calls:
        call_flags.check_call(op_class, workload, dtype)
    targets = describe_targets(device)
    report: dict[str, Any] = {
        "tileops": version(),
        "torch": torch.__version__,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "targets": targets,
        "load_failures": [str(failure) for failure in load_failures()],
        "calls": [],
    }
    if not args.json:
        print(f"TileOPs {report['tileops']} on {device} (torch {report['torch']})")
        print(f"targets registered: {'; '.join(_target_text(t, device) for t in targets) or 'none'}")
        for failure in report["load_failures"]:
            print(f"backend failed to load: {failure}")
    family_shown = None
    for family, op_class, workload in calls:
        entry = op_class.manifest_entry()
        op = op_class(**workload.params)
        inputs = workload_inputs(entry, workload, dtype, device)
        # The reference runs on clones, before the op, which may write its inputs.
        reference, reference_written = reference_outputs(entry, inputs, op.params)
        result = op(**inputs)
        outputs = result if isinstance(result, tuple) else (result,)
        error = reference_error(
            entry,
            dtype,
            {**{d.name: t for d, t in zip(entry.outputs, outputs)}, **{name: inputs[name] for name in reference_written}},
            {**{d.name: t for d, t in zip(entry.outputs, reference)}, **reference_written},
        )
        call = {
            "op": op_class.__name__,
            "family": family,
            "workload": workload.name,
            "inputs": {name: list(tensor.shape) for name, tensor in inputs.items()},
            "target": op.target,
            "served_by": sorted({key for key, _ in op.built_kernels()}),
            "reference_error": error,
        }
        report["calls"].append(call)
        if args.json:
            continue
        if family != family_shown:
            family_shown = family
            print(f"\n{family} (each op on {'--shape' if args.shape else 'its smallest manifest workload'}):")
        first = entry.inputs[0].name
        print(
            f"  {call['op']:<24} {workload.name:<10} {first}{tuple(inputs[first].shape)} "
            f"{report['dtype']}  target={op.target}  served by {_served_by(op_class, call['served_by'])}  "
            f"{_error_text(error, len(entry.outputs) + len(reference_written))}"
        )
    outside = [call["op"] for call in report["calls"] if not call["reference_error"]["within_tolerance"]]
    model_failed = False
    if not (args.ops or args.shape or args.no_model):
        from tileops.integrations.transformers import side_by_side

        try:
            report["model"] = side_by_side.compare(device, dtype)
        except Exception as error:  # noqa: BLE001 - any failure of the model part is reported, not raised
            report["model"] = {"failed": describe(error)}
        model_failed = "failed" in report["model"] or not report["model"].get("finite", True)
        if not args.json:
            print("\n" + side_by_side.describe(report["model"], device, dtype))
    if args.json:
        print_json(report)
    elif outside:
        print(f"\n{len(outside)} call(s) outside the manifest's tolerance: {', '.join(outside)}")
    return 1 if outside or model_failed else 0
