"""Backend discovery for real: throwaway distributions with ``tileops.backends`` entry points
(dist-info folders on sys.path), imported by a fresh interpreter when the first op is built."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

from helpers import run_python


def _distribution(site: Path, name: str, module_source: str) -> None:
    """A minimal installed distribution ``name`` whose entry point imports module ``name``."""
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[tileops.backends]\n{name} = {name}\n")
    (site / f"{name}.py").write_text(textwrap.dedent(module_source))


HALF_WAY = """
    from tileops.backend import register_detector, register_kernel_builder
    register_detector(target="half", detect=lambda device: device.type == "cpu")
    register_kernel_builder(op="RMSNormFwdOp", target="half", build_kernel=lambda *a, **k: None)
    raise ImportError("the half backend's driver is missing")
"""

GOOD = """
    import torch.nn.functional as F
    from tileops.backend import register_kernel_builder, register_detector
    register_detector(target="good", detect=lambda device: False)
    register_kernel_builder(
        op="RMSNormFwdOp", target="good",
        build_kernel=lambda x, w, *, normalized_shape, eps: (lambda x, w, **outs: F.rms_norm(x, normalized_shape, w, eps)),
    )
"""

PROBE = """
import json, sys, warnings
import torch
import tileops.ops, tileops.backend as backend
from tileops.core import discovery
assert not discovery._state["done"], "importing tileops.* must not import backends"
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    op = tileops.ops.RMSNormFwdOp(8)
y = op(torch.randn(2, 8))  # no target claims the CPU now: in-tree
good = tileops.ops.RMSNormFwdOp(8, target="good")(torch.randn(2, 8))
try:
    tileops.ops.RMSNormFwdOp(8, target="half")
    unknown = None
except backend.UnknownTargetError as error:
    unknown = str(error)
print(json.dumps({
    "targets": backend.registered_targets(),
    "failures": [[f.name, f.distribution, type(f.error).__name__, str(f.error)] for f in backend.load_failures()],
    "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
    "bound": op.target,
    "unknown": unknown,
}))
"""


def test_discovery_imports_backends_once_undoes_a_half_loaded_one_and_reports_it(tmp_path):
    site = tmp_path / "site"
    _distribution(site, "half_backend", HALF_WAY)
    _distribution(site, "good_backend", GOOD)
    path = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
    result = run_python(PROBE, env={"PYTHONPATH": path})
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert "good" in report["targets"] and "half" not in report["targets"]
    assert report["failures"] == [
        ["half_backend", "half_backend", "ImportError", "the half backend's driver is missing"]
    ]
    assert len(report["warnings"]) == 1 and "half_backend" in report["warnings"][0]
    assert report["bound"] == "builtin"  # the half backend's detector, which claimed cpu, was undone
    assert "no backend registered target 'half'" in report["unknown"]
    assert "1 installed backend(s) failed to load ('half_backend')" in report["unknown"]


INTERRUPTING = """
    import os
    from tileops.backend import register_detector
    register_detector(target="flaky", detect=lambda device: False)
    if os.environ.get("INTERRUPT_ONCE") and not os.path.exists(os.environ["INTERRUPT_ONCE"]):
        open(os.environ["INTERRUPT_ONCE"], "w").close()
        raise KeyboardInterrupt
"""

RETRY = """
import json
import tileops.backend as backend
from tileops.core import discovery
try:
    discovery.load_backends()
    first = "finished"
except KeyboardInterrupt:
    first = "interrupted"
from tileops.core import registry
after_interrupt = registry.all_targets()  # read without triggering discovery again
discovery.load_backends()
print(json.dumps([first, after_interrupt, backend.registered_targets(), len(backend.load_failures())]))
"""


def test_an_interrupt_during_discovery_undoes_that_backend_and_discovery_can_be_retried(tmp_path):
    site = tmp_path / "site"
    _distribution(site, "flaky_backend", INTERRUPTING)
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
           "INTERRUPT_ONCE": str(tmp_path / "interrupted")}
    result = run_python(RETRY, env=env)
    assert result.returncode == 0, result.stderr
    first, after_interrupt, after_retry, failures = json.loads(result.stdout.strip().splitlines()[-1])
    assert first == "interrupted"
    assert "flaky" not in after_interrupt
    assert "flaky" in after_retry and failures == 0
