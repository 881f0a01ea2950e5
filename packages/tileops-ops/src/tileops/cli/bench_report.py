"""What ``tileops bench`` prints: its rows, the tables, the geometric means and the chart.

``tileops.cli.bench`` measures; this module only shows. A row holds one (op, workload, dtype) and,
with ``--backward``, one mode (``forward+backward`` or ``backward``): TileOPs' GPU time, torch
eager's and torch.compile's, one cell per peer (``tileops.cli.peers``), the bytes the call moves
and, for small shapes, call times.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
from typing import Any

from .peers import ABSENT, LOOP_NOTE, Cell, LoopTime, cell_text, ratio


@dataclasses.dataclass
class Row:
    op: str
    workload: str
    dtype: str
    shape: str
    served_by: str
    ours_us: float | None  # None: ours_error says why TileOPs has no time
    eager_us: float | None
    compile_us: float | None
    bytes: int
    ours_call_us: float | None = None
    eager_call_us: float | None = None
    peers: dict[str, Cell] = dataclasses.field(default_factory=dict)  # column -> cell
    ours_error: str | None = None
    mode: str = "forward"  # or, with --backward, "forward+backward" and "backward"
    #: forward+backward rows: side ("ours", "eager", "compile", a peer's column) -> MiB one
    #: training step allocates at its peak above what was allocated before it.
    peak_mib: dict[str, float] = dataclasses.field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        """The row as one flat record (CSV): each peer's cell as ``<column>_us``."""
        record = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("peers", "peak_mib")}
        record.update({f"{column}_us": cell for column, cell in self.peers.items()})
        record.update({f"{side}_peak_mib": mib for side, mib in self.peak_mib.items()})
        return record

    def tb_per_s(self, us: float | None) -> float | None:
        return None if not us else self.bytes / (us * 1e-6) / 1e12


def machine_line(facts: dict[str, str]) -> str:
    return (
        f"{facts['date']}; {facts['gpu']}, driver {facts['driver']}; torch {facts['torch']} "
        f"(CUDA {facts['torch_cuda']}); tilelang {facts['tilelang']}; Python {facts['python']}"
    )


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


#: How wide a peer's cell may be in the table; a longer text is cut there and given in full below.
PEER_CELL_WIDTH = 36


def peer_columns(rows: list[Row]) -> list[str]:
    """The peer columns that have a cell in some row: a peer of other ops (every family's peers
    are prepared for every op, a None where an op has no such peer) would be a column of dashes."""
    columns: list[str] = []
    for r in rows:
        columns += [column for column, cell in r.peers.items() if cell is not None and column not in columns]
    return columns


def table(rows: list[Row], copy_tb_s: float, method: str, *, calls: bool = True) -> str:
    """The rows as a text table under ``method``, the line saying how they were measured; a
    column per peer with its ratio (``<peer>/ours``), the call times where ``calls``, and under
    the table every peer cell that was cut and every error of TileOPs' side."""
    columns = peer_columns(rows)
    widths = {
        column: max([len(f"{column} µs"), *(len(cell_text(r.peers.get(column), PEER_CELL_WIDTH)) for r in rows)])
        for column in columns
    }
    header = (
        f"{'op':<23} {'workload':<19} {'dtype':<8} {'shape':<12} {'ours µs':>8} {'eager µs':>9} {'compile µs':>10} "
        + "".join(f"{column + ' µs':>{widths[column]}} " for column in columns)
        + f"{'TB/s':>5} {'%copy':>5} {'eager/ours':>10} {'compile/ours':>12} "
        + "".join(f"{column + '/ours':>{len(column) + 5}} " for column in columns)
        + (f"{'call µs ours/eager':>18} " if calls else "")
        + " served by"
    )
    lines, cut = [method, header], []
    for r in rows:
        bandwidth = r.tb_per_s(r.ours_us)
        ours = f"{r.ours_us:.2f}" if r.ours_us is not None else "error"
        line = (
            f"{r.op:<23} {r.workload:<19} {r.dtype:<8} {r.shape:<12} {ours:>8} {_fmt(r.eager_us, '.2f'):>9} "
            f"{_fmt(r.compile_us, '.2f'):>10} "
            + "".join(f"{cell_text(r.peers.get(column), PEER_CELL_WIDTH):>{widths[column]}} " for column in columns)
            + f"{_fmt(bandwidth, '.2f'):>5} {_fmt(bandwidth and 100 * bandwidth / copy_tb_s, '.0f'):>5} "
            f"{_fmt(_over(r.eager_us, r.ours_us), '.2f'):>10} {_fmt(_over(r.compile_us, r.ours_us), '.2f'):>12} "
            + "".join(f"{_fmt(ratio(r.peers.get(column), r.ours_us), '.2f'):>{len(column) + 5}} " for column in columns)
        )
        if calls:
            line += f"{'-' if r.ours_call_us is None else f'{r.ours_call_us:.1f}/{_fmt(r.eager_call_us)}':>18} "
        lines.append(line + f" {r.served_by}")
        where = f"{r.op} {r.workload} {r.dtype}"
        if r.ours_error:
            cut.append(f"{where}: TileOPs: {r.ours_error}")
        for column in columns:
            cell = r.peers.get(column)
            if isinstance(cell, str) and len(cell) > PEER_CELL_WIDTH:
                cut.append(f"{where}: {column}: {cell}")
    if any(isinstance(cell, LoopTime) for r in rows for cell in r.peers.values()):
        cut.append(LOOP_NOTE)
    return "\n".join(lines + cut)


def peak_memory(rows: list[Row]) -> str:
    """The peak memory of one training step per side, a line per forward+backward row that has
    any (the memory a fused op saves is the reason to use it, beside its time); empty where none."""
    lines = [
        f"{r.op} {r.workload} {r.dtype}: " + ", ".join(f"{side} {mib:.1f}" for side, mib in r.peak_mib.items())
        for r in rows
        if r.peak_mib
    ]
    if not lines:
        return ""
    return "\n".join(["peak memory of one training step, MiB allocated above its inputs:", *lines])


def _over(baseline: float | None, ours: float | None) -> float | None:
    return baseline / ours if baseline and ours else None


#: The comparisons summarised under a table: (name, baseline field, TileOPs field).
_COMPARISONS = (
    ("eager", "eager_us", "ours_us"),
    ("compile", "compile_us", "ours_us"),
    ("eager_call", "eager_call_us", "ours_call_us"),
)


def _geomean(ratios: list[float]) -> dict[str, float | int]:
    return {
        "ratio": math.exp(statistics.fmean(math.log(ratio) for ratio in ratios)),
        "workloads": len(ratios),
        "slower": sum(ratio < 1 for ratio in ratios),
    }


def geometric_means(rows: list[Row]) -> dict[str, dict[str, float | int]]:
    """Per comparison (GPU time against torch eager, torch.compile and each peer, call time
    against torch eager): the geomean of the baseline's time over ours (above 1: TileOPs
    is faster), over the rows that have both, with the count and the number of rows where ours
    is slower; for a peer also the rows where it is absent and where it refused the call."""
    means = {}
    for name, baseline, ours in _COMPARISONS:
        ratios = [getattr(r, baseline) / getattr(r, ours) for r in rows if getattr(r, baseline) and getattr(r, ours)]
        if ratios:
            means[name] = _geomean(ratios)
    for column in peer_columns(rows):
        cells = [r.peers.get(column) for r in rows]
        ratios = [x for x in (ratio(r.peers.get(column), r.ours_us) for r in rows) if x is not None]
        stats = _geomean(ratios) if ratios else {"ratio": None, "workloads": 0, "slower": 0}
        stats["absent"] = sum(isinstance(c, str) and c.startswith(ABSENT) for c in cells)
        stats["refused"] = sum(isinstance(c, str) and not c.startswith(ABSENT) for c in cells)
        means[f"peer:{column}"] = stats
    return means


def summary(means: dict[str, dict[str, float | int]]) -> str:
    def part(name: str, baseline: str) -> str:
        stats = means[name]
        return f"{stats['ratio']:.2f}x {baseline} over {stats['workloads']} workloads (TileOPs slower on {stats['slower']})"

    def peer(name: str) -> str:
        stats, column = means[name], name.removeprefix("peer:")
        timed = part(name, column) if stats["workloads"] else f"{column} timed on no workload"
        return f"{timed}; {column} absent on {stats['absent']}, refused or failed on {stats['refused']}"

    gpu = [part(name, baseline) for name, baseline in (("eager", "torch eager"), ("compile", "torch.compile")) if name in means]
    gpu += [peer(name) for name in means if name.startswith("peer:")]
    lines = ["geomean of GPU-time ratios: " + ("; ".join(gpu) if gpu else "no baseline ran")]
    if "eager_call" in means:
        lines.append("geomean of call-time ratios (small shapes, host included): " + part("eager_call", "torch eager"))
    return "\n".join(lines)


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
        relative = [value / row.ours_us if value and row.ours_us else 0 for row, value in zip(rows, values)]
        axis.bar([p + offset * 0.27 for p in positions], relative, width=0.27, label=name)
    axis.set_xticks([p + 0.27 for p in positions], labels, rotation=90, fontsize=6)
    axis.set_ylabel("time relative to TileOPs")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
