"""Fault injection: faulty backends, and threads racing discovery and binding.

Each case breaks TileOPs the way a careless backend (or an unlucky thread schedule) would and
asserts three things: the error's type, that its message names the culprit (the backend, its
module, its distribution), and that the registry and every other op still work afterwards.

To add a case with a faulty backend: write the backend's module source, install it with
``_install`` (a real distribution: a dist-info folder with ``entry_points.txt`` on a
temporary ``sys.path`` entry), and run a probe in a fresh interpreter with ``_probe``: backends
are imported once per process, so each case needs its own. A probe prints one JSON object on
its last line, and ends with ``HEALTHY``, which checks the other ops and the registry.
Faults that need no discovery (a detector, a builder, a race on binding) run in this process,
inside ``scoped_registry``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tileops.backend import BackendError, register_detector, register_kernel_builder, set_default_target
from tileops.core import registry
from tileops.ops import FusedAddRMSNormFwdOp, LayerNormFwdOp, RMSNormFwdOp


def _install(site: Path, module: str, source: str, *, distribution: str) -> None:
    """Install distribution ``distribution`` whose ``tileops.backends`` entry point
    ``module = module`` imports ``source``."""
    info = site / f"{distribution.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[tileops.backends]\n{module} = {module}\n")
    (site / f"{module}.py").write_text(textwrap.dedent(source))


# Ends every probe: every op family still computes on the CPU (except the ops a probe lists in
# report["broken_ops"], those its fault is meant to break), the installed template is still
# registered, and a new registration still works.
HEALTHY = """
import torch.nn.functional as _F
from tileops.backend import register_kernel_builder as _register, registered_targets as _targets
from tileops.ops import FAMILIES as _FAMILIES
from torch.autograd.functional import vjp as _vjp
_x, _r = torch.randn(3, 8), torch.randn(3, 8)
_t = torch.tensor([0, 2, -100])
_cu = torch.tensor([0, 3], dtype=torch.int32)
_rms, _layer = (lambda t: _F.rms_norm(t, (8,))), (lambda t: _F.layer_norm(t, (8,)))
_checks = {
    "RMSNormFwdOp": lambda op: torch.testing.assert_close(op(_x), _F.rms_norm(_x, (8,))),
    "LayerNormFwdOp": lambda op: torch.testing.assert_close(op(_x), _F.layer_norm(_x, (8,))),
    "FusedAddRMSNormFwdOp": lambda op: torch.testing.assert_close(op(_x, _r)[1], _x + _r),
    "FusedAddLayerNormFwdOp": lambda op: torch.testing.assert_close(op(_x, _r)[1], _x + _r),
    "RMSNormBwdOp": lambda op: torch.testing.assert_close(op(_r, _x)[0], _vjp(_rms, _x, _r)[1]),
    "LayerNormBwdOp": lambda op: torch.testing.assert_close(op(_r, _x)[0], _vjp(_layer, _x, _r)[1]),
    "FusedAddRMSNormBwdOp": lambda op: torch.testing.assert_close(op(_r, _r, _x)[0], _vjp(_rms, _x, _r)[1] + _r),
    "FusedAddLayerNormBwdOp": lambda op: torch.testing.assert_close(op(_r, _r, _x)[0], _vjp(_layer, _x, _r)[1] + _r),
    "SiLUFwdOp": lambda op: torch.testing.assert_close(op(_x), _F.silu(_x)),
    "GELUFwdOp": lambda op: torch.testing.assert_close(op(_x), _F.gelu(_x)),
    "SwiGLUFwdOp": lambda op: torch.testing.assert_close(op(_x, _r), _F.silu(_x) * _r),
    "GeGLUFwdOp": lambda op: torch.testing.assert_close(op(_x, _r), _F.gelu(_x) * _r),
    "PackedSwiGLUFwdOp": lambda op: torch.testing.assert_close(op(_x), _F.silu(_x[:, :4]) * _x[:, 4:]),
    "PackedGeGLUFwdOp": lambda op: torch.testing.assert_close(op(_x), _F.gelu(_x[:, :4]) * _x[:, 4:]),
    "SiLUBwdOp": lambda op: torch.testing.assert_close(op(_r, _x), _vjp(_F.silu, _x, _r)[1]),
    "GELUBwdOp": lambda op: torch.testing.assert_close(op(_r, _x), _vjp(_F.gelu, _x, _r)[1]),
    "SwiGLUBwdOp": lambda op: torch.testing.assert_close(op(_r, _x, _r)[1], _F.silu(_x) * _r),
    "GeGLUBwdOp": lambda op: torch.testing.assert_close(op(_r, _x, _r)[1], _F.gelu(_x) * _r),
    # The in-place forms write over copies of gate and up and return them.
    "SwiGLUInplaceBwdOp": lambda op: torch.testing.assert_close(op(_r, _x.clone(), _r.clone())[1], _F.silu(_x) * _r),
    "GeGLUInplaceBwdOp": lambda op: torch.testing.assert_close(op(_r, _x.clone(), _r.clone())[1], _F.gelu(_x) * _r),
    "PackedSwiGLUBwdOp": lambda op: torch.testing.assert_close(op(_r[:, :4], _x)[:, 4:], _F.silu(_x[:, :4]) * _r[:, :4]),
    "PackedGeGLUBwdOp": lambda op: torch.testing.assert_close(op(_r[:, :4], _x)[:, 4:], _F.gelu(_x[:, :4]) * _r[:, :4]),
    "PackedSwiGLUInplaceBwdOp": lambda op: torch.testing.assert_close(op(_r[:, :4], _x.clone())[:, 4:], _F.silu(_x[:, :4]) * _r[:, :4]),
    "PackedGeGLUInplaceBwdOp": lambda op: torch.testing.assert_close(op(_r[:, :4], _x.clone())[:, 4:], _F.gelu(_x[:, :4]) * _r[:, :4]),
    # Rows of x as (3 tokens, 1 head, 8), cos 0 and sin 1 at position 0: a quarter turn of each pair, and back.
    "RotaryEmbeddingFwdOp": lambda op: torch.testing.assert_close(
        op(_x[:, None], _r[:, None], torch.zeros(1, 8), torch.ones(1, 8), torch.zeros(3, dtype=torch.int64))[0][:, 0],
        torch.cat((-_x[:, 4:], _x[:, :4]), -1)),
    "RotaryEmbeddingBwdOp": lambda op: torch.testing.assert_close(
        op(_x[:, None], _r[:, None], torch.zeros(1, 8), torch.ones(1, 8), torch.zeros(3, dtype=torch.int64))[0][:, 0],
        torch.cat((_x[:, 4:], -_x[:, :4]), -1)),
    "RotaryEmbeddingInplaceFwdOp": lambda op: torch.testing.assert_close(
        op(_x.clone()[:, None], _r.clone()[:, None], torch.zeros(1, 8), torch.ones(1, 8), torch.zeros(3, dtype=torch.int64))[0][:, 0],
        torch.cat((-_x[:, 4:], _x[:, :4]), -1)),
    # Logits _x (3 rows of 8 classes, or hidden states against the weight _r of 3 classes); the last row ignored.
    "CrossEntropyFwdOp": lambda op: torch.testing.assert_close(op(_x, _t)[0], _F.cross_entropy(_x, _t)),
    "CrossEntropyPerRowFwdOp": lambda op: torch.testing.assert_close(op(_x, _t)[0], _F.cross_entropy(_x, _t, reduction="none")),
    "LinearCrossEntropyFwdOp": lambda op: torch.testing.assert_close(op(_x, _r, None, _t), _F.cross_entropy(_x @ _r.T, _t)),
    # The forward's unit gradient scaled by dloss in place.
    "CrossEntropyBwdOp": lambda op: (lambda unit: torch.testing.assert_close(
        op(torch.tensor(2.0), None, _x, _t, torch.logsumexp(_x, -1), unit.clone()), 2 * unit))(
        _vjp(lambda t: _F.cross_entropy(t, _t), _x)[1]),
    "CrossEntropyPerRowBwdOp": lambda op: torch.testing.assert_close(
        op(_r[:, 0], None, _x, _t, torch.logsumexp(_x, -1)), _vjp(lambda t: _F.cross_entropy(t, _t, reduction="none"), _x, _r[:, 0])[1]),
    # The forward's unit gradients (that of the hidden states, weight's and bias's left zero) scaled by dloss.
    "LinearCrossEntropyBwdOp": lambda op: (lambda unit: torch.testing.assert_close(
        op(torch.tensor(2.0), _x, _r, None, _t, unit.clone(), torch.zeros(3, 8), torch.zeros(3))[0], 2 * unit))(
        _vjp(lambda h: _F.cross_entropy(h @ _r.T, _t), _x)[1]),
    # Attention with q = k = v = _x as (1 sequence, 3 tokens, 1 head, 8) against F's, and dv for do = _r.
    "AttentionFwdOp": lambda op: torch.testing.assert_close(
        op(_x[None, :, None], _x[None, :, None], _x[None, :, None])[0][0, :, 0], _F.scaled_dot_product_attention(_x, _x, _x)),
    "AttentionBwdOp": lambda op: torch.testing.assert_close(
        op(_r[None, :, None], *[_x[None, :, None]] * 3, _F.scaled_dot_product_attention(_x, _x, _x)[None, :, None],
           torch.logsumexp(_x @ _x.T / 8 ** 0.5, -1)[None, None])[2][0, :, 0],
        _vjp(lambda v: _F.scaled_dot_product_attention(_x, _x, v), _x, _r)[1]),
    # The packed form: the same three tokens as one sequence of a packed batch (offsets [0, 3]).
    "VarlenAttentionFwdOp": lambda op: torch.testing.assert_close(
        op(*[_x[:, None]] * 3, _cu, _cu)[0][:, 0], _F.scaled_dot_product_attention(_x, _x, _x)),
    "VarlenAttentionBwdOp": lambda op: torch.testing.assert_close(
        op(_r[:, None], *[_x[:, None]] * 3, _F.scaled_dot_product_attention(_x, _x, _x)[:, None],
           torch.logsumexp(_x @ _x.T / 8 ** 0.5, -1)[None], _cu, _cu, None)[2][:, 0],
        _vjp(lambda v: _F.scaled_dot_product_attention(_x, _x, v), _x, _r)[1]),
    # Decode: one new token _x[2] over a cache of the three rows of _x (as keys and values), length 3.
    "DecodeAttentionFwdOp": lambda op: torch.testing.assert_close(
        op(_x[None, 2:, None], _x[None, :, None], _x[None, :, None], torch.tensor([3], dtype=torch.int32))[0][0, :, 0],
        _F.scaled_dot_product_attention(_x[2:], _x, _x)),
    # Softmax over rows of 8; the backward ops take dy = _r and the forward's output y.
    "SoftmaxFwdOp": lambda op: torch.testing.assert_close(op(_x), _F.softmax(_x, -1)),
    "LogSoftmaxFwdOp": lambda op: torch.testing.assert_close(op(_x), _F.log_softmax(_x, -1)),
    "SoftmaxBwdOp": lambda op: torch.testing.assert_close(op(_r, _F.softmax(_x, -1)), _vjp(lambda t: _F.softmax(t, -1), _x, _r)[1]),
    "LogSoftmaxBwdOp": lambda op: torch.testing.assert_close(
        op(_r, _F.log_softmax(_x, -1)), _vjp(lambda t: _F.log_softmax(t, -1), _x, _r)[1]),
}
# The ops that take no param are constructed without one; the others with 8 (normalized_shape,
# the rope ops' rotary_dim) or 4 (the packed activations' half width d, of rows of 8).
_NO_PARAM = {"SiLUFwdOp", "GELUFwdOp", "SwiGLUFwdOp", "GeGLUFwdOp", "SiLUBwdOp", "GELUBwdOp", "SwiGLUBwdOp", "GeGLUBwdOp",
             "SwiGLUInplaceBwdOp", "GeGLUInplaceBwdOp"}
_NO_PARAM |= {name for name in _checks if "CrossEntropy" in name}  # the loss ops: every param defaults
_NO_PARAM |= {name for name in _checks if "Attention" in name}  # every param keyword-only with a default
_NO_PARAM |= {name for name in _checks if "Softmax" in name}  # row_dim and out_dtype default
_construct = lambda name: _classes[name](target="builtin") if name in _NO_PARAM else _classes[name](4 if name.startswith("Packed") else 8, target="builtin")  # noqa: E731
_classes = {c.__name__: c for cs in _FAMILIES.values() for c in cs}
assert sorted(_classes) == sorted(_checks), "an op was added: give it a check here"
for _name, _check in _checks.items():
    if _name not in report.get("broken_ops", []):
        _check(_construct(_name))
assert "acme" in _targets(), _targets()
_register(op="LayerNormFwdOp", target="afterwards", build_kernel=lambda x, w, b, **p: (lambda x, w, b, **o: _F.layer_norm(x, (8,))))
torch.testing.assert_close(_classes["LayerNormFwdOp"](8, target="afterwards")(_x), _F.layer_norm(_x, (8,)))
print(json.dumps(report))
"""


def _probe(tmp_path: Path, code: str, *, timeout: float = 120) -> dict:
    """Run ``code`` + ``HEALTHY`` in a fresh interpreter that sees the backends installed under
    ``tmp_path / "site"``; ``code`` fills the dict ``report``, which is returned."""
    site = tmp_path / "site"
    env = {**os.environ, "PYTHONSAFEPATH": "1", "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    prologue = "import json, sys, threading, warnings\nimport torch\nreport = {}\n"
    result = subprocess.run(
        [sys.executable, "-P", "-c", prologue + textwrap.dedent(code) + HEALTHY],
        capture_output=True, text=True, env=env, timeout=timeout,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


# -- a failing import undoes its own registrations, never another thread's -----------------------
SLOW_FAILING = """
    import probe_sync
    from tileops.backend import register_detector
    register_detector(target="slowfail", detect=lambda device: device.type == "cpu")
    probe_sync.importing.set()
    assert probe_sync.app_registered.wait(30)
    raise ImportError("slowfail's driver is missing")
"""


def test_a_failing_backend_import_undoes_its_own_registrations_and_never_another_threads(tmp_path):
    _install(tmp_path / "site", "slowfail", SLOW_FAILING, distribution="slowfail-dist")
    report = _probe(tmp_path, """
        import types
        probe_sync = sys.modules["probe_sync"] = types.SimpleNamespace(importing=threading.Event(), app_registered=threading.Event())
        import torch.nn.functional as F
        from tileops.backend import load_failures, register_kernel_builder, registered_targets
        from tileops.ops import RMSNormFwdOp

        def application():  # registers its own target while the backend is being imported
            probe_sync.importing.wait(30)
            register_kernel_builder(op="RMSNormFwdOp", target="usertarget",
                                    build_kernel=lambda x, w, **p: (lambda x, w, **o: F.rms_norm(x, (8,)) + 1))
            probe_sync.app_registered.set()

        app = threading.Thread(target=application)
        app.start()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            RMSNormFwdOp(8)  # imports the backends
        app.join()
        x = torch.randn(2, 8)
        report["user_result_ok"] = bool(torch.allclose(RMSNormFwdOp(8, target="usertarget")(x), F.rms_norm(x, (8,)) + 1))
        report["targets"] = registered_targets()
        report["failures"] = [str(f) for f in load_failures()]
        report["warnings"] = [str(w.message) for w in caught]
        report["bound"] = (lambda op: (op(x), op.target)[1])(RMSNormFwdOp(8))
    """)
    assert report["user_result_ok"] and "usertarget" in report["targets"]
    assert "slowfail" not in report["targets"] and report["bound"] == "builtin"
    (failure,) = report["failures"]
    assert "slowfail" in failure and "slowfail-dist" in failure and "ImportError" in failure
    assert any("slowfail-dist" in w for w in report["warnings"])


# -- threads a backend's import starts belong to that backend ----------------------------------
THREAD_STARTING_FAILING = """
    import threading
    import torch.nn.functional as F
    import probe_sync
    from tileops.backend import register_detector, register_kernel_builder

    def helper():  # started by the worker: a thread of a thread of the import
        register_detector(target="threadfail", detect=lambda device: False)

    def worker():
        register_kernel_builder(op="RMSNormFwdOp", target="threadfail",
                                build_kernel=lambda x, w, **p: (lambda x, w, **o: F.rms_norm(x, (8,)) + 1))
        nested = threading.Thread(target=helper)
        nested.start()
        nested.join()
        probe_sync.registered.set()
        probe_sync.import_failed.wait(30)
        try:  # after its backend's import failed
            register_kernel_builder(op="LayerNormFwdOp", target="threadlate",
                                    build_kernel=lambda x, w, b, **p: (lambda x, w, b, **o: x))
            probe_sync.late.append("registered")
        except Exception as error:
            probe_sync.late.append(f"{type(error).__name__}: {error}")

    probe_sync.worker = threading.Thread(target=worker, name="threadfail-worker")
    probe_sync.worker.start()
    assert probe_sync.registered.wait(30)
    raise ImportError("threadfail's driver is missing")
"""


def test_registrations_by_threads_a_failing_backend_import_started_are_undone_with_it(tmp_path):
    _install(tmp_path / "site", "threadfail", THREAD_STARTING_FAILING, distribution="threadfail-dist")
    report = _probe(tmp_path, """
        import types
        probe_sync = sys.modules["probe_sync"] = types.SimpleNamespace(
            registered=threading.Event(), import_failed=threading.Event(), late=[])
        from tileops.backend import load_failures, registered_targets
        from tileops.ops import RMSNormFwdOp
        original_start = threading.Thread.start
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            op = RMSNormFwdOp(8)  # imports the backends
        report["targets_after_import"] = registered_targets()
        probe_sync.import_failed.set()
        probe_sync.worker.join(30)
        report["late"] = probe_sync.late
        report["targets"] = registered_targets()
        report["failures"] = [str(f) for f in load_failures()]
        report["start_restored"] = threading.Thread.start is original_start
        op(torch.randn(2, 8))
        report["bound"] = op.target
    """)
    assert "threadfail" not in report["targets_after_import"] and "threadfail" not in report["targets"]
    (late,) = report["late"]
    assert late.startswith("BackendError: ") and "threadfail-worker" in late
    assert "'threadfail'" in late and "threadfail-dist" in late and "failed" in late
    assert "threadlate" not in report["targets"]
    (failure,) = report["failures"]
    assert "threadfail-dist" in failure and "ImportError" in failure
    assert report["start_restored"] and report["bound"] == "builtin"


THREAD_STARTING = """
    import threading
    from tileops.backend import register_kernel_builder

    def worker():
        register_kernel_builder(op="RMSNormFwdOp", target="threaded", build_kernel=lambda x, w, **p: (lambda x, w, **o: x.clone()))

    started = threading.Thread(target=worker)
    started.start()
    started.join()
"""


def test_registrations_by_threads_a_backend_import_started_are_that_backends(tmp_path):
    _install(tmp_path / "site", "threaded", THREAD_STARTING, distribution="threaded-dist")
    report = _probe(tmp_path, """
        from tileops.core import registry
        from tileops.ops import RMSNormFwdOp
        x = torch.randn(2, 8)
        report["result_ok"] = bool(torch.equal(RMSNormFwdOp(8, target="threaded")(x), x))
        report["registrant"] = registry.builder("RMSNormFwdOp", "threaded").registrant()
    """)
    assert report["result_ok"]
    assert "backend 'threaded'" in report["registrant"] and "threaded-dist" in report["registrant"]


# -- a distribution whose entry points cannot be read ------------------------------------------
GOOD_NEIGHBOUR = """
    from tileops.backend import register_kernel_builder
    register_kernel_builder(op="RMSNormFwdOp", target="neighbour", build_kernel=lambda x, w, **p: (lambda x, w, **o: x.clone()))
"""


@pytest.mark.parametrize(
    ("entry_points", "error"),
    [(b"[tileops.backends]\nbroken\n", "TypeError"), (b"\xff\xfe[tileops.backends]\x00", "UnicodeDecodeError")],
    ids=["line-without-equals", "not-utf8"],
)
def test_a_distribution_with_an_unreadable_entry_points_file_is_a_load_failure_naming_it(tmp_path, entry_points, error):
    _install(tmp_path / "site", "neighbour", GOOD_NEIGHBOUR, distribution="neighbour-dist")
    # Any distribution, backend or not: discovery reads them all. torch's own import reads every
    # distribution's entry points too (and fails on this one), so the probe puts its folder on
    # the path after importing torch, as an application adding a plugin folder would.
    info = tmp_path / "late-site" / "garbled_dist-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: garbled-dist\nVersion: 1.0\n")
    (info / "entry_points.txt").write_bytes(entry_points)
    report = _probe(tmp_path, f"""
        sys.path.insert(0, {str(info.parent)!r})
        from tileops.backend import load_failures, registered_targets
        from tileops.cli.list_backends import describe_backends
        from tileops.ops import RMSNormFwdOp
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            op = RMSNormFwdOp(8)
        x = torch.randn(2, 8)
        report["neighbour_ok"] = bool(torch.equal(RMSNormFwdOp(8, target="neighbour")(x), x))
        op(x)
        report["bound"] = op.target
        report["failures"] = [(type(f.error).__name__, f.distribution, str(f)) for f in load_failures()]
        report["warned"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        report["listed"] = [f["distribution"] for f in describe_backends()["load_failures"]]
        report["targets"] = registered_targets()
    """)
    ((error_type, distribution, failure),) = report["failures"]
    assert error_type == error and distribution == "garbled-dist"
    assert "garbled-dist" in failure and "entry_points.txt" in failure and "cannot be read" in failure
    assert len(report["warned"]) == 1 and "garbled-dist" in report["warned"][0]
    assert report["listed"] == ["garbled-dist"]
    assert report["neighbour_ok"] and "neighbour" in report["targets"] and report["bound"] == "builtin"


def test_an_undo_step_removes_only_the_registration_it_was_recorded_for(scoped_registry):
    register_detector(target="reused", detect=lambda device: False)
    current = registry.detectors()["reused"]
    stale = registry.Registration(current.value, current.module)  # an earlier one, since undone
    registry._remove(registry._detectors, "reused", stale)
    assert registry.detectors()["reused"] is current


# -- sys.exit() in an import, and detectors that do not answer with a bool -----------------------
EXITING = """
    import sys
    from tileops.backend import register_detector
    register_detector(target="exiting", detect=lambda device: True)
    sys.exit(3)
"""


def test_sys_exit_in_a_backend_import_is_a_load_failure_and_the_program_goes_on(tmp_path):
    _install(tmp_path / "site", "exiting", EXITING, distribution="exiting-dist")
    report = _probe(tmp_path, """
        from tileops.backend import load_failures, registered_targets
        from tileops.ops import RMSNormFwdOp
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            op = RMSNormFwdOp(8)
        op(torch.randn(2, 8))
        report["bound"] = op.target
        report["targets"] = registered_targets()
        report["failures"] = [(type(f.error).__name__, str(f)) for f in load_failures()]
        report["warned"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    """)
    ((error_type, failure),) = report["failures"]
    assert error_type == "SystemExit" and "exiting-dist" in failure
    assert "exiting" not in report["targets"] and report["bound"] == "builtin"
    assert len(report["warned"]) == 1 and "exiting" in report["warned"][0]


@pytest.mark.parametrize("answer", ["no", 1, None, torch.tensor(False)], ids=["str", "int", "None", "tensor"])
def test_a_detector_that_answers_with_something_other_than_a_bool_is_refused_naming_it(scoped_registry, answer):
    def vague_detector(device):
        return answer

    register_detector(target="vague", detect=vague_detector)
    with pytest.raises(BackendError, match=r"target 'vague' .*vague_detector, registered by tests.test_fault_injection_backends.* returned .*a detector returns True or False"):
        RMSNormFwdOp(8)(torch.randn(2, 8))
    registry._remove(registry._detectors, "vague", registry._detectors["vague"])
    assert RMSNormFwdOp(8)(torch.randn(2, 8)).shape == (2, 8)


def test_a_detector_that_calls_sys_exit_is_reported_as_the_backends_fault(scoped_registry):
    def leaving_detector(device):
        sys.exit("leaving")

    register_detector(target="leaving", detect=leaving_detector)
    with pytest.raises(BackendError, match=r"leaving_detector.*raised SystemExit: leaving"):
        RMSNormFwdOp(8)(torch.randn(2, 8))


# -- a kernel type that breaks its contract ------------------------------------------------------
BAD_KERNEL_TYPE = """
    from tileops.backend import Kernel, register_kernel_type

    class CudaOnlyNorm(Kernel):  # subclasses no kernel interface
        devices = frozenset({"cuda"})

        @classmethod
        def entry_for(cls, call):
            return None, cls

    register_kernel_type("RMSNormFwdOp", "cuda_only", CudaOnlyNorm)
"""


def test_a_backend_kernel_type_that_breaks_its_contract_is_named_at_construction_by_check_and_backends(tmp_path):
    _install(tmp_path / "site", "badkernel", BAD_KERNEL_TYPE, distribution="badkernel-dist")
    report = _probe(tmp_path, """
        from tileops.backend import BackendError, load_failures
        from tileops.cli.check import check_files, shipped_manifest_files
        from tileops.cli.list_backends import describe_backends
        from tileops.ops import LayerNormFwdOp, RMSNormFwdOp
        try:
            RMSNormFwdOp(8)
            report["construction"] = None
        except BackendError as error:
            report["construction"] = str(error)
        report["other_op"] = list(LayerNormFwdOp(8)(torch.randn(2, 8)).shape)
        checked = check_files(shipped_manifest_files(), against_op_classes=True)
        report["check_ok"] = checked["ok"]
        report["check_problems"] = {op["op"]: op["problems"] for op in checked["ops"] if op["problems"]}
        described = describe_backends()
        report["backends"] = {b["name"]: b["kernel_types"] for b in described["backends"]}
        report["load_failures"] = len(load_failures())
        report["broken_ops"] = ["RMSNormFwdOp"]  # what the fault breaks, as long as the backend is installed
    """)
    construction = report["construction"]
    assert "'cuda_only'" in construction and "inherits none of the op's kernel interfaces" in construction
    assert "badkernel" in construction and "badkernel-dist" in construction
    assert report["other_op"] == [2, 8]
    assert report["check_ok"] is False
    (problem,) = report["check_problems"]["RMSNormFwdOp"]
    assert "badkernel-dist" in problem and list(report["check_problems"]) == ["RMSNormFwdOp"]
    (kernel_type,) = report["backends"]["badkernel"]
    assert "badkernel-dist" in kernel_type["problem"]
    assert all(t["problem"] is None for t in report["backends"]["acme"])


# -- threads racing discovery ----------------------------------------------------------------------
SLOW = """
    import time
    from tileops.backend import register_kernel_builder
    time.sleep(0.5)
    register_kernel_builder(op="RMSNormFwdOp", target="slow", build_kernel=lambda x, w, **p: (lambda x, w, **o: x.clone()))
"""


def test_threads_racing_discovery_wait_for_it_and_all_see_every_backend(tmp_path):
    _install(tmp_path / "site", "slow", SLOW, distribution="slow-dist")
    report = _probe(tmp_path, """
        from tileops.ops import RMSNormFwdOp
        start, seen = threading.Barrier(4), []

        def construct():
            start.wait()
            seen.append(RMSNormFwdOp(8, target="slow").target is None)

        threads = [threading.Thread(target=construct) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        report["constructed"] = seen
    """)
    assert report["constructed"] == [True] * 4


JOINING = """
    import threading
    from tileops.ops import RMSNormFwdOp
    errors = []

    def construct():
        try:
            RMSNormFwdOp(8)
        except Exception as error:
            errors.append(f"{type(error).__name__}: {error}")

    worker = threading.Thread(target=construct, name="joined-worker")
    worker.start()
    worker.join()
"""


def test_a_backend_whose_import_joins_a_thread_that_constructs_an_op_gets_an_error_not_a_hang(tmp_path):
    _install(tmp_path / "site", "joiner", JOINING, distribution="joiner-dist")
    report = _probe(tmp_path, """
        from tileops.core import discovery
        discovery.STARTED_DURING_IMPORT_WAIT_S = 0.2  # the refusal's wait, shortened to keep the test quick
        from tileops.core.discovery import loaded_backends
        from tileops.ops import RMSNormFwdOp
        began = __import__("time").monotonic()
        RMSNormFwdOp(8)
        report["seconds"] = __import__("time").monotonic() - began
        report["errors"] = sys.modules["joiner"].errors
        report["loaded"] = [b.name for b in loaded_backends()]
    """, timeout=60)
    (error,) = report["errors"]
    assert error.startswith("BackendError: ") and "'joiner'" in error and "joiner-dist" in error
    assert "joined-worker" in error and "joiner" in report["loaded"]
    assert report["seconds"] < 30


# -- threads racing a binding call that fails ----------------------------------------------------
def test_a_call_racing_a_failed_binding_never_keeps_a_kernel_of_an_undone_binding(scoped_registry):
    binding_started, racer_started = threading.Event(), threading.Event()
    attempts = []

    def build(marker):
        def kernel(x, weight, **outs):
            return torch.full_like(x, marker)

        return kernel

    def first_builder(x, weight, *, normalized_shape, eps):
        attempts.append(threading.current_thread().name)
        if len(attempts) == 1:  # the binding call: let the racer read the op's state, then fail
            binding_started.set()
            assert racer_started.wait(10)
            time.sleep(0.3)
            raise RuntimeError("device busy")
        return build(1.0)

    register_kernel_builder(op="RMSNormFwdOp", target="first", build_kernel=first_builder)
    register_kernel_builder(op="RMSNormFwdOp", target="second", build_kernel=lambda x, w, **p: build(2.0))
    set_default_target("first")
    try:
        op = RMSNormFwdOp(8)
        x = torch.randn(2, 8)
        errors, results = [], []

        def binder():
            try:
                op(x)
            except RuntimeError as error:
                errors.append(str(error))

        def racer():
            binding_started.wait(10)
            racer_started.set()
            results.append(op(x))

        threads = [threading.Thread(target=binder), threading.Thread(target=racer)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        set_default_target("second")  # read only by an unbound instance
        after = op(x)
    finally:
        set_default_target(None)
    assert errors == ["device busy"]
    assert op.target == "first", op.target_reason
    assert {target for target, _ in op.built_kernels()} == {"first"}
    assert bool((results[0] == 1.0).all()) and bool((after == 1.0).all())
    assert FusedAddRMSNormFwdOp(8)(x, x)[0].shape == (2, 8) and LayerNormFwdOp(8)(x).shape == (2, 8)


# -- builders that cannot be called as the protocol says --------------------------------------------
def test_a_kernel_builder_with_the_wrong_signature_is_named_with_what_it_is_called_with(scoped_registry):
    def narrow_builder(x):
        return lambda x, weight, **outs: x

    register_kernel_builder(op="RMSNormFwdOp", target="narrow", build_kernel=narrow_builder)
    op = RMSNormFwdOp(8, target="narrow")
    with pytest.raises(BackendError, match=r"narrow_builder, registered by tests.test_fault_injection_backends\) cannot be called as build_kernel\(x, weight, \*, normalized_shape, eps\)"):
        op(torch.randn(2, 8))
    assert op.target is None
    torch.testing.assert_close(RMSNormFwdOp(8)(torch.ones(2, 8)), F.rms_norm(torch.ones(2, 8), (8,)))
