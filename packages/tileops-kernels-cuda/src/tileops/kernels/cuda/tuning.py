"""Tuning of kernels' launch configurations, on request only (``op.request_tune()``), and the
store that keeps what tuning chose.

A kernel asks ``tune`` to time a list of candidate configurations on the tensors of the call
that tunes (compiled in parallel threads, then timed one by one); the fastest is remembered
under the kernel's entry key (``entry_key``: family, kind and build identity), in the process
and in one JSON file per GPU model for every family, ``$TILEOPS_CACHE_DIR/tuning/<model>.json``
(``store_path``), so each entry is tuned once per machine and GPU model. Writers take a lock
on the file (processes tuning at once keep each other's entries) and replace it atomically
(a reader never sees half a file). Entries are checked when read: one that is not a
configuration, or not one of the kernel's (other keys, other value types), is ignored with a
warning, and tuning replaces it.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from tileops.core import gpu_time_us, shown

from .device import cache_root
from .progress import Progress

#: A candidate must beat the default by this factor to replace it: closer timings are noise.
_MARGIN = 0.97
_TIMED_LAUNCHES = 20
_SAMPLES = 5
#: Candidates compile in parallel threads (TileLang's lowering and nvcc), at most this many.
_MAX_COMPILE_THREADS = 16
#: What a stored configuration's values may be.
_VALUE_TYPES = (bool, int, float, str)

_chosen: dict[tuple[str, str], dict[str, Any]] = {}  # (GPU model, entry key) -> configuration
_loaded: set[Path] = set()
_lock = threading.RLock()


def entry_key(family: str, kind: str, identity: tuple) -> str:
    """The store's key of one build identity: ``family/kind/part/part...`` (dtypes without
    their ``torch.`` prefix), e.g. ``family/kind/variant/1000/bfloat16/True``."""
    parts = [str(part).removeprefix("torch.") if isinstance(part, torch.dtype) else str(part) for part in identity]
    return "/".join([family, kind, *parts])


def store_path(gpu_model: str) -> Path:
    """The file the configurations tuned on ``gpu_model`` (a device name such as
    ``NVIDIA H200``) are kept in."""
    return cache_root() / "tuning" / f"{re.sub(r'[^A-Za-z0-9._-]+', '_', gpu_model)}.json"


def _problem(config: Any) -> str | None:
    """Why ``config`` is not a configuration (a JSON object of plain values), or None."""
    if not isinstance(config, dict):
        return f"a {type(config).__name__}, not an object"
    for name, value in config.items():
        if not isinstance(value, _VALUE_TYPES):
            return f"{shown(name)} holds a {type(value).__name__}"
        if isinstance(value, float) and not math.isfinite(value):
            return f"{shown(name)} holds {value}"
    return None


def _mismatch(config: dict[str, Any], like: dict[str, Any]) -> str | None:
    """Why ``config`` is not a configuration of the kernel whose default is ``like``, or None."""
    if set(config) != set(like):
        return f"its keys {shown(sorted(config))} are not the kernel's {sorted(like)}"
    for name, value in like.items():
        stored = config[name]
        # JSON writes 2.0 as 2.0 but a float field may hold an integral value written as 2.
        same = type(stored) is type(value) or (type(value) is float and type(stored) is int)
        if not same:
            return f"{name!r} is a {type(stored).__name__}, the kernel's is a {type(value).__name__}"
    return None


def _read(path: Path) -> dict[str, dict[str, Any]]:
    """The valid entries ``path`` holds (none where it does not exist), warning about the rest."""
    try:
        stored = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        _warn(f"tuned configurations in {path} were not read ({shown(str(error), 200)}); tuning will replace the file")
        return {}
    except RecursionError:  # JSON nested deeper than the parser recurses
        _warn(f"tuned configurations in {path} were not read (nested too deeply); tuning will replace the file")
        return {}
    if not isinstance(stored, dict):
        _warn(f"tuned configurations in {path} were not read (expected a JSON object, found "
              f"{type(stored).__name__}); tuning will replace the file")
        return {}
    entries = {}
    for key, config in stored.items():
        problem = _problem(config)
        if problem is None:
            entries[key] = config
        else:
            _warn(f"the tuned configuration {shown(key)} in {path} is ignored ({problem}); tuning will replace it")
    return entries


def _warn(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=4)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold the store's lock file: other processes writing it wait."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _load(gpu_model: str) -> None:
    path = store_path(gpu_model)
    if path not in _loaded:
        _loaded.add(path)
        for key, config in _read(path).items():
            _chosen.setdefault((gpu_model, key), config)


def chosen(gpu_model: str, key: str, like: dict[str, Any]) -> dict[str, Any] | None:
    """The configuration tuned for ``key`` on ``gpu_model`` on this machine (this process or an
    earlier one), or None if it was never tuned. ``like``: the kernel's default configuration;
    a stored one with other keys or value types is ignored, with a warning."""
    with _lock:
        _load(gpu_model)
        config = _chosen.get((gpu_model, key))
        if config is None:
            return None
        mismatch = _mismatch(config, like)
        if mismatch is not None:
            _warn(f"the tuned configuration {key!r} in {store_path(gpu_model)} is ignored ({mismatch}); "
                  "tuning will replace it")
            del _chosen[(gpu_model, key)]
            return None
        return {name: type(like[name])(value) for name, value in config.items()}  # 2 for a float field: 2.0


def remember(gpu_model: str, key: str, config: dict[str, Any]) -> None:
    """Keep ``config`` as the one for ``key``, in this process and in ``store_path(gpu_model)``."""
    with _lock:
        _load(gpu_model)  # what earlier processes stored stays in the file
        _chosen[(gpu_model, key)] = config
        path = store_path(gpu_model)
        try:
            with _locked(path):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # said when the store was loaded
                    stored = _read(path)
                stored[key] = config
                # Written aside and renamed, so a reader never sees half a file.
                with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as handle:
                    json.dump(stored, handle, indent=1, sort_keys=True)
                os.replace(handle.name, path)
        except OSError as error:
            warnings.warn(
                f"the tuned configuration was not saved to {path} ({error}); it holds for this process only",
                RuntimeWarning,
                stacklevel=2,
            )


def tune(
    gpu_model: str,
    key: str,
    candidates: list[dict[str, Any]],
    compile_candidate: Callable[[dict[str, Any]], Callable[..., None]],
    tensors: tuple[torch.Tensor, ...],
    what: str,
) -> dict[str, Any]:
    """Compile the candidates (the first is the default) in parallel threads, time each launched
    with ``tensors`` on the current stream, remember and return the fastest. The launches
    write the call's own outputs, which the real launch that follows overwrites."""
    with _lock:
        earlier = chosen(gpu_model, key, candidates[0])
        if earlier is not None:  # another kernel of the same key tuned meanwhile
            return earlier
        progress = Progress(what, 2 * len(candidates))
        failures = []
        kernels: dict[int, Callable[..., None]] = {}
        workers = max(1, min(len(candidates), os.cpu_count() or 1, _MAX_COMPILE_THREADS))
        with ThreadPoolExecutor(workers, thread_name_prefix="tileops-tune") as pool:
            pending = {pool.submit(compile_candidate, config): index for index, config in enumerate(candidates)}
            for future in as_completed(pending):
                index = pending[future]
                try:
                    kernels[index] = future.result()
                except Exception as error:  # noqa: BLE001 - a candidate the compiler rejects is skipped, and said so
                    failures.append(f"{candidates[index]}: {type(error).__name__}: {error}")
                progress.advance(None)
        timings: list[tuple[float, int]] = []
        for index in range(len(candidates)):
            kernel = kernels.get(index)
            if kernel is not None:
                try:
                    timed = gpu_time_us(lambda kernel=kernel: kernel(*tensors), calls=_TIMED_LAUNCHES, replays=_SAMPLES)
                    timings.append((timed, index))
                except Exception as error:  # noqa: BLE001 - a candidate the driver refuses to launch is skipped, and said so
                    failures.append(f"{candidates[index]}: {type(error).__name__}: {error}")
            progress.advance(min(timings)[0] if timings else None)
        if not timings:
            progress.finish("no candidate ran")
            raise RuntimeError(f"tuning {what}: no candidate ran:\n" + "\n".join(sorted(failures)))
        best_us, best = min(timings)
        default_us = next((us for us, index in timings if index == 0), None)
        if default_us is not None and best_us > default_us * _MARGIN:
            best_us, best = default_us, 0
        versus = "" if default_us is None else f" (default {default_us:.2f} us)"
        skipped = f"; {len(failures)} candidate(s) failed to compile or launch" if failures else ""
        progress.finish(f"chose {candidates[best]} at {best_us:.2f} us{versus}{skipped}")
        remember(gpu_model, key, candidates[best])
        return candidates[best]
