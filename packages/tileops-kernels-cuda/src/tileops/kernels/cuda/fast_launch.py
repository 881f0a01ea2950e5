"""The C++ hit path of a kernel call (``fast_launch.cpp``): built once per machine, then loaded.

A decode-sized call is all host time. In Python, a kernel's forward pays for ``torch.empty_like``
through torch's argument parser (about 1.8 us on the H200's host) and for tvm-ffi turning each
tensor into an ffi Tensor (about 0.6 us) around TileLang's entry function; the C++ ``Launcher``
allocates through ATen and hands the entry DLTensors built on the stack. It is called as the
kernel's forward and sends every call it does not handle to the Python forward, which serves
them all. It allocates outputs shaped like one of the call's arguments only: a kernel with an
output of another shape (a shape function of the inputs and params) keeps its Python forward
for every call (``kernel.TileLangKernel`` asks for no launcher then).

It is compiled when the first kernel is built on a machine, with the C++ compiler (``$CXX``, else
``c++``), against the torch, tvm-ffi, Python and CUDA headers in use, into
``$TILEOPS_CACHE_DIR/fast-launch/<key>/`` (see ``device.cache_root``); the key covers the source, the
build's flags and those versions, so later processes load it. Where it cannot be built, kernels keep their
Python forward, a warning says why once, and ``unavailable_reason()`` tells. Setting
``TILEOPS_FAST_LAUNCH=0`` keeps the Python forward without trying.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from .device import cache_root

_SOURCE = Path(__file__).with_name("fast_launch.cpp")
_MODULE_NAME = "tileops_fast_launch"  # the name PyInit_ in the source is built for
_BUILD_TIMEOUT_S = 600

_unavailable: str | None = None
# Threads building kernels at once wait for one compilation, then load its result.
_build_lock = threading.Lock()


class _CannotBuild(Exception):
    """Why the launcher cannot be built here, in words a user can act on."""


def _cuda_include() -> Path:
    """The CUDA toolkit's include folder: where CUDA_HOME, CUDA_PATH, TileLang or nvcc point."""
    from tilelang.env import CUDA_HOME

    nvcc = shutil.which("nvcc")
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), CUDA_HOME,
             nvcc and Path(nvcc).resolve().parent.parent, "/usr/local/cuda"]
    for home in homes:
        if home and (Path(home) / "include" / "cuda_runtime_api.h").is_file():
            return Path(home) / "include"
    raise _CannotBuild(f"no CUDA headers (cuda_runtime_api.h) under any of {[str(h) for h in homes if h]}; set CUDA_HOME")


def _include_dirs() -> list[Path]:
    import tvm_ffi

    python = Path(sysconfig.get_paths()["include"])
    if not (python / "Python.h").is_file():
        raise _CannotBuild(f"no Python.h in {python} (install the Python development headers)")
    torch_include = Path(torch.__file__).parent / "include"
    return [python, torch_include, torch_include / "torch" / "csrc" / "api" / "include", _cuda_include(),
            Path(tvm_ffi.__file__).parent / "include"]


def _library_dirs() -> list[Path]:
    import tvm_ffi

    return [Path(torch.__file__).parent / "lib", Path(tvm_ffi.__file__).parent / "lib"]


def _compiler() -> str:
    compiler = os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None:
        raise _CannotBuild(f"no C++ compiler {compiler!r} on PATH (set CXX)")
    return compiler


def _build_key(compiler: str) -> str:
    import tvm_ffi

    # This file too: it holds the compiler flags and libraries the build uses.
    facts = [_SOURCE.read_bytes(), Path(__file__).read_bytes(), torch.__version__, str(torch.version.cuda),
             tvm_ffi.__version__, sys.version, platform.machine(), compiler]
    digest = hashlib.sha256()
    for fact in facts:
        digest.update(fact if isinstance(fact, bytes) else fact.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _compile(compiler: str, target: Path) -> None:
    """Compile the source into ``target``, atomically: a concurrent process sees no half file."""
    libraries = _library_dirs()
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        command = [
            compiler, "-O2", "-std=c++20", "-shared", "-fPIC", "-fvisibility=hidden",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            *(f"-I{folder}" for folder in _include_dirs()),
            str(_SOURCE), "-o", str(built),
            *(f"-L{folder}" for folder in libraries),
            *(f"-Wl,-rpath,{folder}" for folder in libraries),
            "-lc10", "-lc10_cuda", "-ltorch_cpu", "-ltorch_python", "-ltvm_ffi",
        ]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise _CannotBuild(f"compiling {_SOURCE.name} took over {_BUILD_TIMEOUT_S} s") from None
        if done.returncode != 0:
            last_lines = "\n".join(done.stderr.strip().splitlines()[-5:])
            raise _CannotBuild(f"{compiler} failed on {_SOURCE.name}:\n{last_lines}")
        os.replace(built, target)


def _load(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(_MODULE_NAME, str(path))
    spec = importlib.util.spec_from_file_location(_MODULE_NAME, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@functools.cache
def _module() -> ModuleType | None:
    global _unavailable
    if os.environ.get("TILEOPS_FAST_LAUNCH") == "0":
        _unavailable = "turned off by TILEOPS_FAST_LAUNCH=0"
        return None
    try:
        compiler = _compiler()
        folder = cache_root() / "fast-launch" / _build_key(compiler)
        target = folder / f"{_MODULE_NAME}{importlib.machinery.EXTENSION_SUFFIXES[0]}"
        with _build_lock:
            if not target.is_file():
                folder.mkdir(parents=True, exist_ok=True)
                _compile(compiler, target)
            return _load(target)
    except (_CannotBuild, OSError, ImportError) as error:
        _unavailable = str(error)
    warnings.warn(
        f"TileOPs' C++ launch path is not available ({_unavailable}); the CUDA kernels run their "
        "Python forward, about 2 us more per call. Set TILEOPS_FAST_LAUNCH=0 to skip this attempt.",
        RuntimeWarning,
        stacklevel=3,
    )
    return None


def unavailable_reason() -> str | None:
    """Why the C++ launch path is not in use, or None where it is (or was not needed yet)."""
    return _unavailable


def launcher(
    fallback: Callable[..., Any],
    resolve: Callable[[int, int], Any],
    device: int,
    *,
    arity: int,
    order: tuple[int, ...],
    outputs: tuple[int, ...],
    size_of: int,
    choices: tuple[tuple[int, int], ...],
    default_build: int,
) -> Callable[..., Any] | None:
    """A C++ forward for a kernel, or None where the launch path cannot be built.

    fallback: the kernel's Python forward, called with the same arguments whenever the C++ one
    does not handle a call. resolve(rank, build): the TileLang entry of that build for tensors
    of that rank (compiling it if needed), or None to leave them to the fallback. device: the
    CUDA device index calls launch on (-1: every call goes to the fallback; the ``device``
    attribute can change it). arity: how many arguments a call has; order: the positions of
    those the entry takes, in its order (an absent one, None, is left out); outputs: for each
    tensor allocated and passed after them, the position of the argument it is allocated like
    (one output is returned alone, several as a tuple). size_of: the argument whose rank picks
    the compiled rank and whose numel the build: the build of the first (bound, build) of
    ``choices`` (increasing bounds) with numel <= bound, else ``default_build``. The C++ side
    refuses, with a ValueError, declarations outside its limits (8 arguments, 4 outputs, 8 builds).
    """
    module = _module()
    if module is None:
        return None
    return module.Launcher(fallback, resolve, device, arity, order, outputs, size_of, choices, default_build)
