"""Selecting and building in-tree and registered implementations (register_kernel_type)."""

from __future__ import annotations

import ast
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from helpers import ROOT, run_device
from tileops.backend import (
    BackendError,
    CallSpec,
    DeviceFacts,
    Kernel,
    KernelSelectionError,
    OpArgumentError,
    register_kernel_builder,
    register_kernel_type,
)
from tileops.core import device_facts as device_facts_module
from tileops.core.tensor_description import TensorDescription
from tileops.ops import LayerNormFwdOp, RMSNormFwdOp
from tileops.ops.norm import LayerNormCall, LayerNormFwdInterface, RMSNormFwdInterface


class _TorchLayerNorm(Kernel, LayerNormFwdInterface):
    """A replacement written against ``LayerNormFwdInterface`` alone."""

    devices = frozenset({torch.device(run_device()).type})

    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.n, self.eps = n, eps

    @classmethod
    def entry_for(cls, call: LayerNormCall):
        return (call.n, call.eps), lambda: cls(call.n, call.eps)

    def forward(self, x, weight, bias):
        return F.layer_norm(x.float(), (self.n,), weight.float(), bias.float(), self.eps).to(
            x.dtype
        )


class _NarrowTorchLayerNorm(_TorchLayerNorm):
    """An added implementation for short rows, which wins over the in-tree one there."""

    preferred_over = frozenset({"layer_norm"})

    @classmethod
    def refusal(cls, call: LayerNormCall) -> str | None:
        return None if call.n <= 256 else "serves rows of at most 256"


def _inputs(n: int, rows: int = 4):
    device = run_device()
    return (
        torch.randn(rows, n, device=device),
        torch.randn(n, device=device),
        torch.randn(n, device=device),
    )


def _served_by(op) -> set[str]:
    return {key for key, _ in op.built_kernels()}


def test_an_added_implementation_serves_its_region_and_the_in_tree_one_the_rest(scoped_registry):
    register_kernel_type("LayerNormFwdOp", "torch_short_rows", _NarrowTorchLayerNorm)
    short = LayerNormFwdOp(128)
    x, w, b = _inputs(128)
    torch.testing.assert_close(short(x, w, b), F.layer_norm(x, (128,), w, b))
    assert _served_by(short) == {"torch_short_rows"}

    long = LayerNormFwdOp(1024)
    x, w, b = _inputs(1024)
    torch.testing.assert_close(long(x, w, b), F.layer_norm(x, (1024,), w, b))
    assert "torch_short_rows" not in _served_by(long)


def test_an_added_implementation_enters_only_ops_constructed_after_registration(scoped_registry):
    before = LayerNormFwdOp(128)
    register_kernel_type("LayerNormFwdOp", "torch_short_rows", _NarrowTorchLayerNorm)
    after = LayerNormFwdOp(128)
    x, w, b = _inputs(128)
    before(x, w, b)
    after(x, w, b)
    assert "torch_short_rows" not in _served_by(before)
    assert _served_by(after) == {"torch_short_rows"}


class _DroppingLastColumnLayerNorm(_NarrowTorchLayerNorm):
    """A registered implementation that breaks the interface's contract: y is one column short."""

    def forward(self, x, weight, bias):
        return super().forward(x, weight, bias)[:, :-1]


def test_a_registered_implementation_returning_the_wrong_shape_is_an_op_argument_error(scoped_registry):
    # Results of in-tree implementations are trusted; a backend's are checked, on the generated
    # path (2-D contiguous inputs) as on the reference one (a non-contiguous 3-D input), and
    # never broadcast into an out= buffer.
    register_kernel_type("LayerNormFwdOp", "dropping", _DroppingLastColumnLayerNorm)
    op = LayerNormFwdOp(128)
    x, w, b = _inputs(128)
    out = torch.zeros_like(x)
    for call, buffers in ((x, {}), (x.unsqueeze(0).transpose(0, 1), {}), (x, {"out": out})):
        with pytest.raises(OpArgumentError, match=r"LayerNormFwdOp: forward returned output 'y' as \(4, 127\)"):
            op(call, w, b, **buffers)
    assert not out.any()


class _ShapeRecordingLayerNorm(_NarrowTorchLayerNorm):
    """Records the shape of every x it is given."""

    seen: list = []

    def forward(self, x, weight, bias):
        self.seen.append(tuple(x.shape))
        return super().forward(x, weight, bias)


class _LeadingDimsLayerNorm(_ShapeRecordingLayerNorm):
    takes_any_shape = True
    seen: list = []


@pytest.mark.parametrize(("implementation", "given"), [(_ShapeRecordingLayerNorm, (6, 128)), (_LeadingDimsLayerNorm, (2, 3, 128))])
def test_an_implementation_gets_rows_unless_it_takes_any_shape(scoped_registry, implementation, given):
    implementation.seen.clear()  # class-level: a rerun in the same process starts empty
    register_kernel_type("LayerNormFwdOp", "recording", implementation)
    op = LayerNormFwdOp(128)
    x = torch.randn(2, 3, 128, device=run_device())
    w, b = torch.randn(128, device=run_device()), torch.randn(128, device=run_device())
    y = op(x, w, b)
    assert implementation.seen == [given]
    assert y.shape == x.shape
    torch.testing.assert_close(y, F.layer_norm(x, (128,), w, b))
    assert (y._base is None) == implementation.takes_any_shape  # rows come back as a view of the (m, n) result


def test_registering_a_key_twice_raises_and_keeps_the_first(scoped_registry):
    register_kernel_type("LayerNormFwdOp", "torch_short_rows", _NarrowTorchLayerNorm)
    with pytest.raises(BackendError, match="already has a registered kernel type under key 'torch_short_rows'"):
        register_kernel_type("LayerNormFwdOp", "torch_short_rows", _TorchLayerNorm)
    op = LayerNormFwdOp(128)
    op(*_inputs(128))
    assert _served_by(op) == {"torch_short_rows"}


def test_a_key_equal_to_an_in_tree_key_raises_reuse_keys_it_has(scoped_registry):
    register_kernel_type("LayerNormFwdOp", "layer_norm", _NarrowTorchLayerNorm)
    with pytest.raises(BackendError, match="reuse keys it has: 'layer_norm'"):
        LayerNormFwdOp(128)


def test_an_unregistered_and_undone_registration_leaves_no_trace(scoped_registry):
    register_kernel_type("LayerNormFwdOp", "torch_short_rows", _NarrowTorchLayerNorm)
    from tileops.core import registry

    assert "torch_short_rows" in registry.kernel_types("LayerNormFwdOp")


def test_the_registration_above_was_undone():
    from tileops.core import registry

    assert "torch_short_rows" not in registry.kernel_types("LayerNormFwdOp")


class _NoInterface(Kernel):
    @classmethod
    def entry_for(cls, call):
        return None, cls

    def forward(self, x, weight, bias):
        return x


class _InstanceEntry(_TorchLayerNorm):
    def entry_for(self, call):  # not a class method
        return None, None


class _WrongForward(_TorchLayerNorm):
    def forward(self, x, bias):
        return x


class _NoEntryFor(Kernel, LayerNormFwdInterface):
    def forward(self, x, weight, bias):
        return x


class _NoForward(Kernel, LayerNormFwdInterface):
    @classmethod
    def entry_for(cls, call):
        return None, cls


class _OtherGeneral(_TorchLayerNorm):
    general = True
    devices = frozenset({"cpu"})


@pytest.mark.parametrize(
    ("kernel_type", "message"),
    [
        (_NoInterface, "inherits none of the op's kernel interfaces"),
        (_InstanceEntry, "entry_for must be a @classmethod"),
        (_WrongForward, r"forward takes \(x, bias\) but LayerNormFwdInterface.forward takes \(x, weight, bias\)"),
        (_OtherGeneral, "both declare general = True on cpu"),
        (_NoEntryFor, r"does not define entry_for\(call\)"),
        (_NoForward, "leaves abstract methods undefined: forward"),
    ],
)
def test_contract_mistakes_raise_when_the_op_is_constructed(scoped_registry, kernel_type, message):
    register_kernel_type("LayerNormFwdOp", "broken", kernel_type)
    with pytest.raises(BackendError, match=message):
        LayerNormFwdOp(128)


def test_a_forward_replaced_after_an_op_was_built_is_checked_again(scoped_registry, monkeypatch):
    # Op construction remembers each forward's signature (it is checked on every construction):
    # the memory is the function's, so a class given another forward is checked anew.
    class _Patched(_TorchLayerNorm):
        pass

    register_kernel_type("LayerNormFwdOp", "patched", _Patched)
    LayerNormFwdOp(128)
    monkeypatch.setattr(_Patched, "forward", _WrongForward.forward)
    with pytest.raises(BackendError, match=r"'patched' .*forward takes \(x, bias\)"):
        LayerNormFwdOp(128)


def test_an_implementation_of_another_ops_interface_is_refused(scoped_registry):
    class _RMSForLayerNorm(Kernel, RMSNormFwdInterface):
        @classmethod
        def entry_for(cls, call):
            return None, cls

        def forward(self, x, weight):
            return x

    register_kernel_type("LayerNormFwdOp", "rms_here", _RMSForLayerNorm)
    with pytest.raises(BackendError, match="inherits none of the op's kernel interfaces"):
        LayerNormFwdOp(128)


def test_a_preferred_over_cycle_raises(scoped_registry):
    class _A(_TorchLayerNorm):
        preferred_over = frozenset({"cycle_b"})

    class _B(_TorchLayerNorm):
        preferred_over = frozenset({"cycle_a"})

    register_kernel_type("LayerNormFwdOp", "cycle_a", _A)
    register_kernel_type("LayerNormFwdOp", "cycle_b", _B)
    with pytest.raises(BackendError, match="preferred_over forms a cycle"):
        LayerNormFwdOp(128)


def test_preferred_over_naming_an_unknown_key_raises(scoped_registry):
    class _Typo(_TorchLayerNorm):
        preferred_over = frozenset({"layer_nrom"})

    register_kernel_type("LayerNormFwdOp", "typo", _Typo)
    with pytest.raises(BackendError, match="preferred_over 'layer_nrom'"):
        LayerNormFwdOp(128)


def test_two_implementations_that_both_serve_a_call_raise_naming_the_settling_declaration(scoped_registry):
    class _Twin(_NarrowTorchLayerNorm):
        pass

    register_kernel_type("LayerNormFwdOp", "short_a", _NarrowTorchLayerNorm)
    register_kernel_type("LayerNormFwdOp", "short_b", _Twin)
    op = LayerNormFwdOp(128)
    with pytest.raises(KernelSelectionError, match="short_a, short_b") as info:
        op(*_inputs(128))
    assert "preferred_over" in str(info.value)
    assert op.target is None  # the failed binding call was undone


def test_preferred_over_is_transitive(scoped_registry):
    class _Top(_NarrowTorchLayerNorm):
        preferred_over = frozenset({"middle"})

    register_kernel_type("LayerNormFwdOp", "middle", _NarrowTorchLayerNorm)  # beats layer_norm
    register_kernel_type("LayerNormFwdOp", "top", _Top)
    op = LayerNormFwdOp(128)
    top = op.implementations()[LayerNormFwdInterface]
    assert {"middle", "layer_norm", "layer_norm_shared", "layer_norm_streamed"} <= top.beats["top"]


def test_no_survivor_lists_every_key_with_its_reason():
    op = LayerNormFwdOp(64)
    call = LayerNormCall(torch.device("meta"), 64, torch.float32, 1e-5, False, False, True)
    with pytest.raises(KernelSelectionError) as info:
        op.kernel_for(LayerNormFwdInterface, call)
    text = str(info.value)
    assert "no implementation serves" in text
    for key in ("torch_cpu", "layer_norm", "layer_norm_scalar"):
        assert f"  - {key}: unavailable" in text
    assert "device=device(type='meta')" in text


def test_a_call_spec_holding_a_mutable_value_is_refused_naming_the_field():
    @dataclasses.dataclass(frozen=True)
    class _BadCall(CallSpec):
        sizes: list

    with pytest.raises(BackendError, match=r"_BadCall.sizes = \[1, 2\]"):
        _BadCall(torch.device("cpu"), [1, 2]).validate()
    _BadCall(torch.device("cpu"), (1, 2)).validate()  # a tuple is fine


def test_one_kernel_is_built_per_identity_and_a_repeat_call_reads_no_device(scoped_registry, monkeypatch):
    built = []

    class _Counting(_NarrowTorchLayerNorm):
        def __init__(self, n, eps):
            built.append((n, eps))
            super().__init__(n, eps)

    register_kernel_type("LayerNormFwdOp", "counting", _Counting)
    op = LayerNormFwdOp(128)
    x, w, b = _inputs(128)
    op(x, w, b)
    op(x[:2], w, b)  # another batch size: same call spec
    op(x.double().float(), w, b)
    assert built == [(128, 1e-5)]

    def _no_device_reads(device):
        raise AssertionError("the hit path read device facts")

    monkeypatch.setattr(device_facts_module, "facts_for", _no_device_reads)
    op(x, w, b)


def test_supported_archs_are_checked_against_stated_device_facts(scoped_registry):
    class _HopperOnly(_NarrowTorchLayerNorm):
        devices = frozenset({"cuda"})
        supported_archs = frozenset({90})

    register_kernel_type("LayerNormFwdOp", "hopper_only", _HopperOnly)
    op = LayerNormFwdOp(128)
    call = LayerNormCall(torch.device("cuda", 0), 128, torch.bfloat16, 1e-5, True, True, True)
    on_hopper = {v.key: v for v in op.verdicts(LayerNormFwdInterface, call, DeviceFacts("cuda", arch=90))}
    on_ampere = {v.key: v for v in op.verdicts(LayerNormFwdInterface, call, DeviceFacts("cuda", arch=80))}
    assert on_hopper["hopper_only"].outcome == "selected"
    assert on_ampere["hopper_only"].outcome == "unavailable"
    assert "needs architecture 90" in on_ampere["hopper_only"].reason
    assert on_ampere["layer_norm"].outcome == "selected"


def test_an_op_says_whether_a_call_runs_more_than_its_general_implementation(scoped_registry):
    # What an integration asks before routing a call to an op rather than to a library's own
    # fused path: whether the call gets more than the op's catch-all (general) implementation.
    def described(device, n=128):
        shapes = {"x": (4, n), "weight": (n,), "bias": (n,)}
        return {name: TensorDescription(device, torch.float32, shape) for name, shape in shapes.items()}

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert LayerNormFwdOp(128).served_beyond_general(cuda, described(cuda), DeviceFacts("cuda", arch=90))
    assert not LayerNormFwdOp(128).served_beyond_general(cpu, described(cpu))  # the CPU's is general
    register_kernel_type("LayerNormFwdOp", "narrow", _NarrowTorchLayerNorm)  # rows of at most 256
    assert LayerNormFwdOp(128).served_beyond_general(cpu, described(cpu))
    assert not LayerNormFwdOp(512).served_beyond_general(cpu, described(cpu, 512))
    # A target's own kernels are narrower by definition.
    register_kernel_builder(op="LayerNormFwdOp", target="somewhere", build_kernel=lambda *args, **kwargs: None)
    assert LayerNormFwdOp(512, target="somewhere").served_beyond_general(cpu, described(cpu, 512))


def test_supported_archs_on_a_device_type_without_facts_names_register_device_facts(scoped_registry):
    class _Archy(_NarrowTorchLayerNorm):
        devices = frozenset({"xpu"})
        supported_archs = frozenset({1})

    register_kernel_type("LayerNormFwdOp", "archy", _Archy)
    op = LayerNormFwdOp(128)
    call = LayerNormCall(torch.device("xpu", 0), 128, torch.float32, 1e-5, True, True, True)
    verdict = {v.key: v for v in op.verdicts(LayerNormFwdInterface, call)}["archy"]
    assert verdict.outcome == "unavailable"
    assert "register_device_facts('xpu', ...)" in verdict.reason


def test_rms_norm_in_tree_keys_follow_the_spec():
    op = RMSNormFwdOp(4096)
    keys = set(op.implementations()[RMSNormFwdInterface].classes)
    assert {"rms_norm", "torch_cpu"} <= keys
    layer = LayerNormFwdOp(4096).implementations()[LayerNormFwdInterface].classes
    assert layer["layer_norm"].general is False


def test_concurrent_first_calls_build_each_entry_once_and_agree(scoped_registry):
    import threading
    import time

    built = []

    class _Slow(_NarrowTorchLayerNorm):
        def __init__(self, n, eps):
            time.sleep(0.05)  # widen the window in which a second thread could build too
            built.append(n)
            super().__init__(n, eps)

    register_kernel_type("LayerNormFwdOp", "slow", _Slow)
    op = LayerNormFwdOp(128)
    x, w, b = _inputs(128)
    results, start = [], threading.Barrier(8)

    def call():
        start.wait()
        results.append(op(x, w, b))

    threads = [threading.Thread(target=call) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert built == [128]
    assert len(results) == 8 and all(torch.equal(r, results[0]) for r in results)


def test_in_tree_keys_are_the_ops_own_and_its_kernel_tables_named_once():
    from tileops.kernels.cuda.norm import KERNELS

    keys = LayerNormFwdOp.in_tree_keys()
    assert keys == {**LayerNormFwdOp.in_tree_kernels[LayerNormFwdInterface], **KERNELS[LayerNormFwdInterface]}
    assert list(keys) == [
        "torch_cpu", "torch_float64", "layer_norm", "layer_norm_shared", "layer_norm_streamed", "layer_norm_scalar"
    ]


def test_a_key_in_both_the_ops_kernels_and_a_table_is_refused_at_construction():
    from tileops.kernels.cuda.norm import KERNELS

    clash = type("LayerNormFwdOp", (LayerNormFwdOp,), {
        "_custom_op": None,
        "in_tree_kernels": {LayerNormFwdInterface: {"layer_norm": KERNELS[LayerNormFwdInterface]["layer_norm"]}},
    })
    with pytest.raises(BackendError, match="key 'layer_norm' of LayerNormFwdInterface is in tileops.kernels.cuda.norm:KERNELS"):
        clash(1024)


def test_a_kernel_table_that_is_not_a_mapping_is_refused_naming_it():
    odd = type("LayerNormFwdOp", (LayerNormFwdOp,), {"_custom_op": None, "kernel_tables": ("tileops.kernels.cuda.norm:policy",)})
    with pytest.raises(BackendError, match="names tileops.kernels.cuda.norm:policy, which is module, not a mapping"):
        odd(1024)


def test_tileops_core_exports_the_names_op_families_use_as_the_backend_apis_own_objects():
    import tileops.backend as backend
    import tileops.core as core

    assert {"Op", "KernelInterface", "CallSpec", "Kernel", "BUILTIN", "DeviceFacts", "facts_for", "OpArgumentError"} <= set(
        core.__all__
    )
    for name in core.__all__:
        if name in backend.__all__:
            assert getattr(core, name) is getattr(backend, name), name


def test_in_tree_family_code_imports_op_family_names_from_tileops_core_only():
    """One import path per name: an op family (``tileops.ops.<family>``) and the in-tree CUDA
    kernels import what ``tileops.core`` exports from there, never from ``tileops.backend``
    (the backends' path) or from a module behind ``tileops.core``."""
    roots = [ROOT / "packages/tileops-ops/src/tileops/ops", ROOT / "packages/tileops-kernels-cuda/src/tileops/kernels/cuda"]
    offenders = []
    for path in sorted(p for root in roots for p in root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            modules = [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            for module in modules:
                if module == "tileops.backend" or (module or "").startswith("tileops.core."):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {module}")
    assert offenders == [], "\n".join(offenders)


def test_a_backends_preference_over_a_kernel_of_a_table_that_is_not_installed_is_not_an_error(scoped_registry):
    # The spec's backend prefers itself over the in-tree CUDA key; where the CUDA kernels'
    # distribution is absent that key is unknown, and the op must still construct and serve.
    register_kernel_type("LayerNormFwdOp", "torch_short_rows", _NarrowTorchLayerNorm)
    without_cuda_kernels = type(
        "LayerNormFwdOp", (LayerNormFwdOp,), {"_custom_op": None, "kernel_tables": ("tileops.kernels.ghost.norm:KERNELS",)}
    )
    op = without_cuda_kernels(128)
    assert "layer_norm" not in op.in_tree_keys() and "tileops.kernels.ghost.norm" in op.in_tree_keys()
    x, w, b = _inputs(128)
    torch.testing.assert_close(op(x, w, b), F.layer_norm(x, (128,), w, b))
    assert _served_by(op) == {"torch_short_rows"}


def test_a_preference_over_an_unknown_key_is_refused_where_every_table_is_installed(scoped_registry):
    register_kernel_type("LayerNormFwdOp", "typo", type("_Typo", (_TorchLayerNorm,), {"preferred_over": frozenset({"layer_nrom"})}))
    with pytest.raises(BackendError, match="'typo' is preferred_over 'layer_nrom', which is not an implementation"):
        LayerNormFwdOp(128)


def test_stated_facts_answer_for_their_device_type_only_and_only_while_stated():
    stated = device_facts_module.stated_facts("cuda", 86)
    assert stated == DeviceFacts("cuda", arch=86, shared_memory_per_block=99 * 1024)
    assert device_facts_module.stated_facts("npu", 3) == DeviceFacts("npu", arch=3)
    before = device_facts_module.facts_for(torch.device("cpu"))
    with device_facts_module.stating(stated):
        assert device_facts_module.facts_for(torch.device("cuda", 0)) is stated
        assert device_facts_module.facts_for(torch.device("cuda", 3)) is stated
        assert device_facts_module.facts_for(torch.device("cpu")) == before
    assert not device_facts_module.is_stated(torch.device("cuda", 0))
    if torch.cuda.is_available():
        assert device_facts_module.facts_for(torch.device("cuda", 0)) is not stated
