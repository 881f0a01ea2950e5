"""``tileops overhead``: what the op layer adds to a call on the hit path, on the CPU.

``RMSNormFwdOp`` is measured with one change: its in-tree implementation is one that returns a
preallocated tensor (a subclass holds it; nothing is registered), so the kernel costs next to
nothing; the op is then called in a loop against calling that implementation's ``forward``
directly, in the same run. The difference is the op layer of an in-tree call: the generated
signature checks, target and kernel lookup, and the op's own forward (reshaping, call-spec
fields).
"""

from __future__ import annotations

import argparse
import json

import torch

from tileops.backend import Kernel
from tileops.core.timing import best_call_times_us
from tileops.ops import RMSNormFwdOp
from tileops.ops.norm import RMSNormCall, RMSNormFwdInterface

BUDGET_US = 3.0
LOOPS = 200  # timed loops per side; the best one counts


class _Preallocated(Kernel, RMSNormFwdInterface):
    """Returns the same preallocated tensor for every call: a kernel that costs nothing."""

    devices = frozenset({"cpu"})
    takes_leading_dims = True  # as the in-tree implementations do

    def __init__(self, n: int) -> None:
        super().__init__()
        self.result = torch.empty(1, n)

    @classmethod
    def entry_for(cls, call: RMSNormCall):
        return call.n, lambda: cls(call.n)

    def forward(self, x, weight):
        return self.result


class _ProbedRMSNorm(RMSNormFwdOp):
    """``RMSNormFwdOp`` (same manifest entry, forward and call path) whose in-tree
    implementation is the probe."""

    in_tree_kernels = {RMSNormFwdInterface: {"overhead_probe": _Preallocated}}
    _custom_op = None  # never traced, so no custom op is defined for it

    @classmethod
    def manifest_entry(cls):
        return RMSNormFwdOp.manifest_entry()


def measure(calls: int = 1000, repeats: int = LOOPS) -> dict[str, float]:
    op = _ProbedRMSNorm(4096)
    x, weight = torch.randn(1, 4096), torch.randn(4096)
    op(x, weight)
    (key, kernel), = op.built_kernels()
    assert key == "overhead_probe", key
    op_us, kernel_us = best_call_times_us([lambda: op(x, weight), lambda: kernel.forward(x, weight)], calls=calls, loops=repeats)
    return {"op_us": op_us, "kernel_us": kernel_us, "overhead_us": op_us - kernel_us, "budget_us": BUDGET_US}


def run(args: argparse.Namespace) -> int:
    result = measure(args.calls)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"RMSNormFwdOp(4096) on a 1x4096 CPU tensor, kernel returning a preallocated tensor, best of {LOOPS} loops of {args.calls} calls, op and kernel interleaved")
        print(f"  op(x, weight)            {result['op_us']:7.2f} us/call")
        print(f"  kernel.forward(x, w)     {result['kernel_us']:7.2f} us/call")
        print(f"  op layer adds            {result['overhead_us']:7.2f} us/call   (budget {BUDGET_US:.1f} us)")
    return 0


def register(commands) -> None:
    parser = commands.add_parser("overhead", help="measure what the op layer adds per call (CPU, hit path)", description=__doc__)
    parser.add_argument("--calls", type=int, default=1000, help="calls per timed loop (default 1000)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.set_defaults(handler=run)
