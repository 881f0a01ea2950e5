"""The workspace's shape: one namespace, the manifest found through importlib.resources,
the console script, and core/ops importable without tilelang."""

from __future__ import annotations

import importlib.metadata
try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
from importlib.resources import files

from helpers import ROOT, run_python

PACKAGES = ("tileops-core", "tileops-ops", "tileops-kernels-cuda", "tileops-acme-template")


def test_no_distribution_ships_a_tileops_init():
    offenders = [p for p in ROOT.glob("packages/*/src/tileops/__init__.py")]
    assert offenders == [], f"tileops is a PEP 420 namespace; remove {offenders}"


def test_every_package_shares_one_version_and_the_meta_distribution_pins_it():
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    version = root["project"]["version"]
    for name in PACKAGES:
        project = tomllib.loads((ROOT / "packages" / name / "pyproject.toml").read_text())["project"]
        assert project["version"] == version, name
        assert project["requires-python"] == ">=3.10"
        assert (ROOT / "packages" / name / "README.md").read_text().strip()
    pins = set(root["project"]["dependencies"])
    assert pins == {f"{n}=={version}" for n in PACKAGES if n != "tileops-acme-template"}


def test_tilelang_is_a_dependency_of_the_cuda_kernels_only():
    for name in PACKAGES:
        deps = tomllib.loads((ROOT / "packages" / name / "pyproject.toml").read_text())["project"]["dependencies"]
        has_tilelang = any(d.startswith("tilelang") for d in deps)
        assert has_tilelang == (name == "tileops-kernels-cuda"), name


def test_every_distribution_declares_the_torch_floor_that_ci_tests():
    """tools/torch-floor.sh runs the CPU subset on the floor it reads from tileops-core: every
    distribution must declare that same floor, or CI would test a version nobody declares."""
    floors = {}
    for name in PACKAGES:
        deps = tomllib.loads((ROOT / "packages" / name / "pyproject.toml").read_text())["project"]["dependencies"]
        floors[name] = [d for d in deps if d.replace(" ", "").startswith("torch>=")]
    assert set(map(tuple, floors.values())) == {("torch>=2.11",)}, floors
    script = (ROOT / "tools/torch-floor.sh").read_text()
    assert "packages/tileops-core/pyproject.toml" in script and "torch==$floor.*" in script
    assert "tools/torch-floor.sh" in (ROOT / ".ci/run").read_text()


def test_the_template_builds_outside_the_workspace():
    template = tomllib.loads((ROOT / "packages/tileops-acme-template/pyproject.toml").read_text())
    assert "sources" not in template.get("tool", {}).get("uv", {})
    assert all(d.split(">")[0].split("=")[0] in {"tileops-core", "tileops-ops", "torch"} for d in template["project"]["dependencies"])
    assert template["project"]["entry-points"]["tileops.backends"] == {"acme": "tileops_acme"}


def test_the_manifest_ships_with_the_ops_and_matches_the_top_level_folder():
    shipped = files("tileops.ops") / "manifest"
    names = sorted(p.name for p in shipped.iterdir() if p.name.endswith(".yaml"))
    assert names == sorted(p.name for p in (ROOT / "manifest").glob("*.yaml"))
    assert (shipped / "norm.yaml").read_text() == (ROOT / "manifest/norm.yaml").read_text()


def test_the_console_script_reports_its_version():
    scripts = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts["tileops"] == "tileops.cli:main"
    result = run_python("import sys; from tileops.cli import main; sys.exit(main(['--version']))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "tileops 0.1.0"


BLOCK_TILELANG = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name == "tilelang" or name.startswith("tilelang."):
            raise ImportError("tilelang is blocked in this test")
sys.meta_path.insert(0, _Block())
"""


def test_core_and_ops_work_without_tilelang():
    code = BLOCK_TILELANG + """
import torch
import tileops.core, tileops.backend, tileops.ops
from tileops.ops import RMSNormFwdOp
y = RMSNormFwdOp(16)(torch.ones(2, 16))
assert y.shape == (2, 16)
assert "tilelang" not in sys.modules
print("ok")
"""
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
