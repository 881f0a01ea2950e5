"""Reading manifest files and validating every entry strictly.

Each top-level key of a file is an op's class name; its value is the op's entry. Unknown
fields, undefined names, contradictory declarations and bad values are ``ManifestError``s
naming the file, the op and the field, quoting what they found cut short (``quoting``);
no other exception escapes, whatever the file holds. The YAML is read as plain data
(``plain_yaml``) into the data model of ``entries``. Constraints are evaluated on every
workload's params when the file is loaded, so a constraint that cannot be evaluated (comparing
a shape with an int) is the loader's error, not the constructor's. The schema is documented in docs/manifest.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import ManifestError
from .entries import (
    ACCESS,
    CONSUME_INPUTS,
    DTYPES,
    MAX_NUMEL,
    PARAM_TYPES,
    REQUIRED,
    SKIP_OUTPUTS,
    BackwardDecl,
    Constraint,
    OpEntry,
    ParamDecl,
    TensorDecl,
    Workload,
    is_int,
    param_value,
)
from .expressions import FUNCTIONS, ExpressionError, compile_expression, evaluate
from .plain_yaml import read_yaml
from .quoting import shown, shown_text
from .shapes import ShapePattern

class _Where:
    """Builds errors that name the file, the op and the field."""

    def __init__(self, source: str, op: str | None = None, field: str = "") -> None:
        self.source, self.op, self.field = source, op, field

    def at(self, field: str) -> _Where:
        return _Where(self.source, self.op, f"{self.field}.{field}" if self.field else field)

    def error(self, message: str) -> ManifestError:
        return ManifestError(f"{self.place}: {message}")

    @property
    def place(self) -> str:
        place = self.source
        if self.op:
            place += f", op {shown_text(self.op)}"
        if self.field:
            place += f", field {shown_text(self.field, 200)}"
        return place


def _names(value: Any, where: _Where) -> dict:
    """A mapping whose keys name Python arguments (inputs, outputs, params)."""
    mapping = _mapping(value, where, set(value) if isinstance(value, dict) else set())
    for name in mapping:
        if not isinstance(name, str) or not name.isidentifier():
            raise where.error(f"{shown(name)} is not a valid argument name")
    return mapping


def _mapping(value: Any, where: _Where, allowed: set[str], required: set[str] = frozenset()) -> dict:
    if not isinstance(value, dict):
        raise where.error(f"expected a mapping, got {type(value).__name__}")
    unknown = sorted(set(value) - allowed, key=repr)  # keys may be of any type: 1, null
    if unknown:
        listed = shown_text(", ".join(shown(key) for key in unknown), 200)
        raise where.error(f"unknown field(s) {listed}; allowed: {shown_text(', '.join(sorted(allowed)), 200)}")
    missing = sorted(required - set(value))
    if missing:
        raise where.error(f"missing required field(s) {', '.join(map(repr, missing))}")
    return value


def _str(value: Any, where: _Where) -> str:
    if not isinstance(value, str):
        raise where.error(f"expected a string, got {shown(value)}")
    return value


def _bool(value: Any, where: _Where) -> bool:
    if not isinstance(value, bool):
        raise where.error(f"expected true or false, got {shown(value)}")
    return value


def _dtype(value: Any, where: _Where) -> torch.dtype:
    if not isinstance(value, str):
        raise where.error(f"expected a dtype name ({', '.join(DTYPES)}), got {shown(value)}")
    if value not in DTYPES:
        raise where.error(f"unknown dtype {shown(value)}; known: {', '.join(DTYPES)}")
    return DTYPES[value]


def _dtype_decl(value: Any, where: _Where, earlier: list[str]) -> tuple[tuple[torch.dtype, ...] | None, str | None]:
    if isinstance(value, dict):
        ref = _str(_mapping(value, where, {"same_as"}, {"same_as"})["same_as"], where.at("same_as"))
        if ref not in earlier:
            raise where.error(f"same_as {shown(ref)} names no tensor declared before it (declared: {', '.join(earlier) or 'none'})")
        return None, ref
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise where.error(f"expected a dtype, a list of dtypes or {{same_as: tensor}}, got {shown(value)}")
    dtypes = tuple(_dtype(v, where) for v in value)
    if len(set(dtypes)) != len(dtypes):
        raise where.error(f"lists a dtype twice: {shown(value)}")
    return dtypes, None


def _shape_decl(value: Any, where: _Where, earlier: list[str], shape_params: set[str]):
    if isinstance(value, dict):
        ref = _str(_mapping(value, where, {"same_as"}, {"same_as"})["same_as"], where.at("same_as"))
        if ref not in earlier:
            raise where.error(f"same_as {shown(ref)} names no tensor declared before it (declared: {', '.join(earlier) or 'none'})")
        return None, ref
    if not isinstance(value, list):
        raise where.error(f"expected a list of dimensions or {{same_as: tensor}}, got {shown(value)}")
    try:
        return ShapePattern.parse(value, shape_params), None
    except ValueError as error:
        raise where.error(str(error)) from None


def _tensor(
    name: str, value: Any, where: _Where, earlier: list[str], shape_params: set[str], *, output: bool, inputs: dict,
    dtype_params: set[str] = frozenset(),
) -> TensorDecl:
    common = {"dtype", "shape", "doc"}
    output_keys = {"aliases", "out", "absent_without"}
    input_keys = {"optional", "device", "contiguous", "row_views", "access", "derive"}
    allowed = common | (output_keys if output else input_keys)
    aliased = output and isinstance(value, dict) and "aliases" in value
    spec = _mapping(value, where, allowed, set() if aliased else {"dtype", "shape"})
    fields: dict[str, Any] = {"name": name, "doc": _str(spec.get("doc", ""), where.at("doc"))}
    if output and "aliases" in spec:
        target = _str(spec["aliases"], where.at("aliases"))
        if target not in inputs:
            raise where.at("aliases").error(f"names no input (inputs: {', '.join(inputs)})")
        if not inputs[target].written:
            raise where.at("aliases").error(
                f"input {target!r} is not written (access: {inputs[target].access}); only a written input can be aliased"
            )
        if "out" in spec:
            raise where.error("declares both aliases and out; an output either returns a written input or fills a caller buffer")
        if "absent_without" in spec:
            raise where.at("absent_without").error("an aliasing output is already None where the call leaves its input out")
        for field in ("dtype", "shape"):
            if field in spec:
                raise where.at(field).error(f"contradicts aliases: the output is input {target!r}, with its {field}")
        fields.update(dtypes=None, dtype_same_as=target, shape=None, shape_same_as=target, aliases=target)
        return TensorDecl(**fields)
    dtype_spec = spec["dtype"]
    if isinstance(dtype_spec, dict) and "param" in dtype_spec:
        dtype_where = where.at("dtype")
        if not output:
            raise dtype_where.error("only an output's dtype can follow a param; an input's dtype is the caller's")
        param = _str(_mapping(dtype_spec, dtype_where, {"same_as", "param"}, {"same_as", "param"})["param"], dtype_where.at("param"))
        if param not in dtype_params:
            raise dtype_where.at("param").error(
                f"{shown(param)} names no param of type dtype (dtype params: {', '.join(sorted(dtype_params)) or 'none'})"
            )
        fields["dtype_param"] = param
        dtype_spec = {"same_as": dtype_spec["same_as"]}
    fields["dtypes"], fields["dtype_same_as"] = _dtype_decl(dtype_spec, where.at("dtype"), earlier)
    fields["shape"], fields["shape_same_as"] = _shape_decl(spec["shape"], where.at("shape"), earlier, shape_params)
    if output:
        if "out" in spec:
            fields["out"] = _str(spec["out"], where.at("out"))
            if not fields["out"].isidentifier():
                raise where.at("out").error(f"{shown(fields['out'])} is not a valid keyword name")
        if "absent_without" in spec:
            absent_where = where.at("absent_without")
            source = _str(spec["absent_without"], absent_where)
            if source not in inputs:
                raise absent_where.error(f"names no input (inputs: {', '.join(inputs)})")
            if not inputs[source].optional:
                raise absent_where.error(f"input {source!r} is not optional: a call always gives it, so the output is never absent")
            if "out" in spec:
                raise where.error("declares both absent_without and out; a caller's buffer cannot be left unfilled")
            fields["absent_without"] = source
    else:
        fields["optional"] = _bool(spec.get("optional", False), where.at("optional"))
        fields["contiguous"] = _bool(spec.get("contiguous", False), where.at("contiguous"))
        if "device" in spec:
            if spec["device"] != "cpu":
                raise where.at("device").error(f"the only device a tensor can be pinned to is 'cpu', got {shown(spec['device'])}")
            fields["cpu"] = True
        access = spec.get("access", "read")
        if not isinstance(access, str) or access not in ACCESS:
            raise where.at("access").error(f"expected one of {', '.join(ACCESS)}, got {shown(access)}")
        fields["access"] = access
        if "derive" in spec:
            fields["derive"] = _str(spec["derive"], where.at("derive"))
        if access in ("read", "shape") and fields["contiguous"]:
            raise where.at("contiguous").error(
                "only written inputs declare contiguous: inputs that are read are always made contiguous, "
                "and the layout of one whose shape alone is read (access: shape) does not matter"
            )
        fields["row_views"] = _bool(spec.get("row_views", False), where.at("row_views"))
    decl = TensorDecl(**fields)
    if decl.row_views:
        _check_row_views(decl, where.at("row_views"), inputs, shape_params)
    return decl


def _check_row_views(decl: TensorDecl, where: _Where, inputs: dict, shape_params: set[str]) -> None:
    """Refuse ``row_views: true`` where it means nothing: on an input that is not only read, or
    whose shape (its own or the one it follows) does not begin with its leading dimensions (``...``
    or a group no param gives, such as ``*batch``), whose row is what follows them (the last
    dimension where nothing does)."""
    if decl.access != "read":
        raise where.error(
            f"is for inputs that are read (access: read), not access: {decl.access}: a written input is passed as it "
            "comes, and the values of one whose shape alone is read are never read"
        )
    pattern = decl.pattern(inputs.__getitem__)
    leading = pattern.entries[0] if pattern.entries else None
    if (
        leading is None or leading.name in shape_params
        or pattern.row_width(lambda name: () if name in shape_params else None) is None
    ):
        raise where.error(
            f"needs a shape that begins with the leading dimensions ('...' or a group such as '*batch', not a "
            f"param's), got {pattern}: the row is what follows the leading dimensions (the last dimension where "
            "nothing does)"
        )


def _param(name: str, value: Any, where: _Where) -> ParamDecl:
    spec = _mapping(value, where, {"type", "default", "nullable", "keyword_only", "doc"}, {"type"})
    if not isinstance(spec["type"], str) or spec["type"] not in PARAM_TYPES:
        raise where.at("type").error(f"expected one of {', '.join(PARAM_TYPES)}, got {shown(spec['type'])}")
    nullable = _bool(spec.get("nullable", False), where.at("nullable"))
    default = spec.get("default", REQUIRED)
    if default is None and not nullable:
        raise where.at("default").error("is null but the param is not nullable: add nullable: true")
    if default is not None and default is not REQUIRED:
        default = _written_param(spec["type"], default, where.at("default"))
    return ParamDecl(
        name=name,
        type=spec["type"],
        default=default,
        nullable=nullable,
        keyword_only=_bool(spec.get("keyword_only", False), where.at("keyword_only")),
        doc=_str(spec.get("doc", ""), where.at("doc")),
    )


def _written_param(kind: str, value: Any, where: _Where) -> Any:
    """A param's value as a manifest writes it (dtypes by name), in its canonical form."""
    if kind == "dtype":
        return _dtype(value, where)
    try:
        value = param_value(kind, value)
    except ValueError as error:
        raise where.error(f"expected {error} (the param's type is {kind}), got {shown(value)}") from None
    if kind == "float" and not math.isfinite(value):
        raise where.error(f"expected a finite float, got {value!r}")
    return value


def _entry(op: Any, value: Any, source: str) -> OpEntry:
    if not isinstance(op, str) or not op.isidentifier():
        raise _Where(source).error(f"op name {shown(op)} is not a class name")
    where = _Where(source, op)
    spec = _mapping(
        value, where,
        {"family", "summary", "signature", "backward", "ref_api", "torch_api", "tolerance", "workloads", "roofline"},
        {"family", "summary", "signature", "ref_api", "tolerance", "workloads", "roofline"},
    )
    sig = _mapping(
        spec["signature"], where.at("signature"), {"inputs", "outputs", "params", "exec_args", "constraints"}, {"inputs", "outputs"}
    )

    params_spec = sig.get("params") or {}
    params = tuple(
        _param(name, v, where.at(f"signature.params.{name}"))
        for name, v in _names(params_spec, where.at("signature.params")).items()
    )
    shape_params = {p.name for p in params if p.type == "shape"}
    inputs: dict[str, TensorDecl] = {}
    for name, v in _names(sig["inputs"] or {}, where.at("signature.inputs")).items():
        inputs[name] = _tensor(name, v, where.at(f"signature.inputs.{name}"), list(inputs), shape_params, output=False, inputs=inputs)
    if not inputs:
        raise where.at("signature.inputs").error("an op needs at least one input tensor")
    if not any(t.shape is not None and not t.cpu for t in inputs.values()):
        raise where.at("signature.inputs").error("at least one input must state its shape and live on the call's device")
    if inputs[next(iter(inputs))].optional:
        raise where.at("signature.inputs").error("the first input decides the call's device and cannot be optional")
    outputs: dict[str, TensorDecl] = {}
    for name, v in _names(sig["outputs"] or {}, where.at("signature.outputs")).items():
        if name in inputs:
            raise where.at(f"signature.outputs.{name}").error("an output cannot share an input's name; use aliases")
        outputs[name] = _tensor(
            name, v, where.at(f"signature.outputs.{name}"), list(inputs), shape_params, output=True, inputs=inputs,
            dtype_params={p.name for p in params if p.type == "dtype"},
        )
    if not outputs:
        raise where.at("signature.outputs").error("an op needs at least one output")
    _check_skip_outputs(params, outputs, where.at("signature.params"))
    clash = sorted({t.out for t in outputs.values() if t.out} & (set(inputs) | {p.name for p in params}))
    if clash:
        raise where.at("signature.outputs").error(f"out keyword(s) {', '.join(clash)} clash with an input or param name")
    exec_args = tuple(
        _param(name, v, where.at(f"signature.exec_args.{name}"))
        for name, v in _names(sig.get("exec_args") or {}, where.at("signature.exec_args")).items()
    )
    for decl in exec_args:
        if decl.required:
            raise where.at(f"signature.exec_args.{decl.name}").error("an execution argument needs a default: callers may omit it")
        taken = set(inputs) | {p.name for p in params} | {t.out for t in outputs.values() if t.out}
        if decl.name in taken:
            raise where.at(f"signature.exec_args.{decl.name}").error("clashes with an input, param or out keyword")
    keywords = [t.out for t in outputs.values() if t.out]
    if len(keywords) != len(set(keywords)):
        raise where.at("signature.outputs").error(f"two outputs share one out keyword: {keywords}")
    for name, t in outputs.items():
        for field, ref in (("dtype", t.dtype_same_as), ("shape", t.shape_same_as)):
            if ref is not None and not t.aliases and inputs[ref].optional:
                raise where.at(f"signature.outputs.{name}.{field}").error(
                    f"same_as {ref!r} names an optional input, which a call may omit; declare the {field} outright"
                )

    dims = set().union(*(t.shape.names for t in inputs.values() if t.shape is not None))
    param_names = {p.name for p in params}
    overlap = sorted(dims & param_names - shape_params)
    if overlap:
        raise where.at("signature").error(f"dimension name(s) {', '.join(overlap)} clash with param names")
    for name, t in outputs.items():
        if t.shape is not None and t.shape.has_rest:
            raise where.at(f"signature.outputs.{name}.shape").error(
                "'...' cannot be expanded in an output; name the group ('*batch') in an input, or use same_as"
            )
        undefined = sorted((t.shape.names if t.shape is not None else set()) - dims - param_names)
        if undefined:
            raise where.at(f"signature.outputs.{name}.shape").error(
                f"uses {', '.join(undefined)}, which no input shape or param binds"
            )

    constraints = []
    constraints_spec = sig.get("constraints") or []
    if not isinstance(constraints_spec, list):
        raise where.at("signature.constraints").error(f"expected a list of {{expr, message}}, got {shown(constraints_spec)}")
    for i, item in enumerate(constraints_spec):
        cwhere = where.at(f"signature.constraints[{i}]")
        c = _mapping(item, cwhere, {"expr", "message"}, {"expr", "message"})
        code = _expression(c["expr"], dims | param_names, cwhere.at("expr"))
        at_construction = not (set(code.co_names) & (dims - param_names))
        message = _str(c["message"], cwhere.at("message"))
        constraints.append(Constraint(c["expr"], code, message, at_construction, cwhere.place))

    reference_names = set(inputs) | param_names | set(REFERENCE_MODULES)
    ref_code = _expression(spec["ref_api"], reference_names, where.at("ref_api"), attributes=True)
    for name, decl in inputs.items():
        if decl.derive is not None:
            code = _expression(decl.derive, reference_names, where.at(f"signature.inputs.{name}.derive"), attributes=True)
            inputs[name] = dataclasses.replace(decl, derive_code=code)
    backward = None if "backward" not in spec else _backward(spec["backward"], where.at("backward"), inputs, outputs)
    torch_code = None
    if "torch_api" in spec:
        torch_code = _expression(spec["torch_api"], reference_names, where.at("torch_api"), attributes=True)

    tolerance = {}
    for dname, tol in _mapping(spec["tolerance"], where.at("tolerance"), set(DTYPES)).items():
        twhere = where.at(f"tolerance.{dname}")
        tol = _mapping(tol, twhere, {"atol", "rtol"}, {"atol", "rtol"})
        for k in ("atol", "rtol"):
            value = tol[k]
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise twhere.at(k).error(f"expected a finite non-negative number, got {shown(value)}")
        tolerance[DTYPES[dname]] = (float(tol["atol"]), float(tol["rtol"]))

    allowed_dtypes = set().union(*(set(t.dtypes) for t in inputs.values() if t.dtypes))
    workloads = []
    if not isinstance(spec["workloads"], list) or not spec["workloads"]:
        raise where.at("workloads").error("expected a non-empty list of workloads")
    for i, w in enumerate(spec["workloads"]):
        wwhere = where.at(f"workloads[{i}]")
        w = _mapping(w, wwhere, {"name", "shapes", "dtypes", "params"}, {"name", "shapes", "dtypes"})
        shapes = {}
        for tname, shape in _mapping(w["shapes"], wwhere.at("shapes"), set(inputs)).items():
            if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
                raise wwhere.at(f"shapes.{tname}").error(f"expected a list of non-negative ints, got {shown(shape)}")
            if math.prod(shape) > MAX_NUMEL:
                raise wwhere.at(f"shapes.{tname}").error(f"{shown(shape)} has more elements than a tensor can hold (2**60)")
            shapes[tname] = tuple(shape)
        first = next(iter(inputs))
        if first not in shapes:
            raise wwhere.at("shapes").error(f"must give the shape of the first input {first!r}")
        if not isinstance(w["dtypes"], list):
            raise wwhere.at("dtypes").error(f"expected a list of dtype names, got {shown(w['dtypes'])}")
        dtypes = tuple(_dtype(d, wwhere.at("dtypes")) for d in w["dtypes"])
        bad = [d for d in dtypes if d not in allowed_dtypes or d not in tolerance]
        if not dtypes or bad:
            raise wwhere.at("dtypes").error(
                f"every dtype must be accepted by the inputs and have a tolerance; check {shown(bad or w['dtypes'])}"
            )
        wparams = dict(_mapping(w.get("params") or {}, wwhere.at("params"), param_names))
        missing = sorted(p.name for p in params if p.required and p.name not in wparams)
        if missing:
            raise wwhere.at("params").error(f"missing required param(s) {', '.join(missing)}")
        for decl in params:  # dtypes are written by name; the op takes torch.dtype
            if decl.type == "dtype" and wparams.get(decl.name) is not None:
                wparams[decl.name] = _dtype(wparams[decl.name], wwhere.at(f"params.{decl.name}"))
        workload = Workload(_str(w["name"], wwhere.at("name")), shapes, dtypes, wparams)
        _evaluate_constraints(workload, params, inputs, constraints, wwhere)
        workloads.append(workload)

    roof = _mapping(spec["roofline"], where.at("roofline"), {"bytes", "flops"}, {"bytes", "flops"})
    roof_names = dims | param_names | set(inputs) | set(outputs)
    roofline = {k: _expression(roof[k], roof_names, where.at(f"roofline.{k}")) for k in ("bytes", "flops")}

    return OpEntry(
        name=op,
        family=_str(spec["family"], where.at("family")),
        summary=_str(spec["summary"], where.at("summary")),
        inputs=tuple(inputs.values()),
        outputs=tuple(outputs.values()),
        params=params,
        exec_args=exec_args,
        constraints=tuple(constraints),
        ref_api=spec["ref_api"],
        ref_code=ref_code,
        torch_api=spec.get("torch_api"),
        torch_code=torch_code,
        tolerance=tolerance,
        workloads=tuple(workloads),
        roofline=roofline,
        source=source,
        backward=backward,
    )


#: What a training step hands an output named in ``backward.incoming``.
INCOMING = ("one", "none")


def _backward(value: Any, where: _Where, inputs: Mapping[str, TensorDecl], outputs: Mapping[str, TensorDecl]) -> BackwardDecl:
    """A forward's ``backward:`` declaration, checked against the forward itself; how it fits
    the backward op's entry is checked once the whole file is read (``_check_backward``)."""
    spec = _mapping(value, where, {"op", "saves", "grads", "saved_for", "in_place", "incoming"}, {"op", "grads"})
    op = _str(spec["op"], where.at("op"))
    absent = [name for name, t in outputs.items() if t.absent_without]
    if absent:
        # An absent output is a gradient a backward op leaves out; a differentiable op's outputs
        # take gradients of their own.
        raise where.error(f"a differentiable op's outputs are always computed; {', '.join(absent)} declare(s) absent_without")
    in_place = None if spec.get("in_place") is None else _str(spec["in_place"], where.at("in_place"))
    saves = spec.get("saves") or []
    if not isinstance(saves, list) or not all(isinstance(name, str) and name.isidentifier() for name in saves):
        raise where.at("saves").error(f"expected a list of the backward op's input names, got {shown(saves)}")
    grads = _mapping(spec["grads"], where.at("grads"), set(inputs))
    if not grads:
        raise where.at("grads").error("names no input: a backward gives at least one input a gradient")
    for name, target in grads.items():
        _str(target, where.at(f"grads.{name}"))
    taken = set(inputs) | set(outputs) | {f"d{name}" for name in outputs}
    clash = sorted(set(saves) & taken)
    if clash:
        raise where.at("saves").error(f"{', '.join(clash)} already name(s) a forward input, output or output gradient")
    saved_for = _mapping(spec.get("saved_for") or {}, where.at("saved_for"), set(saves))
    for name, target in saved_for.items():
        if _str(target, where.at(f"saved_for.{name}")) not in grads:
            raise where.at(f"saved_for.{name}").error(
                f"names {shown(target)}, which gets no gradient (grads: {', '.join(grads)}); a statistic is saved for "
                "an input whose gradient it serves"
            )
    incoming = _mapping(spec.get("incoming") or {}, where.at("incoming"), set(outputs))
    for name, kind in incoming.items():
        if kind not in INCOMING:
            raise where.at(f"incoming.{name}").error(f"expected one of {', '.join(INCOMING)}, got {shown(kind)}")
    if outputs and all(incoming.get(name) == "none" for name in outputs):
        raise where.at("incoming").error("leaves every output unused: a training step differentiates at least one")
    return BackwardDecl(op, tuple(saves), dict(grads), dict(saved_for), in_place, dict(incoming))


def _check_skip_outputs(params: tuple[ParamDecl, ...], outputs: Mapping[str, TensorDecl], where: _Where) -> None:
    """The ``skip_outputs`` param: the one param of type ``outputs``, empty by default, on an op
    with outputs that may be absent (those are the ones a caller may skip)."""
    for decl in params:
        if (decl.name == SKIP_OUTPUTS) != (decl.type == "outputs"):
            raise where.at(decl.name).error(f"a param of type outputs is named {SKIP_OUTPUTS}, and that param has that type")
        if decl.name != SKIP_OUTPUTS:
            continue
        if decl.default != ():
            raise where.at(f"{decl.name}.default").error("must be [] (a call computes every output unless asked not to)")
        if not any(t.absent_without for t in outputs.values()):
            raise where.at(decl.name).error("the op has no output declared absent_without, which alone may be skipped")


def _check_backward(entries: Mapping[str, OpEntry], source: str) -> None:
    """How each forward's ``backward:`` fits its backward op's entry: the names of the
    backward's inputs say what each receives, every saved statistic can be had without the
    forward's saving it (a target's forward does not compute it), the gradients are its outputs
    and its params are the forward's."""
    for entry in entries.values():
        decl = entry.backward
        if decl is None:
            continue
        where = _Where(source, entry.name, "backward")
        backward = entries.get(decl.op)
        if backward is None:
            raise where.at("op").error(f"names {shown(decl.op)}, which has no entry in this file")
        if backward.backward is not None:
            raise where.at("op").error(f"{decl.op} declares a backward of its own; double backward is not supported")
        receives = {t.name for t in entry.inputs} | {t.name for t in entry.outputs}
        receives |= {f"d{t.name}" for t in entry.outputs} | set(decl.saves)
        for t in backward.inputs:
            if t.name not in receives:
                raise where.error(
                    f"{decl.op}'s input {t.name!r} is neither a saved statistic ({', '.join(decl.saves) or 'none'}), "
                    "a forward input or output, nor d<output> (an output's gradient)"
                )
        names = {t.name: t for t in backward.inputs}
        for name in decl.saves:
            if name not in names:
                raise where.at("saves").error(f"{name!r} is not an input of {decl.op}")
            if name in decl.saved_for and not names[name].optional:
                raise where.at(f"saved_for.{name}").error(
                    f"{decl.op}'s input {name!r} must be optional: it is None where {decl.saved_for[name]!r} "
                    "requires no grad"
                )
            if not names[name].optional and names[name].derive is None:
                raise where.at("saves").error(
                    f"{decl.op}'s input {name!r} must be optional (the backward op computes it) or declare a derive "
                    "expression (the autograd node computes it): a target's forward does not compute it"
                )
        outputs = {t.name for t in backward.outputs}
        for name, target in decl.grads.items():
            if target not in outputs:
                raise where.at(f"grads.{name}").error(f"{target!r} is not an output of {decl.op} ({', '.join(sorted(outputs))})")
        unused = sorted(outputs - set(decl.grads.values()))
        if unused:
            raise where.at("grads").error(f"{decl.op}'s output(s) {', '.join(unused)} give no input a gradient")
        forward_params = [p.name for p in entry.params if p.name != CONSUME_INPUTS]
        backward_params = [p.name for p in backward.params if p.name != SKIP_OUTPUTS]
        if backward_params != forward_params:
            raise where.error(
                f"{decl.op} takes params ({', '.join(backward_params)}); a backward op takes its "
                f"forward's ({', '.join(forward_params)}), the same op instance's, and may add {SKIP_OUTPUTS}"
            )
        if decl.in_place is not None:
            _check_in_place(entry, backward, entries.get(decl.in_place), where.at("in_place"))
        elif any(p.name == CONSUME_INPUTS for p in entry.params):
            raise where.error(f"declares the param {CONSUME_INPUTS!r} but no in_place backward op to run with it")


def _check_in_place(forward: OpEntry, backward: OpEntry, in_place: OpEntry | None, where: _Where) -> None:
    """An ``in_place`` backward op is the backward op with outputs written over forward inputs:
    the same inputs, outputs and params, each output an alias of a written input the forward
    takes; the forward declares the bool param that chooses it."""
    if in_place is None:
        raise where.error("names an op that has no entry in this file")
    param = next((p for p in forward.params if p.name == CONSUME_INPUTS), None)
    if param is None or param.type != "bool" or param.default is not False:
        raise where.error(f"needs the forward to declare the param {CONSUME_INPUTS}: {{type: bool, default: false}}")
    if in_place.backward is not None:
        raise where.error(f"{in_place.name} declares a backward of its own; double backward is not supported")
    for what, ours, theirs in (
        ("inputs", in_place.inputs, backward.inputs),
        ("outputs", in_place.outputs, backward.outputs),
        ("params", in_place.params, backward.params),
    ):
        if [t.name for t in ours] != [t.name for t in theirs]:
            raise where.error(
                f"{in_place.name}'s {what} ({', '.join(t.name for t in ours)}) must be {backward.name}'s "
                f"({', '.join(t.name for t in theirs)})"
            )
    forward_inputs = {t.name for t in forward.inputs}
    for t in in_place.outputs:
        if t.aliases is None or t.aliases not in forward_inputs:
            raise where.error(
                f"{in_place.name}'s output {t.name!r} must alias (aliases:) one of the forward inputs it writes over "
                f"({', '.join(sorted(forward_inputs))})"
            )


def _evaluate_constraints(
    workload: Workload, params: tuple[ParamDecl, ...], inputs: dict[str, TensorDecl], constraints: list[Constraint], where: _Where
) -> None:
    """Evaluate every constraint on ``workload``'s params (and the dimensions its shapes bind),
    so that one that cannot be evaluated on values of the declared types is found now. Whether
    the workload satisfies them is ``tileops check``'s question, answered with the op's error."""
    values: dict[str, Any] = {}
    for decl in params:
        given = workload.params.get(decl.name, decl.default)
        if given is None or decl.type == "dtype":
            values[decl.name] = given
        else:
            values[decl.name] = _written_param(decl.type, given, where.at(f"params.{decl.name}"))
    dims: dict[str, Any] = {}
    for name, shape in workload.shapes.items():
        pattern = inputs[name].shape
        if pattern is not None and pattern.match(shape, dims, values) is not None:
            return  # the shapes do not fit the signature: `tileops check` says so
    namespace = {**values, **dims}
    for constraint in constraints:
        if not set(constraint.code.co_names) - set(FUNCTIONS) <= set(namespace):
            continue  # it reads a dimension of an input the workload omits
        try:
            evaluate(constraint.code, namespace)
        except Exception as error:  # noqa: BLE001 - whatever the expression raises is the manifest's fault
            raise where.error(constraint.unevaluable(namespace, error, "this workload's values")) from None


#: The module names reference expressions use, and what they stand for.
REFERENCE_MODULES = {"torch": torch, "F": torch.nn.functional}


def _expression(text: Any, names: set[str], where: _Where, *, attributes: bool = False):
    try:
        return compile_expression(text, names, attributes=attributes, modules=REFERENCE_MODULES if attributes else {})
    except ExpressionError as error:
        raise where.error(str(error)) from None


def parse_manifest(text: str, source: str) -> dict[str, OpEntry]:
    """Validate the YAML ``text`` of one manifest file; ``source`` names it in errors."""
    document = read_yaml(text, source)
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise ManifestError(f"{source}: the top level must map op class names to entries, got {shown(document)}")
    entries = {op: _entry(op, value, source) for op, value in document.items()}
    _check_backward(entries, source)
    return entries


@functools.cache
def load_manifest(path: Any) -> Mapping[str, OpEntry]:
    """Load and validate one manifest file (a path or an ``importlib.resources`` traversable)."""
    return parse_manifest(path.read_text(encoding="utf-8"), str(path))
