"""What ``inspect.signature(op)`` and ``help(OpClass)`` show: an op's call signature and its
docstring, generated from its manifest entry.

``Op.__call__`` takes ``*args, **kwargs`` (the generated call path binds them), so without this
an IDE or ``help`` would show nothing of the inputs, params and outputs the manifest declares.
Both are read from the manifest on first use, never at class creation: importing an op reads
no YAML, and a manifest that does not load shows as a note in the docstring, not an import error.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from .manifest import OpEntry
from .manifest.entries import ParamDecl, TensorDecl


def call_signature(entry: OpEntry) -> inspect.Signature:
    """A call of the op: its inputs (optional ones default to None), then keyword-only the
    caller's output buffers and the execution arguments."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    parameters = [
        inspect.Parameter(
            decl.name, kind, default=None if decl.optional else inspect.Parameter.empty, annotation=_tensor_type(decl)
        )
        for decl in entry.inputs
    ]
    parameters += [
        inspect.Parameter(decl.out, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=torch.Tensor | None)
        for decl in entry.outputs
        if decl.out is not None
    ]
    parameters += [
        inspect.Parameter(decl.name, inspect.Parameter.KEYWORD_ONLY, default=None if decl.required else decl.default)
        for decl in entry.exec_args
    ]
    returns = torch.Tensor if len(entry.outputs) == 1 else tuple[(torch.Tensor,) * len(entry.outputs)]
    return inspect.Signature(parameters, return_annotation=returns)


def _tensor_type(decl: TensorDecl) -> Any:
    return torch.Tensor | None if decl.optional else torch.Tensor


def manifest_doc(entry: OpEntry) -> str:
    """The manifest's account of the op: summary, params, inputs and outputs."""
    lines = [entry.summary, "", "Params (constructor arguments):"]
    lines += [f"    {_param_text(p)}: {p.type}{', or None' if p.nullable else ''}. {p.doc}".rstrip() for p in entry.params]
    lines += ["", "Inputs (call arguments, in this order):"] + [f"    {_tensor_text(d)}" for d in entry.inputs]
    lines += ["", "Outputs (returned, in this order):"] + [f"    {_tensor_text(d)}" for d in entry.outputs]
    if entry.exec_args:
        lines += ["", "Execution arguments (keyword-only):"]
        lines += [f"    {_param_text(p)}: {p.type}. {p.doc}".rstrip() for p in entry.exec_args]
    lines += ["", f"Reference: {entry.ref_api}", f"Manifest: {entry.source}"]
    return "\n".join(lines)


def _param_text(decl: ParamDecl) -> str:
    return decl.name if decl.required else f"{decl.name}={decl.default!r}"


def _tensor_text(decl: TensorDecl) -> str:
    dtype = f"dtype of {decl.dtype_same_as}" if decl.dtypes is None else "|".join(str(d).removeprefix("torch.") for d in decl.dtypes)
    if decl.dtype_param is not None:
        dtype = f"{decl.dtype_param} if given, else {dtype}"
    shape = f"shape of {decl.shape_same_as}" if decl.shape is None else f"shape {decl.shape}"
    extras = [text for flag, text in ((decl.optional, "optional"), (decl.access != "read", decl.access)) if flag]
    if decl.out is not None:
        extras.append(f"fills {decl.out}= when given")
    if decl.aliases is not None:
        extras.append(f"is {decl.aliases}")
    if decl.absent_without is not None:
        extras.append(f"None where {decl.absent_without} is not given")
    extra = f" ({', '.join(extras)})" if extras else ""
    return f"{decl.name}: {dtype}, {shape}{extra}. {decl.doc}".rstrip()


class CallSignature:
    """``Op.__signature__``: on an instance, the call signature; on the class, None, so that
    ``inspect.signature(OpClass)`` shows the constructor as usual."""

    def __init__(self, entry_of: Callable[[type], OpEntry]) -> None:
        self._entry_of = entry_of

    def __get__(self, instance: Any, owner: type) -> inspect.Signature | None:
        if instance is None:
            return None
        cached = owner.__dict__.get("_call_signature_cache")
        if cached is None:
            cached = call_signature(self._entry_of(owner))
            owner._call_signature_cache = cached
        return cached


class ManifestDoc:
    """An op class's ``__doc__``: its own docstring, then the manifest's account of the op,
    generated on first read (``type.__doc__`` calls a descriptor found in the class)."""

    def __init__(self, own: str | None, entry_of: Callable[[type], OpEntry]) -> None:
        self._own = inspect.cleandoc(own) if own else ""
        self._entry_of = entry_of
        self._text: str | None = None

    def __get__(self, instance: Any, owner: type) -> str:
        if self._text is None:
            try:
                generated = manifest_doc(self._entry_of(owner))
            except Exception as error:  # noqa: BLE001 - help() must work on an op whose manifest is broken
                generated = f"(its manifest entry does not load: {type(error).__name__}: {error})"
            self._text = "\n\n".join(part for part in (self._own, generated) if part)
        return self._text
