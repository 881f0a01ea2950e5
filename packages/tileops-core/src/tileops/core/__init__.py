"""TileOPs core: the public names for people who write ops and their in-tree kernels.

Public here, and stable across releases:

- ``Op``: the base class of every op;
- ``KernelInterface``, ``CallSpec``, ``Kernel``: an op family's kernel interfaces, the call
  specs that select an implementation, and the implementations themselves;
- ``BUILTIN``: the name of the in-tree implementations wherever a target is named;
- ``DeviceFacts``, ``facts_for``: what is known about a device (a kernel's launch policy reads
  its SM count, shared memory and architecture); ``is_stated``: whether those facts are stated
  for a device that is asked about (``tileops explain --arch``), not read from one present;
- ``gpu_time_us``: the GPU time of a call by CUDA-graph replay (kernels that tune themselves);
- ``derive_input``: an op's input computed by its manifest ``derive`` expression (a backward
  op computes a statistic its forward did not save);
- ``stand_in``: what autograd passes for an ``access: shape`` input, a one-element view of its
  shape (``tileops.testing`` passes it to the op under test too);
- ``is_row_view``, ``row_pitch``: the layout of an input a manifest declares ``row_views`` (dense
  rows at a pitch), as an op hands it to a kernel that takes it;
- ``shown``: a value quoted for an error message, cut to a bounded length (a message about a
  file quotes what it found there, which can be any size);
- the errors: ``TileOpsError`` and its subclasses.

Backend authors use ``tileops.backend``, which exports the names a backend needs (some of
these among them). ``tileops.core.manifest`` is the manifest's data model for TileOPs' own
tools (the command line, ``tileops.testing``); every other module of this package is internal.
"""

from .autograd import derive_input, stand_in
from .device_facts import DeviceFacts, facts_for, is_stated
from .errors import (
    AmbiguousTargetError,
    BackendError,
    KernelBuildError,
    KernelSelectionError,
    ManifestError,
    OpArgumentError,
    OpNotAvailableError,
    TileOpsError,
    UnknownTargetError,
)
from .kernel import CallSpec, Kernel, KernelInterface
from .manifest.quoting import shown
from .op import Op
from .registry import BUILTIN
from .row_views import is_row_view, row_pitch
from .timing import gpu_time_us

__all__ = [
    "BUILTIN",
    "AmbiguousTargetError",
    "BackendError",
    "CallSpec",
    "DeviceFacts",
    "Kernel",
    "KernelInterface",
    "KernelBuildError",
    "KernelSelectionError",
    "ManifestError",
    "Op",
    "OpArgumentError",
    "OpNotAvailableError",
    "TileOpsError",
    "UnknownTargetError",
    "derive_input",
    "facts_for",
    "gpu_time_us",
    "is_row_view",
    "is_stated",
    "row_pitch",
    "shown",
    "stand_in",
]
