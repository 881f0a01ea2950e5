"""The checks an op runs on every call, derived once per op class from its manifest entry.

``Signature.bind_params`` checks construction arguments; ``Signature.bind`` checks a call's
tensors (presence, kind, dtype, shape, device, contiguity, output buffers, and that no tensor
the call writes shares memory with another of its tensors) and returns a ``BoundCall``;
``Signature.empty_result`` builds the outputs of a call that writes nothing.
Every failure is an ``OpArgumentError`` naming the op, the argument, what the signature
declares and what came. Expressions were compiled by the loader; nothing is parsed here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import OpArgumentError
from ..row_views import is_row_view
from .entries import SKIP_OUTPUTS, OpEntry, ParamDecl, TensorDecl, param_value
from .overlap import overlapping
from .quoting import shown
from .shapes import given


class BoundCall:
    """One checked call: its inputs (read-only ones made contiguous, except row views where
    declared and inputs whose shape alone is read), the keywords the caller passed for
    implementations (output buffers and execution arguments, in ``outs``), the call's device,
    the bound dimensions and the outputs' shapes and dtypes."""

    __slots__ = ("inputs", "outs", "device", "dims", "output_shapes", "output_dtypes")

    def __init__(self, inputs, outs, device, dims, output_shapes, output_dtypes) -> None:
        self.inputs: tuple[torch.Tensor | None, ...] = inputs
        self.outs: dict[str, torch.Tensor] = outs
        self.device: torch.device = device
        self.dims: dict[str, Any] = dims
        self.output_shapes: tuple[tuple[int, ...], ...] = output_shapes
        self.output_dtypes: tuple[torch.dtype, ...] = output_dtypes


def unsupported_kind(tensor: torch.Tensor) -> str | None:
    """What kind of tensor ``tensor`` is when no op takes it (sparse, nested, mkldnn, wrapped by
    a torch.func transform such as ``torch.vmap``), or None for a plain dense tensor."""
    if tensor.is_nested:
        return "a nested tensor"
    if tensor.is_mkldnn:  # its layout's name, "_mkldnn", would read as a private detail
        return "an mkldnn (oneDNN) tensor (layout torch._mkldnn)"
    if tensor.layout is not torch.strided:
        return f"a {str(tensor.layout).removeprefix('torch.')} tensor (layout {tensor.layout})"
    if torch._C._functorch.is_functorch_wrapped_tensor(tensor):
        return "a tensor wrapped by a torch.func transform (torch.vmap, grad, jacrev...)"
    return None


def _sentence_inside(doc: str) -> str:
    """A doc sentence continued after a colon: its first word lower-cased unless it is a name
    or an acronym ("Each" -> "each"; "GPU's" and "KV" stay), without the final period."""
    first = doc.split(" ", 1)[0]
    if first[:1].isupper() and first[1:].islower():
        doc = doc[0].lower() + doc[1:]
    return doc.rstrip(".")


def _dtype_text(dtypes: Sequence[torch.dtype]) -> str:
    return " or ".join(str(d).removeprefix("torch.") for d in dtypes)


class _ParamCheck:
    """Converts and checks one construction argument."""

    def __init__(self, op: str, decl: ParamDecl, kind: str = "param") -> None:
        self.op, self.decl, self.kind = op, decl, kind

    def __call__(self, value: Any) -> Any:
        if value is None:
            if self.decl.nullable:
                return None
            expected = "a value (it is not nullable)"
        else:
            try:
                return param_value(self.decl.type, value)
            except ValueError as error:
                expected = str(error)
        raise OpArgumentError(
            f"{self.op}: {self.kind} {self.decl.name!r} expected {expected}, got {shown(value)} ({type(value).__name__})"
        )


class Signature:
    """The generated checks of one op class."""

    def __init__(self, entry: OpEntry) -> None:
        self.entry = entry
        self.op = entry.name
        self.input_names = tuple(t.name for t in entry.inputs)
        self._input_index = {name: i for i, name in enumerate(self.input_names)}
        self._required_inputs = tuple(t.name for t in entry.inputs if not t.optional)
        self.out_keywords = {t.out: i for i, t in enumerate(entry.outputs) if t.out}
        self._param_checks = {p.name: _ParamCheck(self.op, p) for p in entry.params}
        self._exec_checks = {a.name: _ParamCheck(self.op, a, "execution argument") for a in entry.exec_args}
        self._first = entry.inputs[0].name
        self._written_inputs = tuple(i for i, t in enumerate(entry.inputs) if t.written)
        #: Read inputs a call may pass on without making them contiguous: any strides where only
        #: the shape is read (``access: shape``), row views where declared (``row_views``). A
        #: target still receives them contiguous.
        self.uncopied_inputs = tuple(i for i, t in enumerate(entry.inputs) if t.described_only or t.row_views)
        self._aliased = tuple(self._input_index[t.aliases] if t.aliases else None for t in entry.outputs)
        #: Per output: the optional input without which it is None (its alias, or ``absent_without``).
        self._exists_with = tuple(
            self._input_index[t.aliases or t.absent_without] if t.aliases or t.absent_without else None
            for t in entry.outputs
        )
        #: The outputs a caller may skip (``skip_outputs``): those that may be absent.
        self.skippable = tuple(t.name for t in entry.outputs if t.absent_without)
        self._single_output = len(entry.outputs) == 1
        self.writes = tuple(t.name for t in entry.inputs if t.written) + tuple(
            t.name for t in entry.outputs if not t.aliases
        )

    # -- construction -------------------------------------------------------------------
    def bind_params(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """Check construction arguments; returns them converted, in signature order."""
        unknown = sorted(set(given) - set(self._param_checks))
        if unknown:
            raise OpArgumentError(
                f"{self.op}: unexpected param(s) {', '.join(unknown)}; it takes "
                f"{', '.join(self._param_checks) or 'no params'}"
            )
        params = {}
        for decl in self.entry.params:
            if decl.name in given:
                params[decl.name] = self._param_checks[decl.name](given[decl.name])
            elif decl.required:
                raise OpArgumentError(f"{self.op}: missing required param {decl.name!r}")
            else:
                params[decl.name] = decl.default
        unknown = sorted(set(params.get(SKIP_OUTPUTS, ())) - set(self.skippable))
        if unknown:
            raise OpArgumentError(
                f"{self.op}: param {SKIP_OUTPUTS!r} expected outputs that may be absent "
                f"({', '.join(self.skippable)}), got {', '.join(map(repr, unknown))}"
            )
        for constraint in self.entry.constraints:
            if constraint.at_construction and not constraint.holds(params):
                values = ", ".join(f"{k}={shown(v)}" for k, v in params.items())
                raise OpArgumentError(f"{self.op}: {constraint.message} (params: {values}; rule: {constraint.text})")
        return params

    def check_exec_arg(self, name: str, value: Any) -> Any:
        """An execution argument's value checked and converted as a call's would be."""
        return self._exec_checks[name](value)

    # -- call ---------------------------------------------------------------------------
    def bind(self, params: Mapping[str, Any], args: tuple, kwargs: dict, *, check_overlap: bool = True) -> BoundCall:
        """Check one call's arguments against the signature.

        ``check_overlap=False`` skips the shared-memory rule (traced calls: their tensors are
        fake and have no addresses; the compiled graph's eager call checks it).
        """
        entry = self.entry
        n_inputs = len(self.input_names)
        if len(args) > n_inputs:
            raise OpArgumentError(
                f"{self.op}: takes at most {n_inputs} positional tensor(s) ({', '.join(self.input_names)}), "
                f"got {len(args)}"
            )
        values: list[Any] = list(args) + [None] * (n_inputs - len(args))
        outs: dict[str, Any] = {}
        execution: dict[str, Any] = {}
        for name, value in kwargs.items():
            index = self._input_index.get(name)
            if index is not None:
                if index < len(args):
                    raise OpArgumentError(f"{self.op}: got input {name!r} both by position and by keyword")
                values[index] = value
            elif name in self.out_keywords:
                if value is not None:
                    outs[name] = value
            elif name in self._exec_checks:
                execution[name] = self._exec_checks[name](value)
            else:
                raise OpArgumentError(
                    f"{self.op}: unexpected argument {name!r}; it takes inputs {', '.join(self.input_names)}"
                    + (f" and output buffers {', '.join(self.out_keywords)}" if self.out_keywords else "")
                    + (f" and execution arguments {', '.join(self._exec_checks)}" if self._exec_checks else "")
                    + (
                        f" ({name} is a param: it is given when the op is constructed, {self.op}(..., {name}=...))"
                        if any(param.name == name for param in entry.params)
                        else ""
                    )
                )

        first = values[0]
        if not isinstance(first, torch.Tensor):
            self._missing_or_wrong(entry.inputs[0], first)
        device = first.device
        dims: dict[str, Any] = {}
        scope = params  # names a pattern may refer to: params, then bound dims
        for i, decl in enumerate(entry.inputs):
            tensor = values[i]
            if tensor is None:
                if not decl.optional:
                    self._missing_or_wrong(decl, tensor)
                continue
            if not isinstance(tensor, torch.Tensor):
                self._missing_or_wrong(decl, tensor)
            self._check_kind(f"argument {decl.name!r}", tensor)
            self._check_dtype(decl, tensor, values)
            self._check_shape(decl, tensor, values, dims, scope)
            if decl.cpu:
                if tensor.device.type != "cpu":
                    raise OpArgumentError(
                        f"{self.op}: argument {decl.name!r} is declared device: cpu, got a tensor on {tensor.device}"
                    )
            elif tensor.device != device:
                raise OpArgumentError(
                    f"{self.op}: argument {decl.name!r} is on {tensor.device}, but the call's device "
                    f"(from {self._first!r}) is {device}; move every tensor to one device"
                )
            if decl.described_only:  # its values are never read: a copy would only cost memory
                pass
            elif not decl.written:
                if not tensor.is_contiguous() and not (decl.row_views and self._row_view(decl, tensor, dims, scope)):
                    values[i] = tensor.contiguous()
            elif decl.contiguous and not tensor.is_contiguous():
                raise OpArgumentError(
                    f"{self.op}: argument {decl.name!r} is written in place and must be contiguous; "
                    f"got strides {tuple(tensor.stride())} for shape {tuple(tensor.shape)}"
                )
        if entry.constraints:
            self._check_call_constraints(params, dims)
        shapes, dtypes = self._output_layout(values, dims, params)
        for keyword, buffer in outs.items():
            self._check_out_buffer(keyword, buffer, shapes, dtypes, device)
        if check_overlap and (outs or self._written_inputs):
            self.check_no_overlap(values, outs)
        # Execution arguments travel with the output buffers: both reach implementations as keywords.
        return BoundCall(tuple(values), {**outs, **execution}, device, dims, shapes, dtypes)

    def written_and_read(self, inputs: Sequence[Any], outs: Mapping[str, torch.Tensor]):
        """(name, tensor) of what a call writes (written inputs, output buffers) and of what it
        only reads."""
        written = [(f"output buffer {k!r}", t) for k, t in outs.items()]
        read = []
        for decl, tensor in zip(self.entry.inputs, inputs):
            if tensor is not None:
                (written if decl.written else read).append((f"argument {decl.name!r}", tensor))
        return written, read

    def check_no_overlap(self, inputs: Sequence[Any], outs: Mapping[str, torch.Tensor]) -> None:
        """Refuse a call in which a tensor it writes shares memory with another of its tensors."""
        pair = overlapping(*self.written_and_read(inputs, outs))
        if pair is not None:
            raise OpArgumentError(
                f"{self.op}: {pair[0]} and {pair[1]} share memory; a tensor the op writes must not overlap "
                "any other tensor of the call (pass a separate buffer; an op that computes in place "
                "declares a written input and an output that aliases it)"
            )

    def writes_nothing(self, call: BoundCall) -> bool:
        """True when every tensor the call writes is empty (so no implementation must run)."""
        for shape, alias in zip(call.output_shapes, self._aliased):
            if alias is None and shape is not None and 0 not in shape:
                return False
        for i in self._written_inputs:
            tensor = call.inputs[i]
            if tensor is not None and tensor.numel() != 0:
                return False
        return True

    def absent_outputs(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> tuple[bool, ...]:
        """Per output: whether a call with ``inputs`` of an instance with ``params`` has it as
        None (it aliases, or is declared ``absent_without``, an optional input the call leaves
        out; or the instance skips it)."""
        skipped = params.get(SKIP_OUTPUTS, ())
        return tuple(
            (source is not None and inputs[source] is None) or decl.name in skipped
            for decl, source in zip(self.entry.outputs, self._exists_with)
        )

    def with_written_inputs(self, results: list, inputs: Sequence[Any], params: Mapping[str, Any]) -> list:
        """``results`` (one per output) with each output that aliases a written input replaced by
        that input, and each absent output by None: a custom op returns placeholders for them,
        since its results are tensors that alias none of its arguments."""
        for index, (alias, absent) in enumerate(zip(self._aliased, self.absent_outputs(inputs, params))):
            if absent:
                results[index] = None
            elif alias is not None:
                results[index] = inputs[alias]
        return results

    def empty_result(self, call: BoundCall):
        """The outputs of a call that writes nothing, built from the signature."""
        results = []
        for i, decl in enumerate(self.entry.outputs):
            if call.output_shapes[i] is None:  # absent
                results.append(None)
            elif decl.aliases:
                results.append(call.inputs[self._aliased[i]])
            elif decl.out and decl.out in call.outs:
                results.append(call.outs[decl.out])
            else:
                results.append(torch.empty(call.output_shapes[i], dtype=call.output_dtypes[i], device=call.device))
        return results[0] if len(results) == 1 else tuple(results)

    def check_result(self, result: Any, call: BoundCall, producer: str):
        """Checks of what an implementation returned: the count of outputs, and each one a
        tensor of the signature's shape and dtype on the call's device; an output the caller
        passed a buffer for is that buffer, an output that aliases an input is that input."""
        if self._single_output:
            if self._fits(0, result, call):
                return result
        elif type(result) is tuple and len(result) == len(call.output_shapes):
            for index, item in enumerate(result):
                if not self._fits(index, item, call):
                    break
            else:
                return result
        raise OpArgumentError(self._result_problem(result, call, producer))

    def _fits(self, index: int, item: Any, call: BoundCall) -> bool:
        if call.output_shapes[index] is None:  # absent
            return item is None
        if not (
            isinstance(item, torch.Tensor)
            and item.shape == call.output_shapes[index]
            and item.dtype is call.output_dtypes[index]
            and item.device == call.device
        ):
            return False
        decl = self.entry.outputs[index]
        if decl.aliases:
            return item is call.inputs[self._aliased[index]]
        return decl.out is None or call.outs.get(decl.out, item) is item

    def _result_problem(self, result: Any, call: BoundCall, producer: str) -> str:
        outputs = self.entry.outputs
        items = (result,) if self._single_output else result
        if not isinstance(items, tuple) or len(items) != len(outputs):
            return (
                f"{self.op}: {producer} returned {type(result).__name__}, but the signature declares "
                f"{len(outputs)} output(s): {', '.join(t.name for t in outputs)}"
            )
        for index, (decl, item) in enumerate(zip(outputs, items)):
            if self._fits(index, item, call):
                continue
            if call.output_shapes[index] is None:
                if call.inputs[self._exists_with[index]] is not None:  # present: the instance skips it
                    return (
                        f"{self.op}: {producer} returned output {decl.name!r} as {type(item).__name__}; the op was "
                        f"built with {SKIP_OUTPUTS} naming it, and it must be None"
                    )
                how = "aliases" if decl.aliases else "is absent without"
                return (
                    f"{self.op}: {producer} returned output {decl.name!r} as {type(item).__name__}; it {how} input "
                    f"{decl.aliases or decl.absent_without!r}, which the call left out, and must be None"
                )
            shape, dtype = tuple(call.output_shapes[index]), call.output_dtypes[index]
            if not isinstance(item, torch.Tensor):
                got = type(item).__name__
            else:
                got = f"{tuple(item.shape)} {item.dtype} on {item.device}"
            expected = f"{shape} {dtype} on {call.device}"
            if isinstance(item, torch.Tensor) and got == expected:
                if decl.aliases:
                    return (
                        f"{self.op}: {producer} returned output {decl.name!r} as a new tensor; it aliases "
                        f"input {decl.aliases!r} and must be that tensor, written in place"
                    )
                return (
                    f"{self.op}: {producer} returned output {decl.name!r} as a new tensor instead of the "
                    f"buffer passed as {decl.out}= (the buffer was left as it was); fill and return the buffer"
                )
            return f"{self.op}: {producer} returned output {decl.name!r} as {got}; the signature gives {expected}"
        return f"{self.op}: {producer} returned an unexpected result"

    # -- pieces ----------------------------------------------------------------------------
    def _missing_or_wrong(self, decl: TensorDecl, value: Any):
        if value is None:
            # The input's doc says what it is (and, where the manifest says so, which op takes a
            # call without it).
            what = f": {_sentence_inside(decl.doc)}" if decl.doc else ""
            raise OpArgumentError(f"{self.op}: missing required input {decl.name!r}{what}")
        raise OpArgumentError(f"{self.op}: argument {decl.name!r} expected a torch.Tensor, got {type(value).__name__}")

    def _check_kind(self, what: str, tensor: torch.Tensor) -> None:
        kind = unsupported_kind(tensor)
        if kind is not None:
            raise OpArgumentError(
                f"{self.op}: {what} is {kind}; ops take dense (strided) tensors outside torch.func transforms "
                "(convert it, e.g. with .to_dense(), or call the op outside the transform)"
            )

    def _check_dtype(self, decl: TensorDecl, tensor: torch.Tensor, values: list) -> None:
        if decl.dtypes is not None:
            if tensor.dtype not in decl.dtypes:
                raise OpArgumentError(
                    f"{self.op}: argument {decl.name!r} expected dtype {_dtype_text(decl.dtypes)}, got {tensor.dtype}"
                )
            return
        other = values[self._input_index[decl.dtype_same_as]]
        if other is not None and tensor.dtype != other.dtype:
            raise OpArgumentError(
                f"{self.op}: argument {decl.name!r} must have the dtype of {decl.dtype_same_as!r} "
                f"({other.dtype}), got {tensor.dtype}"
            )

    def _check_shape(self, decl: TensorDecl, tensor: torch.Tensor, values: list, dims: dict, scope) -> None:
        shape = tuple(tensor.shape)
        if decl.shape is None:
            other = values[self._input_index[decl.shape_same_as]]
            if other is not None and shape != tuple(other.shape):
                raise OpArgumentError(
                    f"{self.op}: argument {decl.name!r} must have the shape of {decl.shape_same_as!r} "
                    f"{tuple(other.shape)}, got {shape}"
                )
            return
        problem = decl.shape.match(shape, dims, scope)
        if problem is not None:
            raise OpArgumentError(
                f"{self.op}: argument {decl.name!r} expected shape {decl.shape}"
                f"{decl.shape.bindings_text(dims, scope)}, got {shape}: {problem}"
            )

    def _row_view(self, decl: TensorDecl, tensor: torch.Tensor, dims: dict, scope) -> bool:
        """Whether ``tensor``, matched to ``decl`` (``row_views``), is a row view of its rows: the
        dimensions its shape pattern (or the one it follows) names after the leading ``...``."""
        rank = decl.pattern(self.entry.input).row_width(lambda name: given(name, dims, scope))
        return bool(rank) and is_row_view(tensor, rank)

    def _check_call_constraints(self, params: Mapping[str, Any], dims: dict) -> None:
        namespace = None
        for constraint in self.entry.constraints:
            if constraint.at_construction:
                continue
            namespace = namespace or {**params, **dims}
            if not constraint.holds(namespace):
                values = ", ".join(f"{k}={shown(v)}" for k, v in dims.items())
                raise OpArgumentError(f"{self.op}: {constraint.message} (bound: {values}; rule: {constraint.text})")

    def _output_layout(self, values: list, dims: dict, params: Mapping[str, Any]):
        shapes, dtypes = [], []
        for decl, absent in zip(self.entry.outputs, self.absent_outputs(values, params)):
            if absent:  # None in the result: no layout
                shapes.append(None)
                dtypes.append(None)
                continue
            if decl.shape_same_as is not None:
                source = values[self._input_index[decl.shape_same_as]]
                shapes.append(tuple(source.shape))
            else:
                shapes.append(decl.shape.expand(lambda name: given(name, dims, params)))
            if decl.dtype_param is not None and params[decl.dtype_param] is not None:
                dtypes.append(params[decl.dtype_param])
            elif decl.dtype_same_as is not None:
                dtypes.append(values[self._input_index[decl.dtype_same_as]].dtype)
            else:
                dtypes.append(decl.dtypes[0])
        return tuple(shapes), tuple(dtypes)

    def _check_out_buffer(self, keyword: str, buffer: Any, shapes, dtypes, device) -> None:
        index = self.out_keywords[keyword]
        shape, dtype = shapes[index], dtypes[index]
        if not isinstance(buffer, torch.Tensor):
            raise OpArgumentError(f"{self.op}: output buffer {keyword!r} expected a torch.Tensor, got {type(buffer).__name__}")
        self._check_kind(f"output buffer {keyword!r}", buffer)
        if tuple(buffer.shape) != shape or buffer.dtype != dtype:
            raise OpArgumentError(
                f"{self.op}: output buffer {keyword!r} expected shape {shape} and dtype {dtype}, "
                f"got {tuple(buffer.shape)} {buffer.dtype}"
            )
        if buffer.device != device:
            raise OpArgumentError(f"{self.op}: output buffer {keyword!r} is on {buffer.device}, the call's device is {device}")
        if not buffer.is_contiguous():
            raise OpArgumentError(
                f"{self.op}: output buffer {keyword!r} must be contiguous; got strides {tuple(buffer.stride())}"
            )
