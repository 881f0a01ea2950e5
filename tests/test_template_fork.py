"""Fork the acme template as a backend author would, and check the fork works on its own.

The template is copied out of the tree, renamed (distribution, module, target, device type),
built, and installed with the wheels of tileops-core and tileops-ops into a fresh virtual
environment, where its own tests run and its target is found through its entry point.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, run_python, run_uv

pytestmark = pytest.mark.slow


def _fork(destination: Path) -> Path:
    fork = destination / "tileops-zeta"
    shutil.copytree(ROOT / "packages/tileops-acme-template", fork, ignore=shutil.ignore_patterns("__pycache__"))
    (fork / "src/tileops_acme").rename(fork / "src/tileops_zeta")
    for path in fork.rglob("*"):
        if path.is_file() and path.suffix in {".py", ".toml", ".md"}:
            text = path.read_text()
            text = text.replace("tileops-acme-template", "tileops-zeta")
            text = text.replace("acme", "zeta").replace("Acme", "Zeta")
            path.write_text(text)
    return fork


def test_a_renamed_fork_builds_installs_and_passes_its_tests_outside_the_tree(dist, tmp_path):
    fork = _fork(tmp_path)
    assert "acme" not in (fork / "pyproject.toml").read_text()
    run_uv("build", "--wheel", "-o", str(tmp_path / "fork-dist"), cwd=fork)
    (fork_wheel,) = (tmp_path / "fork-dist").glob("tileops_zeta-*.whl")

    venv = tmp_path / "venv"
    run_uv("venv", "--python", sys.executable, str(venv))
    python = str(venv / "bin" / "python")
    core_and_ops = [str(w) for w in dist.glob("tileops_core-*.whl")] + [str(w) for w in dist.glob("tileops_ops-*.whl")]
    run_uv("pip", "install", "--python", python, *core_and_ops, str(fork_wheel), "pytest")

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
