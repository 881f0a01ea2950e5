"""Compiling TileLang programs for the kernels: once per build identity in a process (TileLang's
disk cache, ``TILELANG_CACHE_DIR``, keeps them across processes), one compiled kernel per rank
of the tensors a kernel is called with, and the entry function a launch calls.

Importing this module does not import tilelang; the first compilation does. Compile messages
are TileOPs' own: one line on stderr per kernel built, saying what and how long (none while a
progress bar stands for the builds, as tuning draws). TileLang's INFO log lines are quieted when
it is first imported here; ``TILEOPS_TILELANG_LOG=1`` leaves TileLang's logging as TileLang sets it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

from tileops.core import KernelBuildError

from . import progress

#: The pass configuration of a program that guards each of its global accesses itself: where
#: TileLang cannot prove an index in range it adds a check of its own, and a checked access is
#: not vectorised (a row's 16-byte accesses in a flat view of rows of any length, whose bound
#: it cannot derive from the guard).
GUARDED_BY_THE_PROGRAM = {"tl.disable_safe_memory_legalize": True}

_compiled: dict[tuple, Any] = {}
# One lock per build identity, so that different identities (tuning candidates) compile in
# parallel threads while one identity still compiles once.
_identity_locks: dict[tuple, threading.Lock] = {}
_identity_locks_lock = threading.Lock()


def compile_once(
    identity: Hashable, make_program: Callable[[], Any], target: dict[str, str], *, pass_configs: dict | None = None
) -> Any:
    """The TileLang kernel compiled from ``make_program()`` for ``target`` (with TileLang's
    ``pass_configs``), once per process for each (identity, target, pass_configs): ``identity``
    must cover everything the program depends on. Safe to call from several threads: distinct
    identities compile concurrently."""
    key = (identity, json.dumps(target, sort_keys=True), json.dumps(pass_configs, sort_keys=True))
    kernel = _compiled.get(key)
    if kernel is not None:
        return kernel
    with _identity_locks_lock:
        lock = _identity_locks.setdefault(key, threading.Lock())
    with lock:
        kernel = _compiled.get(key)
        if kernel is None:
            tilelang = _import_tilelang()
            started = time.perf_counter()
            program = make_program().with_attr("global_symbol", kernel_name(identity))
            try:
                kernel = _compiled[key] = tilelang.compile(program, target=target, pass_configs=pass_configs)
            except Exception as error:
                complaint = _compiler_complaint(error)
                hint = (
                    " The CUDA toolkit TileLang compiles with must build for the GPU's architecture (CUDA 13's "
                    "nvcc builds for sm_75 and later): install one that does."
                    if re.search(r"unsupported gpu architecture", complaint, re.IGNORECASE) else ""
                )
                raise KernelBuildError(
                    f"the TileLang kernel {_described(identity)} could not be compiled for "
                    f"{' '.join(map(str, target.values()))}: {complaint}.{hint} The compiler's whole output is "
                    "this error's cause"
                ) from error
            if not progress.drawing():
                sys.stderr.write(
                    f"tileops: built kernel {_described(identity)} for {' '.join(map(str, target.values()))} "
                    f"in {time.perf_counter() - started:.1f} s\n"
                )
    return kernel


def _compiler_complaint(error: Exception) -> str:
    """The lines of a failed compilation's message that say what failed (nvcc's "fatal" and
    "error" lines, not TileLang's heading), else its last line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    said = [line for line in lines if re.search(r"\b(error|fatal)\b", line, re.IGNORECASE)
            and not line.lower().startswith("compilation error")]
    return "; ".join(said[:3]) if said else (lines[-1] if lines else type(error).__name__)


def kernel_name(identity: Hashable) -> str:
    """The name a build's CUDA kernel carries in profilers (torch.profiler, Nsight), with
    TileLang's ``_kernel`` suffix: ``tileops_`` and the leading words of its identity (family,
    kind, function), so that a profile tells the families' kernels apart where TileLang would
    name every one ``main_kernel``."""
    words = []
    for part in identity if isinstance(identity, tuple) else (identity,):
        if not isinstance(part, str):
            break
        words.append(part)
    return re.sub(r"\W", "_", "_".join(["tileops", *words]))


def _import_tilelang() -> Any:
    import tilelang

    if os.environ.get("TILEOPS_TILELANG_LOG", "") in ("", "0"):
        # TileLang logs each compilation's stages at INFO to stderr; ours is the line above.
        logging.getLogger("tilelang").setLevel(logging.WARNING)
    return tilelang


def _described(identity: Hashable) -> str:
    """A build identity as words: its scalars, and its (name, value) pairs as name=value."""
    if not isinstance(identity, tuple):
        return str(identity)
    words = []
    for part in identity:
        if isinstance(part, tuple) and all(isinstance(item, tuple) and len(item) == 2 for item in part):
            words.extend(f"{name}={value}" for name, value in part)
        else:
            words.append(str(part))
    return " ".join(words)


class CompiledByRank(dict):
    """One build's launch functions by the rank of the tensors it is called with; a rank's is
    compiled on its first call (the same program, taking one size per leading dimension)."""

    def __init__(self, compile_rank: Callable[[int], Callable[..., None]]) -> None:
        super().__init__()
        self._compile_rank = compile_rank

    def __missing__(self, rank: int) -> Callable[..., None]:
        launch = self[rank] = self._compile_rank(rank)
        return launch


def entry_function(kernel: Any) -> Callable[..., Any]:
    """The cheapest way to call a compiled TileLang kernel whose outputs the caller allocates.

    TileLang's own ``kernel(*tensors)`` goes through a Python adapter that re-derives output
    shapes and counts arguments on every call (several microseconds on a decode-sized call).
    The kernels allocate nothing (no ``out_idx``), so the compiled entry function can take the
    tensors directly; where this TileLang does not expose it, the adapter is used.

    The entry function keeps the GIL while it launches, as torch's own launches do: releasing and
    taking it back around a launch that only queues work cost 0.1-0.3 us per call on the H200's
    host (2-3% of a decode-sized call).
    """
    adapter = getattr(kernel, "adapter", None)
    executable = getattr(adapter, "get_exportable_executable", None)
    if executable is None or getattr(adapter, "result_idx", None):
        return kernel
    # The host function carries the program's name (``kernel_name``).
    name = getattr(getattr(kernel, "prim_func", None), "attrs", {}).get("global_symbol", "main")
    try:
        entry = executable()[str(name)]
    except (AttributeError, KeyError, RuntimeError):
        return kernel
    if hasattr(entry, "release_gil"):
        entry.release_gil = False
    return entry
