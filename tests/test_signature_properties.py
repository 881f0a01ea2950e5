"""Property-based tests of the call checks each op's manifest entry generates.

Calls are generated from an op's manifest entry, never written per op: params where the entry
leaves a choice, batch ranks 0-3 (empty batches included), every dtype the entry allows,
optional inputs present or absent, inputs passed by position or by keyword, and out= buffers
for the outputs that declare one. The properties:

* a valid call succeeds; its outputs have the shapes and dtypes the signature declares (and the
  manifest's reference computes), and out= buffers come back as given;
* a non-contiguous read-only input is copied, not refused, and gives the same result;
* exactly one corruption of a valid call raises ``OpArgumentError``, whose message starts with
  the op's name and names the argument at fault first; the fast path declines the call;
* the generated fast path agrees with the reference ``Signature.bind`` on every valid call.

CPU only. Hypothesis keeps no example database, and its other files go to a temporary folder,
so a run leaves nothing in the checkout.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
from collections.abc import Callable, Hashable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, assume, event, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from helpers import generated_bind
from tileops.core.call_path import call_path_factory
from tileops.backend import OpArgumentError
from tileops.core import Op
from tileops.core.manifest.expressions import evaluate
from tileops.core.manifest import DTYPES, SKIP_OUTPUTS, OpEntry, ParamDecl, TensorDecl
from tileops.ops import FAMILIES
from tileops.testing import reference_outputs

# Hypothesis writes caches under ./.hypothesis as soon as a property is collected, even without
# an example database: send them to the temporary folder, unless the caller chose a place.
if "HYPOTHESIS_STORAGE_DIRECTORY" not in os.environ:
    set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "tileops-hypothesis")

OP_CLASSES = [op_class for op_classes in FAMILIES.values() for op_class in op_classes]

#: The source of a dimension that a literal or a param fixes; any other size is refused.
PINNED: Hashable = ("pinned",)

#: A param left out of the constructor call, so that its default applies.
OMITTED = object()

SHAPE_SIZES = st.integers(1, 4)  # sizes of a shape param such as normalized_shape
BATCH_SIZES = st.integers(0, 3)  # sizes of '...' and of named dims: 0 makes an empty call
BATCH_RANK = 3
#: Calls are drawn and then filtered by the entry's call constraints; where these relate several
#: dimensions (the rope ops: the caches' width is the rotated width, at most the head size), most
#: drawn calls are filtered out, which is expected, not a slow strategy.
FILTERED = [HealthCheck.filter_too_much]


def class_name(op_class: type) -> str:
    return op_class.__name__


# -- generating valid calls from a manifest entry ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class Dim:
    """One dimension of a generated tensor: its size, and what fixes that size.

    ``source`` is ``PINNED`` for a literal or a param; otherwise a key that every dimension
    which must equal this one shares: ``("...", tensor, k)`` for a tensor's own batch
    dimensions (the tensors declared ``shape: {same_as: tensor}`` share them), or
    ``("dim", name, k)`` for a dimension name that the first tensor having it binds.
    """

    size: int
    source: Hashable


def expand_pattern(
    pattern: tuple, params: Mapping[str, Any], bindings: Mapping[str, Any], owner: str
) -> tuple[Dim, ...]:
    """The dimensions of a tensor whose manifest shape is ``pattern``.

    ``params`` give the sizes of param names ('*normalized_shape'); ``bindings`` give '...' (a
    tuple of batch sizes), each other '*name' (a tuple) and each plain name (an int);
    ``owner`` names the tensor, whose '...' is its own.
    """
    dims: list[Dim] = []
    for entry in pattern:
        if isinstance(entry, int):
            dims.append(Dim(entry, PINNED))
        elif entry == "...":
            dims.extend(Dim(size, ("...", owner, k)) for k, size in enumerate(bindings["..."]))
        else:
            name = entry.lstrip("*")
            value = params[name] if name in params else bindings[name]
            sizes = value if entry.startswith("*") else (value,)
            dims.extend(Dim(size, PINNED if name in params else ("dim", name, k)) for k, size in enumerate(sizes))
    return tuple(dims)


def shape_of(dims: tuple[Dim, ...]) -> tuple[int, ...]:
    return tuple(dim.size for dim in dims)


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator).to(dtype)


def non_contiguous_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values with its elements two apart in memory: not contiguous unless the
    tensor has at most one element (torch calls any such tensor contiguous)."""
    spread = torch.empty((*tensor.shape, 2), dtype=tensor.dtype, device=tensor.device)[..., 0]
    return spread.copy_(tensor)


def declared_dtypes(entry: OpEntry, decl: TensorDecl) -> tuple[torch.dtype, ...]:
    """The dtypes ``decl`` may have, following ``dtype: {same_as: ...}`` to a list."""
    while decl.dtypes is None:
        decl = entry.input(decl.dtype_same_as)
    return decl.dtypes


def param_values(decl: ParamDecl, entry: OpEntry | None = None) -> st.SearchStrategy:
    """What a caller may pass for ``decl``, in every form the param accepts, kept small. A str
    param takes the values the entry's default and workloads give it (a string's valid values
    are the entry's constraints, which no strategy can read)."""
    if decl.type == "str" and entry is not None:
        used = {workload.params[decl.name] for workload in entry.workloads if decl.name in workload.params}
        values = st.sampled_from(sorted(used | ({decl.default} if decl.default is not None else set())))
    elif decl.type == "shape":
        sizes = st.lists(SHAPE_SIZES, min_size=1, max_size=2)
        values = st.one_of(sizes, sizes.map(tuple), sizes.map(torch.Size), SHAPE_SIZES)
    elif decl.type == "float":
        # The values the entry's workloads give it, or a float32 number of 1e-6 to 0.1, or 1 as an
        # int. Not an eps of 0 or 1e-30: a norm of two nearly equal elements is then so
        # ill-conditioned that float32 arithmetic misses the float64 reference by more than any
        # tolerance (a layer norm backward of rows of 2 at eps 0 missed by 8e-4 relative).
        used = {float(workload.params[decl.name]) for workload in entry.workloads if workload.params.get(decl.name) is not None} if entry else set()
        values = st.one_of(st.sampled_from(sorted(used | {1e-5})), st.floats(1e-6, 0.1), st.just(1))
    elif decl.type == "int":
        values = st.integers(0, 4)
    elif decl.type == "bool":
        values = st.booleans()
    elif decl.type == "dtype":
        values = st.sampled_from(list(DTYPES.values()))
    elif decl.type == "outputs" and entry is not None:
        skippable = [t.name for t in entry.outputs if t.absent_without]
        values = st.lists(st.sampled_from(skippable), unique=True).flatmap(
            lambda names: st.sampled_from([names, tuple(names)] + ([names[0]] if len(names) == 1 else []))
        )
    else:
        raise NotImplementedError(f"no values for a {decl.type} param ({decl.name}); teach param_values one")
    if decl.nullable:
        values = st.none() | values
    if not decl.required:
        values = st.just(OMITTED) | values
    return values


def bound_params(entry: OpEntry, given: Mapping[str, Any]) -> dict[str, Any]:
    """The params an op constructed with ``given`` must hold: every param, shapes as tuples."""
    params = {}
    for decl in entry.params:
        value = given.get(decl.name, decl.default)
        if decl.type == "shape" and value is not None:
            value = (value,) if isinstance(value, int) else tuple(value)
        elif decl.type == "float" and value is not None:
            value = float(value)
        elif decl.type == "outputs":  # names, sorted, whatever sequence (or single name) was given
            value = tuple(sorted({value} if isinstance(value, str) else set(value)))
        params[decl.name] = value
    return params


@dataclasses.dataclass(frozen=True)
class GeneratedCall:
    """A call of an op: the constructor's arguments, then the call's tensors."""

    op_class: type[Op]
    given_params: Mapping[str, Any]  # what the constructor is passed (defaults may be left out)
    params: Mapping[str, Any]  # what the op must hold after construction
    dims: Mapping[str, tuple[Dim, ...]]  # every input and output, by its name
    dtypes: Mapping[str, torch.dtype]  # every input and output, by its name
    inputs: Mapping[str, torch.Tensor | None]  # every input, None where absent
    outs: Mapping[str, torch.Tensor]  # out keyword -> the caller's buffer
    positional: int  # how many inputs are passed by position; the rest by keyword

    @property
    def entry(self) -> OpEntry:
        return self.op_class.manifest_entry()

    def build_op(self) -> Op:
        return self.op_class(**self.given_params)

    def arguments(self) -> tuple[tuple, dict[str, Any]]:
        """The call's ``(args, kwargs)``: absent inputs are None by position, left out by keyword."""
        names = [decl.name for decl in self.entry.inputs]
        args = tuple(self.inputs[name] for name in names[: self.positional])
        kwargs = {name: self.inputs[name] for name in names[self.positional:] if self.inputs[name] is not None}
        return args, {**kwargs, **self.outs}

    def with_argument(self, name: str, value: Any) -> GeneratedCall:
        """This call with input or out buffer ``name`` replaced (None: absent)."""
        if name in self.inputs:
            return dataclasses.replace(self, inputs={**self.inputs, name: value})
        outs = {keyword: buffer for keyword, buffer in self.outs.items() if keyword != name}
        return dataclasses.replace(self, outs=outs if value is None else {**outs, name: value})

    def output_for(self, keyword: str) -> TensorDecl:
        return next(decl for decl in self.entry.outputs if decl.out == keyword)

    def argument_dims(self, name: str) -> tuple[Dim, ...]:
        return self.dims[name] if name in self.inputs else self.dims[self.output_for(name).name]

    def argument_dtype(self, name: str) -> torch.dtype:
        return self.dtypes[name] if name in self.inputs else self.dtypes[self.output_for(name).name]

    def checked_arguments(self) -> list[str]:
        """The tensors passed, in the order the reference bind checks them."""
        return [name for name, tensor in self.inputs.items() if tensor is not None] + list(self.outs)

    def __repr__(self) -> str:
        def describe(tensor: torch.Tensor | None) -> str:
            if tensor is None:
                return "absent"
            return f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"

        given = ", ".join(f"{name}={value!r}" for name, value in self.given_params.items())
        tensors = [f"{name}={describe(tensor)}" for name, tensor in self.inputs.items()]
        tensors += [f"{keyword}={describe(buffer)}" for keyword, buffer in self.outs.items()]
        return f"{self.op_class.__name__}({given})({', '.join(tensors)}; {self.positional} by position)"


def constraints_hold(entry: OpEntry, namespace: Mapping[str, Any], *, at_construction: bool) -> bool:
    return all(
        evaluate(constraint.code, dict(namespace))
        for constraint in entry.constraints
        if constraint.at_construction == at_construction
    )


def solved_dims(entry: OpEntry, params: Mapping[str, Any]) -> dict[str, Any]:
    """Dimensions a call-time rule ``DIM == expression of the params`` fixes (``N == 2 * d``):
    drawn at random they would almost never satisfy it."""
    import ast

    solved = {}
    for constraint in entry.constraints:
        tree = ast.parse(constraint.text, mode="eval").body
        if constraint.at_construction or not (
            isinstance(tree, ast.Compare) and len(tree.ops) == 1 and isinstance(tree.ops[0], ast.Eq)
            and isinstance(tree.left, ast.Name)
        ):
            continue
        try:
            solved[tree.left.id] = evaluate(compile(ast.Expression(tree.comparators[0]), "<rule>", "eval"), dict(params))
        except NameError:  # the expression uses another dimension
            continue
    return solved


@st.composite
def valid_calls(draw: Callable, op_class: type[Op]) -> GeneratedCall:
    """A call that the op's signature accepts, built from its manifest entry alone."""
    entry = op_class.manifest_entry()
    given = draw(st.fixed_dictionaries({decl.name: param_values(decl, entry) for decl in entry.params}))
    given = {name: value for name, value in given.items() if value is not OMITTED}
    params = bound_params(entry, given)
    assume(constraints_hold(entry, params, at_construction=True))

    bindings: dict[str, Any] = {"...": tuple(draw(st.lists(BATCH_SIZES, max_size=BATCH_RANK)))}
    bindings.update(solved_dims(entry, params))
    for decl in entry.inputs:
        for pattern_entry in decl.shape or ():
            name = pattern_entry.lstrip("*") if isinstance(pattern_entry, str) else None
            if name and name not in params and name not in bindings:
                group = pattern_entry.startswith("*")
                bindings[name] = tuple(draw(st.lists(BATCH_SIZES, max_size=2))) if group else draw(BATCH_SIZES)
    named_dims = {name: value for name, value in bindings.items() if name != "..."}
    assume(constraints_hold(entry, {**params, **named_dims}, at_construction=False))

    dims: dict[str, tuple[Dim, ...]] = {}
    dtypes: dict[str, torch.dtype] = {}
    for decl in (*entry.inputs, *entry.outputs):
        if decl.shape_same_as is not None:
            dims[decl.name] = dims[decl.shape_same_as]
        else:
            dims[decl.name] = expand_pattern(decl.shape, params, bindings, decl.name)
        if decl.dtype_param is not None and params[decl.dtype_param] is not None:
            dtypes[decl.name] = params[decl.dtype_param]  # an output whose dtype a param chooses
        elif decl.dtype_same_as is not None:
            dtypes[decl.name] = dtypes[decl.dtype_same_as]
        elif decl in entry.inputs:
            dtypes[decl.name] = draw(st.sampled_from(decl.dtypes))
        else:
            dtypes[decl.name] = decl.dtypes[0]  # an output declaring a list gets its first dtype

    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    inputs = {}
    for decl in entry.inputs:
        present = not decl.optional or draw(st.booleans())
        inputs[decl.name] = random_tensor(shape_of(dims[decl.name]), dtypes[decl.name], generator) if present else None
    for decl in entry.inputs:
        # A derived input (a forward's saved statistic) must agree with the others: computed.
        if decl.derive_code is not None and inputs[decl.name] is not None:
            namespace = {**inputs, **params, "torch": torch, "F": F}
            inputs[decl.name] = evaluate(decl.derive_code, namespace)
            dtypes[decl.name] = inputs[decl.name].dtype
    outs = {
        decl.out: torch.empty(shape_of(dims[decl.name]), dtype=dtypes[decl.name])
        for decl in entry.outputs
        if decl.out and draw(st.booleans())
    }
    positional = draw(st.integers(0, len(entry.inputs)))
    return GeneratedCall(op_class, given, params, dims, dtypes, inputs, outs, positional)


def outputs_of(result: Any, entry: OpEntry) -> tuple:
    return result if len(entry.outputs) > 1 else (result,)


def present_inputs(call: GeneratedCall) -> dict[str, torch.Tensor]:
    return {name: tensor for name, tensor in call.inputs.items() if tensor is not None}


# -- property 1: valid calls succeed with the declared outputs ---------------------------------


@pytest.mark.parametrize("op_class", OP_CLASSES, ids=class_name)
@settings(max_examples=60, deadline=None, database=None, suppress_health_check=FILTERED)
@given(data=st.data())
def test_a_valid_call_returns_the_outputs_the_signature_declares(op_class, data):
    call = data.draw(valid_calls(op_class), label="call")
    entry = call.entry
    op = call.build_op()
    assert op.params == call.params
    untouched = {name: tensor.clone() for name, tensor in present_inputs(call).items()}
    args, kwargs = call.arguments()

    outputs = outputs_of(op(*args, **kwargs), entry)

    expected, _ = reference_outputs(entry, untouched, call.params)  # the inputs before an in-place op wrote them
    assert len(outputs) == len(entry.outputs) == len(expected)
    for decl, got, want in zip(entry.outputs, outputs, expected, strict=True):
        source = decl.aliases or decl.absent_without
        if source and call.inputs[source] is None:  # it aliases, or is absent without, an optional input left out
            assert got is None and want is None, decl.name
            continue
        if decl.name in call.params.get(SKIP_OUTPUTS, ()):  # the op was built to skip it
            assert got is None and want is None, decl.name
            continue
        assert isinstance(got, torch.Tensor), decl.name
        assert tuple(got.shape) == shape_of(call.dims[decl.name]) == tuple(want.shape), decl.name
        assert got.dtype == call.dtypes[decl.name] == want.dtype, decl.name
        assert got.device == want.device, decl.name
        if decl.out in call.outs:
            assert got is call.outs[decl.out], f"{decl.name} is not the {decl.out}= buffer passed"
        if decl.aliases:
            assert got is call.inputs[decl.aliases], f"{decl.name} is not input {decl.aliases!r} itself"
        atol, rtol = entry.tolerance[got.dtype]
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol, equal_nan=True)
    for decl in entry.inputs:
        if not decl.written and decl.name in untouched:
            assert torch.equal(call.inputs[decl.name], untouched[decl.name]), f"read-only input {decl.name!r} changed"


# Ops with an input whose values are read and that is not a 0-dim scalar (one that may be strided).
STRIDABLE_OP_CLASSES = [
    op for op in OP_CLASSES
    if any(decl.access == "read" and (decl.shape is None or len(decl.shape)) for decl in op.manifest_entry().inputs)
]


@pytest.mark.parametrize("op_class", STRIDABLE_OP_CLASSES, ids=class_name)
@settings(max_examples=40, deadline=None, database=None, suppress_health_check=FILTERED)
@given(data=st.data())
def test_a_non_contiguous_read_only_input_is_made_contiguous_or_read_as_a_row_view_with_the_same_result(op_class, data):
    call = dataclasses.replace(data.draw(valid_calls(op_class), label="call"), outs={})
    read_only = [
        decl.name for decl in call.entry.inputs
        if decl.access == "read" and call.inputs[decl.name] is not None and call.inputs[decl.name].numel() > 1
    ]
    assume(read_only)
    chosen = data.draw(st.lists(st.sampled_from(read_only), min_size=1, unique=True), label="non-contiguous")
    strided = call
    for name in chosen:
        strided = strided.with_argument(name, non_contiguous_copy(call.inputs[name]))
        assert not strided.inputs[name].is_contiguous()
    for decl in call.entry.inputs:  # an in-place op's two calls each write inputs of their own
        if decl.written and call.inputs[decl.name] is not None:
            strided = strided.with_argument(decl.name, call.inputs[decl.name].clone())
    op = call.build_op()
    args, kwargs = call.arguments()
    strided_args, strided_kwargs = strided.arguments()

    # The reference copies each chosen input, except a row view of an input that declares
    # row_views (a row of one element, spread two apart, is one); the generated path takes a
    # call only where the reference copies nothing.
    reference = op.signature().bind(op.params, strided_args, strided_kwargs)
    positions = {decl.name: i for i, decl in enumerate(call.entry.inputs)}
    uncopied = {name for name in chosen if reference.inputs[positions[name]] is strided.inputs[name]}
    assert all(call.entry.input(name).row_views for name in uncopied), uncopied
    if uncopied != set(chosen):
        assert generated_bind(op.signature(), op.params, strided_args, strided_kwargs) is None
    got = outputs_of(op(*strided_args, **strided_kwargs), call.entry)
    want = outputs_of(op(*args, **kwargs), call.entry)

    for decl, strided_output, contiguous_output in zip(call.entry.outputs, got, want, strict=True):
        if strided_output is None or contiguous_output is None:  # aliases, or is absent without, an optional input left out; or skipped
            assert strided_output is contiguous_output is None, decl.name
            assert call.inputs[decl.aliases or decl.absent_without] is None or decl.name in op.params.get(SKIP_OUTPUTS, ()), decl.name
            continue
        assert strided_output.shape == contiguous_output.shape and strided_output.dtype == contiguous_output.dtype
        torch.testing.assert_close(strided_output, contiguous_output, atol=0, rtol=0, equal_nan=True, msg=decl.name)
    for name in chosen:
        assert torch.equal(strided.inputs[name], call.inputs[name]), f"input {name!r} changed"


# -- property 2: one corruption is refused, naming the argument ---------------------------------


@dataclasses.dataclass(frozen=True)
class CorruptedCall:
    """A valid call with one thing wrong, and what the error must say."""

    what: str
    args: tuple
    kwargs: dict[str, Any]
    culprit: str | None  # the argument the message names first; None: it names none
    reason: str  # a fragment of the message that says what is wrong


def corrupted(what: str, call: GeneratedCall, culprit: str | None, reason: str) -> CorruptedCall:
    args, kwargs = call.arguments()
    return CorruptedCall(what, args, kwargs, culprit, reason)


@st.composite
def wrong_dtype(draw: Callable, call: GeneratedCall) -> CorruptedCall:
    """An input or out buffer in a dtype the signature refuses for it."""
    entry = call.entry
    name = draw(st.sampled_from(call.checked_arguments()), label="argument")
    decl = entry.input(name) if name in call.inputs else call.output_for(name)
    if name in call.inputs and decl.dtype_same_as is None:
        refused = [dtype for dtype in DTYPES.values() if dtype not in decl.dtypes]
    else:  # same_as another tensor, or an out buffer: any other dtype, the allowed ones first
        if name in call.inputs:
            assume(call.inputs[decl.dtype_same_as] is not None)
        allowed = declared_dtypes(entry, decl)
        refused = sorted((d for d in DTYPES.values() if d != call.argument_dtype(name)), key=lambda d: d not in allowed)
    dtype = draw(st.sampled_from(refused), label="dtype")
    tensor = call.inputs.get(name, call.outs.get(name))
    return corrupted(f"{name} as {dtype}", call.with_argument(name, tensor.to(dtype)), name, "dtype")


def culprit_of_resized_dim(call: GeneratedCall, name: str, position: int) -> str | None:
    """The argument the reference bind blames when one size of ``name`` changes; None when the
    call stays valid (a batch size nothing else has to match)."""
    dims = call.argument_dims(name)
    source = dims[position].source
    if source == PINNED or name in call.outs or sum(dim.source == source for dim in dims) > 1:
        return name
    order = call.checked_arguments()
    sharing = [other for other in order if other != name and source in {d.source for d in call.argument_dims(other)}]
    if any(order.index(other) < order.index(name) for other in sharing):
        return name  # an earlier tensor bound the size: this one disagrees with it
    return sharing[0] if sharing else None  # the first later tensor that must match is blamed


@st.composite
def wrong_size(draw: Callable, call: GeneratedCall) -> CorruptedCall:
    """One dimension of one input or out buffer changed to another size."""
    choices = [
        (name, position, culprit)
        for name in call.checked_arguments()
        for position in range(len(call.argument_dims(name)))
        if (culprit := culprit_of_resized_dim(call, name, position)) is not None
    ]
    assume(choices)
    name, position, culprit = draw(st.sampled_from(choices), label="dimension")
    shape = list(shape_of(call.argument_dims(name)))
    old_size = shape[position]
    shape[position] = draw(st.integers(0, old_size + 2).filter(lambda size: size != old_size), label="size")
    tensor = random_tensor(tuple(shape), call.argument_dtype(name), torch.Generator().manual_seed(0))
    return corrupted(f"{name} resized to {shape}", call.with_argument(name, tensor), culprit, "shape")


@st.composite
def on_meta_device(draw: Callable, call: GeneratedCall) -> CorruptedCall:
    """One tensor moved to the meta device; moving the first input moves the call's device, so
    the first other tensor on the CPU is blamed."""
    entry = call.entry
    order = call.checked_arguments()
    first = entry.inputs[0].name
    on_call_device = [name for name in order if name != first and not (name in call.inputs and entry.input(name).cpu)]
    targets = [name for name in order if name != first or on_call_device]
    assume(targets)
    name = draw(st.sampled_from(targets), label="argument")
    culprit = on_call_device[0] if name == first else name
    tensor = call.inputs.get(name, call.outs.get(name))
    return corrupted(f"{name} on meta", call.with_argument(name, tensor.to("meta")), culprit, "device")


@st.composite
def non_contiguous_out_buffer(draw: Callable, call: GeneratedCall) -> CorruptedCall:
    keyword = draw(st.sampled_from([decl.out for decl in call.entry.outputs if decl.out]), label="buffer")
    buffer = non_contiguous_copy(torch.empty(shape_of(call.argument_dims(keyword)), dtype=call.argument_dtype(keyword)))
    assume(not buffer.is_contiguous())  # a tensor of at most one element is always contiguous
    return corrupted(f"non-contiguous {keyword}=", call.with_argument(keyword, buffer), keyword, "contiguous")


@st.composite
def required_input_missing(draw: Callable, call: GeneratedCall) -> CorruptedCall:
    name = draw(st.sampled_from([decl.name for decl in call.entry.inputs if not decl.optional]), label="input")
    return corrupted(f"no {name}", call.with_argument(name, None), name, "missing required input")


def unexpected_keywords(entry: OpEntry) -> st.SearchStrategy[str]:
    """Keywords the call does not take: params and output names (likely slips), and made-up names."""
    taken = {decl.name for decl in entry.inputs} | {decl.out for decl in entry.outputs if decl.out}
    # 'self' is left to its own test below: it fails before the op's code runs.
    slips = st.sampled_from([decl.name for decl in entry.params] + [decl.name for decl in entry.outputs])
    invented = st.lists(st.sampled_from("abcdefghijklmnopqrstuvwxyz_"), min_size=1, max_size=10).map("".join)
    return (slips | invented).filter(lambda name: name not in taken and name != "self")


@st.composite
def unexpected_keyword(draw: Callable, call: GeneratedCall) -> CorruptedCall:
    keyword = draw(unexpected_keywords(call.entry), label="keyword")
    args, kwargs = call.arguments()
    first = call.inputs[call.entry.inputs[0].name]
    return CorruptedCall(f"{keyword}=", args, {**kwargs, keyword: first.clone()}, keyword, "unexpected argument")


def extra_positional_tensor(call: GeneratedCall) -> st.SearchStrategy[CorruptedCall]:
    names = [decl.name for decl in call.entry.inputs]
    extra = call.inputs[names[0]].clone()
    args = (*(call.inputs[name] for name in names), extra)
    reason = f"takes at most {len(names)} positional"
    return st.just(CorruptedCall("one positional tensor too many", args, dict(call.outs), None, reason))


@st.composite
def input_by_position_and_keyword(draw: Callable, call: GeneratedCall) -> CorruptedCall:
    names = [name for name, tensor in call.inputs.items() if tensor is not None]
    name = draw(st.sampled_from(names), label="input")
    by_position = dataclasses.replace(call, positional=max(call.positional, list(call.inputs).index(name) + 1))
    args, kwargs = by_position.arguments()
    kwargs[name] = call.inputs[name]
    return CorruptedCall(f"{name} twice", args, kwargs, name, "both by position and by keyword")


@st.composite
def not_a_tensor(draw: Callable, call: GeneratedCall) -> CorruptedCall:
    name = draw(st.sampled_from(call.checked_arguments()), label="argument")
    tensor = call.inputs.get(name, call.outs.get(name))
    value = draw(st.sampled_from([tensor.tolist(), 1.0, "tensor"]), label="value")
    what = f"{name} as {type(value).__name__}"
    return corrupted(what, call.with_argument(name, value), name, "expected a torch.Tensor")


#: Each builds, from a valid call, a strategy of calls with exactly one thing wrong.
CORRUPTIONS: dict[str, Callable[[GeneratedCall], st.SearchStrategy[CorruptedCall]]] = {
    "wrong_dtype": wrong_dtype,
    "wrong_size": wrong_size,
    "on_meta_device": on_meta_device,
    "non_contiguous_out_buffer": non_contiguous_out_buffer,
    "required_input_missing": required_input_missing,
    "unexpected_keyword": unexpected_keyword,
    "extra_positional_tensor": extra_positional_tensor,
    "input_by_position_and_keyword": input_by_position_and_keyword,
    "not_a_tensor": not_a_tensor,
}


def corruption_applies(op_class: type[Op], corruption: str) -> bool:
    entry = op_class.manifest_entry()
    if corruption == "non_contiguous_out_buffer":
        return any(decl.out for decl in entry.outputs)
    return True


CORRUPTION_CASES = [
    pytest.param(op_class, corruption, id=f"{op_class.__name__}-{corruption}")
    for op_class in OP_CLASSES
    for corruption in CORRUPTIONS
    if corruption_applies(op_class, corruption)
]

QUOTED = re.compile(r"'([^']*)'")


@pytest.mark.parametrize(("op_class", "corruption"), CORRUPTION_CASES)
@settings(max_examples=30, deadline=None, database=None, suppress_health_check=FILTERED)
@given(data=st.data())
def test_one_corruption_is_refused_naming_the_op_and_the_argument(op_class, corruption, data):
    call = data.draw(valid_calls(op_class), label="call")
    bad = data.draw(CORRUPTIONS[corruption](call), label="corruption")
    op = call.build_op()

    with pytest.raises(OpArgumentError) as caught:
        op(*bad.args, **bad.kwargs)

    message = str(caught.value)
    assert message.startswith(f"{op_class.__name__}: "), message
    assert bad.reason in message, message
    if bad.culprit is not None:
        named = QUOTED.search(message)
        assert named is not None and named.group(1) == bad.culprit, f"{bad.what}: {bad.culprit!r} not named first"
    assert generated_bind(op.signature(), op.params, bad.args, bad.kwargs) is None, f"the fast path accepted {bad.what}"


@pytest.mark.parametrize("op_class", OP_CLASSES, ids=class_name)
@settings(max_examples=3, deadline=None, database=None, suppress_health_check=FILTERED, phases=[Phase.generate])
@given(data=st.data())
def test_self_as_an_unexpected_keyword_is_refused_naming_the_op(op_class, data):
    call = data.draw(valid_calls(op_class), label="call")
    args, kwargs = call.arguments()
    with pytest.raises(OpArgumentError, match=rf"^{op_class.__name__}: unexpected argument 'self'"):
        call.build_op()(*args, **kwargs, self=call.inputs[call.entry.inputs[0].name])


# -- property 3: the generated fast path agrees with the reference bind ------------------------


@pytest.mark.parametrize("op_class", OP_CLASSES, ids=class_name)
@settings(max_examples=60, deadline=None, database=None, suppress_health_check=FILTERED)
@given(data=st.data())
def test_the_fast_path_agrees_with_the_reference_bind(op_class, data):
    call = data.draw(valid_calls(op_class), label="call")
    op = call.build_op()
    args, kwargs = call.arguments()

    fast = generated_bind(op.signature(), op.params, args, kwargs)
    reference = type(op).signature().bind(op.params, args, kwargs)

    event("fast path served" if fast is not None else "fast path declined")
    if fast is None:
        return
    # None: an output aliasing an optional input left out has no layout.
    assert [None if s is None else tuple(s) for s in fast.output_shapes] == [None if s is None else tuple(s) for s in reference.output_shapes]
    assert fast.output_dtypes == reference.output_dtypes
    assert fast.outs.keys() == reference.outs.keys()
    assert all(fast.outs[keyword] is reference.outs[keyword] for keyword in fast.outs)
    assert fast.device == reference.device
    assert [id(tensor) for tensor in fast.inputs] == [id(tensor) for tensor in reference.inputs]


@pytest.mark.parametrize("op_class", OP_CLASSES, ids=class_name)
@settings(max_examples=20, deadline=None, database=None, suppress_health_check=FILTERED, phases=[Phase.generate])
@given(data=st.data())
def test_the_fast_path_and_the_reference_bind_the_same_dimension_names(op_class, data):
    call = data.draw(valid_calls(op_class), label="call")
    op = call.build_op()
    args, kwargs = call.arguments()
    fast = generated_bind(op.signature(), op.params, args, kwargs)
    reference = type(op).signature().bind(op.params, args, kwargs)
    assert fast is None or dict(fast.dims) == dict(reference.dims)


@pytest.mark.parametrize("op_class", OP_CLASSES, ids=class_name)
@settings(max_examples=5, deadline=None, database=None, suppress_health_check=FILTERED, phases=[Phase.generate])
@given(data=st.data())
def test_every_op_has_a_generated_call_path(op_class, data):
    # Without one, every call takes the reference bind: 15-20 us of op layer on a 2-core CPU
    # instead of 2-4 (a decode attention call with its optional block table did until the
    # optional inputs were checked after the required ones).
    op = data.draw(valid_calls(op_class), label="call").build_op()
    assert call_path_factory(type(op).signature(), op.params) is not None


DESCRIBED_OP_CLASSES = [op for op in OP_CLASSES if any(decl.described_only for decl in op.manifest_entry().inputs)]


def test_some_shipped_op_reads_only_the_description_of_an_input():
    assert DESCRIBED_OP_CLASSES  # else the property below checks nothing


@pytest.mark.parametrize("op_class", DESCRIBED_OP_CLASSES, ids=class_name)
@settings(max_examples=20, deadline=None, database=None, suppress_health_check=FILTERED)
@given(data=st.data())
def test_an_input_whose_shape_alone_is_read_may_be_a_one_element_stand_in(op_class, data):
    """What an eager autograd node passes for an ``access: shape`` input: the generated path
    takes it as it is (no contiguous copy) and the op gives what it gives for the real tensor."""
    call = dataclasses.replace(data.draw(valid_calls(op_class), label="call"), outs={})
    stood_in = call
    for decl in call.entry.inputs:
        tensor = call.inputs[decl.name]
        if tensor is None:
            continue
        if decl.described_only:
            stood_in = stood_in.with_argument(decl.name, tensor.new_empty(()).expand(tensor.shape))
        elif decl.written:  # the two calls each write inputs of their own
            stood_in = stood_in.with_argument(decl.name, tensor.clone())
    op = call.build_op()
    args, kwargs = call.arguments()
    stood_in_args, stood_in_kwargs = stood_in.arguments()

    assert generated_bind(op.signature(), op.params, stood_in_args, stood_in_kwargs) is not None
    got = outputs_of(op(*stood_in_args, **stood_in_kwargs), call.entry)
    want = outputs_of(op(*args, **kwargs), call.entry)
    for decl, from_stand_in, from_tensor in zip(call.entry.outputs, got, want, strict=True):
        if from_tensor is None:
            assert from_stand_in is None, decl.name
            continue
        torch.testing.assert_close(from_stand_in, from_tensor, atol=0, rtol=0, equal_nan=True, msg=decl.name)
