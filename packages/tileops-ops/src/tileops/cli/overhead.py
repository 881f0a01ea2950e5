"""``tileops overhead``: what the op layer adds to a call on the hit path, on the CPU.

The op (by default the first one ``tileops ops`` lists) is measured on its first manifest
workload of at most ``MAX_ELEMENTS`` input elements (else its smallest), its inputs contiguous
(as the hit path takes them), with one change: each
of its in-tree CPU implementations is replaced by a subclass whose ``forward`` returns the
result it computed on the first call (a subclass of the op holds them; nothing is registered),
so the kernel costs next to nothing. The op is then called in a loop against calling those
implementations' ``forward`` directly with the arguments the op passed them, in the same run.
The difference is the op layer of an in-tree call: the generated signature checks, target and
kernel lookup, and the op's own forward (reshaping, call-spec fields).

In the same run, in loops of their own, the op itself, with its real CPU implementation, is
timed against the torch function it stands for (the manifest's ``torch_api``) on the same
inputs: what a user pays for calling the op instead of torch on the CPU.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from tileops.core.kernel import Kernel, KernelInterface
from tileops.core.manifest import OpEntry
from tileops.core.manifest.expressions import FUNCTIONS
from tileops.core.op import Op
from tileops.core.timing import best_call_times_us
from tileops.testing import smallest_workload, workload_elements, workload_inputs

from . import call_flags
from .output import UsageError

BUDGET_US = 3.0
LOOPS = 200  # timed loops per side; the best one counts
PROBE_KEY = "overhead_probe"
#: The real op and torch compute on the CPU in every timed call: on a prefill-sized first
#: workload the run took hours. The op layer's cost does not depend on the size.
MAX_ELEMENTS = 1 << 16
#: A timed loop of the real op lasts about this long at most: its calls per loop are fewer than
#: ``calls`` for ops whose smallest workload is still slow to compute on the CPU (millions of
#: elements); the op layer's sides always take ``calls``.
MAX_LOOP_SECONDS = 0.005
MIN_CALLS = 10


def _probe_of(implementation: type[Kernel]) -> type[Kernel]:
    """``implementation`` (a CPU implementation), answering every call after the first with the
    first call's result, and keeping the arguments it was given."""

    class Probe(implementation):
        result = arguments = None

        def forward(self, *args):
            if self.arguments is None:
                self.arguments, self.result = args, super().forward(*args)
            return self.result

    Probe.__qualname__ = f"Probe[{implementation.__qualname__}]"
    return Probe


def probed(op_class: type[Op]) -> type[Op]:
    """``op_class`` (same manifest entry, forward and call path) whose in-tree implementation
    of each interface is a probe of its CPU implementation."""
    probes: dict[type[KernelInterface], dict[str, type[Kernel]]] = {}
    for index, interface in enumerate(op_class.kernel_interfaces):
        # The CPU implementations live with the ops, in ``in_tree_kernels``; the kernel tables
        # of other distributions need not be imported to find them.
        cpu = [cls for cls in op_class.in_tree_kernels.get(interface, {}).values() if "cpu" in cls.devices]
        if not cpu:
            raise UsageError(f"{op_class.__name__} has no in-tree CPU implementation of {interface.__name__} to probe")
        probes[interface] = {f"{PROBE_KEY}{index or ''}": _probe_of(cpu[0])}
    # Named apart from the op, so that no backend's registration for the op applies to it.
    return type(
        f"_Probed{op_class.__name__}",
        (op_class,),
        {
            "in_tree_kernels": probes,
            "kernel_tables": (),
            "_custom_op": None,  # never traced, so no custom op is defined for it
            "manifest_entry": classmethod(lambda cls: op_class.manifest_entry()),
        },
    )


def _torch_function(entry: OpEntry, params: dict):
    """The manifest's ``torch_api`` as a function of the op's inputs, the params bound: timed as
    a user calls torch, not through an expression evaluated per call."""
    if entry.torch_api is None:
        return None
    names = ", ".join(decl.name for decl in entry.inputs)
    namespace = {"__builtins__": {}, **FUNCTIONS, "torch": torch, "F": F, **params}
    # The expression passed the manifest loader's checks (no builtins, no unsafe attributes).
    return eval(f"lambda {names}: ({entry.torch_api})", namespace)  # noqa: S307


def measure(op_name: str | None = None, calls: int = 1000, repeats: int = LOOPS) -> dict[str, float]:
    op_class = call_flags.op_class_named(op_name) if op_name else next(iter(call_flags.op_classes().values()))
    if not op_class.kernel_interfaces:
        raise UsageError(
            f"{op_class.__name__} holds no kernels: its forward is its own torch code, with no kernel to tell the op "
            "layer apart from"
        )
    entry = op_class.manifest_entry()
    small = [w for w in entry.workloads if workload_elements(w) <= MAX_ELEMENTS]
    workload = small[0] if small else smallest_workload(op_class)
    # float32 where the workload has it: the CPU's own type, as the CPU implementations compute.
    dtype = torch.float32 if torch.float32 in workload.dtypes else workload.dtypes[0]
    # Contiguous, as the hit path takes them: a derived input may come as a view (of a transposed
    # output), which the reference bind would copy on every call.
    inputs = {name: t.contiguous() for name, t in workload_inputs(entry, workload, dtype, "cpu").items()}
    arguments = [inputs.get(d.name) for d in entry.inputs]
    op = probed(op_class)(**workload.params)
    op(*arguments)
    built = op.built_kernels()
    if len(built) != 1:
        raise UsageError(f"{op_class.__name__}: overhead measures calls that run one kernel; this one ran {len(built)}")
    ((key, kernel),) = built
    assert key == PROBE_KEY, key
    kernel_arguments = kernel.arguments
    real = op_class(**workload.params, target="builtin")
    torch_function = _torch_function(entry, real.params)
    # The op layer: the probed op against its kernel alone, neither computing anything.
    op_us, kernel_us = best_call_times_us(
        [lambda: op(*arguments), lambda: kernel.forward(*kernel_arguments)], calls=calls, loops=repeats
    )
    # The real op against torch, in a run of their own: with fewer calls per loop where one
    # computes for long, and apart from the op layer's sides, whose calls would otherwise start
    # with caches the computation emptied.
    sides = [lambda: real(*arguments)]
    if torch_function is not None:
        sides.append(lambda: torch_function(*arguments))
    real(*arguments)  # its first call builds its kernel
    started = time.perf_counter()
    real(*arguments)
    torch_calls = min(calls, max(MIN_CALLS, int(MAX_LOOP_SECONDS / (time.perf_counter() - started))))
    times = best_call_times_us(sides, calls=torch_calls, loops=repeats)
    real_us = times[0]
    torch_us = times[1] if torch_function is not None else None
    return {
        "op": f"{op_class.__name__}({', '.join(f'{k}={v!r}' for k, v in op.params.items())}) on {workload.name}: "
        + ", ".join(f"{name} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for name, t in inputs.items()),
        "calls": calls,
        "torch_calls": torch_calls,
        "op_us": op_us,
        "kernel_us": kernel_us,
        "overhead_us": op_us - kernel_us,
        "budget_us": BUDGET_US,
        "real_op_us": real_us,
        "torch_us": torch_us,
        "over_torch_us": None if torch_us is None else real_us - torch_us,
        "torch_api": entry.torch_api,
    }


def run(args: argparse.Namespace) -> int:
    result = measure(args.op, args.calls)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{result['op']} ({result['calls']} calls per loop, best of {LOOPS} loops, op and kernel interleaved; "
            "the kernel returns a result computed once)"
        )
        print(f"  op(...)                  {result['op_us']:7.2f} us/call")
        print(f"  kernel.forward(...)      {result['kernel_us']:7.2f} us/call")
        print(f"  op layer adds            {result['overhead_us']:7.2f} us/call   (budget {BUDGET_US:.1f} us)")
        if result["torch_us"] is not None:
            print(
                f"the op with its CPU implementation against the torch it stands for, {result['torch_api']} "
                f"({result['torch_calls']} calls per loop, the two in turns):"
            )
            print(f"  op(...)                  {result['real_op_us']:7.2f} us/call")
            print(f"  torch                    {result['torch_us']:7.2f} us/call")
            print(f"  op costs more by         {result['over_torch_us']:7.2f} us/call   (budget {BUDGET_US:.1f} us)")
    return 0


def register(commands) -> None:
    parser = commands.add_parser(
        "overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("op", nargs="?", metavar="OP", help="the op's class name (default: the first op listed)")
    parser.add_argument(
        "--calls", type=int, default=1000,
        help="calls per timed loop (default 1000; the real op and torch take fewer where one call computes for long)",
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.set_defaults(handler=run)
