"""Fixtures shared by every test."""

from __future__ import annotations

import hashlib
import os
import pathlib
import tempfile

import hypothesis
import pytest
import torch

from tileops.core.discovery import load_backends
from tileops.core.registry import journal

# Tuned kernel configurations go to a folder of the test session's own, never the user's cache.
os.environ["TILEOPS_CACHE_DIR"] = tempfile.mkdtemp(prefix="tileops-test-cache-")


def _compiled_graph_cache() -> str:
    """A torch.compile cache folder for the tests, one per state of what a compiled graph of the
    ops depends on: the manifests (the custom ops' schemas) and the tracing and autograd code (how
    they are defined and differentiated). torch's on-disk caches key a graph by the names of the
    custom ops in it, not by their schemas or backward formulas (pytorch/pytorch#144344), so a
    graph compiled before an op's manifest entry changed would be reused, and fail, after it."""
    src = pathlib.Path(__file__).resolve().parents[1] / "packages"
    digest = hashlib.sha256()
    for path in sorted([*src.glob("*/src/tileops/ops/manifest/*.yaml"), *src.glob("tileops-core/src/tileops/core/*.py")]):
        digest.update(path.read_bytes())
    return os.path.join(tempfile.gettempdir(), f"tileops-test-compiled-{digest.hexdigest()[:16]}")


os.environ["TORCHINDUCTOR_CACHE_DIR"] = _compiled_graph_cache()

# In CI the property tests draw the same examples on every run (a failure there is reproduced
# by any rerun, never a one-off); elsewhere each run explores new ones.
hypothesis.settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    hypothesis.settings.load_profile("ci")


@pytest.fixture(scope="session")
def dist(tmp_path_factory):
    """Every wheel and sdist of the workspace, built once per test session."""
    from helpers import run_uv

    out = tmp_path_factory.mktemp("dist")
    run_uv("build", "--all-packages", "-o", str(out))
    return out


@pytest.fixture
def scoped_registry():
    """Registrations made inside the test are undone after it, as a failed backend's are."""
    load_backends()  # installed backends stay registered: they load outside the test's scope
    journal.open()
    try:
        yield
    finally:
        journal.close(undo=True)


def pytest_collection_modifyitems(config, items):
    """GPU-tier tests need CUDA; compile-tier tests need nvcc. Elsewhere they skip, saying so."""
    import shutil

    import torch

    no_gpu = pytest.mark.skip(reason="GPU tier: needs a CUDA GPU")
    no_nvcc = pytest.mark.skip(reason="compile tier: needs nvcc (the CUDA toolkit) on PATH")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if "compile" in item.keywords and shutil.which("nvcc") is None:
            item.add_marker(no_nvcc)


#: Messages of the CUDA errors after which a process's context refuses every later call.
_CONTEXT_POISONED = ("illegal instruction", "illegal memory access", "device-side assert", "misaligned address", "CUDA_ERROR_ILLEGAL")
_POISONED = pytest.StashKey[bool]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Note a test whose error poisoned the process's CUDA context (see ``pytest_runtest_teardown``)."""
    yield
    if call.excinfo is not None and any(sign in str(call.excinfo.value) for sign in _CONTEXT_POISONED):
        item.stash[_POISONED] = True


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item):
    """After such an error every later test of the process fails with the same message. Under
    pytest-xdist the process ends here, once the test's failure is reported, and xdist starts a
    fresh one for the tests left: one broken kernel shows as its own failures only."""
    if item.stash.get(_POISONED, False) and "PYTEST_XDIST_WORKER" in os.environ:
        os._exit(3)
    # A process keeps the memory its test's tensors took in torch's cache. Beside a worker per
    # core sharing one GPU, the caches of tests with float64 references (below the large_memory
    # mark) held an 80 GB GPU's memory until cuBLAS could not create a handle in the next test
    # (CUBLAS_STATUS_ALLOC_FAILED, 54 of 432 tests over seven files): each gives it back here.
    if item.get_closest_marker("gpu") is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
