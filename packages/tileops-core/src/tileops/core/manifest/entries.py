"""The manifest's data model: a validated op entry and its parts (tensors, params, constraints,
workloads, the backward declaration), and the canonical form of a param's value.

``loader`` builds these from YAML; everything else reads them.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..errors import ManifestError
from .expressions import evaluate
from .quoting import shown, shown_text
from .shapes import ShapePattern

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
PARAM_TYPES = ("int", "float", "bool", "str", "shape", "dtype", "outputs")
#: What an op does with an input: reads it; reads and writes it in place; only writes it; or reads
#: only its shape, dtype and device (``shape``: a backward op told a forward input's description,
#: whose values its implementations never read, so that autograd need not keep the tensor alive).
ACCESS = ("read", "readwrite", "write", "shape")
#: The most elements a workload's tensor (or a shape param) may have: its bytes, 8 per
#: element at most, must fit torch's int64 sizes.
MAX_NUMEL = 2**60
#: A ``ParamDecl.default`` that says the param has none (a caller must give it).
REQUIRED = object()


@dataclasses.dataclass(frozen=True)
class TensorDecl:
    """An input or output tensor of a signature."""

    name: str
    dtypes: tuple[torch.dtype, ...] | None  # allowed dtypes, or None when dtype_same_as is set
    dtype_same_as: str | None
    shape: ShapePattern | None  # None when shape_same_as is set
    shape_same_as: str | None
    optional: bool = False
    cpu: bool = False
    contiguous: bool = False
    #: inputs that are read: a row view (``tileops.core.row_views``; the row is what the shape
    #: pattern names after its leading ``...``) reaches the in-tree implementations uncopied
    row_views: bool = False
    access: str = "read"
    aliases: str | None = None  # outputs: the written input this output returns
    #: outputs: an optional input without which the output is None (a gradient of that input)
    absent_without: str | None = None
    out: str | None = None  # outputs: keyword of a caller buffer to fill
    doc: str = ""
    #: inputs: the expression that computes this input from the others where a workload needs
    #: it (a forward's saved statistics, which random values would contradict); None: random
    derive: str | None = None
    derive_code: Any = None
    #: outputs: a ``dtype`` param whose value, when not None, is the output's dtype instead of
    #: ``dtype_same_as``'s (``dtype: {same_as: x, param: NAME}``: a caller asks for wider results)
    dtype_param: str | None = None

    @property
    def written(self) -> bool:
        return self.access in ("readwrite", "write")

    @property
    def described_only(self) -> bool:
        """Whether implementations read only this input's shape, dtype and device (``access: shape``)."""
        return self.access == "shape"

    def pattern(self, tensor: Callable[[str], TensorDecl]) -> ShapePattern:
        """This input's shape pattern: its own, or that of the input it follows (``shape: {same_as:
        ...}``, through any chain of them), ``tensor(name)`` giving the earlier inputs."""
        decl = self
        while decl.shape is None:
            decl = tensor(decl.shape_same_as)
        return decl.shape

    def dtype_in(self, dtype: torch.dtype) -> torch.dtype:
        """This tensor's dtype in a call (a workload, a description) whose tensors are ``dtype``:
        ``dtype``, except for a derived input whose declaration does not accept it, which gets
        the first dtype it declares (a float32 statistic beside bfloat16 tensors)."""
        if self.derive is None or self.dtypes is None or dtype in self.dtypes:
            return dtype
        return self.dtypes[0]


@dataclasses.dataclass(frozen=True)
class ParamDecl:
    name: str
    type: str
    default: Any = REQUIRED
    nullable: bool = False
    keyword_only: bool = False
    doc: str = ""

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


@dataclasses.dataclass(frozen=True)
class Constraint:
    text: str
    code: Any
    message: str
    at_construction: bool  # uses params only, so it is checked once per op instance
    place: str = ""  # the file, op and field, for errors

    def holds(self, namespace: dict[str, Any]) -> bool:
        """Whether the constraint holds for ``namespace`` (params and dimensions); a
        ``ManifestError`` naming the constraint where it cannot be evaluated on them."""
        try:
            return bool(evaluate(self.code, namespace))
        except Exception as error:  # noqa: BLE001 - whatever the expression raises is the manifest's fault
            raise ManifestError(f"{self.place}: {self.unevaluable(namespace, error)}") from None

    def unevaluable(self, namespace: dict[str, Any], error: Exception, values: str = "") -> str:
        """Why the constraint cannot be evaluated on ``namespace``: its text, the values (called
        ``values`` where given) and the error the expression raised."""
        shown_values = shown_text(", ".join(f"{k}={shown(v, 40)}" for k, v in namespace.items()), 200)
        on = f"{values} ({shown_values})" if values else shown_values
        return f"the constraint {shown(self.text)} cannot be evaluated on {on}: {type(error).__name__}: {shown_text(str(error), 200)}"


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    shapes: Mapping[str, tuple[int, ...]]
    dtypes: tuple[torch.dtype, ...]
    params: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class BackwardDecl:
    """What a differentiable forward op declares of its backward op.

    ``op`` names the backward op (an entry of the same file). ``saves`` are the backward's
    inputs the forward's implementation computes in its own pass (per-row statistics);
    the backward's other inputs are named after what they receive: ``d<output>``, the incoming
    gradient of a forward output, or the name of a forward input or output. ``grads`` maps each
    forward input that gets a gradient to the backward output holding it (several inputs may
    share one, as the two addends of a fused sum do). ``saved_for`` maps a saved statistic that
    serves one input's gradient alone (that gradient, computed by the forward pass) to that
    input: a differentiated call computes it only where the input requires grad, and the
    backward op receives None instead (its output for that gradient is then None too).

    ``incoming`` says which outputs a training step starts its backward from (``one``) or
    leaves unused (``none``); the others get a gradient from the layers after them.

    ``in_place`` names a second backward op, of the same inputs and outputs, that writes the
    gradients over forward inputs it reads (its outputs alias them), so that no new tensors of
    their size exist: a forward op built with ``consume_inputs=True`` (a bool param it must
    declare, which its backward ops do not take) runs it where that is safe.
    """

    op: str
    saves: tuple[str, ...]
    grads: Mapping[str, str]
    saved_for: Mapping[str, str] = dataclasses.field(default_factory=dict)
    in_place: str | None = None
    #: Output -> what a training step's backward hands it where that is not a gradient of its
    #: shape from the layers after it: ``one`` (the objective, where ``.backward()`` starts) or
    #: ``none`` (an output a training step does not use). Benchmarks time that step.
    incoming: Mapping[str, str] = dataclasses.field(default_factory=dict)


#: The forward param that lets a backward declared ``in_place`` write over the forward's inputs.
CONSUME_INPUTS = "consume_inputs"
#: The param (type ``outputs``) of an op with outputs declared ``absent_without``: those of them
#: a caller does not want (a frozen parameter's gradient), None in every call of the instance.
SKIP_OUTPUTS = "skip_outputs"


@dataclasses.dataclass(frozen=True)
class OpEntry:
    """One op's validated manifest entry."""

    name: str
    family: str
    summary: str
    inputs: tuple[TensorDecl, ...]
    outputs: tuple[TensorDecl, ...]
    params: tuple[ParamDecl, ...]
    exec_args: tuple[ParamDecl, ...]  # keyword-only call arguments passed through to implementations
    constraints: tuple[Constraint, ...]
    ref_api: str
    ref_code: Any
    torch_api: str | None  # the same computation in plain torch at the inputs' precision (benchmarks)
    torch_code: Any
    tolerance: Mapping[torch.dtype, tuple[float, float]]  # dtype -> (atol, rtol)
    workloads: tuple[Workload, ...]
    roofline: Mapping[str, Any]  # "bytes"/"flops" -> code
    source: str
    backward: BackwardDecl | None = None  # None: the op is not differentiable

    def input(self, name: str) -> TensorDecl:
        return next(t for t in self.inputs if t.name == name)



def param_value(kind: str, value: Any) -> Any:
    """A non-null ``value`` of a param of type ``kind`` in its canonical form (shapes as
    tuples, floats as float); ValueError saying what was expected otherwise."""
    if kind == "int":
        if not is_int(value):
            raise ValueError("an int")
        return int(value)
    if kind == "float":
        # Any real number: Python's, numpy's of every width (numpy registers its scalar types
        # as numbers.Real), a Fraction; not a bool.
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError("a float")
        try:
            return float(value)
        except (OverflowError, ValueError, TypeError):
            raise ValueError("a float (a real number that fits one)") from None
    if kind == "bool":
        if not isinstance(value, bool):
            raise ValueError("a bool")
        return value
    if kind == "str":
        if not isinstance(value, str):
            raise ValueError("a str")
        return value
    if kind == "dtype":
        if not isinstance(value, torch.dtype):
            raise ValueError("a torch.dtype")
        return value
    if kind == "outputs":  # output names, in one order whatever order the caller gave
        names = (value,) if isinstance(value, str) else value
        if isinstance(names, (list, tuple, set, frozenset)) and all(isinstance(name, str) for name in names):
            return tuple(sorted(set(names)))
        raise ValueError("an output name or a sequence of them")
    # shape: an int or a sequence of ints, as torch's shape arguments take
    if is_int(value):
        value = (value,)
    if isinstance(value, (list, tuple, torch.Size)) and all(is_int(d) and 0 <= d <= MAX_NUMEL for d in value):
        return tuple(int(d) for d in value)
    raise ValueError("an int or a sequence of non-negative ints")


def is_int(value: Any) -> bool:
    """An integer (Python's or numpy's of any width), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
