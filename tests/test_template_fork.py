"""Fork the acme template with its fork script, as a backend author would, and check the fork.

``fork.py zeta DEST`` copies the template out of the tree renamed (distribution, module, target,
device type, classes, prose); the fork is built, and installed with its ``test`` extra from the
wheels of the workspace (``--find-links``, as its README says) into a fresh virtual environment,
where its own tests run and its target is found through its entry point.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, run_python, run_uv

TEMPLATE = ROOT / "packages/tileops-acme-template"


def _run_fork(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "fork.py", *args], cwd=TEMPLATE, capture_output=True, text=True, timeout=120)


def _fork(destination: Path) -> Path:
    fork = destination / "tileops-zeta-backend"
    made = _run_fork("zeta", str(fork))
    assert made.returncode == 0, made.stderr
    return fork


def test_the_fork_renames_everything(tmp_path):
    fork = _fork(tmp_path)
    leftovers = [str(p.relative_to(fork)) for p in fork.rglob("*") if "acme" in p.name.lower()]
    leftovers += [f"{p.relative_to(fork)}: {line.strip()}" for p in fork.rglob("*") if p.is_file() for line in p.read_text().splitlines() if "acme" in line.lower()]
    assert leftovers == []
    assert not (fork / "fork.py").exists()
    assert sorted(str(p.relative_to(fork)) for p in fork.rglob("*.py")) == [
        "src/tileops_zeta/__init__.py",
        "src/tileops_zeta/builders.py",
        "src/tileops_zeta/detect.py",
        "src/tileops_zeta/kernels.py",
        "src/tileops_zeta/short_rows.py",
        "tests/test_zeta.py",
    ]
    pyproject = (fork / "pyproject.toml").read_text()
    assert 'name = "tileops-zeta-backend"' in pyproject and 'zeta = "tileops_zeta"' in pyproject
    assert 'test = ["pytest>=8"]' in pyproject
    assert "class ZetaShortRowRMSNorm(Kernel, RMSNormFwdInterface)" in (fork / "src/tileops_zeta/short_rows.py").read_text()
    detect = (fork / "src/tileops_zeta/detect.py").read_text()
    assert 'TARGET = "zeta"' in detect and "a zeta device" in detect and "an zeta" not in detect
    readme = (fork / "README.md").read_text()
    assert readme.startswith("# tileops-zeta-backend\n") and "fork.py" not in readme and "--find-links" in readme


def test_a_name_starting_with_a_vowel_takes_an(tmp_path):
    fork = tmp_path / "fork"
    assert _run_fork("orion_x", str(fork)).returncode == 0
    detect = (fork / "src/tileops_orion_x/detect.py").read_text()
    assert "an orion_x device" in detect and 'name="OrionX reference device"' in detect
    assert 'name = "tileops-orion-x-backend"' in (fork / "pyproject.toml").read_text()


@pytest.mark.parametrize(
    "name, says",
    [
        ("Zeta", "NAME must be lowercase letters and digits, starting with a letter, with single underscores between words"),
        ("my-chip", "got 'my-chip'"),
        ("9zeta", "got '9zeta'"),
        ("acme", "NAME must differ from the template's own name 'acme'"),
        ("builtin", "NAME 'builtin' names TileOPs' in-tree implementations"),
        ("cuda", "NAME 'cuda' is an in-tree device type"),
    ],
)
def test_a_name_that_cannot_name_a_backend_is_refused_in_one_line(tmp_path, name, says):
    refused = _run_fork(name, str(tmp_path / "fork"))
    assert refused.returncode == 2
    assert refused.stdout == "" and len(refused.stderr.splitlines()) == 1
    assert refused.stderr.startswith("fork.py: ") and says in refused.stderr
    assert not (tmp_path / "fork").exists()


def test_a_destination_with_files_in_it_is_refused(tmp_path):
    (tmp_path / "fork").mkdir()
    (tmp_path / "fork" / "mine.txt").write_text("keep me")
    refused = _run_fork("zeta", str(tmp_path / "fork"))
    assert refused.returncode == 2 and "exists and is not empty" in refused.stderr
    assert [p.name for p in (tmp_path / "fork").iterdir()] == ["mine.txt"]


@pytest.mark.slow
def test_a_fork_builds_installs_and_passes_its_tests_outside_the_tree(dist, tmp_path):
    fork = _fork(tmp_path)
    run_uv("build", "--wheel", "-o", str(tmp_path / "fork-dist"), cwd=fork)
    assert [w.name.split("-")[0] for w in (tmp_path / "fork-dist").glob("*.whl")] == ["tileops_zeta_backend"]

    venv = tmp_path / "venv"
    run_uv("venv", "--python", sys.executable, str(venv))
    python = str(venv / "bin" / "python")
    # By name, from the folders of wheels: pytest comes in through the fork's `test` extra.
    run_uv("pip", "install", "--python", python, "--find-links", str(dist), "--find-links", str(tmp_path / "fork-dist"), "tileops-zeta-backend[test]")

    found = run_python(
        """
import importlib.metadata, json
import tileops.backend as backend
from tileops.ops import RMSNormFwdOp
eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="tileops.backends")}
import torch
op = RMSNormFwdOp(8, target="zeta")
op(torch.randn(2, 8))
print(json.dumps([eps, backend.registered_targets(), op.target, [str(f) for f in backend.load_failures()]]))
""",
        python=python,
    )
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip().splitlines()[-1] == '[{"zeta": "tileops_zeta"}, ["zeta"], "zeta", []]'

    tests = subprocess.run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=importlib", "tests"],
        cwd=fork,
        capture_output=True,
        text=True,
        timeout=900,
        env={"PATH": str(venv / "bin"), "PYTHONSAFEPATH": "1", "HOME": str(tmp_path)},
    )
    assert tests.returncode == 0, tests.stdout[-6000:] + tests.stderr[-2000:]
    assert " passed" in tests.stdout and "failed" not in tests.stdout
