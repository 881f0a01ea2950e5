"""Facts about a device that selection and launch rules read (architecture, SM count, shared
memory, what a multiprocessor holds, name).

Facts are read per device, never from "the current device", and only when an op misses its
cache. CUDA and CPU facts are built in; another device type's backend registers a reader with
``register_device_facts``. Facts can also be stated outright to ask what would run elsewhere
(``stated_facts``); within ``stating(facts)`` every reader of a device's facts gets them, rules
that read a device's limits at selection included, not the present device's.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
from collections.abc import Callable, Iterator

import torch

from .errors import BackendError


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
    """What selection may know about one device.

    ``arch`` is ``major * 10 + minor`` on CUDA (90 for Hopper); other device types choose
    their own numbering. ``shared_memory_per_block`` is what one block may opt in to; the
    ``*_per_sm`` facts are what one multiprocessor holds (shared memory in bytes, 32-bit
    registers, resident threads), from which a launch rule counts the blocks resident at once;
    ``l2_bytes`` is the size of the L2 cache, which tells a rule whether a call's tensors stay on
    chip between two kernels. Unknown facts are None.
    """

    device_type: str
    arch: int | None = None
    sm_count: int | None = None
    shared_memory_per_block: int | None = None
    name: str = ""
    shared_memory_per_sm: int | None = None
    registers_per_sm: int | None = None
    threads_per_sm: int | None = None
    l2_bytes: int | None = None


FactsReader = Callable[[torch.device], DeviceFacts]

#: The shared memory one block may opt in to, by CUDA architecture, as NVIDIA documents it per
#: compute capability: what a stated architecture's facts carry, so that a rule bounded by it
#: answers for that architecture.
CUDA_SHARED_MEMORY_PER_BLOCK = {
    70: 96 * 1024,
    75: 64 * 1024,
    80: 163 * 1024,
    86: 99 * 1024,
    87: 163 * 1024,
    89: 99 * 1024,
    90: 227 * 1024,
    100: 227 * 1024,
    120: 99 * 1024,
}

_stated: contextvars.ContextVar[DeviceFacts | None] = contextvars.ContextVar("tileops_stated_facts", default=None)


def stated_facts(device_type: str, arch: int) -> DeviceFacts:
    """The facts of a device of ``device_type`` and ``arch`` that no machine is asked for: the
    architecture, and on CUDA the documented shared memory per block; the rest unknown."""
    shared = CUDA_SHARED_MEMORY_PER_BLOCK.get(arch) if device_type == "cuda" else None
    return DeviceFacts(device_type, arch=arch, shared_memory_per_block=shared)


@contextlib.contextmanager
def stating(facts: DeviceFacts) -> Iterator[None]:
    """Within: ``facts_for`` answers ``facts`` for every device of their type, so that a question
    about another device (``tileops explain --arch``) is not answered with the present one's."""
    token = _stated.set(facts)
    try:
        yield
    finally:
        _stated.reset(token)


def _cuda_facts(device: torch.device) -> DeviceFacts:
    props = torch.cuda.get_device_properties(device)
    return DeviceFacts(
        device_type="cuda",
        arch=props.major * 10 + props.minor,
        sm_count=props.multi_processor_count,
        shared_memory_per_block=getattr(props, "shared_memory_per_block_optin", None),
        name=props.name,
        shared_memory_per_sm=props.shared_memory_per_multiprocessor,
        registers_per_sm=props.regs_per_multiprocessor,
        threads_per_sm=props.max_threads_per_multi_processor,
        l2_bytes=getattr(props, "L2_cache_size", None) or None,
    )


def _cpu_facts(device: torch.device) -> DeviceFacts:
    return DeviceFacts(device_type="cpu", name="cpu")


_readers: dict[str, FactsReader] = {"cuda": _cuda_facts, "cpu": _cpu_facts}
_cache: dict[torch.device, DeviceFacts] = {}
_lock = threading.Lock()


def register_device_facts(device_type: str, read: FactsReader) -> None:
    """Tell TileOPs how to read the facts of devices of ``device_type``.

    ``read(device)`` returns a :class:`DeviceFacts`; it is called at most once per device.
    """
    if not isinstance(device_type, str) or not device_type:
        raise BackendError(f"register_device_facts: device_type must be a non-empty str, got {device_type!r}")
    if not callable(read):
        raise BackendError(f"register_device_facts({device_type!r}): read must be callable, got {read!r}")
    from .registry import journal

    with _lock:
        if device_type in _readers:
            raise BackendError(
                f"register_device_facts: facts for device type {device_type!r} are already registered "
                f"(by {_readers[device_type].__module__}.{_readers[device_type].__qualname__})"
            )
        _readers[device_type] = read
        for device in [d for d in _cache if d.type == device_type]:
            del _cache[device]
    journal.record(lambda: _unregister(device_type, read))


def _unregister(device_type: str, read: FactsReader) -> None:
    with _lock:
        if _readers.get(device_type) is read:
            del _readers[device_type]
        for device in [d for d in _cache if d.type == device_type]:
            del _cache[device]


def has_facts_reader(device_type: str) -> bool:
    return device_type in _readers


def is_stated(device: torch.device) -> bool:
    """Whether ``facts_for(device)`` answers stated facts here (within ``stating``)."""
    stated = _stated.get()
    return stated is not None and stated.device_type == device.type


def facts_for(device: torch.device) -> DeviceFacts | None:
    """The facts of ``device``, or None where no reader is registered for its type."""
    if is_stated(device):
        return _stated.get()
    facts = _cache.get(device)
    if facts is not None:
        return facts
    read = _readers.get(device.type)
    if read is None:
        return None
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    try:
        facts = read(device)
    except Exception as error:
        raise BackendError(
            f"the device-facts reader for {device.type!r} ({read.__module__}.{read.__qualname__}) raised "
            f"{type(error).__name__}: {error} while reading {device}. This is a fault of the backend that "
            "registered it; report it to its authors, or uninstall it"
        ) from error
    if not isinstance(facts, DeviceFacts):
        raise BackendError(
            f"the device-facts reader for {device.type!r} ({read.__module__}.{read.__qualname__}) "
            f"returned {type(facts).__name__}, not DeviceFacts"
        )
    _cache[device] = facts
    return facts
