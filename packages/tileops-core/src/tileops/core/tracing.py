"""Ops under ``torch.compile``: each op class is a ``torch.library`` custom op when traced.

Eager calls never come here (they keep their own fast path). When Dynamo traces a call, the op
calls its class's custom op ``tileops::<OpName>``, whose schema is derived from the manifest
signature (the inputs as tensors, then the params, then the requested target) and whose fake
implementation builds the outputs from the signature, so the graph needs no break and shapes
stay symbolic. When the compiled graph runs, the custom op calls an eager op instance with the
same params and target, so target binding and kernel selection happen as in eager calls.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import torch

from .errors import OpArgumentError

if TYPE_CHECKING:
    from .op import Op

_PARAM_SCHEMA = {"int": "int", "float": "float", "bool": "bool", "str": "str", "shape": "int[]", "dtype": "ScalarType"}
_lock = threading.Lock()
_instances: dict[tuple, Op] = {}


#: True while Dynamo (torch.compile) traces the caller; called on every eager op call.
is_compiling = torch.compiler.is_compiling


def _schema(op_class: type[Op]) -> str:
    entry = op_class.manifest_entry()
    arguments = []
    for decl in entry.inputs:
        arguments.append(f"Tensor{'?' if decl.optional else ''}{'(a!)' if decl.written else ''} {decl.name}")
    for param in entry.params:
        arguments.append(f"{_PARAM_SCHEMA[param.type]}{'?' if param.nullable else ''} {param.name}")
    for argument in entry.exec_args:  # None: not passed (the implementation uses its default)
        arguments.append(f"{_PARAM_SCHEMA[argument.type]}? {argument.name}")
    arguments.append("str? target")
    outputs = ", ".join("Tensor" for _ in entry.outputs)
    returns = outputs if len(entry.outputs) == 1 else f"({outputs})"
    return f"({', '.join(arguments)}) -> {returns}"


def _eager_instance(op_class: type[Op], params: tuple, target: str | None) -> Op:
    key = (op_class, params, target)
    instance = _instances.get(key)
    if instance is None:
        with _lock:
            instance = _instances.get(key)
            if instance is None:
                instance = op_class(**dict(params), target=target)
                _instances[key] = instance
    return instance


def define_custom_op(op_class: type[Op]) -> None:
    """Define the ``torch.library`` custom op of ``op_class`` as ``op_class._custom_op``.

    Called when the first instance is constructed (outside tracing: Dynamo cannot trace the
    definition), so that a traced call only reads a class attribute.
    """
    if "_custom_op" in op_class.__dict__:
        return
    with _lock:
        if "_custom_op" in op_class.__dict__:
            return
        entry = op_class.manifest_entry()
        if any(t.aliases for t in entry.outputs):
            return  # an output aliasing an input cannot be a custom op's result: not traceable yet
        n_inputs = len(entry.inputs)
        param_names = [p.name for p in entry.params]
        n_params = len(param_names)
        exec_names = [a.name for a in entry.exec_args]
        mutated = [t.name for t in entry.inputs if t.written]

        def split(arguments: tuple):
            """(inputs, params, execution arguments given) of the custom op's arguments."""
            inputs = arguments[:n_inputs]
            params = _as_params(arguments[n_inputs : n_inputs + n_params], entry)
            given = {
                name: value
                for name, value in zip(exec_names, arguments[n_inputs + n_params : -1])
                if value is not None
            }
            return inputs, params, given

        def implementation(*arguments):
            inputs, params, given = split(arguments)
            result = _eager_instance(op_class, tuple(zip(param_names, params)), arguments[-1])(*inputs, **given)
            return tuple(t.clone() if _is_input(t, inputs) else t for t in result) if isinstance(result, tuple) else (
                result.clone() if _is_input(result, inputs) else result
            )

        def fake(*arguments):
            inputs, params, given = split(arguments)
            signature = op_class.signature()
            call = signature.bind(signature.bind_params(dict(zip(param_names, params))), inputs, given)
            outputs = tuple(
                torch.empty(shape, dtype=dtype, device=call.device)
                for shape, dtype in zip(call.output_shapes, call.output_dtypes)
            )
            return outputs[0] if len(outputs) == 1 else outputs

        library_name = f"tileops::{op_class.__name__}"
        custom = torch.library.custom_op(
            library_name, implementation, mutates_args=mutated, schema=_schema(op_class)
        )
        custom.register_fake(fake)
        op_class._custom_op = custom


def _is_input(tensor: torch.Tensor, inputs: tuple) -> bool:
    return any(tensor is t for t in inputs)


def _as_params(values: tuple, entry) -> list:
    """Schema values back to the types the op's constructor takes (int[] arrives as a list)."""
    return [tuple(v) if p.type == "shape" and v is not None else v for p, v in zip(entry.params, values)]


def traced_call(op: Op, args: tuple, kwargs: dict) -> Any:
    """What ``op(*args, **kwargs)`` records while Dynamo traces it."""
    signature = op.signature()
    names = signature.input_names
    inputs: list[Any] = list(args) + [None] * (len(names) - len(args))
    exec_args = {a.name: a for a in signature.entry.exec_args}
    outs = {}
    given = {}
    for name, value in kwargs.items():
        if name in signature.out_keywords:
            outs[name] = value
        elif name in names:
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
            signature.bind(op.params, args, kwargs)  # raises the precise error
    custom = type(op).__dict__.get("_custom_op")
    if custom is None and any(t.aliases for t in signature.entry.outputs):
        raise OpArgumentError(
            f"{type(op).__name__}: an output aliases a written input, which a torch.library custom op "
            "cannot return; this op cannot be traced by torch.compile yet (call it outside the compiled region)"
        )
    if custom is None:
        raise OpArgumentError(
            f"{type(op).__name__}: an op constructed inside a compiled function cannot be traced; "
            "construct it outside (e.g. in the module's __init__)"
        )
    result = custom(*inputs, *op.params.values(), *[given.get(name) for name in exec_args], op.requested_target)
    if not outs:
        return result
    results = list(result) if isinstance(result, tuple) else [result]
    for keyword, index in signature.out_keywords.items():
        if outs.get(keyword) is not None:
            outs[keyword].copy_(results[index])
            results[index] = outs[keyword]
    return tuple(results) if isinstance(result, tuple) else results[0]
