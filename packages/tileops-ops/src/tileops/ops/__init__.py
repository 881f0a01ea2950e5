"""TileOPs ops: every op class, importable as ``tileops.ops.<OpName>``.

Each family is a subpackage (``tileops.ops.norm``) holding its ops, kernel interfaces, call
specs and CPU implementations, and listing its op classes in ``OPS``. The families are found
here by looking for subpackages, so adding one edits nothing in this file. Importing this
package never imports tilelang.
"""

import importlib
import pkgutil


def _find_families() -> dict[str, tuple[type, ...]]:
    families: dict[str, tuple[type, ...]] = {}
    seen: dict[str, str] = {}
    for module in pkgutil.iter_modules(__path__):
        if not module.ispkg:
            continue
        package = importlib.import_module(f"{__name__}.{module.name}")
        ops = getattr(package, "OPS", None)
        if not isinstance(ops, tuple) or not ops:
            raise ImportError(
                f"{package.__name__} is a family package but defines no OPS: a family lists its op classes "
                f"in a non-empty tuple OPS, got {ops!r}"
            )
        for op_class in ops:
            if op_class.__name__ in seen:
                raise ImportError(
                    f"{package.__name__} and {seen[op_class.__name__]} both define an op named {op_class.__name__}"
                )
            seen[op_class.__name__] = package.__name__
        families[module.name] = ops
    return families


#: Every op class, by family (the subpackage's name, which is also the manifest's ``family``).
FAMILIES = _find_families()

globals().update((op_class.__name__, op_class) for ops in FAMILIES.values() for op_class in ops)

__all__ = ["FAMILIES", *sorted(op_class.__name__ for ops in FAMILIES.values() for op_class in ops)]
