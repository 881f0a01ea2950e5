"""Argument parsing for the ``tileops`` command, and its ``demo`` subcommand.

Each other subcommand lives in its own module, which adds its parser (``register``) and
handles it: ``ops`` (list_ops), ``backends`` (list_backends), ``explain``, ``check``,
``bench`` and ``overhead``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from . import bench, call_flags, check, explain, list_backends, list_ops, overhead
from .call_flags import CallFlags
from .output import UsageError, installed_version, shape_argument


def _version() -> str:
    return installed_version("tileops-ops") or "from a source tree (tileops-ops is not installed)"


def _best_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _demo(args: argparse.Namespace) -> int:
    """Run every op (or the named ones) once on the best device present and print what served
    each call."""
    from tileops.backend import load_failures, registered_targets
    from tileops.ops import FAMILIES
    from tileops.testing import workload_inputs

    device = torch.device(args.device) if args.device else _best_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    wanted = {call_flags.op_class_named(name) for name in args.ops}
    flags = CallFlags.of(args)
    calls = {
        family: [(op_class, flags.workload(op_class, shape=args.shape)) for op_class in ops if not wanted or op_class in wanted]
        for family, ops in FAMILIES.items()
    }
    # Every call is checked before any runs: a flag that does not fit an op stops the demo at once.
    for op_class, workload in (call for described in calls.values() for call in described):
        call_flags.check_call(op_class, workload, dtype)
    print(f"TileOPs {_version()} on {device} (torch {torch.__version__})")
    print(f"targets registered: {', '.join(registered_targets()) or 'none'}")
    for failure in load_failures():
        print(f"backend failed to load: {failure}")
    for family, described in calls.items():
        if not described:
            continue
        print(f"\n{family} (each op on {'--shape' if args.shape else 'its first manifest workload'}):")
        for op_class, workload in described:
            entry = op_class.manifest_entry()
            op = op_class(**workload.params)
            inputs = workload_inputs(entry, workload, dtype, device)
            op(**inputs)
            served = ", ".join(sorted({key for key, _ in op.built_kernels()})) or "-"
            first = entry.inputs[0].name
            print(
                f"  {op_class.__name__:<24} {workload.name:<10} {first}{tuple(inputs[first].shape)} "
                f"{str(dtype).removeprefix('torch.')}  target={op.target}  served by {served}"
            )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tileops",
        description="TileOPs: PyTorch operators with TileLang kernels and pluggable backends.",
    )
    parser.add_argument("--version", action="version", version=f"tileops {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser("demo", help="run every op once and print what served each call")
    demo.add_argument("ops", nargs="*", metavar="OP", help="op class names (default: every op)")
    demo.add_argument("--device", help="device to run on (default: cuda if present, else cpu)")
    demo.add_argument(
        "--shape", type=shape_argument, help="shape of each op's first input (default: its first manifest workload's)"
    )
    call_flags.add_arguments(demo)
    demo.set_defaults(handler=_demo)
    for command in (list_ops, list_backends, explain, check, bench, overhead):
        command.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.handler(args)
    except UsageError as error:
        print(f"tileops {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
