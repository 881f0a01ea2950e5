"""TileOPs core: the ``Op`` base class for people who write new ops.

Backend authors use ``tileops.backend``; the rest of this package is internal.
"""

from .op import Op

__all__ = ["Op"]
