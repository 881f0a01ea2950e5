"""Ops under ``torch.compile``: each op class is a ``torch.library`` custom op when traced.

Eager calls never come here (they keep their own fast path). When Dynamo traces a call, the op
calls its class's custom op ``tileops::<OpName>``, whose schema is derived from the manifest
signature (the inputs as tensors, the ``out=`` buffers as tensors it writes, the execution
arguments, then the key of the op instance) and whose fake implementation builds the outputs
from the signature, so the graph needs no break and shapes stay symbolic.

When the compiled graph runs, the custom op calls the very op instance that was traced, with
the call's own tensors and buffers: its bound target, its kernels and every check of an eager
call (shapes, dtypes, devices, contiguity, buffers, shared memory) hold as in eager code, and a
call that fails them raises the eager call's error. A call that fails them while it is traced
is traced with placeholder outputs, so that the error is the one the compiled graph's eager
call raises when it runs, not one of Dynamo's.

A differentiable op has a third custom op, ``tileops::<OpName>_saving``, for traced calls whose
inputs require grad: it returns the outputs and then the statistics the backward reads, and
carries the autograd formula (``autograd.register_formula``) that calls the backward op's
custom op, so compiled training steps differentiate through it.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch._subclasses.fake_tensor import is_fake

from . import autograd
from .errors import OpArgumentError

if TYPE_CHECKING:
    from .op import Op

_PARAM_SCHEMA = {"int": "int", "float": "float", "bool": "bool", "str": "str", "shape": "int[]", "dtype": "ScalarType"}
_lock = threading.Lock()
#: Key (an int in the traced graph) -> the op instance a compiled call runs.
_traced_instances: weakref.WeakValueDictionary[int, Op] = weakref.WeakValueDictionary()
_keys = itertools.count()


#: True while Dynamo (torch.compile) traces the caller; called on every eager op call.
is_compiling = torch.compiler.is_compiling


def instance_key(op: Op) -> int:
    """The key by which a compiled graph names ``op``: its calls run ``op`` itself."""
    key = next(_keys)
    _traced_instances[key] = op
    return key


def _schema(op_class: type[Op], with_buffers: bool, saving: bool = False) -> str:
    entry = op_class.manifest_entry()
    arguments = []
    # Every input is optional in the schema: a missing one reaches the eager call's check.
    for i, decl in enumerate(entry.inputs):
        arguments.append(f"Tensor{f'(w{i}!)' if decl.written else ''}? {decl.name}")
    if with_buffers:
        arguments += [f"Tensor(o{i}!)? {t.out}" for i, t in enumerate(entry.outputs) if t.out]
    for argument in entry.exec_args:  # None: not passed (the implementation uses its default)
        arguments.append(f"{_PARAM_SCHEMA[argument.type]}? {argument.name}")
    if saving:
        arguments.append("int wanted")  # the inputs whose gradients are computed, a bit each
    arguments.append("int instance")
    count = len(entry.outputs) + (len(entry.backward.saves) if saving else 0)
    outputs = ", ".join("Tensor" for _ in range(count))
    returns = outputs if count == 1 else f"({outputs})"
    return f"({', '.join(arguments)}) -> {returns}"


def _instance(key: int, op_name: str) -> Op:
    op = _traced_instances.get(key)
    if op is None:
        raise OpArgumentError(
            f"{op_name}: the op instance this compiled code was traced with no longer exists; keep the op "
            "alive (e.g. as a module attribute) for as long as the compiled function is used"
        )
    return op


def define_custom_op(op_class: type[Op]) -> None:
    """Define the ``torch.library`` custom ops of ``op_class``: ``op_class._custom_op`` for
    calls without output buffers and, for an op that takes ``out=`` buffers,
    ``op_class._custom_op_with_buffers`` for calls with some (two ops, because a call without
    buffers then mutates nothing, which Inductor needs to lower a single-output op).

    Called when the first instance is constructed (outside tracing: Dynamo cannot trace the
    definition), so that a traced call only reads a class attribute.
    """
    if "_custom_op" in op_class.__dict__:
        return
    with _lock:
        if "_custom_op" in op_class.__dict__:
            return
        entry = op_class.manifest_entry()
        written = [t.name for t in entry.inputs if t.written]
        out_keywords = [t.out for t in entry.outputs if t.out]
        # All three are set on the class itself (None where the op has no use for one), so that a
        # traced call reads them as plain attributes: Dynamo refuses to read a class's
        # __dict__ once the traced function has mutated a dict, and an attribute the class
        # lacked would be its parent's.
        op_class._custom_op_with_buffers = (
            _custom_op(op_class, f"{op_class.__name__}_with_buffers", out_keywords, written) if out_keywords else None
        )
        op_class._custom_op_saving = _saving_custom_op(op_class) if entry.backward is not None and not written else None
        op_class._custom_op = _custom_op(op_class, op_class.__name__, [], written)


def _custom_op(op_class: type[Op], library_name: str, out_keywords: list[str], written: list[str]):
    entry = op_class.manifest_entry()
    name = op_class.__name__
    n_inputs = len(entry.inputs)
    input_names = [t.name for t in entry.inputs]
    exec_names = [a.name for a in entry.exec_args]
    single = len(entry.outputs) == 1

    def split(arguments: tuple):
        return _split(arguments, n_inputs, out_keywords, exec_names)

    aliased = {i: input_names.index(t.aliases) for i, t in enumerate(entry.outputs) if t.aliases}

    def implementation(*arguments):
        inputs, given, key = split(arguments)
        result = _instance(key, name)(*inputs, **given)
        results = (result,) if single else result
        # A custom op's result may alias none of its arguments: a filled buffer and an input the
        # op writes and returns are returned by the traced call itself; any other input (or a
        # view of one) returned becomes a copy.
        results = tuple(
            _placeholder(given[t.out]) if t.out in given
            else _alias_placeholder(inputs, aliased[i]) if i in aliased
            else _nothing(_device_of(inputs)) if r is None  # absent: the traced call puts None back
            else (r.clone() if _is_input(r, inputs) else r)
            for i, (t, r) in enumerate(zip(entry.outputs, results))
        )
        return results[0] if single else results

    def fake(*arguments):
        if not any(is_fake(a) for a in arguments if isinstance(a, torch.Tensor)):
            # Not tracing: a meta tensor among real ones sent the call to the meta kernel.
            return implementation(*arguments)
        inputs, given, key = split(arguments)
        op = _instance(key, name)
        try:
            call = op.signature().bind(op.params, inputs, given, check_overlap=False)
        except OpArgumentError:
            # Traced with placeholders; the graph's eager call raises the same error when it runs.
            outputs = _placeholders(entry, inputs)
        else:
            outputs = tuple(
                _placeholder(given[t.out]) if t.out in given
                else _alias_placeholder(inputs, aliased[i]) if i in aliased
                else _nothing(call.device) if shape is None  # absent
                else torch.empty(shape, dtype=dtype, device=call.device)
                for i, (t, shape, dtype) in enumerate(zip(entry.outputs, call.output_shapes, call.output_dtypes))
            )
        return outputs[0] if single else outputs

    custom = torch.library.custom_op(
        f"tileops::{library_name}", implementation, mutates_args=written + out_keywords, schema=_schema(op_class, bool(out_keywords))
    )
    custom.register_fake(fake)
    return custom


def _split(arguments: tuple, n_inputs: int, out_keywords, exec_names):
    """(inputs, keywords given: buffers and execution arguments, instance key) of a custom op's
    arguments (inputs..., buffers..., execution arguments..., instance)."""
    n_outs = len(out_keywords)
    given = dict(zip(out_keywords, arguments[n_inputs : n_inputs + n_outs]))
    given.update(zip(exec_names, arguments[n_inputs + n_outs : -1]))
    return arguments[:n_inputs], {k: v for k, v in given.items() if v is not None}, arguments[-1]


def _saving_custom_op(op_class: type[Op]):
    """The custom op of traced calls that record autograd history: outputs, then statistics (an
    empty placeholder for each saved for an input that wants no gradient: a custom op returns
    tensors)."""
    entry = op_class.manifest_entry()
    name = op_class.__name__
    n_inputs, n_outputs = len(entry.inputs), len(entry.outputs)
    exec_names = [a.name for a in entry.exec_args]
    backward_entry = op_class.backward_class().manifest_entry()
    saves = entry.backward.saves

    def split(arguments: tuple):
        # (inputs, keywords, wanted, instance key): the wanted gradients come before the key.
        inputs, given, key = _split((*arguments[:-2], arguments[-1]), n_inputs, (), exec_names)
        return inputs, given, arguments[-2], key

    def implementation(*arguments):
        inputs, given, wanted, key = split(arguments)
        op = _instance(key, name)
        call = op.signature().bind(op.params, inputs, given)
        result, saved = op.run_saving(call, wanted)
        outputs = (result,) if n_outputs == 1 else tuple(result)
        saved = op.differentiation.complete_saved(op, call.inputs, outputs, saved, wanted)
        # A custom op's result may alias none of its arguments (an implementation may return a
        # view of an input where nothing changes).
        outputs = tuple(r.clone() if _is_input(r, inputs) else r for r in outputs)
        saved = tuple(_nothing(call.device) if value is None else value for value in saved)
        return _one_or_tuple((*outputs, *saved))

    def fake(*arguments):
        inputs, given, wanted, key = split(arguments)
        op = _instance(key, name)
        try:
            call = op.signature().bind(op.params, inputs, given, check_overlap=False)
        except OpArgumentError:
            outputs = _placeholders(entry, inputs)
            return _one_or_tuple((*outputs, *[_nothing(outputs[0].device) for _ in saves]))
        outputs = tuple(
            torch.empty(shape, dtype=dtype, device=call.device)
            for shape, dtype in zip(call.output_shapes, call.output_dtypes)
        )
        tensors = {t.name: value for t, value in zip(entry.inputs, call.inputs)}
        for t, value in zip(entry.outputs, outputs):
            tensors[t.name] = tensors[f"d{t.name}"] = value
        statistics = _statistics(backward_entry, saves, tensors, op.params, call.device)
        skipped = op.differentiation.unwanted(wanted)
        statistics = [_nothing(call.device) if skip else value for value, skip in zip(statistics, skipped)]
        return _one_or_tuple((*outputs, *statistics))

    custom = torch.library.custom_op(
        f"tileops::{name}_saving", implementation, mutates_args=(), schema=_schema(op_class, False, saving=True)
    )
    custom.register_fake(fake)
    autograd.register_formula(custom, n_inputs, n_outputs, lambda key: _instance(key, name))
    return custom


def _one_or_tuple(results: tuple):
    """A custom op's results as its schema returns them: one tensor alone, several as a tuple."""
    return results[0] if len(results) == 1 else results


def _statistics(backward_entry, saves, tensors: dict, params, device) -> list[torch.Tensor]:
    """Traced statistics of a call: the backward op's declared shapes of ``saves``, with the
    dimensions its other inputs bind where ``tensors`` (forward inputs and outputs by name, an
    output's gradient as ``d<output>``) give them; of the declared dtype that matches the call's
    first input, else the first declared."""
    dims: dict = {}
    for decl in backward_entry.inputs:
        tensor = tensors.get(decl.name)
        if decl.shape is not None and tensor is not None and decl.name not in saves:
            decl.shape.match(tuple(tensor.shape), dims, params)
    first = tensors[backward_entry.inputs[0].name]
    statistics = []
    for name in saves:
        decl = backward_entry.input(name)
        dtype = decl.dtype_in(first.dtype)
        shape = decl.shape.expand(lambda dim: params.get(dim) if params.get(dim) is not None else dims.get(dim))
        statistics.append(torch.empty(shape, dtype=dtype, device=device))
    return statistics


def _placeholder(buffer: torch.Tensor) -> torch.Tensor:
    """What the custom op returns for an output written into the caller's ``buffer``."""
    return torch.empty(0, dtype=buffer.dtype, device=buffer.device)


def _alias_placeholder(inputs: tuple, index: int) -> torch.Tensor:
    """What the custom op returns for an output that aliases ``inputs[index]``; the traced call
    returns the input itself, or None where the call left that optional input out."""
    if inputs[index] is not None:
        return _placeholder(inputs[index])
    return _nothing(_device_of(inputs))


def _device_of(inputs: tuple) -> torch.device:
    """The device of a call's first tensor input."""
    return next(t.device for t in inputs if isinstance(t, torch.Tensor))


def _nothing(device: torch.device) -> torch.Tensor:
    """What a custom op returns where it has no tensor to return (its results are tensors): an
    empty one. Where it stands for None, the traced call or the autograd formula puts None back."""
    return torch.empty(0, device=device)


def _placeholders(entry, inputs: tuple) -> tuple[torch.Tensor, ...]:
    """Outputs for a call that fails its checks while traced: of an input's shape and dtype
    where the output is declared so (code after the call traces as it would), else empty."""
    by_name = {decl.name: t for decl, t in zip(entry.inputs, inputs) if isinstance(t, torch.Tensor)}
    outputs = []
    for decl in entry.outputs:
        shape_source, dtype_source = by_name.get(decl.shape_same_as), by_name.get(decl.dtype_same_as)
        device = next(iter(by_name.values())).device if by_name else None
        outputs.append(
            torch.empty(
                () if shape_source is None else shape_source.shape,
                dtype=dtype_source.dtype if dtype_source is not None else (decl.dtypes or [torch.float32])[0],
                device=device,
            )
        )
    return tuple(outputs)


def _is_input(tensor: torch.Tensor, inputs: tuple) -> bool:
    """Whether ``tensor`` is, or views the memory of, one of ``inputs`` (a custom op's result
    may alias none of its arguments)."""
    storage = tensor.untyped_storage().data_ptr()
    return any(
        t is tensor or (isinstance(t, torch.Tensor) and storage != 0 and t.untyped_storage().data_ptr() == storage)
        for t in inputs
    )


def traced_call(op: Op, args: tuple, kwargs: dict) -> Any:
    """What ``op(*args, **kwargs)`` records while Dynamo traces it.

    Arguments the custom op's schema cannot carry (too many, unknown, not tensors) are refused
    here, by the eager call's rules; everything about the tensors is checked by the eager call
    the graph makes when it runs.
    """
    signature = op.signature()
    names = signature.input_names
    if len(args) > len(names):
        signature.bind(op.params, args, kwargs)  # raises the eager call's error
    inputs: list[Any] = list(args) + [None] * (len(names) - len(args))
    exec_args = {a.name: a for a in signature.entry.exec_args}
    outs = {}
    given = {}
    for name, value in kwargs.items():
        if name in signature.out_keywords:
            outs[name] = value
        elif name in names and names.index(name) >= len(args):
            inputs[names.index(name)] = value
        elif name in exec_args:
            value = signature.check_exec_arg(name, value)
            if value is None and exec_args[name].default is not None:
                # The custom op's schema passes None for "not given": this call would run with the default.
                raise OpArgumentError(
                    f"{type(op).__name__}: execution argument {name!r} cannot be passed as None inside "
                    f"torch.compile (its default is {exec_args[name].default!r}); call the op outside the "
                    "compiled region to pass None"
                )
            given[name] = value
        else:
            signature.bind(op.params, args, kwargs)  # raises the eager call's error
    for name, value in [*zip(names, inputs), *outs.items()]:
        if value is not None and not isinstance(value, torch.Tensor):
            what = "output buffer" if name in outs else "argument"
            raise OpArgumentError(f"{type(op).__name__}: {what} {name!r} expected a torch.Tensor, got {type(value).__name__}")
    custom = type(op)._custom_op
    execution = [given.get(name) for name in exec_args]
    buffers = [outs.get(keyword) for keyword in signature.out_keywords]
    wiring = op.differentiation
    if wiring is not None and wiring.needs_grad(inputs):
        autograd.refuse_buffers(op, {k: v for k, v in outs.items() if v is not None})
        results = type(op)._custom_op_saving(*inputs, *execution, wiring.wanted(inputs), op.trace_key)
        if not isinstance(results, tuple):  # one output and nothing saved
            return results
        n_outputs = len(signature.entry.outputs)
        return results[0] if n_outputs == 1 else tuple(results[:n_outputs])
    if all(buffer is None for buffer in buffers):
        result = custom(*inputs, *execution, op.trace_key)
    else:
        result = type(op)._custom_op_with_buffers(*inputs, *buffers, *execution, op.trace_key)
    results = [result] if len(signature.entry.outputs) == 1 else list(result)
    # The outputs the custom op returns as placeholders: the caller's buffers, the inputs it wrote.
    for keyword, index in signature.out_keywords.items():
        if outs.get(keyword) is not None:
            results[index] = outs[keyword]
    results = signature.with_written_inputs(results, inputs, op.params)
    return results[0] if len(results) == 1 else tuple(results)
