"""The generated fast path of an op's call checks.

For one op instance (its class's entry and its params), Python source is written once that
accepts only the common case — every tensor present as declared, a torch.Tensor, contiguous,
on the call's device, with the declared dtype and shape, output buffers that fit — and returns
``None`` for anything else, including a call whose written tensors are all empty.
``Signature.bind`` stays the reference: it handles what the fast path declines (copies
non-contiguous inputs, builds the precise error, returns an empty call's outputs). So the fast path can
only ever be stricter, never more lenient, than the reference.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch

from .expressions import evaluate
from .loader import OpEntry, TensorDecl


class _Writer:
    def __init__(self, entry: OpEntry, params: Mapping[str, Any]) -> None:
        self.entry, self.params = entry, params
        self.lines: list[str] = []
        self.constants: dict[str, Any] = {}
        self.dims: dict[str, str] = {}  # bound name -> local variable holding it

    def constant(self, value: Any) -> str:
        name = f"_c{len(self.constants)}"
        self.constants[name] = value
        return name

    def emit(self, line: str, indent: int) -> None:
        self.lines.append("    " * indent + line)

    def shape_checks(self, decl: TensorDecl, shape_var: str, indent: int) -> None:
        pattern = decl.shape
        widths = []
        free_at = None
        for i, dim in enumerate(pattern):
            if isinstance(dim, str) and (dim == "..." or dim[0] == "*"):
                name = dim[1:]
                if name in self.params:
                    widths.append(len(self.params[name]))
                elif name in self.dims:
                    widths.append(None)  # bound by an earlier input: same length, checked below
                    free_at = i if free_at is None else free_at
                else:
                    widths.append(None)
                    free_at = i if free_at is None else free_at
            else:
                widths.append(1)
        fixed = sum(w for w in widths if w is not None)
        comparison = "<" if free_at is not None else "!="
        self.emit(f"if len({shape_var}) {comparison} {fixed}: return None", indent)
        # Entries before the free group index from the front, entries after it from the back
        # (negative indices), so no index depends on the call's rank.
        offset = 0
        for i, dim in enumerate(pattern):
            if free_at is not None and i >= free_at:
                break
            self._check_entry(dim, shape_var, offset, widths[i], indent)
            offset += widths[i]
        if free_at is None:
            return
        back = 0
        for i in range(len(pattern) - 1, free_at, -1):
            back += widths[i]
            self._check_entry(pattern[i], shape_var, -back, widths[i], indent)
        dim = pattern[free_at]
        if dim != "...":
            group = f"tuple({shape_var}[{offset}:len({shape_var}) - {back}])"
            self._bind_or_compare(dim[1:], group, indent)

    def _check_entry(self, dim, shape_var: str, index: int, width: int, indent: int) -> None:
        """Checks of one pattern entry starting at ``index`` (negative: from the end)."""
        if isinstance(dim, int):
            self.emit(f"if {shape_var}[{index}] != {dim}: return None", indent)
        elif dim[0] == "*":
            # A group bound by a shape param: its sizes are known now, so compare them one by
            # one (ints compare faster than a slice of torch.Size).
            for position, size in enumerate(self.params[dim[1:]]):
                self.emit(f"if {shape_var}[{index + position}] != {size}: return None", indent)
        elif dim in self.params:
            self.emit(f"if {shape_var}[{index}] != {self.constant(self.params[dim])}: return None", indent)
        else:
            self._bind_or_compare(dim, f"{shape_var}[{index}]", indent)

    def _bind_or_compare(self, name: str, value: str, indent: int) -> None:
        if name in self.dims:
            self.emit(f"if {value} != {self.dims[name]}: return None", indent)
        else:
            local = f"_d_{name}"
            self.emit(f"{local} = {value}", indent)
            self.dims[name] = local

    def output_shape(self, decl: TensorDecl) -> str:
        if decl.shape_same_as is not None:
            return f"_s_{decl.shape_same_as}"
        parts = []
        for dim in decl.shape:
            if isinstance(dim, int):
                parts.append(f"({dim},)")
            elif dim[0] == "*":
                name = dim[1:]
                parts.append(self.constant(tuple(self.params[name])) if name in self.params else self.dims[name])
            else:
                parts.append(f"({self.constant(self.params[dim]) if dim in self.params else self.dims[dim]},)")
        return "torch.Size(" + (" + ".join(parts) or "()") + ")"

    def output_dtype(self, decl: TensorDecl) -> str:
        return f"_t_{decl.dtype_same_as}" if decl.dtype_same_as else self.constant(decl.dtypes[0])


_ABSENT = object()


def compile_fast_bind(entry: OpEntry, params: Mapping[str, Any], bound_call: type) -> Callable[..., Any]:
    """A function taking the op's call arguments and returning a ``bound_call`` or None."""
    w = _Writer(entry, params)
    arguments = []
    for decl in entry.inputs:
        arguments.append(f"{decl.name}={'None' if decl.optional else '_ABSENT'}")
    outs = [t.out for t in entry.outputs if t.out]
    header = ", ".join(arguments) + (", *, " + ", ".join(f"{o}=None" for o in outs) if outs else "")
    w.emit(f"def fast_bind({header}):", 0)
    first = entry.inputs[0].name
    for decl in entry.inputs:
        t = decl.name
        indent = 1
        if decl.optional:
            w.emit(f"if {t} is not None:", 1)
            indent = 2
        else:
            w.emit(f"if {t} is _ABSENT: return None", 1)
        w.emit(f"if not isinstance({t}, _Tensor): return None", indent)
        if decl.dtypes is not None:
            w.emit(f"_t_{t} = {t}.dtype", indent)
            w.emit(f"if _t_{t} not in {w.constant(frozenset(decl.dtypes))}: return None", indent)
        else:
            ref = decl.dtype_same_as
            ref_optional = entry.input(ref).optional
            guard = f"{ref} is not None and " if ref_optional else ""
            w.emit(f"_t_{t} = {t}.dtype", indent)
            w.emit(f"if {guard}_t_{t} is not _t_{ref}: return None", indent)
        w.emit(f"_s_{t} = {t}.shape", indent)
        if decl.shape is not None:
            if decl.optional:
                # A name first bound inside an optional input's block may be unbound later.
                before = dict(w.dims)
                w.shape_checks(decl, f"_s_{t}", indent)
                if set(w.dims) != set(before):
                    raise _Unsupported
            else:
                w.shape_checks(decl, f"_s_{t}", indent)
        else:
            ref = decl.shape_same_as
            guard = f"{ref} is not None and " if entry.input(ref).optional else ""
            w.emit(f"if {guard}_s_{t} != _s_{ref}: return None", indent)
        if t == first:
            w.emit(f"_dev = {t}.device", indent)
        elif decl.cpu:
            w.emit(f"if {t}.device.type != 'cpu': return None", indent)
        else:
            w.emit(f"if {t}.device != _dev: return None", indent)
        w.emit(f"if not {t}.is_contiguous(): return None", indent)
    if any(decl.optional and decl.dtypes is not None for decl in entry.inputs):
        raise _Unsupported  # its dtype local would be unbound when the input is absent
    for decl in entry.outputs:
        if decl.dtype_same_as and entry.input(decl.dtype_same_as).optional:
            raise _Unsupported
        if decl.shape_same_as and entry.input(decl.shape_same_as).optional:
            raise _Unsupported
    shapes = [w.output_shape(decl) for decl in entry.outputs]
    dtypes = [w.output_dtype(decl) for decl in entry.outputs]
    w.emit("_outs = _NO_OUTS", 1)
    for i, decl in enumerate(entry.outputs):
        if decl.out:
            o = decl.out
            w.emit(f"if {o} is not None:", 1)
            w.emit(
                f"if not isinstance({o}, _Tensor) or {o}.shape != {shapes[i]} or {o}.dtype is not {dtypes[i]} "
                f"or {o}.device != _dev or not {o}.is_contiguous(): return None",
                2,
            )
            w.emit(f"_outs = {{**_outs, {o!r}: {o}}}", 2)
    # A call whose written tensors are all empty runs nothing: the reference bind handles it.
    written = [f"0 in {shape}" for decl, shape in zip(entry.outputs, shapes) if not decl.aliases]
    written += [f"{decl.name}.numel() == 0" for decl in entry.inputs if decl.written and not decl.optional]
    if written:
        w.emit(f"if {' and '.join(written)}: return None", 1)
    dims = ("{" + ", ".join(f"{name!r}: {local}" for name, local in w.dims.items()) + "}") if w.dims else "_NO_DIMS"
    w.emit(f"_dims = {dims}", 1)
    call_constraints = [c for c in entry.constraints if not c.at_construction]
    if call_constraints:
        w.emit(f"if not _constraints_hold({{**_params, **_dims}}): return None", 1)
    inputs = "(" + "".join(f"{decl.name}, " for decl in entry.inputs) + ")"
    w.emit(
        f"return _BoundCall({inputs}, _outs, _dev, _dims, ({''.join(s + ', ' for s in shapes)}), "
        f"({''.join(d + ', ' for d in dtypes)}))",
        1,
    )
    source = "\n".join(w.lines)

    def constraints_hold(namespace: dict) -> bool:
        return all(evaluate(c.code, namespace) for c in call_constraints)

    namespace = {
        "_ABSENT": _ABSENT,
        "_Tensor": torch.Tensor,
        "torch": torch,
        "_BoundCall": bound_call,
        "_params": dict(params),
        "_NO_OUTS": MappingProxyType({}),
        "_NO_DIMS": MappingProxyType({}),
        "_constraints_hold": constraints_hold,
        **w.constants,
    }
    exec(compile(source, f"<fast bind of {entry.name}>", "exec"), namespace)  # noqa: S102 - our own source
    fast_bind = namespace["fast_bind"]
    fast_bind.source = source
    return fast_bind


class _Unsupported(Exception):
    """The entry uses a feature the fast path does not generate; the reference bind serves it."""


def try_compile_fast_bind(entry: OpEntry, params: Mapping[str, Any], bound_call: type):
    """``compile_fast_bind``, or None where the entry needs the reference bind for every call."""
    try:
        return compile_fast_bind(entry, params, bound_call)
    except _Unsupported:
        return None
