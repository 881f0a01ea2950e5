"""The generated call path of an op instance: its checks, dispatch and result checks.

For one op entry and one set of params, Python source is written once that accepts only the
common case (every tensor present as declared, a torch.Tensor, contiguous or a declared row
view, on the call's device, with the declared dtype and shape, output buffers that fit and
share no memory with another tensor of the call, no torch.func transform active), runs the
op's forward (or hands the checked call to the op's ``run_bound``, or, for a call that must
record autograd history, to its ``differentiate``) and checks the result inline. Anything
else, including a call whose written tensors are all empty, is declined: the path raises
``CallDeclined`` and ``Op`` hands the call's own arguments to ``Signature.bind``, the
reference, which copies non-contiguous inputs (row views of inputs that declare them
excepted), builds the precise error and returns an empty call's outputs. So the
generated checks can only ever be stricter, never more lenient, than the reference, and a
declined call is bound once. The generated source names no attribute of the
op: the op passes in what the path calls. The source is kept on the factory as ``source``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch

from .manifest import SKIP_OUTPUTS, BoundCall, Signature
from .manifest.entries import OpEntry, TensorDecl
from .manifest.expressions import FUNCTIONS
from .manifest.overlap import overlapping
from .manifest.shapes import PatternEntry
from .row_views import is_row_view


class _Writer:
    """Collects the lines and constants of one call path's source."""

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
        """A line of the call path's body at ``indent`` levels inside its ``while`` block."""
        self.lines.append("    " * (indent + 2) + line)

    def row_width(self, decl: TensorDecl) -> int | None:
        """How many trailing dimensions make a row of ``decl`` (declared ``row_views``), where the
        params alone say; else None."""
        return decl.pattern(self.entry.input).row_width(self.params.get)

    def shape_checks(self, decl: TensorDecl, shape_var: str, indent: int) -> None:
        pattern = decl.shape
        known = pattern.known_shape(self.params)
        if known is not None:  # one tuple comparison instead of a length and an index per entry
            self.emit(f"if {shape_var} != {self.constant(known)}: break", indent)
            return
        # Groups the params size have their width now; any other group (free, or bound by an
        # earlier input, whose size the comparison of the group checks) is the free one.
        widths = pattern.widths(self.params.get)
        fixed, free_at = pattern.arity(widths)
        comparison = "<" if free_at is not None else "!="
        if fixed or free_at is None:  # a free group alone takes every rank: nothing to check
            self.emit(f"if len({shape_var}) {comparison} {fixed}: break", indent)
        # Entries before the free group index from the front, entries after it from the back
        # (negative indices), so no index depends on the call's rank.
        entries = pattern.entries
        offset = 0
        for entry, width in zip(entries[:free_at], widths):
            self._check_entry(entry, shape_var, offset, indent)
            offset += width
        if free_at is None:
            return
        back = 0
        for i in range(len(entries) - 1, free_at, -1):
            back += widths[i]
            self._check_entry(entries[i], shape_var, -back, indent)
        group = entries[free_at]
        if group.name is None:  # '...' binds nothing
            return
        if offset == 0 and back == 0:
            # The group is the whole shape: compared as it is (a torch.Size equals the tuple of
            # its sizes), with no slice to build (0.23 us a tensor).
            self._bind_or_compare(group.name, f"tuple({shape_var})", indent, compared=shape_var)
        else:
            self._bind_or_compare(group.name, f"tuple({shape_var}[{offset}:len({shape_var}) - {back}])", indent)

    def _check_entry(self, entry: PatternEntry, shape_var: str, index: int, indent: int) -> None:
        """Checks of one pattern entry of known width starting at ``index`` (negative: from the end)."""
        if entry.size is not None:
            self.emit(f"if {shape_var}[{index}] != {entry.size}: break", indent)
        elif entry.group:
            # A group bound by a shape param: its sizes are known now, so compare them one by
            # one (ints compare faster than a slice of torch.Size).
            for position, size in enumerate(self.params[entry.name]):
                self.emit(f"if {shape_var}[{index + position}] != {size}: break", indent)
        elif self.params.get(entry.name) is not None:
            self.emit(f"if {shape_var}[{index}] != {self.constant(self.params[entry.name])}: break", indent)
        else:
            self._bind_or_compare(entry.name, f"{shape_var}[{index}]", indent)

    def _bind_or_compare(self, name: str, value: str, indent: int, compared: str | None = None) -> None:
        """Bind dimension ``name`` to ``value``, or, if an earlier input bound it, compare
        ``compared`` (by default ``value``) with it."""
        if name in self.dims:
            self.emit(f"if {compared or value} != {self.dims[name]}: break", indent)
        else:
            local = f"_d_{name}"
            self.emit(f"{local} = {value}", indent)
            self.dims[name] = local

    def output_shape(self, decl: TensorDecl) -> str:
        if decl.shape_same_as is not None:
            return f"_s_{decl.shape_same_as}"
        known = decl.shape.known_shape(self.params)
        if known is not None:  # made once, not on every call (a parameter's gradient: (n,))
            return self.constant(torch.Size(known))
        parts = []
        for entry in decl.shape.entries:
            if entry.size is not None:
                parts.append(f"({entry.size},)")
                continue
            param = self.params.get(entry.name)
            if entry.group:
                parts.append(self.dims[entry.name] if param is None else self.constant(tuple(param)))
            else:
                parts.append(f"({self.dims[entry.name] if param is None else self.constant(param)},)")
        return "torch.Size(" + (" + ".join(parts) or "()") + ")"

    def output_dtype(self, decl: TensorDecl) -> str:
        if decl.dtype_param is not None and self.params[decl.dtype_param] is not None:
            return self.constant(self.params[decl.dtype_param])
        return f"_t_{decl.dtype_same_as}" if decl.dtype_same_as else self.constant(decl.dtypes[0])


#: The default of a required input in the generated signature: the caller did not pass it.
_ABSENT = object()


class CallDeclined(Exception):
    """Raised by a generated call path for a call it does not take: the caller hands the call's
    own arguments to the reference bind. Raising costs nothing on the calls the path takes
    (a return-value sentinel would cost a comparison on every one)."""


def _shape_names(decl: TensorDecl) -> set[str]:
    """The dimension names ``decl``'s shape pattern uses (none where its shape is another's)."""
    return set() if decl.shape is None else {entry.name for entry in decl.shape.entries if entry.name is not None}


def _constraints_function(constraints, params: Mapping[str, Any], dims: list[str]) -> Callable[..., bool]:
    """One function of the call's dimensions (in ``dims``' order) that says whether every one
    of ``constraints`` holds, the op's params bound: one call in place of evaluating each
    constraint on a namespace built per call (10 us a call for an op of four of them). A
    constraint that cannot be evaluated counts as failing: the reference bind, which checks
    them one by one, then names it."""
    if not constraints:
        return lambda *dims: True
    body = " and ".join(f"({c.text})" for c in constraints)
    source = f"def holds({', '.join(dims)}):\n    try:\n        return bool({body})\n    except Exception:\n        return False\n"
    # The texts passed the manifest's expression checks (names, FUNCTIONS, no attributes).
    namespace = {**FUNCTIONS, **params, "bool": bool, "Exception": Exception, "__builtins__": {}}
    exec(compile(source, "<constraints>", "exec"), namespace)  # noqa: S102 - checked manifest text
    return namespace["holds"]


def compile_call_path(signature: Signature, params: Mapping[str, Any]):
    """The factory of the call path of an op with ``params``:
    ``make_call_path(forward=, run_bound=, runs_forward=, check_results=, differentiate=)``.

    The call path takes the op's call arguments. When every check holds it returns
    ``differentiate(call)`` of the checked ``BoundCall`` for a call that must record autograd
    history (an op with a backward, grad mode on, an input that gets a gradient requiring it);
    else it runs ``forward(*inputs, **out_buffers)`` if ``runs_forward`` (the op is bound to its
    in-tree implementations), checking the result inline unless ``check_results`` is false (the
    op runs only its own, tested implementations: the check would cost a tenth of a decode call
    and never fire); otherwise it returns ``run_bound(call)``. It raises ``CallDeclined`` for any
    call it does not take.
    ``signature.check_result(result, call, producer)`` builds the error for a result that does
    not fit.
    """
    entry = signature.entry
    outs = [t.out for t in entry.outputs if t.out]
    names = [decl.name for decl in entry.inputs] + outs
    if any(name.startswith("_") for name in names):
        raise _Unsupported  # would shadow the generated locals
    w = _Writer(entry, params)
    first = entry.inputs[0]
    if first.optional:
        raise _Unsupported  # the call's device is the first input's
    # Required inputs are checked first, so an optional input's dimensions are mostly bound
    # already (compared, not bound, in its block); a dimension only optional inputs name is
    # checked within its block and left out of the call's dims, unless a later shape needs it.
    required = [decl for decl in entry.inputs if not decl.optional]
    optional = [decl for decl in entry.inputs if decl.optional]
    optional_names = {decl.name for decl in optional}
    if any(decl.dtype_same_as in optional_names or decl.shape_same_as in optional_names for decl in required):
        raise _Unsupported
    # Tensors under torch.vmap (and other torch.func transforms) pass every check below but
    # have no storage: one check per call, cheaper than one per tensor.
    w.emit("if _transforms_active(): break", 1)
    conditional_dims: dict[str, dict[str, str]] = {}  # optional input -> the dims only it binds
    for position, decl in enumerate(required + optional):
        t = decl.name
        indent = 1
        if decl.optional:
            w.emit(f"if {t} is not None:", 1)
            indent = 2
        # A required input not passed holds _ABSENT, no tensor: the reference bind names it.
        w.emit(f"if not isinstance({t}, _Tensor): break", indent)
        if decl.dtypes is not None:
            w.emit(f"_t_{t} = {t}.dtype", indent)
            w.emit(f"if _t_{t} not in {w.constant(frozenset(decl.dtypes))}: break", indent)
        else:
            ref = decl.dtype_same_as
            ref_optional = entry.input(ref).optional
            guard = f"{ref} is not None and " if ref_optional else ""
            w.emit(f"_t_{t} = {t}.dtype", indent)
            w.emit(f"if {guard}_t_{t} is not _t_{ref}: break", indent)
        w.emit(f"_s_{t} = {t}.shape", indent)
        if decl.shape is not None:
            if decl.optional:
                # A name first bound inside an optional input's block is unbound where the
                # input is None: no later shape may use it.
                before = set(w.dims)
                w.shape_checks(decl, f"_s_{t}", indent)
                bound_here = set(w.dims) - before
                later = [*optional[position - len(required) + 1:], *entry.outputs]
                if bound_here & {name for later_decl in later for name in _shape_names(later_decl)}:
                    raise _Unsupported
                if bound_here:
                    conditional_dims[t] = {name: w.dims.pop(name) for name in sorted(bound_here)}
            else:
                w.shape_checks(decl, f"_s_{t}", indent)
        else:
            ref = decl.shape_same_as
            guard = f"{ref} is not None and " if entry.input(ref).optional else ""
            w.emit(f"if {guard}_s_{t} != _s_{ref}: break", indent)
        if decl is first:
            w.emit(f"_dev = {t}.device", indent)
        elif decl.cpu:
            w.emit(f"if not {t}.is_cpu: break", indent)
        else:
            w.emit(f"if {t}.device != _dev: break", indent)
        # An mkldnn tensor says it is contiguous: its layout tells it apart. An input whose
        # shape alone is read may be any strided view (autograd passes a one-element stand-in).
        # A row view passes where its row's width is known from the params alone; otherwise the
        # reference bind, which knows the call's dimensions, decides.
        row_width = w.row_width(decl) if decl.row_views else None
        if decl.described_only:
            w.emit(f"if {t}.layout is not _strided: break", indent)
        elif row_width:
            w.emit(f"if {t}.layout is not _strided or not ({t}.is_contiguous() or _row_view({t}, {row_width})): break", indent)
        else:
            w.emit(f"if not {t}.is_contiguous() or {t}.layout is not _strided: break", indent)
    if entry.backward is not None:
        # A call that must record autograd history is checked as any other, then handed to
        # ``differentiate`` (the op's autograd node): the reference bind would cost a training
        # step's call 44 us more. Grad mode is read first: under torch.no_grad (serving, with
        # parameters that require grad) it answers in one read, not one per tensor.
        tracked = [
            f"({decl.name} is not None and {decl.name}.requires_grad)" if decl.optional else f"{decl.name}.requires_grad"
            for decl in entry.inputs
            if decl.name in entry.backward.grads
        ]
        w.emit(f"_tracked = _grad_enabled() and ({' or '.join(tracked)})", 1)
    for decl in entry.outputs:
        if decl.aliases:  # an optional input's alias is None where the input is: checked below
            continue
        if decl.dtype_same_as and entry.input(decl.dtype_same_as).optional:
            raise _Unsupported
        if decl.shape_same_as and entry.input(decl.shape_same_as).optional:
            raise _Unsupported
    shapes, dtypes = [], []
    skipped = params.get(SKIP_OUTPUTS, ())
    for i, decl in enumerate(entry.outputs):
        if decl.name in skipped:  # None in every call of the instance
            shapes.append("None")
            dtypes.append("None")
            continue
        shape, dtype = w.output_shape(decl), w.output_dtype(decl)
        source = decl.absent_without or (decl.aliases if decl.aliases and entry.input(decl.aliases).optional else None)
        if source:
            # No layout where the call left the input out (its _s_ and _t_ names are unbound).
            w.emit(f"_o{i}, _d{i} = ({shape}, {dtype}) if {source} is not None else (None, None)", 1)
            shape, dtype = f"_o{i}", f"_d{i}"
        elif not shape.isidentifier():  # computed once, then compared by name
            w.emit(f"_o{i} = {shape}", 1)
            shape = f"_o{i}"
        shapes.append(shape)
        dtypes.append(dtype)
    w.emit("_outs = _NO_OUTS", 1)
    for i, decl in enumerate(entry.outputs):
        if decl.out:
            o = decl.out
            w.emit(f"if {o} is not None:", 1)
            w.emit(
                f"if not isinstance({o}, _Tensor) or {o}.shape != {shapes[i]} or {o}.dtype is not {dtypes[i]} "
                f"or {o}.device != _dev or not {o}.is_contiguous() or {o}.layout is not _strided: break",
                2,
            )
            w.emit(f"_outs = {{**_outs, {o!r}: {o}}}", 2)
    inputs = "".join(f"{decl.name}, " for decl in entry.inputs)
    # The shared-memory rule costs nothing on a call that passes no buffer and writes no input.
    if any(decl.written for decl in entry.inputs):
        w.emit(f"if _overlap(({inputs}), _outs): break", 1)
    elif outs:
        w.emit(f"if _outs is not _NO_OUTS and _overlap(({inputs}), _outs): break", 1)
    # A call whose written tensors are all empty runs nothing: the reference bind handles it.
    # (Each shape once: outputs shaped like the same input share one test.)
    written = list(dict.fromkeys(
        f"({shape} is None or 0 in {shape})" if decl.absent_without else f"0 in {shape}"
        for decl, shape in zip(entry.outputs, shapes)
        if not decl.aliases and decl.name not in skipped
    ))
    written += [f"{decl.name}.numel() == 0" for decl in entry.inputs if decl.written and not decl.optional]
    if written:
        w.emit(f"if {' and '.join(written)}: break", 1)
    dims = ", ".join(f"{name!r}: {local}" for name, local in w.dims.items())
    for t, bound in conditional_dims.items():
        items = ", ".join(f"{name!r}: {local}" for name, local in bound.items())
        dims += f"{', ' if dims else ''}**({{{items}}} if {t} is not None else _NO_DIMS)"
    dims = f"{{{dims}}}" if dims else "_NO_DIMS"
    call_constraints = [c for c in entry.constraints if not c.at_construction]
    if call_constraints:
        w.emit(f"if not _constraints_hold({', '.join(w.dims.values())}): break", 1)
    checks_end = len(w.lines)
    bound = (
        f"_BoundCall(({inputs}), _outs, _dev, {dims}, ({''.join(s + ', ' for s in shapes)}), "
        f"({''.join(d + ', ' for d in dtypes)}))"
    )
    if entry.backward is not None:
        w.emit("if _tracked:", 1)
        w.emit(f"return _differentiate({bound})", 2)
    w.emit("if not _runs_forward:", 1)
    w.emit(f"return _run_bound({bound})", 2)
    w.emit(f"_r = _forward({inputs}) if _outs is _NO_OUTS else _forward({inputs}**_outs)", 1)
    if skipped:
        # The instance's result is None for a skipped output whatever the implementation
        # returned there (Op._without_skipped on the other paths).
        kept = [f"_r[{i}]" if decl.name not in skipped else "None" for i, decl in enumerate(entry.outputs)]
        w.emit(f"if type(_r) is tuple and len(_r) == {len(kept)}: _r = ({', '.join(kept)},)", 1)
    w.emit("if _trusted: return _r", 1)
    def fits(r: str, decl: TensorDecl, shape: str, dtype: str) -> str:
        if decl.name in skipped:
            return f"{r} is None"
        if decl.aliases:  # the input itself (None where an optional input was left out)
            return f"{r} is {decl.aliases}"
        test = f"isinstance({r}, _Tensor) and {r}.shape == {shape} and {r}.dtype is {dtype} and {r}.device == _dev"
        if decl.absent_without:  # None where the call left that input out
            return f"({r} is None if {decl.absent_without} is None else {test})"
        return f"{test} and ({decl.out} is None or {r} is {decl.out})" if decl.out else test

    if len(entry.outputs) == 1:
        w.emit(f"if {fits('_r', entry.outputs[0], shapes[0], dtypes[0])}: return _r", 1)
    else:
        items = [f"_r{i}" for i in range(len(entry.outputs))]
        w.emit(f"if type(_r) is tuple and len(_r) == {len(items)}:", 1)
        w.emit(f"{', '.join(items)}, = _r", 2)
        w.emit(f"if {' and '.join(fits(*parts) for parts in zip(items, entry.outputs, shapes, dtypes))}: return _r", 2)
    w.emit(f"return _check_result(_r, {bound}, 'forward')", 1)

    header = ", ".join(f"{decl.name}={'None' if decl.optional else '_ABSENT'}" for decl in entry.inputs)
    # Arguments the entry does not declare make Python's binding raise TypeError, which
    # ``Op.__call__`` hands to the reference bind (cheaper than collecting *args and **kwargs).
    if outs:
        header += ", *" + "".join(f", {o}=None" for o in outs)
    # A tensor of another kind (a sparse CSR one, a nested one) raises from a check: the
    # reference bind names its kind. The try costs nothing on calls that raise nothing.
    source = "\n".join(
        [
            "def make_call_path(*, forward, run_bound, runs_forward, check_results, differentiate):",
            "    _forward, _run_bound, _runs_forward, _differentiate = forward, run_bound, runs_forward, differentiate",
            "    _trusted = not check_results",
            f"    def call_path({header}):",
            "        while True:",
            "            try:",
            *["    " + line for line in w.lines[:checks_end]],
            "            except RuntimeError:",
            "                break",
            *w.lines[checks_end:],
            "        raise _CallDeclined",
            "    return call_path",
        ]
    )

    namespace = {
        "_ABSENT": _ABSENT,
        "_CallDeclined": CallDeclined,
        "_Tensor": torch.Tensor,
        "_strided": torch.strided,
        "_row_view": is_row_view,
        "torch": torch,
        "_BoundCall": BoundCall,
        "_check_result": signature.check_result,
        "_overlap": lambda inputs, outs: overlapping(*signature.written_and_read(inputs, outs)) is not None,
        "_transforms_active": torch._C._are_functorch_transforms_active,
        "_grad_enabled": torch.is_grad_enabled,
        "_NO_OUTS": MappingProxyType({}),
        "_NO_DIMS": MappingProxyType({}),
        "_constraints_hold": _constraints_function(call_constraints, params, list(w.dims)),
        **w.constants,
    }
    exec(compile(source, f"<call path of {entry.name}>", "exec"), namespace)  # noqa: S102 - our own source
    make_call_path = namespace["make_call_path"]
    make_call_path.source = source
    return make_call_path


class _Unsupported(Exception):
    """The entry uses a feature the fast path does not generate; the reference bind serves it."""


_factories: dict[tuple, Callable[..., Any] | None] = {}


def call_path_factory(signature: Signature, params: Mapping[str, Any]) -> Callable[..., Any] | None:
    """The factory of the generated call path for an instance with ``params`` of the op whose
    signature is ``signature``, or None where every call takes the reference bind.

    Generated once per op and distinct params; each instance makes its own call path from it.
    """
    try:
        key = (signature, *params.items())
        return _factories[key]
    except KeyError:
        pass
    except TypeError:  # params that cannot key a cache: the reference bind serves
        return None
    try:
        factory = compile_call_path(signature, params)
    except _Unsupported:
        factory = None
    _factories[key] = factory
    return factory
