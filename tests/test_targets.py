"""Targets: detectors, kernel builders, binding rules and backend discovery."""

from __future__ import annotations

import importlib.metadata
import warnings

import pytest
import torch
import torch.nn.functional as F

from tileops.backend import (
    BUILTIN,
    AmbiguousTargetError,
    BackendError,
    OpNotAvailableError,
    TensorSpec,
    UnknownTargetError,
    default_target,
    register_detector,
    register_kernel_builder,
    registered_targets,
    set_default_target,
)
from tileops.core import discovery
from tileops.ops import FusedAddRMSNormFwdOp, LayerNormFwdOp, RMSNormFwdOp


class _Recorder:
    """A kernel builder that records what it was given and builds a torch RMSNorm."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple, dict]] = []

    def __call__(self, x, weight, *, normalized_shape, eps):
        self.calls.append(((x, weight), {"normalized_shape": normalized_shape, "eps": eps}))

        def kernel(x, weight, *, out=None):
            kernel.seen.append((x, weight, out))
            y = F.rms_norm(x, normalized_shape, weight, eps)
            return y if out is None else out.copy_(y)

        kernel.seen = []
        return kernel


@pytest.fixture
def recorder(scoped_registry):
    build = _Recorder()
    register_kernel_builder(op="RMSNormFwdOp", target="probe", build_kernel=build)
    return build


def test_a_named_target_serves_every_call_and_the_op_forward_never_runs(recorder, monkeypatch):
    op = RMSNormFwdOp(8, target="probe")
    monkeypatch.setattr(op, "forward", lambda *a, **k: pytest.fail("the op's own forward ran"))
    x, w = torch.randn(3, 8), torch.randn(8)
    torch.testing.assert_close(op(x, w), F.rms_norm(x, (8,), w))
    assert op.target == "probe"


def test_build_kernel_gets_tensor_specs_in_signature_order_and_params_as_keywords(recorder):
    op = RMSNormFwdOp([2, 4], eps=1e-3, target="probe")
    x = torch.randn(5, 2, 4)
    op(x)
    (specs, params), = recorder.calls
    assert specs == (TensorSpec(x.device, torch.float32, (5, 2, 4)), None)
    assert params == {"normalized_shape": (2, 4), "eps": 1e-3}


def test_kernels_are_cached_by_device_presence_dtype_and_shape(recorder):
    op = RMSNormFwdOp(8, target="probe")
    x, w = torch.randn(3, 8), torch.randn(8)
    op(x, w)
    op(x.clone(), w.clone())
    assert len(recorder.calls) == 1
    op(x)  # weight absent
    op(x.half(), w.half())  # another dtype
    op(torch.randn(4, 8), w)  # another shape
    assert len(recorder.calls) == 4


def test_the_kernel_gets_output_buffers_as_keywords_and_contiguous_inputs(recorder):
    op = RMSNormFwdOp(8, target="probe")
    x = torch.randn(8, 3).t()  # not contiguous
    out = torch.empty(3, 8)
    result = op(x, out=out)
    assert result is out
    (seen_x, seen_w, seen_out), = op.built_kernels()[0][1].seen
    assert seen_x.is_contiguous() and seen_w is None and seen_out is out


def test_a_target_gets_contiguous_inputs_where_the_in_tree_path_takes_stand_ins(scoped_registry):
    # LinearCrossEntropyBwdOp reads only the shapes of hidden_states, weight and target_ids
    # (access: shape): the in-tree path takes them as they come (an autograd node's one-element
    # stand-ins), and a target is still handed contiguous tensors, as every input it reads.
    from tileops.core import stand_in
    from tileops.ops import LinearCrossEntropyBwdOp

    seen = []

    def build(*specs, **params):
        def kernel(dloss, hidden_states, weight, bias, target_ids, grad_hidden, grad_weight, grad_bias):
            seen.append((hidden_states, weight, target_ids))
            return grad_hidden.mul_(dloss), grad_weight.mul_(dloss), grad_bias

        return kernel

    register_kernel_builder(op="LinearCrossEntropyBwdOp", target="probe", build_kernel=build)
    hidden_states, weight, target_ids = torch.randn(6, 4), torch.randn(4, 10).t(), torch.arange(6)
    grads = torch.ones(6, 4), torch.ones(10, 4)
    results = LinearCrossEntropyBwdOp(target="probe")(torch.tensor(2.0), stand_in(hidden_states), weight, None,
                                                      stand_in(target_ids), *grads)
    ((h, w, t),) = seen
    assert h.is_contiguous() and w.is_contiguous() and t.is_contiguous()
    assert h.shape == (6, 4) and w.shape == (10, 4) and t.shape == (6,) and torch.equal(w, weight)
    assert results[0] is grads[0] and torch.equal(results[1], torch.full((10, 4), 2.0))


def test_a_target_without_a_builder_for_the_op_raises_op_not_available(recorder):
    op = LayerNormFwdOp(8, target="probe")
    with pytest.raises(OpNotAvailableError) as info:
        op(torch.randn(2, 8))
    assert "registers no kernel builder for LayerNormFwdOp" in str(info.value)
    assert "Targets that serve LayerNormFwdOp: acme" in str(info.value)
    assert op.target is None


def test_an_unknown_target_lists_the_known_ones():
    with pytest.raises(UnknownTargetError, match="known targets: builtin, acme"):
        RMSNormFwdOp(8, target="nope")
    with pytest.raises(UnknownTargetError):
        set_default_target("nope")


def test_a_call_that_writes_only_empty_tensors_binds_nothing(recorder):
    op = RMSNormFwdOp(8, target="probe")
    y = op(torch.randn(0, 8))
    assert y.shape == (0, 8) and op.target is None and recorder.calls == []
    out = torch.empty(0, 8)
    assert op(torch.randn(0, 8), out=out) is out


def test_the_process_default_comes_after_the_construction_argument(recorder):
    try:
        set_default_target("probe")
        assert default_target() == "probe"
        op = RMSNormFwdOp(8)
        op(torch.randn(2, 8))
        assert op.target == "probe"
        forced = RMSNormFwdOp(8, target=BUILTIN)
        forced(torch.randn(2, 8))
        assert forced.target == BUILTIN
    finally:
        set_default_target(None)


def test_detectors_bind_the_claiming_target_and_several_claims_are_ambiguous(recorder):
    register_detector(target="probe", detect=lambda device: device.type == "cpu")
    op = RMSNormFwdOp(8)
    op(torch.randn(2, 8))
    assert op.target == "probe"
    assert "claims cpu" in op.target_reason

    register_detector(target="probe2", detect=lambda device: True)
    op = RMSNormFwdOp(8)
    with pytest.raises(AmbiguousTargetError, match="'probe', 'probe2'"):
        op(torch.randn(2, 8))
    assert op.target is None


def test_the_target_is_fixed_after_binding(recorder):
    op = RMSNormFwdOp(8)
    op(torch.randn(2, 8))
    assert op.target == BUILTIN
    register_detector(target="probe", detect=lambda device: True)
    op(torch.randn(2, 8))
    assert op.target == BUILTIN


def test_a_failed_binding_call_is_undone_and_the_next_call_binds_again(scoped_registry):
    attempts = []

    def flaky(x, weight, *, normalized_shape, eps):
        attempts.append(x)
        if len(attempts) == 1:
            raise RuntimeError("device busy")
        return lambda x, weight, **outs: F.rms_norm(x, normalized_shape, weight, eps)

    register_kernel_builder(op="RMSNormFwdOp", target="flaky", build_kernel=flaky)
    op = RMSNormFwdOp(8, target="flaky")
    with pytest.raises(RuntimeError, match="device busy"):
        op(torch.randn(2, 8))
    assert op.target is None and op.built_kernels() == []
    op(torch.randn(2, 8))
    assert op.target == "flaky" and len(attempts) == 2


def test_a_detector_that_raises_is_reported_as_the_backends_fault(scoped_registry):
    def broken_detector(device):
        raise KeyError("no such device")

    register_detector(target="broken", detect=broken_detector)
    with pytest.raises(BackendError, match=r"test_targets.*broken_detector.*raised KeyError"):
        RMSNormFwdOp(8)(torch.randn(2, 8))


def test_a_second_detector_or_builder_names_both_registrants(recorder):
    with pytest.raises(BackendError, match="already registered by tests.test_targets"):
        register_kernel_builder(op="RMSNormFwdOp", target="probe", build_kernel=_Recorder())
    register_detector(target="probe", detect=lambda d: False)
    with pytest.raises(BackendError, match="already has a detector, registered by tests.test_targets"):
        register_detector(target="probe", detect=lambda d: False)


def test_a_builder_returning_something_not_callable_is_a_clear_error(scoped_registry):
    register_kernel_builder(op="RMSNormFwdOp", target="lazy", build_kernel=lambda *specs, **params: 42)
    with pytest.raises(BackendError, match="returned int, which is not callable"):
        RMSNormFwdOp(8, target="lazy")(torch.randn(2, 8))


def test_a_kernel_returning_the_wrong_outputs_is_caught(scoped_registry):
    register_kernel_builder(
        op="FusedAddRMSNormFwdOp", target="half", build_kernel=lambda *specs, **params: (lambda x, r, w, **o: x)
    )
    with pytest.raises(Exception, match="declares 2 output"):
        FusedAddRMSNormFwdOp(8, target="half")(torch.randn(2, 8), torch.randn(2, 8))


def test_registered_targets_lists_the_installed_template():
    assert "acme" in registered_targets()
    assert "acme" in registered_targets("RMSNormFwdOp")


def test_the_template_target_serves_cpu_tensors_when_named():
    op = FusedAddRMSNormFwdOp(16, target="acme")
    x, r = torch.randn(4, 16), torch.randn(4, 16)
    y, total = op(x, r)
    torch.testing.assert_close(total, x + r)
    torch.testing.assert_close(y, F.rms_norm(x + r, (16,), eps=torch.finfo(torch.float32).eps))


class _FakeEntryPoint:
    def __init__(self, load):
        self.name, self.value, self.dist = "fake", "fake_backend", None
        self.load = load


def test_a_backend_that_fails_to_import_is_undone_warned_and_recorded():
    def load():
        register_detector(target="half_loaded", detect=lambda d: True)
        raise ImportError("missing driver")

    before = len(discovery._failures)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        discovery._load_one(_FakeEntryPoint(load))
    try:
        assert "half_loaded" not in registered_targets()
        assert any(issubclass(w.category, RuntimeWarning) and "missing driver" in str(w.message) for w in caught)
        failure = discovery.load_failures()[-1]
        assert failure.name == "fake" and isinstance(failure.error, ImportError)
        assert "missing driver" in failure.traceback
    finally:
        del discovery._failures[before:]


def test_the_template_is_found_through_its_entry_point():
    names = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="tileops.backends")}
    assert names.get("acme") == "tileops_acme"
    assert discovery.load_failures() == []


def test_request_tune_reaches_the_target_kernels_that_define_it(scoped_registry):
    asked = []

    class TunableKernel:
        config = {"block": 128}

        def request_tune(self):
            asked.append(self)

        def __call__(self, x, weight, *, out=None):
            return F.rms_norm(x, (8,))

    register_kernel_builder(op="RMSNormFwdOp", target="tunable", build_kernel=lambda *specs, **params: TunableKernel())
    op = RMSNormFwdOp(8, target="tunable")
    op(torch.randn(2, 8))
    op(torch.randn(3, 8))
    op.request_tune()
    assert len(asked) == 2 and all(kernel.config == {"block": 128} for kernel in asked)
