"""Tuning of the norm kernels' launch configurations, on request only (``op.request_tune()``).

A kernel asks ``tune`` to time a list of candidate configurations on the tensors of the call
that tunes (compiled in parallel threads, then timed one by one); the fastest is remembered
per tuning key (GPU name and architecture, kind, variant, row length, dtype, eps, flags), in
the process and in a JSON file under ``$TILEOPS_CACHE_DIR`` (default ``~/.cache/tileops``),
so each key is tuned once per machine. Progress is drawn on stderr, as tuning compiles one
kernel per candidate and takes seconds.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import torch

from tileops.core.timing import gpu_time_us

from ..device import cache_root

#: A candidate must beat the default by this factor to replace it: closer timings are noise.
_MARGIN = 0.97
_TIMED_LAUNCHES = 20
_SAMPLES = 5
#: Candidates compile in parallel threads (TileLang's lowering and nvcc), at most this many.
_MAX_COMPILE_THREADS = 16

_chosen: dict[str, dict[str, Any]] = {}
_loaded = False
_lock = threading.RLock()


def store_path() -> Path:
    """The file tuned configurations are kept in."""
    return cache_root() / "norm-tuning.json"


def _text(key: tuple) -> str:
    return json.dumps([str(part) if isinstance(part, torch.dtype) else part for part in key])


def _read_store() -> dict[str, Any]:
    """What ``store_path()`` holds; ValueError when it is not a JSON object."""
    stored = json.loads(store_path().read_text())
    if not isinstance(stored, dict):
        raise ValueError(f"expected a JSON object, found {type(stored).__name__}")
    return stored


def chosen(key: tuple) -> dict[str, Any] | None:
    """The configuration tuned for ``key`` on this machine (this process or an earlier one),
    or None if it was never tuned."""
    global _loaded
    with _lock:
        if not _loaded:
            _loaded = True
            try:
                _chosen.update({k: v for k, v in _read_store().items() if k not in _chosen})
            except FileNotFoundError:
                pass
            except (OSError, ValueError) as error:
                warnings.warn(
                    f"tuned configurations in {store_path()} were not read ({error}); tuning will replace the file",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return _chosen.get(_text(key))


def remember(key: tuple, config: dict[str, Any]) -> None:
    """Keep ``config`` as the one for ``key``, in this process and in ``store_path()``."""
    with _lock:
        chosen(key)  # loads what earlier processes stored, so the file keeps it
        _chosen[_text(key)] = config
        path = store_path()
        try:
            stored = _read_store()
        except (OSError, ValueError):  # missing or unreadable (said when it was loaded): start afresh
            stored = {}
        stored[_text(key)] = config
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
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
    key: tuple,
    candidates: list[dict[str, Any]],
    compile_candidate: Callable[[dict[str, Any]], Callable[..., None]],
    tensors: tuple[torch.Tensor, ...],
    what: str,
) -> dict[str, Any]:
    """Compile the candidates (the first is the default) in parallel threads, time each launched
    with ``tensors`` on the current stream, remember and return the fastest. The launches
    write the call's own outputs, which the real launch that follows overwrites."""
    with _lock:
        earlier = chosen(key)
        if earlier is not None:  # another kernel of the same key tuned meanwhile
            return earlier
        progress = _Progress(what, 2 * len(candidates))
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
                    timings.append((gpu_time_us(lambda: kernel(*tensors), calls=_TIMED_LAUNCHES, replays=_SAMPLES), index))
                except Exception as error:  # noqa: BLE001 - a candidate the driver refuses to launch is skipped, and said so
                    failures.append(f"{candidates[index]}: {type(error).__name__}: {error}")
            progress.advance(min(timings)[0] if timings else None)
        if not timings:
            raise RuntimeError(f"tuning {what}: no candidate ran:\n" + "\n".join(sorted(failures)))
        best_us, best = min(timings)
        default_us = next((us for us, index in timings if index == 0), None)
        if default_us is not None and best_us > default_us * _MARGIN:
            best_us, best = default_us, 0
        progress.finish(candidates[best], best_us, default_us, len(failures))
        remember(key, candidates[best])
        return candidates[best]


class _Progress:
    """A one-line progress bar on stderr, ending with what was chosen."""

    _WIDTH = 24

    def __init__(self, what: str, total: int) -> None:
        self.what, self.total, self.done = what, total, 0
        self._draw(None)

    def advance(self, best_us: float | None) -> None:
        self.done += 1
        self._draw(best_us)

    def _draw(self, best_us: float | None) -> None:
        filled = self._WIDTH * self.done // self.total
        best = "" if best_us is None else f"  best {best_us:.2f} us"
        sys.stderr.write(f"\rtuning {self.what} [{'#' * filled}{'.' * (self._WIDTH - filled)}] "
                         f"{self.done}/{self.total}{best}")
        sys.stderr.flush()

    def finish(self, config: dict[str, Any], best_us: float, default_us: float | None, failed: int) -> None:
        versus = "" if default_us is None else f" (default {default_us:.2f} us)"
        skipped = f"; {failed} candidate(s) failed to compile or launch" if failed else ""
        sys.stderr.write(f"\rtuning {self.what}: chose {config} at {best_us:.2f} us{versus}{skipped}\n")
        sys.stderr.flush()
