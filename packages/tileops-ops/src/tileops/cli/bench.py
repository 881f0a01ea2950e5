"""``tileops bench``: the manifest workloads on the current device, against torch.

``--shape 8192x7168`` times shapes of your own instead: the first input takes the shape and
the others follow from the manifest's shape patterns (``tileops.testing.workload_for_shape``);
with ``--workload W`` they follow from W: its params, and its sizes of the dimensions the first
input does not name.
``--param NAME=VALUE`` and ``--omit NAME`` change every timed call's params and inputs.
``--backward`` times training instead: forward+backward and backward alone, for the ops whose
manifest declares a backward (``tileops.cli.bench_training``). ``--sweep N --seed S`` times N calls
drawn from the shapes users have, as each family declares them, and reports the distribution of
the ratio to the best other side (``tileops.cli.sweep``).

Method (docs/performance.md): GPU time is measured by capturing ``CALLS`` back-to-back calls
in one CUDA graph after a warm-up and replaying it; the median over replays, divided by the
calls, is the time of one call. The same method times torch eager and torch.compile of the
entry's ``torch_api`` in the same run. Bandwidth is the roofline's bytes over GPU time,
reported against the device-to-device copy bandwidth measured in the same run. For small
shapes the host-inclusive call time of eager calls is reported too, TileOPs and torch eager
timed in turns (best of many short loops). L2 is not flushed. The peer libraries a family
declares (``tileops.cli.peers``; the ``bench`` extra installs them) are timed the same way,
each in its own column, which says ``absent`` or ``refused: reason`` where there is no time.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import io
import json
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F

from tileops.core.manifest.expressions import evaluate
from tileops.core.manifest import Workload
from tileops.core.timing import best_call_times_us
from tileops.core.timing import gpu_time_us as graph_replay_time_us
from tileops.ops import FAMILIES
from tileops.testing import workload_inputs

from . import call_flags
from .call_flags import CallFlags
from .output import UsageError, installed_version, shape_argument, without_markup
from .bench_report import Row, _chart, geometric_means, machine_line, peak_memory, summary, table
from .peers import LoopTime, Peers, time_cells

CALLS = 40
REPLAYS = 15
SMALL_SHAPE_BYTES = 4 << 20  # below this, report the host-inclusive call time too
CALLS_PER_LOOP = 100
CALL_LOOPS = 100
NO_CUDA = "tileops bench needs a CUDA device: the benchmarks time GPU kernels by CUDA-graph replay"


def gpu_time_us(fn: Callable[[], Any]) -> float:
    """Median GPU time of one call of ``fn``, by CUDA-graph replay (see the module docstring)."""
    return graph_replay_time_us(fn, calls=CALLS, replays=REPLAYS)


def peer_time_us(fn: Callable[[], Any]) -> float:
    """A peer's GPU time by CUDA-graph replay; for a peer that cannot be captured, the
    host-inclusive time of a call in loops of eager calls, as a ``LoopTime``."""
    try:
        return gpu_time_us(fn)
    except Exception:  # noqa: BLE001 - any capture failure; a call that cannot run at all raises below
        return LoopTime(best_call_times_us([fn], calls=CALLS, loops=REPLAYS, synchronize=torch.cuda.synchronize)[0])


def call_times_us(fns: list[Callable[[], Any]]) -> list[float]:
    """Host-inclusive time of one eager call of each of ``fns``, timed in turns (see
    ``tileops.core.timing.best_call_times_us``): the best of ``CALL_LOOPS`` loops of
    ``CALLS_PER_LOOP`` calls, each loop ended by a synchronisation."""
    return best_call_times_us(fns, calls=CALLS_PER_LOOP, loops=CALL_LOOPS, synchronize=torch.cuda.synchronize)


def copy_bandwidth_tb_s() -> float:
    """Device-to-device copy bandwidth: ``y.copy_(x)`` on 1 GiB of bf16, counting the read and
    the write. Timed with events around a loop of eager copies: a 1 GiB copy dwarfs a launch,
    and a copy captured in a graph runs as a memcpy node, which is slower than torch's kernel."""
    x = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        y.copy_(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return 2 * x.numel() * x.element_size() / statistics.median(times) / 1e12


def torch_baseline(entry, params: dict) -> Callable[..., Any] | None:
    """The entry's ``torch_api`` as a plain Python function of the inputs (so that
    torch.compile can trace it), or None where the entry gives none."""
    if entry.torch_code is None:
        return None
    names = [d.name for d in entry.inputs]
    source = f"lambda {', '.join(names)}: {entry.torch_api}"
    return eval(source, {"torch": torch, "F": F, **params})  # noqa: S307 - the validated manifest's own text


def _roofline_bytes(entry, inputs: dict, outputs: tuple, params: dict) -> int:
    namespace = {d.name: inputs.get(d.name) for d in entry.inputs}
    namespace.update({d.name: out for d, out in zip(entry.outputs, outputs)})
    namespace.update(params)
    return int(evaluate(entry.roofline["bytes"], namespace))


def bench_workload(
    op_class, workload: Workload, dtype: torch.dtype, *, with_compile: bool, tune: bool = False, others: Peers | None = None
) -> Row:
    entry = op_class.manifest_entry()
    op = op_class(**workload.params)
    inputs = workload_inputs(entry, workload, dtype, "cuda")
    # Inputs go by position, as users pass them and as the torch baselines take them (a
    # keyword call costs a few tenths of a microsecond more, which shows on decode shapes).
    arguments = [inputs.get(d.name) for d in entry.inputs]

    def ours_call():
        return op(*arguments)

    result = ours_call()
    if tune:
        op.request_tune()
        result = ours_call()
    outputs = result if isinstance(result, tuple) else (result,)
    ours = gpu_time_us(ours_call)
    eager = compiled_us = None
    baseline = torch_baseline(entry, op.params)
    if baseline is not None:

        def torch_eager():
            return baseline(*arguments)

        eager = gpu_time_us(torch_eager)
        if with_compile:
            torch._dynamo.reset()  # every workload's baseline is a fresh frame: no recompile limit
            compiled = torch.compile(baseline, dynamic=False)
            compiled_us = gpu_time_us(lambda: compiled(*arguments))
    row = Row(
        op=op_class.__name__,
        workload=workload.name,
        dtype=str(dtype).removeprefix("torch."),
        shape="x".join(str(d) for d in inputs[entry.inputs[0].name].shape),
        served_by=",".join(sorted({key for key, _ in op.built_kernels()})),
        ours_us=ours,
        eager_us=eager,
        compile_us=compiled_us,
        bytes=_roofline_bytes(entry, inputs, outputs, op.params),
    )
    if others is not None:
        with torch.no_grad():
            row.peers = time_cells(others.prepare(op_class.__name__, inputs, op.params), peer_time_us)
    if row.bytes <= SMALL_SHAPE_BYTES:
        if baseline is None:
            (row.ours_call_us,) = call_times_us([ours_call])
        else:
            row.ours_call_us, row.eager_call_us = call_times_us([ours_call, torch_eager])
    return row


def _cases(
    op_names: Iterable[str],
    workload_names: Iterable[str],
    dtypes: Iterable[str],
    shapes: Iterable[tuple] = (),
    flags: CallFlags | None = None,
    *,
    differentiable: bool = False,
):
    """The (op class, workload, dtype) triples to time: the manifest's workloads, or with
    ``shapes`` one workload per shape (and per named workload, the shape's template), each with
    ``flags``' params and omitted inputs (UsageError where an op name, a flag or a shape does
    not fit an op). With ``differentiable`` only the ops whose manifest declares a backward
    (UsageError where a named op declares none)."""
    flags = CallFlags() if flags is None else flags
    wanted_ops = {call_flags.op_class_named(name) for name in op_names}
    for op_class in wanted_ops:
        if differentiable and not _declares_backward(op_class):
            raise UsageError(f"{op_class.__name__} declares no backward in its manifest entry; --backward times differentiable ops")
    wanted_workloads, wanted_dtypes = set(workload_names), set(dtypes)
    for ops in FAMILIES.values():
        for op_class in ops:
            if (wanted_ops and op_class not in wanted_ops) or (differentiable and not _declares_backward(op_class)):
                continue
            entry = op_class.manifest_entry()
            if shapes and wanted_workloads:
                # Named after both, so that a table of several templates says which is which.
                workloads = [
                    dataclasses.replace(flags.workload(op_class, shape=shape, template=w),
                                        name=f"{w.name}-as-{'x'.join(map(str, shape)) or 'scalar'}")
                    for w in entry.workloads if w.name in wanted_workloads for shape in shapes
                ]
            elif shapes:
                workloads = [flags.workload(op_class, shape=shape) for shape in shapes]
            else:
                workloads = [
                    flags.workload(op_class, template=w)
                    for w in entry.workloads
                    if not wanted_workloads or w.name in wanted_workloads
                ]
            for workload in workloads:
                for dtype in workload.dtypes:
                    name = str(dtype).removeprefix("torch.")
                    if (wanted_dtypes and name in wanted_dtypes) or (not wanted_dtypes and dtype == workload.dtypes[0]):
                        call_flags.check_call(op_class, workload, dtype)
                        yield op_class, workload, dtype


def _declares_backward(op_class) -> bool:
    return getattr(op_class.manifest_entry(), "backward", None) is not None


def machine() -> dict[str, str]:
    """What a table's figures depend on besides the code: when, which GPU, which versions."""
    major, minor = torch.cuda.get_device_capability()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": f"{torch.cuda.get_device_name()} (sm_{major}{minor})",
        "driver": _driver_version(),
        "torch": torch.__version__,
        "torch_cuda": str(torch.version.cuda),
        "tilelang": installed_version("tilelang") or "not installed",
        "python": platform.python_version(),
    }


def _driver_version() -> str:
    """The NVIDIA driver's version as nvidia-smi reports it (torch does not expose it)."""
    try:
        result = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", f"--id={torch.cuda.current_device()}"],
            capture_output=True, text=True, timeout=30, check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return result.stdout.strip() or "unknown"


def method_line(copy_tb_s: float, *, calls: bool) -> str:
    """How a table's figures were measured (docs/performance.md)."""
    method = (
        f"copy bandwidth (1 GiB, same run): {copy_tb_s:.2f} TB/s; GPU time by CUDA-graph replay of {CALLS} calls, "
        f"median of {REPLAYS}; L2 not flushed"
    )
    if calls:
        method += f"; call time: best of {CALL_LOOPS} loops of {CALLS_PER_LOOP} calls, TileOPs and torch eager in turns"
    return method


def run(args) -> int:
    if args.sweep is not None or args.seed is not None or args.draws is not None:
        from .sweep import run as run_sweep

        return run_sweep(args)
    try:
        flags = CallFlags.of(args)
        cases = list(_cases(args.ops, args.workload or (), args.dtype or (), args.shape or (), flags, differentiable=args.backward))
    except UsageError as error:
        print(f"tileops bench: {error}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    if not cases:
        print("no workload matches the selection; `tileops ops` lists the ops", file=sys.stderr)
        return 2
    facts = machine()
    copy_tb_s = copy_bandwidth_tb_s()
    others = Peers()
    rows = []
    try:
        for index, (op_class, workload, dtype) in enumerate(cases, 1):
            print(f"\r[{index}/{len(cases)}] {op_class.__name__} {workload.name} ...".ljust(70), end="", file=sys.stderr, flush=True)
            options = {"with_compile": not args.no_compile, "tune": args.tune, "others": others}
            if args.backward:
                from .bench_training import bench_training

                rows += bench_training(op_class, workload, dtype, **options)
            else:
                rows.append(bench_workload(op_class, workload, dtype, **options))
    except KeyboardInterrupt:
        # A long run stopped by hand (or by a time limit's SIGINT) still reports what it measured.
        print(f"\ninterrupted: {len(rows)} rows of {len(cases)} workloads measured", file=sys.stderr)
        if not rows:
            return 130
    print(file=sys.stderr)
    modes = {r.mode: [s for s in rows if s.mode == r.mode] for r in rows}
    means = {mode: geometric_means(of_mode) for mode, of_mode in modes.items()}
    if args.json:
        report = {
            "machine": facts,
            "copy_tb_s": copy_tb_s,
            "rows": [dataclasses.asdict(r) for r in rows],
            "geomean": means if args.backward else means["forward"],
            "peers_absent": dict(others.absent),
        }
        print(json.dumps(report, indent=2))
    elif args.csv:
        records = [r.record() for r in rows]
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=list(dict.fromkeys(key for record in records for key in record)))
        writer.writeheader()
        writer.writerows(records)
        print(buffer.getvalue(), end="")
    else:
        print(machine_line(facts))
        for mode, of_mode in modes.items():
            if args.backward:
                print(f"\n{mode}:")
            print(table(of_mode, copy_tb_s, method_line(copy_tb_s, calls=not args.backward), calls=not args.backward))
            print(summary(means[mode]))
            memory = peak_memory(of_mode)
            if memory:
                print(memory)
        for note in others.notes():
            print(note)
    if args.png:
        _chart(rows, args.png)
    return 0


def register(commands) -> None:
    parser = commands.add_parser(
        "bench",
        description=without_markup(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(handler=run)


def add_arguments(parser) -> None:
    parser.add_argument("ops", nargs="*", help="op class names (default: every op)")
    parser.add_argument("--workload", action="append", help="only these manifest workloads (repeatable)")
    parser.add_argument(
        "--shape",
        action="append",
        type=shape_argument,
        help="time this shape of the first input instead, e.g. 8192x7168 (repeatable); the other inputs follow "
        "from the --workload named, if any",
    )
    call_flags.add_arguments(parser)
    parser.add_argument("--dtype", action="append", help="only these dtypes (default: each workload's first)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile (it compiles each workload)")
    parser.add_argument("--tune", action="store_true", help="tune each kernel's launch configuration before timing it")
    parser.add_argument(
        "--backward",
        action="store_true",
        help="time training instead: forward+backward and the backward alone, for the ops whose manifest declares a "
        "backward, against torch eager autograd, torch.compile and the peers",
    )
    from .sweep import add_arguments as add_sweep_arguments

    add_sweep_arguments(parser)
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print the results as JSON")
    output.add_argument("--csv", action="store_true", help="print the results as CSV")
    parser.add_argument("--png", metavar="PATH", help="also draw a chart of the ratios (needs matplotlib)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="tileops bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
