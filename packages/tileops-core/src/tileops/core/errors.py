"""The exceptions TileOPs raises, grouped by who has to act on them.

``BackendError`` and its subclasses are about how backends and targets were registered or
chosen; ``OpArgumentError`` is about what a caller passed to an op; ``KernelSelectionError``
is about a call no implementation (or more than one) claims; ``KernelBuildError`` about a kernel
that could not be compiled for the call's device. Each message is built where the
facts are known and says what to do next.
"""

from __future__ import annotations


class TileOpsError(Exception):
    """Base class of every error TileOPs raises on purpose."""


class BackendError(TileOpsError):
    """A registration or a backend's contract is wrong (duplicate key, bad kernel class...)."""


class UnknownTargetError(BackendError, LookupError):
    """A target was named that no installed backend registered."""


class AmbiguousTargetError(BackendError):
    """Several targets' detectors claim the call's device and nothing says which one wins."""


class OpNotAvailableError(BackendError):
    """The bound target has no kernel builder for this op, and the op will not fall back."""


class OpArgumentError(TileOpsError, TypeError, ValueError):
    """An op was called or constructed with arguments its signature does not accept.

    It is both a ``TypeError`` and a ``ValueError`` so that code written against torch's
    functional API, which raises either, keeps catching it.
    """


class KernelSelectionError(TileOpsError, RuntimeError):
    """No implementation, or more than one, is left for a call after selection."""


class KernelBuildError(TileOpsError, RuntimeError):
    """The implementation selection chose could not build its kernel for the call's device: the
    message names the kernel, the architecture and what the compiler said."""


class ManifestError(TileOpsError, ValueError):
    """A manifest entry is malformed; the message names the file, the op and the field."""
