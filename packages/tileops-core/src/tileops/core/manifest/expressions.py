"""The expression language of manifest entries (constraints, roofline, reference calls).

Expressions are Python syntax, parsed once when the manifest is loaded; names must be
declared by the entry (dimensions, params, tensors) or be one of a few functions. Nothing is
parsed at call time: entries hold compiled code objects.

Constraints and roofline formulas may only compute with their names and FUNCTIONS.
Reference expressions (``ref_api``, ``torch_api``) may also read attributes and call what
they reach, within limits checked here: no attribute whose name starts with ``_`` (which is
how Python code reaches builtins, globals and the interpreter), nothing reached through the
module names (``torch``, ``F``) but torch's computational namespaces (MODULES: not ``os``,
``sys``, ``torch.hub`` or ``torch.utils``), and none of the attributes that read or write
files or load code (UNSAFE_ATTRIBUTES). Every expression is evaluated without builtins.
"""

from __future__ import annotations

import ast
import math
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .quoting import shown

#: Functions every constraint and roofline expression may call.
FUNCTIONS: dict[str, Callable[..., Any]] = {
    "len": len,
    "min": min,
    "max": max,
    "abs": abs,
    "prod": lambda values: math.prod(values),
    "numel": lambda tensor: math.prod(tensor.shape),
    # a tensor's element size, or a dtype param's (an output whose dtype a param chooses)
    "itemsize": lambda tensor: tensor.dtype.itemsize,
    # whether a dtype param (or a tensor's dtype) is a floating-point one, as torch.dtype says
    "is_floating_point": lambda value: getattr(value, "dtype", value).is_floating_point,
}

#: The modules a reference expression may reach through its module names.
MODULES = frozenset({
    "torch", "torch.nn", "torch.nn.functional", "torch.linalg", "torch.fft", "torch.special",
    "torch.autograd",  # backward ops' references differentiate their forward's
})
#: Attributes no reference expression may name: they read or write files, load code or run
#: commands, or format objects' internals into strings.
UNSAFE_ATTRIBUTES = frozenset({
    "load", "loads", "save", "from_file", "tofile", "dump", "dumps", "load_library", "load_inline",
    "system", "popen", "format", "format_map",
})
#: Longer expressions are refused: the parser's recursion and memory grow with nesting.
MAX_LENGTH = 2000
#: The largest exponent a ``**`` may have (a constant): larger ones make evaluation run away.
MAX_EXPONENT = 64

_ALLOWED_NODES = (
    ast.Expression, ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.Compare, ast.Call, ast.Name,
    ast.Constant, ast.Tuple, ast.List, ast.Subscript, ast.Slice, ast.IfExp, ast.Load,
    ast.And, ast.Or, ast.Not, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod,
    ast.Pow, ast.USub, ast.UAdd, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE,
    ast.Is, ast.IsNot, ast.In, ast.NotIn,
)
_REFERENCE_NODES = (ast.Attribute, ast.keyword, ast.Starred, ast.NamedExpr, ast.Store)


class ExpressionError(ValueError):
    """An expression is not valid; the loader adds the file, op and field."""


def compile_expression(text: Any, names: Iterable[str], *, attributes: bool = False, modules: Mapping[str, Any] | None = None):
    """Parse ``text`` and return its code object, refusing unknown names and constructs.

    ``attributes`` allows attribute access, any call and ``name := value`` (for reference
    expressions such as ``torch.nn.functional.logsigmoid(x)``), within the limits the module
    docstring states; ``modules`` maps the names among ``names`` that stand for modules to
    them, so that what is reached through them can be checked. Otherwise only the functions in
    FUNCTIONS.
    """
    if not isinstance(text, str) or not text.strip():
        raise ExpressionError(f"expected an expression string, got {shown(text)}")
    if len(text) > MAX_LENGTH:
        raise ExpressionError(f"{shown(text)} is longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as error:
        raise ExpressionError(f"{shown(text)} is not a valid expression: {error.msg}") from None
    except (RecursionError, MemoryError):
        raise ExpressionError(f"{shown(text)} nests too deeply to parse") from None
    known = set(names) | set(FUNCTIONS)
    modules = modules or {}
    if attributes:
        known |= {node.target.id for node in ast.walk(tree) if isinstance(node, ast.NamedExpr)}
    private = next((n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr.startswith("_")), None)
    if private is not None:  # said first: it is how Python code reaches builtins, globals and the interpreter
        raise ExpressionError(f"{shown(text)} reads the attribute {private!r}; names starting with '_' are not allowed")
    for node in ast.walk(tree):
        if attributes and isinstance(node, _REFERENCE_NODES):
            if isinstance(node, ast.Attribute):
                _check_attribute(node, text, modules)
            continue
        if not isinstance(node, _ALLOWED_NODES):
            raise ExpressionError(f"{shown(text)} uses {type(node).__name__}, which manifest expressions do not allow")
        if isinstance(node, ast.Call) and not attributes:
            if not (isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS):
                raise ExpressionError(f"{shown(text)} calls something other than {', '.join(sorted(FUNCTIONS))}")
        if isinstance(node, ast.Name) and node.id not in known:
            raise ExpressionError(
                f"{shown(text)} uses the undefined name {shown(node.id)} (defined here: {', '.join(sorted(known))})"
            )
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            exponent = node.right
            if isinstance(exponent, ast.UnaryOp) and isinstance(exponent.op, (ast.USub, ast.UAdd)):
                exponent = exponent.operand
            exponent = exponent.value if isinstance(exponent, ast.Constant) else None
            if isinstance(exponent, bool) or not isinstance(exponent, (int, float)) or abs(exponent) > MAX_EXPONENT:
                raise ExpressionError(f"{shown(text)}: the exponent of ** must be a number of at most {MAX_EXPONENT}")
    return compile(tree, f"<manifest: {shown(text.strip())}>", "eval")


def _check_attribute(node: ast.Attribute, text: str, modules: Mapping[str, Any]) -> None:
    """Refuse ``node`` where it names an unsafe attribute, or where it reaches, through a module name, a module other than MODULES."""
    if node.attr in UNSAFE_ATTRIBUTES:
        raise ExpressionError(f"{shown(text)} names {node.attr!r}, which reads or writes files or runs code")
    chain = []
    base: ast.AST = node
    while isinstance(base, ast.Attribute):
        chain.append(base.attr)
        base = base.value
    if not (isinstance(base, ast.Name) and base.id in modules):
        return  # an attribute of a tensor or of a call's result
    value = modules[base.id]
    reached = base.id
    for attr in reversed(chain):
        # Attributes this torch does not have raise AttributeError when evaluated: harmless.
        value = getattr(value, attr, None)
        reached += f".{attr}"
        if isinstance(value, types.ModuleType) and value.__name__ not in MODULES:
            raise ExpressionError(
                f"{shown(text)} reaches the module {value.__name__} ({reached}); reference expressions may use "
                f"{', '.join(sorted(MODULES))}"
            )


def evaluate(code, namespace: dict[str, Any]) -> Any:
    return eval(code, {"__builtins__": {}, **FUNCTIONS}, namespace)  # noqa: S307 - code compiled from a checked expression tree
