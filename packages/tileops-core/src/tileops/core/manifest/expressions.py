"""The expression language of manifest entries (constraints, roofline, reference calls).

Expressions are Python syntax, parsed once when the manifest is loaded; names must be
declared by the entry (dimensions, params, tensors) or be one of a few functions. Nothing is
parsed at call time: entries hold compiled code objects.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable, Iterable
from typing import Any

#: Functions every constraint and roofline expression may call.
FUNCTIONS: dict[str, Callable[..., Any]] = {
    "len": len,
    "min": min,
    "max": max,
    "abs": abs,
    "prod": lambda values: math.prod(values),
    "numel": lambda tensor: math.prod(tensor.shape),
    "itemsize": lambda tensor: tensor.dtype.itemsize,
}

_ALLOWED_NODES = (
    ast.Expression, ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.Compare, ast.Call, ast.Name,
    ast.Constant, ast.Tuple, ast.List, ast.Subscript, ast.Slice, ast.IfExp, ast.Load,
    ast.And, ast.Or, ast.Not, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod,
    ast.Pow, ast.USub, ast.UAdd, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE,
    ast.Is, ast.IsNot, ast.In, ast.NotIn,
)


class ExpressionError(ValueError):
    """An expression is not valid; the loader adds the file, op and field."""


def compile_expression(text: Any, names: Iterable[str], *, attributes: bool = False):
    """Parse ``text`` and return its code object, refusing unknown names and constructs.

    ``attributes`` allows attribute access, any call and ``name := value`` (for reference
    expressions such as ``torch.nn.functional.softmax(x, dim)``); otherwise only the
    functions in FUNCTIONS.
    """
    if not isinstance(text, str) or not text.strip():
        raise ExpressionError(f"expected an expression string, got {text!r}")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as error:
        raise ExpressionError(f"{text!r} is not a valid expression: {error.msg}") from None
    known = set(names) | set(FUNCTIONS)
    if attributes:
        known |= {node.target.id for node in ast.walk(tree) if isinstance(node, ast.NamedExpr)}
    for node in ast.walk(tree):
        if attributes and isinstance(node, (ast.Attribute, ast.keyword, ast.Starred, ast.NamedExpr, ast.Store)):
            continue
        if not isinstance(node, _ALLOWED_NODES):
            raise ExpressionError(f"{text!r} uses {type(node).__name__}, which manifest expressions do not allow")
        if isinstance(node, ast.Call) and not attributes:
            if not (isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS):
                raise ExpressionError(f"{text!r} calls something other than {', '.join(sorted(FUNCTIONS))}")
        if isinstance(node, ast.Name) and node.id not in known:
            raise ExpressionError(
                f"{text!r} uses the undefined name {node.id!r} (defined here: {', '.join(sorted(known))})"
            )
    return compile(tree, f"<manifest: {text.strip()}>", "eval")


def evaluate(code, namespace: dict[str, Any]) -> Any:
    return eval(code, {"__builtins__": {}, **FUNCTIONS}, namespace)  # noqa: S307 - code compiled from a checked expression tree
