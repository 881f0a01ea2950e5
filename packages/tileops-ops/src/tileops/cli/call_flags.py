"""The flags that describe a call of an op, read against the op's manifest entry.

``--param NAME=VALUE`` sets any param, its value read as the manifest declares the param;
``--omit NAME`` leaves an optional input out. A family may declare shorthand flags for these
in its ``command_line`` module (``tileops.ops.<family>.command_line``: ``PARAM_FLAGS``, flag ->
param, and ``OMIT_FLAGS``, flag -> optional input), which this module finds and adds. With a
shape of the first input, ``CallFlags.workload`` gives the call as a workload: every other
input's shape follows from the manifest's shape patterns (``tileops.testing.workload_for_shape``).
Nothing here knows a family, an op, an input or a param by name.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import importlib.util
from types import ModuleType
from typing import Any

import torch

from tileops.core.errors import TileOpsError
from tileops.core.manifest import OpEntry
from tileops.core.manifest import DTYPES, ParamDecl, Workload, param_value
from tileops.core.op import Op
from tileops.ops import FAMILIES
from tileops.testing import workload_for_shape

from .output import UsageError, shape_argument

#: How a value of each param type is spelled on the command line.
_FORMS = {
    "int": "an integer, such as 4096",
    "float": "a number, such as 1e-6 or 0.5",
    "bool": "true or false",
    "str": "any text",
    "shape": "sizes separated by 'x' or ',', such as 4096, 8x64 or 8,64",
    "dtype": f"a dtype, one of {', '.join(DTYPES)}",
}
_NONE = ("None", "none", "null")
_BOOLS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


def op_classes() -> dict[str, type[Op]]:
    """Every op class, by class name, in the order of ``tileops.ops.FAMILIES``."""
    return {op_class.__name__: op_class for ops in FAMILIES.values() for op_class in ops}


def op_class_named(name: str) -> type[Op]:
    classes = op_classes()
    if name not in classes:
        raise UsageError(f"no op is named {name!r}; the ops are {', '.join(classes)}")
    return classes[name]


@functools.cache
def family_adapters() -> dict[str, ModuleType]:
    """Each family's ``command_line`` module, by family, for the families that have one."""
    adapters = {}
    for family in FAMILIES:
        name = f"tileops.ops.{family}.command_line"
        if importlib.util.find_spec(name) is not None:
            adapters[family] = importlib.import_module(name)
    return adapters


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--param``, ``--omit`` and every family's shorthand flags to ``parser``."""
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        type=_name_and_value,
        metavar="NAME=VALUE",
        help="set the op's param NAME (repeatable); VALUE as the manifest declares the param: an integer, "
        "a number, a shape such as 8x64 or 8,64, true/false, text, or None where the param may be null",
    )
    parser.add_argument(
        "--omit",
        action="append",
        default=[],
        metavar="NAME",
        help="leave the optional input NAME out of the call (repeatable; every other input is passed)",
    )
    declared: dict[str, tuple[str, list[str]]] = {}  # flag -> (argparse action, what it means per family)
    for family, adapter in family_adapters().items():
        meanings = [("store", flag, f"--param {param}=VALUE") for flag, param in getattr(adapter, "PARAM_FLAGS", {}).items()]
        meanings += [("store_true", flag, f"--omit {name}") for flag, name in getattr(adapter, "OMIT_FLAGS", {}).items()]
        for action, flag, meaning in meanings:
            known_action, known = declared.setdefault(flag, (action, []))
            if known_action != action:
                raise RuntimeError(
                    f"tileops.ops.{family}.command_line declares {flag} as {meaning}, another family as {known[0]}: "
                    "a flag either sets a param or leaves an input out"
                )
            known.append(f"{meaning} ({family} ops)")
    for flag, (action, meanings) in declared.items():
        value = {"metavar": "VALUE"} if action == "store" else {}
        try:
            parser.add_argument(flag, dest=_dest(flag), action=action, help="the same as " + "; ".join(meanings), **value)
        except argparse.ArgumentError as error:
            raise RuntimeError(f"a family's command_line module declares {flag}, which clashes: {error}") from None


def _dest(flag: str) -> str:
    """Where argparse keeps a shorthand's value: apart from every other option's."""
    return f"shorthand{flag}"


def _name_and_value(text: str) -> tuple[str, str]:
    name, equals, value = text.partition("=")
    if not equals or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name.strip(), value.strip()


@dataclasses.dataclass(frozen=True)
class _Given:
    """One flag that sets a param or leaves an input out, as typed."""

    flag: str  # as the user typed it, for errors
    family: str | None  # the family whose shorthand it is; None for --param and --omit
    name: str  # the param or input it names
    value: str | None = None  # a param's value, as typed


@dataclasses.dataclass(frozen=True)
class CallFlags:
    """What the command line said about a call's params and inputs, not yet read against an op."""

    params: tuple[_Given, ...] = ()
    omitted: tuple[_Given, ...] = ()

    @classmethod
    def of(cls, args: argparse.Namespace) -> CallFlags:
        params = [_Given(f"--param {name}={value}", None, name, value) for name, value in args.param]
        omitted = [_Given(f"--omit {name}", None, name) for name in args.omit]
        for family, adapter in family_adapters().items():
            for flag, param in getattr(adapter, "PARAM_FLAGS", {}).items():
                value = getattr(args, _dest(flag))
                if isinstance(value, str):
                    params.append(_Given(f"{flag} {value}", family, param, value))
            for flag, name in getattr(adapter, "OMIT_FLAGS", {}).items():
                if getattr(args, _dest(flag)) is True:
                    omitted.append(_Given(flag, family, name))
        return cls(tuple(params), tuple(omitted))

    def params_for(self, entry: OpEntry) -> dict[str, Any]:
        """The params the flags set for ``entry``'s op, each in its declared type."""
        declared = {p.name: p for p in entry.params}
        params = {}
        for given in self._of_family(self.params, entry):
            if given.name not in declared:
                raise UsageError(
                    f"{entry.name}: {given.flag}: {entry.name} has no param {given.name!r} "
                    f"(its params: {', '.join(declared) or 'none'})"
                )
            params[given.name] = _param_value(entry, declared[given.name], given)
        return params

    def omitted_for(self, entry: OpEntry) -> frozenset[str]:
        """The optional inputs of ``entry``'s op the flags leave out."""
        optional = [t.name for t in entry.inputs if t.optional]
        omitted = set()
        for given in self._of_family(self.omitted, entry):
            if given.name not in optional:
                required = any(t.name == given.name for t in entry.inputs)
                what = f"{given.name!r} is a required input of" if required else f"no input {given.name!r} in"
                raise UsageError(
                    f"{entry.name}: {given.flag}: {entry.name} has no optional input {given.name!r} ({what} "
                    f"{entry.name}; its optional inputs: {', '.join(optional) or 'none'})"
                )
            omitted.add(given.name)
        return frozenset(omitted)

    @staticmethod
    def _of_family(flags: tuple[_Given, ...], entry: OpEntry) -> list[_Given]:
        """``flags`` that apply to ``entry``: the generic ones and its family's shorthands; a
        shorthand of another family is an error (several families may declare the same flag)."""
        applying = []
        for given in flags:
            if given.family is None or given.family == entry.family:
                applying.append(given)
            elif not any(g.flag == given.flag and g.family == entry.family for g in flags):
                raise UsageError(
                    f"{entry.name}: {given.flag.split()[0]} is a shorthand of the {given.family} family's ops; "
                    f"{entry.name} is of family {entry.family}: use --param or --omit"
                )
        return applying

    def workload(
        self, op_class: type[Op], *, shape: tuple[int, ...] | None = None, template: Workload | None = None
    ) -> Workload:
        """The call the flags describe, as a workload of ``op_class``.

        ``template`` (default: the entry's first manifest workload) with the flags' params over
        its own and the omitted inputs left out. With ``shape``, the first input has that shape
        and every input but the omitted ones is passed, shaped by the manifest's patterns (an
        optional input the template leaves out only where its pattern's dimensions are known:
        a block table's page count is not); the params the flags set win over those the shape
        binds (a contradiction is the signature's to report, as a call's). Without a named
        template the dimensions the first input does not give (a cache's rows) come from the
        first workload that passes the same inputs with the same params as the entry's first
        (the flags' over both) and whose call the signature takes at this shape, else from the
        first.
        """
        entry = op_class.manifest_entry()
        params = self.params_for(entry)
        omitted = self.omitted_for(entry)
        base = entry.workloads[0] if template is None else template
        if shape is None:
            shapes = {name: s for name, s in base.shapes.items() if name not in omitted}
            return Workload(base.name, shapes, base.dtypes, {**base.params, **params})
        first = self._shaped(entry, shape, base, params, omitted)
        if template is not None or _takes(op_class, first, params):
            return first
        for candidate in entry.workloads[1:]:
            if {**candidate.params, **params} != {**base.params, **params} or set(candidate.shapes) != set(base.shapes):
                continue
            try:
                described = self._shaped(entry, shape, candidate, params, omitted)
            except UsageError:
                continue
            if _takes(op_class, described, params):
                return described
        return first

    @staticmethod
    def _shaped(entry: OpEntry, shape: tuple[int, ...], base: Workload, params: dict, omitted: set[str]) -> Workload:
        """``base`` with its first input of ``shape`` and the others shaped by their patterns."""
        # workload_for_shape passes the inputs its template does, each shaped from its pattern.
        known = _dimensions_known(entry, base)
        passed = {
            t.name: base.shapes.get(t.name, ())
            for t in entry.inputs
            if t.name not in omitted and (t.name in base.shapes or _shapes_from(t, known))
        }
        try:
            described = workload_for_shape(entry, shape, Workload(base.name, passed, base.dtypes, {**base.params, **params}))
        except ValueError as error:
            hint = " (--omit leaves out an optional input)" if any(t.optional for t in entry.inputs) else ""
            raise UsageError(f"--shape {'x'.join(map(str, shape))}: {error}{hint}") from None
        return dataclasses.replace(described, params={**described.params, **params})


def _dimensions_known(entry: OpEntry, base: Workload) -> set[str]:
    """The dimension names a call shaped from ``base`` knows: those of the first input and of
    the inputs ``base`` passes, and ``base``'s params."""
    known = set(base.params)
    for decl in entry.inputs:
        if decl.shape is not None and (decl is entry.inputs[0] or decl.name in base.shapes):
            known |= {dim.name for dim in decl.shape.entries if dim.name is not None}
    return known


def _shapes_from(decl, known: set[str]) -> bool:
    """Whether ``decl``'s shape follows from the ``known`` dimensions (or from another input's)."""
    return decl.shape is None or all(dim.name is None or dim.name in known for dim in decl.shape.entries)


def meta_inputs(entry: OpEntry, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Meta tensors of ``shapes``, each in the dtype its input takes in a call in ``dtype``: the
    signature's checks run on them as on a call's, for any size, free."""
    return {name: torch.empty(shape, dtype=entry.input(name).dtype_in(dtype), device="meta") for name, shape in shapes.items()}


def _takes(op_class: type[Op], workload: Workload, params: dict) -> bool:
    """Whether the signature takes a call of ``workload``."""
    try:
        op = op_class(**{**workload.params, **params})
        inputs = meta_inputs(op_class.manifest_entry(), workload.shapes, workload.dtypes[0])
        op_class.signature().bind(op.params, (), inputs)
    except (TileOpsError, ValueError, TypeError):
        return False
    return True


def _param_value(entry: OpEntry, decl: ParamDecl, given: _Given) -> Any:
    text = given.value or ""
    if decl.nullable and text in _NONE:
        return None
    form = _FORMS[decl.type] + (", or None" if decl.nullable else "")
    try:
        if decl.type == "str":
            value: Any = text
        elif decl.type == "int":
            value = int(text)
        elif decl.type == "float":
            value = float(text)
        elif decl.type == "bool":
            value = _BOOLS[text.lower()]
        elif decl.type == "dtype":
            value = DTYPES[text]
        else:
            value = shape_argument(text)
        return param_value(decl.type, value)
    except (ValueError, KeyError, argparse.ArgumentTypeError):
        raise UsageError(
            f"{entry.name}: {given.flag}: expected {form} (param {decl.name} is declared {decl.type}), got {text!r}"
        ) from None



def check_call(op_class: type[Op], workload: Workload, dtype: Any) -> None:
    """UsageError with the op's own error where it would refuse ``workload`` in ``dtype``: checked
    on meta tensors before anything runs, so that a flag that contradicts a workload (a param
    its shapes do not fit) stops the command with the signature's message, not mid-run."""
    signature = op_class.signature()
    try:
        params = signature.bind_params(workload.params)
        entry = op_class.manifest_entry()
        inputs = {
            name: torch.empty(shape, dtype=entry.input(name).dtype_in(dtype), device="cpu" if entry.input(name).cpu else "meta")
            for name, shape in workload.shapes.items()
        }
        signature.bind(params, (), inputs)
    except TileOpsError as error:
        raise UsageError(f"workload {workload.name!r}: {error}") from None
