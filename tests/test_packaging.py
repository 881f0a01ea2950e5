"""Build every wheel and sdist, inspect them, and install the wheels into a fresh virtual
environment, where the packages import and the template's entry point is found."""

from __future__ import annotations

import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from helpers import run_python, run_uv

pytestmark = pytest.mark.slow

def _wheel(dist: Path, name: str) -> Path:
    (wheel,) = dist.glob(f"{name.replace('-', '_')}-*.whl")
    return wheel


def test_every_distribution_builds_a_wheel_and_an_sdist(dist):
    for name in ("tileops", "tileops-core", "tileops-ops", "tileops-kernels-cuda", "tileops-acme-template"):
        assert _wheel(dist, name).exists()
        assert list(dist.glob(f"{name.replace('-', '_')}-*.tar.gz")), name


def test_no_wheel_ships_a_tileops_init(dist):
    for wheel in dist.glob("*.whl"):
        names = zipfile.ZipFile(wheel).namelist()
        assert "tileops/__init__.py" not in names, wheel.name


def test_the_ops_wheel_and_sdist_carry_the_manifest(dist):
    names = zipfile.ZipFile(_wheel(dist, "tileops-ops")).namelist()
    assert "tileops/ops/manifest/norm.yaml" in names
    (sdist,) = dist.glob("tileops_ops-*.tar.gz")
    with tarfile.open(sdist) as archive:
        assert any(m.endswith("/manifest/norm.yaml") and m.count("/") == 2 for m in archive.getnames())


def test_the_cuda_kernels_wheel_carries_the_launchers_cpp_source(dist):
    # fast_launch.py compiles it on the user's machine; without it every call takes the Python forward.
    names = zipfile.ZipFile(_wheel(dist, "tileops-kernels-cuda")).namelist()
    assert {"tileops/kernels/cuda/fast_launch.cpp", "tileops/kernels/cuda/fast_launch.py"} <= set(names)


def test_a_wheel_built_from_the_ops_sdist_carries_the_manifest(dist, tmp_path):
    (sdist,) = dist.glob("tileops_ops-*.tar.gz")
    run_uv("build", "--wheel", str(sdist), "-o", str(tmp_path))
    (wheel,) = tmp_path.glob("tileops_ops-*.whl")
    assert "tileops/ops/manifest/norm.yaml" in zipfile.ZipFile(wheel).namelist()


def test_the_wheels_install_and_work_in_a_fresh_environment(dist, tmp_path):
    venv = tmp_path / "venv"
    run_uv("venv", "--python", sys.executable, str(venv))
    python = str(venv / "bin" / "python")
    wheels = [str(w) for w in dist.glob("*.whl")]
    run_uv("pip", "install", "--python", python, *wheels)
    result = run_python(
        """
import importlib.metadata, sys, torch
import tileops.backend, tileops.ops
eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="tileops.backends")}
assert eps == {"acme": "tileops_acme"}, eps
assert tileops.backend.registered_targets() == ["acme"], tileops.backend.registered_targets()
assert tileops.backend.load_failures() == []
y = tileops.ops.RMSNormFwdOp(8)(torch.ones(2, 8))
assert y.shape == (2, 8) and "tilelang" not in sys.modules
print(tileops.ops.__file__)
""",
        python=python,
    )
    assert result.returncode == 0, result.stderr
    assert str(venv) in result.stdout
