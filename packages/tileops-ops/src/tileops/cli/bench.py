"""``tileops bench``: the manifest workloads on the current device, against torch.

``--shape 8192x7168`` times shapes of your own instead: the first input takes the shape and
the others follow from the manifest's shape patterns (``tileops.testing.workload_for_shape``).
``--param NAME=VALUE`` and ``--omit NAME`` change every timed call's params and inputs.

Method (docs/performance.md): GPU time is measured by capturing ``CALLS`` back-to-back calls
in one CUDA graph after a warm-up and replaying it; the median over replays, divided by the
calls, is the time of one call. The same method times torch eager and torch.compile of the
entry's ``torch_api`` in the same run. Bandwidth is the roofline's bytes over GPU time,
reported against the device-to-device copy bandwidth measured in the same run. For small
shapes the host-inclusive call time of eager calls is reported too, TileOPs and torch eager
timed in turns (best of many short loops). L2 is not flushed.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import io
import json
import math
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F

from tileops.core.manifest.expressions import evaluate
from tileops.core.manifest.loader import Workload
from tileops.core.timing import best_call_times_us
from tileops.core.timing import gpu_time_us as graph_replay_time_us
from tileops.ops import FAMILIES
from tileops.testing import workload_inputs

from . import call_flags
from .call_flags import CallFlags
from .output import UsageError, installed_version, shape_argument, without_markup

CALLS = 40
REPLAYS = 15
SMALL_SHAPE_BYTES = 4 << 20  # below this, report the host-inclusive call time too
CALLS_PER_LOOP = 100
CALL_LOOPS = 100


@dataclasses.dataclass
class Row:
    op: str
    workload: str
    dtype: str
    shape: str
    served_by: str
    ours_us: float
    eager_us: float | None
    compile_us: float | None
    bytes: int
    ours_call_us: float | None = None
    eager_call_us: float | None = None

    def tb_per_s(self, us: float | None) -> float | None:
        return None if not us else self.bytes / (us * 1e-6) / 1e12


def gpu_time_us(fn: Callable[[], Any]) -> float:
    """Median GPU time of one call of ``fn``, by CUDA-graph replay (see the module docstring)."""
    return graph_replay_time_us(fn, calls=CALLS, replays=REPLAYS)


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


def bench_workload(op_class, workload: Workload, dtype: torch.dtype, *, with_compile: bool, tune: bool = False) -> Row:
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
):
    """The (op class, workload, dtype) triples to time: the manifest's workloads, or with
    ``shapes`` one workload per shape, each with ``flags``' params and omitted inputs
    (UsageError where an op name, a flag or a shape does not fit an op)."""
    flags = CallFlags() if flags is None else flags
    wanted_ops = {call_flags.op_class_named(name) for name in op_names}
    wanted_workloads, wanted_dtypes = set(workload_names), set(dtypes)
    for ops in FAMILIES.values():
        for op_class in ops:
            if wanted_ops and op_class not in wanted_ops:
                continue
            entry = op_class.manifest_entry()
            if shapes:
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


def machine_line(facts: dict[str, str]) -> str:
    return (
        f"{facts['date']}; {facts['gpu']}, driver {facts['driver']}; torch {facts['torch']} "
        f"(CUDA {facts['torch_cuda']}); tilelang {facts['tilelang']}; Python {facts['python']}"
    )


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[Row], copy_tb_s: float) -> str:
    header = (
        f"{'op':<23} {'workload':<19} {'dtype':<8} {'shape':<12} {'ours µs':>8} {'eager µs':>9} "
        f"{'compile µs':>10} {'TB/s':>5} {'%copy':>5} {'eager/ours':>10} {'compile/ours':>12} "
        f"{'call µs ours/eager':>18}  served by"
    )
    method = (
        f"copy bandwidth (1 GiB, same run): {copy_tb_s:.2f} TB/s; GPU time by CUDA-graph replay of {CALLS} calls, "
        f"median of {REPLAYS}; L2 not flushed; call time: best of {CALL_LOOPS} loops of {CALLS_PER_LOOP} calls, "
        "TileOPs and torch eager in turns"
    )
    lines = [method, header]
    for r in rows:
        bandwidth = r.tb_per_s(r.ours_us)
        calls = "-" if r.ours_call_us is None else f"{r.ours_call_us:.1f}/{_fmt(r.eager_call_us)}"
        lines.append(
            f"{r.op:<23} {r.workload:<19} {r.dtype:<8} {r.shape:<12} {r.ours_us:>8.2f} {_fmt(r.eager_us, '.2f'):>9} "
            f"{_fmt(r.compile_us, '.2f'):>10} {_fmt(bandwidth, '.2f'):>5} {_fmt(bandwidth and 100 * bandwidth / copy_tb_s, '.0f'):>5} "
            f"{_fmt(r.eager_us and r.eager_us / r.ours_us, '.2f'):>10} {_fmt(r.compile_us and r.compile_us / r.ours_us, '.2f'):>12} "
            f"{calls:>18}  {r.served_by}"
        )
    return "\n".join(lines)


#: The comparisons summarised under a table: (name, baseline field, TileOPs field).
_COMPARISONS = (
    ("eager", "eager_us", "ours_us"),
    ("compile", "compile_us", "ours_us"),
    ("eager_call", "eager_call_us", "ours_call_us"),
)


def geometric_means(rows: list[Row]) -> dict[str, dict[str, float | int]]:
    """Per comparison (GPU time against torch eager and torch.compile, call time against torch
    eager): the geometric mean of the baseline's time over ours (above 1: TileOPs is faster),
    over the rows that have both, with the count and the number of rows where ours is slower."""
    means = {}
    for name, baseline, ours in _COMPARISONS:
        ratios = [getattr(r, baseline) / getattr(r, ours) for r in rows if getattr(r, baseline) and getattr(r, ours)]
        if ratios:
            means[name] = {
                "ratio": math.exp(statistics.fmean(math.log(ratio) for ratio in ratios)),
                "workloads": len(ratios),
                "slower": sum(ratio < 1 for ratio in ratios),
            }
    return means


def summary(means: dict[str, dict[str, float | int]]) -> str:
    def part(name: str, baseline: str) -> str:
        mean = means[name]
        return f"{mean['ratio']:.2f}x {baseline} over {mean['workloads']} workloads (TileOPs slower on {mean['slower']})"

    gpu = [part(name, baseline) for name, baseline in (("eager", "torch eager"), ("compile", "torch.compile")) if name in means]
    lines = ["geometric mean of GPU-time ratios: " + ("; ".join(gpu) if gpu else "no baseline ran")]
    if "eager_call" in means:
        lines.append("geometric mean of call-time ratios (small shapes, host included): " + part("eager_call", "torch eager"))
    return "\n".join(lines)


def run(args) -> int:
    if args.shape and args.workload:
        print("tileops bench: --shape and --workload select different workloads; give one of them", file=sys.stderr)
        return 2
    try:
        cases = list(_cases(args.ops, args.workload or (), args.dtype or (), args.shape or (), CallFlags.of(args)))
    except UsageError as error:
        print(f"tileops bench: {error}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("tileops bench needs a CUDA device: the benchmarks time GPU kernels by CUDA-graph replay", file=sys.stderr)
        return 2
    if not cases:
        print("no workload matches the selection; `tileops ops` lists the ops", file=sys.stderr)
        return 2
    facts = machine()
    copy_tb_s = copy_bandwidth_tb_s()
    rows = []
    for index, (op_class, workload, dtype) in enumerate(cases, 1):
        print(f"\r[{index}/{len(cases)}] {op_class.__name__} {workload.name} ...".ljust(70), end="", file=sys.stderr, flush=True)
        rows.append(bench_workload(op_class, workload, dtype, with_compile=not args.no_compile, tune=args.tune))
    print(file=sys.stderr)
    means = geometric_means(rows)
    if args.json:
        report = {"machine": facts, "copy_tb_s": copy_tb_s, "rows": [dataclasses.asdict(r) for r in rows], "geomean": means}
        print(json.dumps(report, indent=2))
    elif args.csv:
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=[f.name for f in dataclasses.fields(Row)])
        writer.writeheader()
        writer.writerows(dataclasses.asdict(r) for r in rows)
        print(buffer.getvalue(), end="")
    else:
        print(machine_line(facts))
        print(table(rows, copy_tb_s))
        print(summary(means))
    if args.png:
        _chart(rows, args.png)
    return 0


def _chart(rows: list[Row], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--png needs matplotlib (pip install matplotlib); the table above is complete without it", file=sys.stderr)
        return
    labels = [f"{r.op.removesuffix('FwdOp')}\n{r.shape}" for r in rows]
    figure, axis = plt.subplots(figsize=(max(8, len(rows) * 0.6), 4))
    positions = range(len(rows))
    for offset, (name, values) in enumerate(
        [
            ("TileOPs", [r.ours_us for r in rows]),
            ("torch eager", [r.eager_us for r in rows]),
            ("torch.compile", [r.compile_us for r in rows]),
        ]
    ):
        relative = [value / row.ours_us if value else 0 for row, value in zip(rows, values)]
        axis.bar([p + offset * 0.27 for p in positions], relative, width=0.27, label=name)
    axis.set_xticks([p + 0.27 for p in positions], labels, rotation=90, fontsize=6)
    axis.set_ylabel("time relative to TileOPs")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


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
        help="time this shape of the first input instead, e.g. 8192x7168 (repeatable)",
    )
    call_flags.add_arguments(parser)
    parser.add_argument("--dtype", action="append", help="only these dtypes (default: each workload's first)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile (it compiles each workload)")
    parser.add_argument("--tune", action="store_true", help="tune each kernel's launch configuration before timing it")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print the results as JSON")
    output.add_argument("--csv", action="store_true", help="print the results as CSV")
    parser.add_argument("--png", metavar="PATH", help="also draw a chart of the ratios (needs matplotlib)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="tileops bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
