"""The manifest: each op's external contract, declared in YAML, loaded and validated strictly.

``entries`` is the data model (``OpEntry`` and its parts); ``loader`` reads files as plain YAML
(``plain_yaml``) and validates them into entries; ``expressions`` compiles the
small expression language entries use; ``shapes`` is the shape-pattern language;
``signature`` turns an entry into the checks an op runs on every call (the reference bind;
``tileops.core.call_path`` generates the fast path of the common case from the same entry).

The names exported here are the manifest's data model for TileOPs' own tools (the command
line, ``tileops.testing``); the modules behind them are internal.
"""

from .expressions import evaluate
from .entries import CONSUME_INPUTS, DTYPES, SKIP_OUTPUTS, BackwardDecl, OpEntry, ParamDecl, TensorDecl, Workload, param_value
from .loader import load_manifest, parse_manifest
from .shapes import PatternEntry, ShapePattern
from .signature import BoundCall, Signature

__all__ = [
    "CONSUME_INPUTS",
    "DTYPES",
    "SKIP_OUTPUTS",
    "BackwardDecl",
    "BoundCall",
    "OpEntry",
    "ParamDecl",
    "PatternEntry",
    "ShapePattern",
    "Signature",
    "TensorDecl",
    "Workload",
    "evaluate",
    "load_manifest",
    "param_value",
    "parse_manifest",
]
