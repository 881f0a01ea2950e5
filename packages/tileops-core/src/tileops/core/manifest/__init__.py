"""The manifest: each op's external contract, declared in YAML, loaded and validated strictly.

``loader`` reads and validates files into ``OpEntry`` objects; ``expressions`` compiles the
small expression language entries use; ``signature`` turns an entry into the checks an op
runs on every call.
"""

from .loader import OpEntry, load_manifest
from .signature import BoundCall, Signature

__all__ = ["BoundCall", "OpEntry", "Signature", "load_manifest"]
