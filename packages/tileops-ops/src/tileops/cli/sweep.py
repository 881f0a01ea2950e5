"""``tileops bench --sweep N --seed S``: N calls drawn from the shapes users have, each timed as
``tileops bench`` times a workload, and the distribution of the ratio to the best other side.

What the calls look like is the family's to say, in ``SWEEP`` of its ``command_line`` module
(``tileops.ops.<family>.command_line``); nothing here knows a family, an op, an input or a param
by name. ``SWEEP`` is a dict:

- ``widths``: {size: odds}, the first input's last dimension; the op's first manifest workload
  (or one of its ``templates``, below) is the template that binds the params and the other
  inputs' shapes from the first input's shape (``tileops.testing.workload_for_shape``).
- ``rows``: {"low", "high", "decode", "decode_share"}: how many rows (the product of the leading
  dimensions): for a ``decode_share`` of the calls log-uniform integers in [1, decode], for
  the others log-uniform in [low, high]; a call is capped at ``max_bytes`` of first input
  (default ``MAX_BYTES``) by drawing its rows below the cap.
- ``ranks``: {rank: odds}; the rows are spread over rank - 1 leading dimensions at random.
- ``dtypes``: {dtype name: odds}.
- ``strided``: {"share": fraction of the calls, "inputs": names}: those inputs are passed as row
  views, the first half of each row of a tensor twice as wide (the table's ``strided``; a call
  of one row is not strided, its view being contiguous).
- ``ops``: {op class name: {"widths": (as above, instead of the family's), "omit": {tuple of
  optional inputs left out: odds}, "params": {param: {value: odds}}, "width_params": {param:
  divisor}, "templates": {manifest workload name: odds}, "trailing": count}}: a param of
  ``width_params`` is the drawn width divided by its divisor (the packed activations' ``d``, half
  of x's last dimension); the op's widths must be multiples of it. An op with ``templates``
  draws no width: each call takes one of those workloads as its template, keeps the last
  ``trailing`` dimensions of its first input (and every dimension the first input does not
  name, and its params) and draws the rows before them: for ops whose other inputs have sizes
  of their own that only a whole workload gives together.

Every choice from a small set (the op; then per op the dtype, the rank, the template, the inputs
left out, each param, strided or not) is allocated: each value gets its share of the draws by its odds,
rounded by the largest remainder, in a shuffled order, so that 200 draws cover every value;
widths and rows are drawn at random. The same seed, N and selection (op names, ``--dtype``,
``--backward``) draw the same calls: configuration rules must be fitted on one seed's calls and
reported on another's, so that the sweep judges rules on shapes that did not shape them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import math
import random
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from tileops.core.errors import TileOpsError
from tileops.core.manifest import DTYPES, Workload
from tileops.ops import FAMILIES
from tileops.testing import workload_for_shape, workload_inputs

from . import bench, bench_training, call_flags
from .bench_report import Row, _chart
from .call_flags import CallFlags
from .output import UsageError
from .peers import Peers, describe

DEFAULT_CALLS = 200
DEFAULT_SEED = 0
#: The most bytes a drawn call's first input may hold, unless the family says otherwise: every
#: side's buffers fit in GPU memory and the whole sweep in a few minutes.
MAX_BYTES = 256 << 20
#: Threads that build the drawn calls' kernels before the timing (``build_kernels``).
BUILD_WORKERS = 16


@dataclasses.dataclass(frozen=True)
class Space:
    """What one op's calls are drawn from: its family's ``SWEEP``, with the op's own entry."""

    op_class: type
    widths: Mapping[int, float]
    rows: Mapping[str, float]
    ranks: Mapping[int, float]
    dtypes: Mapping[str, float]
    strided_share: float
    strided_inputs: tuple[str, ...]
    omit: Mapping[tuple[str, ...], float]
    params: Mapping[str, Mapping[Any, float]]
    width_params: Mapping[str, int]
    max_bytes: int
    #: Workload name -> odds: the calls' templates (the entry's first workload where not declared).
    templates: Mapping[str, float]
    #: Trailing dimensions of the first input taken from the template (0: a width is drawn).
    trailing: int

    def template(self, name: str) -> Workload:
        return next(w for w in self.op_class.manifest_entry().workloads if w.name == name)

    def template_tail(self, name: str) -> tuple[int, ...]:
        """The last ``trailing`` dimensions of the first input of template ``name``."""
        first = self.op_class.manifest_entry().inputs[0].name
        return tuple(self.template(name).shapes[first][-self.trailing :])

    def tails(self) -> set[tuple[int, ...]]:
        """The trailing dimensions a call's first input may have: a width, or a template's."""
        if not self.trailing:
            return {(width,) for width in self.widths}
        return {self.template_tail(name) for name in self.templates}


@dataclasses.dataclass(frozen=True)
class SweepCall:
    """One drawn call: the op, the workload (named by ``label``), the dtype, the optional inputs
    left out, the inputs passed as row views, and its rows (the count the draw chose: the first
    input's elements over its trailing dimensions, a width or a template's tail)."""

    index: int
    op_class: type
    workload: Workload
    dtype: torch.dtype
    omitted: tuple[str, ...]
    strided: tuple[str, ...]
    #: The manifest workload whose other inputs and params the call took.
    template: str
    rows: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.workload.shapes[self.op_class.manifest_entry().inputs[0].name])

    def record(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "label": self.workload.name,
            "op": self.op_class.__name__,
            "shape": "x".join(map(str, self.shape)),
            "dtype": str(self.dtype).removeprefix("torch."),
            "omitted": list(self.omitted),
            "strided": list(self.strided),
            "params": {name: list(value) if isinstance(value, tuple) else value for name, value in self.workload.params.items()},
            "template": self.template,
            "rows": self.rows,
        }


def label(index: int, omitted: tuple[str, ...], strided: tuple[str, ...]) -> str:
    """A call's name in the tables: its number, ``strided`` where inputs are row views, and
    ``no-<input>`` for each optional input left out."""
    return " ".join([f"#{index:03d}", *(["strided"] if strided else []), *(f"no-{name}" for name in omitted)])


# -- the spaces the families declare ------------------------------------------------------------

def spaces(declarations: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Space]:
    """Every op some family declares a sweep for, by op class name, in ``FAMILIES``' order.
    ``declarations`` maps a family to its ``SWEEP`` (default: each ``command_line`` module's).
    ValueError where a declaration names an op, an input or a dtype that does not exist."""
    if declarations is None:
        declarations = {
            family: module.SWEEP for family, module in call_flags.family_adapters().items() if hasattr(module, "SWEEP")
        }
    classes = call_flags.op_classes()
    found: dict[str, Space] = {}
    for family, sweep in declarations.items():
        for name, own in sweep["ops"].items():
            if name not in classes or classes[name] not in FAMILIES.get(family, ()):
                raise ValueError(f"the {family} family's SWEEP names {name!r}, which is not one of its ops")
            found[name] = _space(family, classes[name], sweep, own)
    order = list(classes)
    return dict(sorted(found.items(), key=lambda item: order.index(item[0])))


def _space(family: str, op_class: type, sweep: Mapping[str, Any], own: Mapping[str, Any]) -> Space:
    entry = op_class.manifest_entry()
    where = f"the {family} family's SWEEP for {op_class.__name__}"
    optional = {t.name for t in entry.inputs if t.optional}
    omit = dict(own.get("omit", {(): 1}))
    for left_out in omit:
        if not set(left_out) <= optional:
            raise ValueError(f"{where} leaves out {sorted(set(left_out) - optional)}, not optional inputs of the op")
    for dtype in sweep["dtypes"]:
        if dtype not in DTYPES:
            raise ValueError(f"{where}: {dtype!r} is not a dtype")
    declared = {p.name for p in entry.params}
    if not set(own.get("params", {})) <= declared:
        raise ValueError(f"{where} draws params the op does not have: {sorted(set(own['params']) - declared)}")
    widths = own.get("widths", sweep["widths"])
    width_params = own.get("width_params", {})
    if not set(width_params) <= declared:
        raise ValueError(f"{where} derives params the op does not have: {sorted(set(width_params) - declared)}")
    for param, divisor in width_params.items():
        uneven = sorted(width for width in widths if width % divisor)
        if uneven:
            raise ValueError(f"{where} derives {param} as the width / {divisor}, but widths {uneven} are not multiples of {divisor}")
    workloads = {w.name: w for w in entry.workloads}
    templates = dict(own.get("templates", {entry.workloads[0].name: 1}))
    unknown = sorted(set(templates) - set(workloads))
    if unknown:
        raise ValueError(f"{where} takes templates that are not workloads of the op: {unknown}")
    trailing = own.get("trailing", 0) if "templates" in own else 0
    ranks = [len(workloads[name].shapes[entry.inputs[0].name]) for name in templates]
    if "templates" in own and not 1 <= trailing < min(ranks):
        raise ValueError(f"{where}: trailing must leave its templates' first input at least one row dimension, got {trailing}")
    strided = sweep.get("strided", {})
    return Space(
        op_class=op_class,
        widths=widths,
        rows=sweep["rows"],
        ranks=sweep["ranks"],
        dtypes=sweep["dtypes"],
        strided_share=strided.get("share", 0.0),
        strided_inputs=tuple(strided.get("inputs", ())),
        omit=omit,
        params=own.get("params", {}),
        width_params=width_params,
        max_bytes=sweep.get("max_bytes", MAX_BYTES),
        templates=templates,
        trailing=trailing,
    )


# -- drawing --------------------------------------------------------------------------------------

def allocate(rng: random.Random, odds: Mapping[Any, float], count: int) -> list:
    """``count`` values of ``odds``' keys, each as often as its share of the total odds says
    (rounded by the largest remainder, ties to the first declared), in a shuffled order."""
    total = sum(odds.values())
    shares = [(value, count * chance / total) for value, chance in odds.items()]
    counts = [int(share) for _, share in shares]
    by_remainder = sorted(range(len(shares)), key=lambda i: counts[i] - shares[i][1])
    for i in by_remainder[: count - sum(counts)]:
        counts[i] += 1
    values = [value for (value, _), times in zip(shares, counts) for _ in range(times)]
    rng.shuffle(values)
    return values


def log_uniform(rng: random.Random, low: int, high: int) -> int:
    """An integer in [low, high] whose logarithm is uniform."""
    return min(high, int(math.exp(rng.uniform(math.log(low), math.log(high + 1)))))


def _divisors(number: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(number) + 1) if number % d == 0]
    return sorted({*small, *(number // d for d in small)})


def spread(rng: random.Random, rows: int, dimensions: int) -> tuple[int, ...]:
    """``rows`` as ``dimensions`` leading dimensions whose product it is, split at random."""
    sizes = []
    for _ in range(dimensions - 1):
        size = rng.choice(_divisors(rows))
        sizes.append(size)
        rows //= size
    return (*sizes, rows)


def draw(count: int, seed: int, of: Mapping[str, Space], dtypes: tuple[str, ...] = ()) -> list[SweepCall]:
    """``count`` calls drawn from the spaces ``of`` (op name -> space), reproducibly from ``seed``;
    ``dtypes`` (names) narrows each space's dtypes. Numbered from 1 in the order they run."""
    rng = random.Random(seed)
    ops = allocate(rng, {name: 1 for name in of}, count)
    drafts = []
    for name in of:
        space, n = of[name], ops.count(name)
        if n == 0:
            continue
        dtype_odds = {d: chance for d, chance in space.dtypes.items() if not dtypes or d in dtypes}
        choices = {
            "dtype": allocate(rng, dtype_odds, n),
            "rank": allocate(rng, space.ranks, n),
            # One template (every op that declares none) draws nothing: the same calls as before templates.
            "template": allocate(rng, space.templates, n) if len(space.templates) > 1 else [*space.templates] * n,
            "omit": allocate(rng, space.omit, n),
            "strided": allocate(rng, {True: space.strided_share, False: 1 - space.strided_share}, n),
            **{f"param:{param}": allocate(rng, values, n) for param, values in space.params.items()},
        }
        for i in range(n):
            drafts.append(_draft(rng, space, {key: values[i] for key, values in choices.items()}))
    rng.shuffle(drafts)
    return [_call(index, *draft) for index, draft in enumerate(drafts, 1)]


def _draft(rng: random.Random, space: Space, chosen: dict[str, Any]) -> tuple:
    dtype = DTYPES[chosen["dtype"]]
    template = space.template(chosen["template"])
    if space.trailing:
        tail = space.template_tail(chosen["template"])
    else:
        tail = (rng.choices(list(space.widths), list(space.widths.values()))[0],)
    item = torch.empty((), dtype=dtype).element_size()
    cap = max(1, space.max_bytes // (math.prod(tail) * item))
    rows = space.rows
    if rng.random() < rows["decode_share"]:
        count = log_uniform(rng, 1, min(int(rows["decode"]), cap))
    else:
        low = min(int(rows["low"]), cap)
        count = log_uniform(rng, low, max(low, min(int(rows["high"]), cap)))
    shape = (*spread(rng, count, chosen["rank"] - len(tail)), *tail)
    params = {key.removeprefix("param:"): value for key, value in chosen.items() if key.startswith("param:")}
    params.update({param: tail[-1] // divisor for param, divisor in space.width_params.items()})
    return space, template, shape, dtype, tuple(chosen["omit"]), chosen["strided"], params, count


def _call(
    index: int, space: Space, base: Workload, shape: tuple, dtype: torch.dtype, omitted: tuple, strided: bool, params: dict,
    rows: int,
) -> SweepCall:
    entry = space.op_class.manifest_entry()
    passed = {t.name: base.shapes.get(t.name, ()) for t in entry.inputs if t.name not in omitted}
    described = workload_for_shape(entry, shape, Workload(base.name, passed, (dtype,), {**base.params, **params}))
    # One row is contiguous however wide the tensor it is a view of: such a call is not strided.
    views = tuple(name for name in space.strided_inputs if strided and name in described.shapes and math.prod(shape[:-1]) > 1)
    workload = Workload(label(index, omitted, views), described.shapes, (dtype,), {**described.params, **params})
    return SweepCall(index, space.op_class, workload, dtype, omitted, views, base.name, rows)


# -- the inputs of a call -------------------------------------------------------------------------

def row_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values as the first half of each row of a tensor twice as wide: a view whose
    rows are strided, as a slice of a wider tensor is."""
    wide = tensor.new_empty(*tensor.shape[:-1], 2 * tensor.shape[-1])
    view = wide[..., : tensor.shape[-1]]
    view.copy_(tensor)
    return view


def meta_inputs(call: SweepCall) -> dict[str, torch.Tensor]:
    """The call's inputs as meta tensors (no memory), strided where the call says."""
    entry = call.op_class.manifest_entry()
    inputs = {}
    for name, shape in call.workload.shapes.items():
        decl = entry.input(name)
        tensor = torch.empty(shape, dtype=decl.dtype_in(call.dtype), device="cpu" if decl.cpu else "meta")
        inputs[name] = row_view(tensor) if name in call.strided else tensor
    return inputs


def check(call: SweepCall) -> None:
    """UsageError with the op's own message where its signature refuses the call (on meta tensors)."""
    signature = call.op_class.signature()
    try:
        signature.bind(signature.bind_params(call.workload.params), (), meta_inputs(call))
    except TileOpsError as error:
        raise UsageError(f"sweep call {call.workload.name} ({call.op_class.__name__}): {error}") from None


def with_row_views(call: SweepCall, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``inputs`` (the call's workload's) with those the call passes strided as row views."""
    inputs.update({name: row_view(inputs[name]) for name in call.strided if name in inputs})
    return inputs


@contextlib.contextmanager
def strided_inputs(call: SweepCall) -> Iterator[None]:
    """While it lasts, the bench's timing functions build ``call``'s inputs with the strided ones
    as row views (``workload_inputs`` of ``bench`` and ``bench_training``, for this call's
    workload only: a backward op's inputs stay as the training step makes them)."""
    if not call.strided:
        yield
        return

    def build(entry, workload, dtype, device, **options):
        inputs = workload_inputs(entry, workload, dtype, device, **options)
        return with_row_views(call, inputs) if workload is call.workload else inputs

    modules = (bench, bench_training)
    saved = [module.workload_inputs for module in modules]
    for module in modules:
        module.workload_inputs = build
    try:
        yield
    finally:
        for module, function in zip(modules, saved):
            module.workload_inputs = function


# -- timing ---------------------------------------------------------------------------------------

def time_call(call: SweepCall, *, backward: bool, with_compile: bool, tune: bool, others: Peers | None) -> list[Row]:
    """The call's rows as ``tileops bench`` times them (one, or with ``backward`` two); a call
    that raises gives rows that say so, and the sweep goes on."""
    options = {"with_compile": with_compile, "tune": tune, "others": others}
    with strided_inputs(call):
        try:
            if backward:
                return list(bench_training.bench_training(call.op_class, call.workload, call.dtype, **options))
            return [bench.bench_workload(call.op_class, call.workload, call.dtype, **options)]
        except Exception as error:  # noqa: BLE001 - one call failing is a row of the table, not the end of the sweep
            modes = (bench_training.FORWARD_BACKWARD, bench_training.BACKWARD) if backward else ("forward",)
            return [
                Row(op=call.op_class.__name__, workload=call.workload.name, dtype=str(call.dtype).removeprefix("torch."),
                    shape="x".join(map(str, call.shape)), served_by="", ours_us=None, eager_us=None, compile_us=None,
                    bytes=0, ours_error=describe(error), mode=mode)
                for mode in modes
            ]


def build_kernels(calls: list[SweepCall], *, backward: bool, device: str = "cuda", workers: int = BUILD_WORKERS) -> None:
    """Run each call once (with ``backward``, a forward and its backward) in ``workers`` threads
    before any is timed, so that the kernels of every drawn shape are built in parallel: a new
    shape's TileLang build takes seconds, most of it in the CUDA compiler's own process, and a
    sweep draws a hundred or more of them. A call that raises here is left to its timing, which
    reports the error in its row."""

    def run_once(call: SweepCall) -> None:
        entry = call.op_class.manifest_entry()
        op = call.op_class(**call.workload.params)
        inputs = with_row_views(call, workload_inputs(entry, call.workload, call.dtype, device))
        leaves = bench_training.differentiable_leaves(entry, inputs) if backward else []
        with torch.set_grad_enabled(backward):
            result = op(*[inputs.get(d.name) for d in entry.inputs])
        outputs = [out for out in bench_training.outputs_of(result) if isinstance(out, torch.Tensor) and out.requires_grad]
        if outputs:
            torch.autograd.grad(outputs, leaves, [torch.ones_like(out) for out in outputs], allow_unused=True)

    def attempt(call: SweepCall) -> None:
        with contextlib.suppress(Exception):
            run_once(call)

    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="tileops-sweep-build") as pool:
        list(pool.map(attempt, calls))
    if device == "cuda":
        torch.cuda.synchronize()


def time_calls(calls: list[SweepCall], timer: Callable[[SweepCall], list[Row]], progress: bool = True) -> list[Row]:
    rows = []
    for call in calls:
        if progress:
            what = f"{call.op_class.__name__} {'x'.join(map(str, call.shape))} {str(call.dtype).removeprefix('torch.')}"
            print(f"\r[{call.index}/{len(calls)}] {what} ...".ljust(70), end="", file=sys.stderr, flush=True)
        rows += timer(call)
    if progress:
        print(file=sys.stderr)
    return rows


# -- the command line -----------------------------------------------------------------------------

def draw_numbers(text: str) -> set[int]:
    """``1-50,60`` as the numbers it names."""
    numbers: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            low, high = int(first), int(last if dash else first)
        except ValueError:
            raise UsageError(f"--draws: expected numbers and ranges such as 1-50,60, got {text!r}") from None
        if low < 1 or high < low:
            raise UsageError(f"--draws: {part.strip()!r} is not a range of draws numbered from 1")
        numbers.update(range(low, high + 1))
    return numbers


def selected_calls(args) -> list[SweepCall]:
    """The calls the command line asks for, checked against each op's signature; UsageError
    where the flags do not go together or select nothing."""
    if args.sweep is None:
        raise UsageError("--seed and --draws go with --sweep N")
    if args.sweep < 1:
        raise UsageError(f"--sweep takes how many calls to draw, at least 1, got {args.sweep}")
    flags = CallFlags.of(args)
    if args.shape or args.workload or flags.params or flags.omitted:
        raise UsageError(
            "--sweep draws its calls' shapes, params and inputs; it takes no --shape, --workload, --param, --omit "
            "or shorthand flags (op names and --dtype narrow the draw)"
        )
    try:
        every = spaces()
    except ValueError as error:
        raise UsageError(str(error)) from None
    named = [call_flags.op_class_named(name).__name__ for name in args.ops]
    for name in named:
        if name not in every:
            raise UsageError(f"{name}: its family declares no sweep (SWEEP in its command_line module)")
        if args.backward and not bench._declares_backward(every[name].op_class):
            raise UsageError(f"{name} declares no backward in its manifest entry; --backward times differentiable ops")
    chosen = {
        name: space for name, space in every.items()
        if (not named or name in named) and (not args.backward or bench._declares_backward(space.op_class))
    }
    dtypes = tuple(args.dtype or ())
    for dtype in dtypes:
        if not any(dtype in space.dtypes for space in chosen.values()):
            raise UsageError(f"--dtype {dtype}: no selected op's sweep draws it")
    chosen = {name: space for name, space in chosen.items() if not dtypes or set(dtypes) & set(space.dtypes)}
    if not chosen:
        raise UsageError("no family declares a sweep for the selected ops")
    calls = draw(args.sweep, DEFAULT_SEED if args.seed is None else args.seed, chosen, dtypes)
    for call in calls:
        check(call)
    if args.draws:
        wanted = draw_numbers(args.draws)
        if max(wanted) > len(calls):
            raise UsageError(f"--draws {args.draws}: the sweep draws {len(calls)} calls")
        calls = [call for call in calls if call.index in wanted]
    return calls


def run(args) -> int:
    from . import sweep_report

    try:
        calls = selected_calls(args)
    except UsageError as error:
        print(f"tileops bench: {error}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(bench.NO_CUDA, file=sys.stderr)
        return 2
    facts = bench.machine()
    copy_tb_s = bench.copy_bandwidth_tb_s()
    others = Peers()
    options = {"backward": args.backward, "with_compile": not args.no_compile, "tune": args.tune, "others": others}
    print(f"building the kernels of {len(calls)} calls ...", file=sys.stderr, flush=True)
    build_kernels(calls, backward=args.backward)
    rows = time_calls(calls, lambda call: time_call(call, **options))
    seed = DEFAULT_SEED if args.seed is None else args.seed
    print(sweep_report.report(rows, calls, seed=seed, drawn=args.sweep, facts=facts, copy_tb_s=copy_tb_s, others=others,
                              form="json" if args.json else "csv" if args.csv else "text", calls_timed=not args.backward),
          end="")
    if args.png:
        _chart(rows, args.png)
    return 0


def add_arguments(parser) -> None:
    parser.add_argument(
        "--sweep",
        nargs="?",
        const=DEFAULT_CALLS,
        type=int,
        metavar="N",
        help=f"time N calls (default {DEFAULT_CALLS}) drawn from the shapes users have, as each family declares them: "
        "widths of published models, decode and long row counts, 2-D to 4-D and strided inputs, every dtype and "
        "optional input; reports the distribution of the ratio to the best other side and the worst calls",
    )
    parser.add_argument(
        "--seed",
        type=int,
        metavar="S",
        help=f"the sweep's random seed (default {DEFAULT_SEED}): the same seed draws the same calls; fit configuration "
        "rules on one seed and report on another",
    )
    parser.add_argument(
        "--draws",
        metavar="LIST",
        help="time only these of the sweep's draws, by number, such as 1-50 or 17,42 (the draws do not change)",
    )
