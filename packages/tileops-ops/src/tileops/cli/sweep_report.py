"""What ``tileops bench --sweep`` prints: the per-call table, and the distribution of the ratio of
the best other side's GPU time to TileOPs' (above 1: TileOPs is faster) per op and overall,
and over two groups of calls that are slow for their own reasons (inputs passed as row views;
decode-sized calls of at most ``DECODE_ROWS`` rows, all launch and latency), with the worst calls.

The best other side of a call is the fastest of those that have a time on it: torch eager,
torch.compile and each peer (``tileops.cli.peers``). A side without a time is left out of that
call's comparison and counted: ``absent`` (its library does not import here), ``refused`` (it
cannot take the call, or failed on it) or ``not run`` (``--no-compile``, or no such peer for the
op). A call where TileOPs has no time, or no other side has one, is counted and has no ratio.
Quantiles interpolate linearly between the sorted ratios (the 5th percentile of 200 calls lies
between the 10th and 11th lowest).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import statistics
from typing import Any

from . import bench
from .bench_report import Row, geometric_means, machine_line, summary, table
from .peers import ABSENT, Peers

#: How many of the slowest calls a report lists.
WORST = 10
#: How far behind the best other side a call may be before it counts as clearly behind.
BEHIND = 0.97
#: Calls of at most this many rows form the decode group: a serving engine's decode steps, whose
#: GPU time is a few microseconds of launch and latency rather than bandwidth.
DECODE_ROWS = 64


def sides(row: Row) -> dict[str, Any]:
    """Every other side's cell on ``row``: torch eager, torch.compile, then each peer."""
    return {"eager": row.eager_us, "compile": row.compile_us, **row.peers}


def best(row: Row) -> tuple[str, float] | None:
    """The fastest other side that has a time on ``row``, and its time."""
    timed = [(us, side) for side, us in sides(row).items() if isinstance(us, float) and us > 0]
    if not timed:
        return None
    us, side = min(timed)
    return side, us


def ratio_to_best(row: Row) -> float | None:
    """The best other side's GPU time over TileOPs' (above 1: TileOPs is faster)."""
    fastest = best(row)
    return fastest[1] / row.ours_us if fastest and row.ours_us else None


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values``, interpolating linearly between the sorted values."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def geomean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(value) for value in values))


def distribution(rows: list[Row]) -> dict[str, Any]:
    """The ratios of ``rows`` that have one: how many, min, 5th percentile, median, geomean, how
    many are below 1 and below ``BEHIND``, and which side was the best how often."""
    ratios = [r for r in map(ratio_to_best, rows) if r is not None]
    winners: dict[str, int] = {}
    for row in rows:
        fastest = best(row)
        if fastest and row.ours_us:
            winners[fastest[0]] = winners.get(fastest[0], 0) + 1
    if not ratios:
        return {"calls": 0}
    return {
        "calls": len(ratios),
        "min": min(ratios),
        "p5": quantile(ratios, 0.05),
        "median": quantile(ratios, 0.5),
        "geomean": geomean(ratios),
        "behind": sum(r < 1 for r in ratios),
        "behind_3pct": sum(r < BEHIND for r in ratios),
        "best_side": dict(sorted(winners.items(), key=lambda item: -item[1])),
    }


def excluded(rows: list[Row]) -> dict[str, Any]:
    """What has no time: calls where TileOPs failed, calls no other side ran, and per side the
    calls where it was absent, refused (or failed) or not run."""
    counts: dict[str, dict[str, int]] = {}
    for row in rows:
        for side, cell in sides(row).items():
            if isinstance(cell, float):
                continue
            kind = "not run" if cell is None else "absent" if cell.startswith(ABSENT) else "refused"
            side_counts = counts.setdefault(side, {"absent": 0, "refused": 0, "not run": 0})
            side_counts[kind] += 1
    return {
        "ours_failed": sum(row.ours_us is None for row in rows),
        "no_other_side": sum(best(row) is None for row in rows),
        "sides": counts,
    }


def worst(rows: list[Row], count: int = WORST) -> list[Row]:
    """The ``count`` rows with the lowest ratio, lowest first (ties in table order)."""
    ranked = [(ratio, index) for index, ratio in enumerate(map(ratio_to_best, rows)) if ratio is not None]
    return [rows[index] for _, index in sorted(ranked)[:count]]


def groups(calls) -> dict[str, set[str]]:
    """The groups of calls the distribution is also given for, by name: each a set of calls'
    labels (their rows' ``workload``). A group no call falls in is left out."""
    named = {
        "strided inputs": {call.workload.name for call in calls if call.strided},
        f"at most {DECODE_ROWS} rows": {call.workload.name for call in calls if call.rows <= DECODE_ROWS},
    }
    return {name: labels for name, labels in named.items() if labels}


def summarise(rows: list[Row], grouped: dict[str, set[str]] | None = None) -> dict[str, dict[str, Any]]:
    """Per mode (``forward``, or with ``--backward`` ``forward+backward`` and ``backward``): the
    distribution over all calls, per op and per group of ``grouped`` (``groups``), what was
    excluded, and the worst calls."""
    modes = list(dict.fromkeys(row.mode for row in rows))
    result = {}
    for mode in modes:
        of_mode = [row for row in rows if row.mode == mode]
        ops = list(dict.fromkeys(row.op for row in of_mode))
        of_group = {name: distribution([r for r in of_mode if r.workload in labels]) for name, labels in (grouped or {}).items()}
        result[mode] = {
            "ratio_to_best": {
                "all": distribution(of_mode), **{op: distribution([r for r in of_mode if r.op == op]) for op in ops}, **of_group,
            },
            "excluded": excluded(of_mode),
            "worst": [_worst_record(row) for row in worst(of_mode)],
        }
    return result


def _worst_record(row: Row) -> dict[str, Any]:
    side, us = best(row)
    return {"call": row.workload, "op": row.op, "shape": row.shape, "dtype": row.dtype, "ours_us": row.ours_us,
            "best_side": side, "best_us": us, "ratio": us / row.ours_us}


def _stats_line(name: str, stats: dict[str, Any]) -> str:
    if not stats["calls"]:
        return f"  {name:<24} no call with a ratio"
    winners = ", ".join(f"{side} {n}" for side, n in stats["best_side"].items())
    return (
        f"  {name:<24} {stats['calls']:>5} {stats['min']:>6.2f} {stats['p5']:>6.2f} {stats['median']:>6.2f} "
        f"{stats['geomean']:>7.2f} {stats['behind']:>6} {stats['behind_3pct']:>6}   {winners}"
    )


def text(summary_of_modes: dict[str, dict[str, Any]]) -> str:
    """The distributions, the exclusions and the worst calls, as lines under the table."""
    lines = []
    for mode, part in summary_of_modes.items():
        lines += [
            f"\n{mode}: ratio of the best other side's GPU time to TileOPs' (above 1: TileOPs is faster)",
            f"  {'':<24} {'calls':>5} {'min':>6} {'p5':>6} {'median':>6} {'geomean':>7} {'<1':>6} {'<0.97':>6}   best side (calls)",
        ]
        lines += [_stats_line(name, stats) for name, stats in part["ratio_to_best"].items()]
        left_out = part["excluded"]
        counted = [
            f"{side} {', '.join(f'{kind} on {n}' for kind, n in kinds.items() if n)}" for side, kinds in left_out["sides"].items()
        ]
        lines.append(
            f"  left out: TileOPs failed on {left_out['ours_failed']}, no other side ran on {left_out['no_other_side']}"
            + "".join(f"; {entry}" for entry in counted)
        )
        lines.append(f"  worst {len(part['worst'])} calls:")
        lines += [
            f"    {w['call']:<28} {w['op']:<24} {w['shape']:<18} {w['dtype']:<9} ours {w['ours_us']:.2f} µs, "
            f"{w['best_side']} {w['best_us']:.2f} µs: {w['ratio']:.2f}"
            for w in part["worst"]
        ]
    return "\n".join(lines)


def _records(rows: list[Row], calls) -> list[dict[str, Any]]:
    by_label = {call.workload.name: call for call in calls}
    records = []
    for row in rows:
        record = row.record()
        call = by_label.get(row.workload)
        fastest = best(row)
        record.update(
            strided=",".join(call.strided) if call else "",
            omitted=",".join(call.omitted) if call else "",
            best_side=fastest[0] if fastest else None,
            best_us=fastest[1] if fastest else None,
            ratio_to_best=ratio_to_best(row),
        )
        records.append(record)
    return records


def report(
    rows: list[Row], calls, *, seed: int, drawn: int, facts: dict[str, str], copy_tb_s: float, others: Peers,
    form: str = "text", calls_timed: bool = True,
) -> str:
    """The whole report in ``form``: ``text`` (the table per mode, the bench's geomeans, the
    distribution lines), ``json`` or ``csv`` (one record per row, with its best side and ratio)."""
    described = summarise(rows, groups(calls))
    if form == "json":
        return json.dumps(
            {
                "machine": facts,
                "copy_tb_s": copy_tb_s,
                "sweep": {"seed": seed, "drawn": drawn, "calls": [call.record() for call in calls]},
                "rows": [dataclasses.asdict(row) for row in rows],
                "summary": described,
                "geomean": {mode: geometric_means([r for r in rows if r.mode == mode]) for mode in described},
                "peers_absent": dict(others.absent),
            },
            indent=2,
        ) + "\n"
    if form == "csv":
        records = _records(rows, calls)
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=list(dict.fromkeys(key for record in records for key in record)))
        writer.writeheader()
        writer.writerows(records)
        return buffer.getvalue()
    lines = [machine_line(facts), f"sweep: seed {seed}, {len(calls)} of {drawn} drawn calls"]
    for mode in described:
        of_mode = [row for row in rows if row.mode == mode]
        lines += [f"\n{mode}:", table(of_mode, copy_tb_s, bench.method_line(copy_tb_s, calls=calls_timed), calls=calls_timed)]
        lines.append(summary(geometric_means(of_mode)))
    lines.append(
        "\nworkload: the draw's number; 'strided' where inputs are row views of a wider tensor; "
        "'no-<input>' for each optional input left out"
    )
    lines.append(text(described))
    lines += others.notes()
    return "\n".join(lines) + "\n"
