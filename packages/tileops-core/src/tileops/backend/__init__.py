"""The public API for backends: add kernel types to ops, or serve whole ops on a target.

Everything a backend (or a test outside TileOPs) needs is importable from here; the modules
behind it are internal and may move between releases.
"""

from ..core.device_facts import DeviceFacts, register_device_facts
from ..core.discovery import LoadFailure, load_failures
from ..core.errors import (
    AmbiguousTargetError,
    BackendError,
    KernelBuildError,
    KernelSelectionError,
    ManifestError,
    OpArgumentError,
    OpNotAvailableError,
    UnknownTargetError,
)
from ..core.kernel import CallSpec, Kernel, KernelInterface
from ..core.registry import BUILTIN, register_detector, register_kernel_builder, register_kernel_type
from ..core.targets import TensorSpec, default_target, registered_targets, set_default_target

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
    "LoadFailure",
    "ManifestError",
    "OpArgumentError",
    "OpNotAvailableError",
    "TensorSpec",
    "UnknownTargetError",
    "default_target",
    "load_failures",
    "register_detector",
    "register_device_facts",
    "register_kernel_builder",
    "register_kernel_type",
    "registered_targets",
    "set_default_target",
]
