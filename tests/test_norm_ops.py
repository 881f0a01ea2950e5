"""The norm family on the CPU: every manifest workload against the reference."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from tileops.ops import FAMILIES, FusedAddLayerNormFwdOp, FusedAddRMSNormFwdOp, LayerNormFwdOp, RMSNormFwdOp
from tileops.testing import check_workload, workload_cases, workload_for_shape

#: The CPU tier runs workloads up to this many elements in all; larger ones run in the GPU tier.
CPU_ELEMENTS = 1 << 23

CASES = list(workload_cases(FAMILIES["norm"]))
# The larger workloads are not test cases here at all (the GPU tier runs every workload), rather
# than a skip line each in every CPU run.
CPU_CASES = [case for case in CASES if case.elements <= CPU_ELEMENTS]


@pytest.mark.parametrize("case", CPU_CASES, ids=[c.id for c in CPU_CASES])
def test_every_workload_matches_the_reference_on_cpu(case):
    op = case.op_class(**case.workload.params)
    check_workload(op, case.workload, case.dtype, "cpu")


def test_rms_norm_default_eps_is_torchs_for_the_input_dtype():
    x = torch.randn(4, 64, dtype=torch.bfloat16) * 1e-2
    expected = F.rms_norm(x.float(), (64,), eps=torch.finfo(torch.bfloat16).eps).bfloat16()
    torch.testing.assert_close(RMSNormFwdOp(64)(x), expected, atol=0, rtol=0)


@pytest.mark.parametrize("n", [1, 3, 7, 1000, 4097])
def test_odd_row_lengths_and_non_contiguous_inputs(n):
    x = torch.randn(n, 5).t()  # (5, n), not contiguous
    w, b = torch.randn(n), torch.randn(n)
    torch.testing.assert_close(LayerNormFwdOp(n)(x, w, b), F.layer_norm(x, (n,), w, b))
    torch.testing.assert_close(RMSNormFwdOp(n)(x[1:], w), F.rms_norm(x[1:], (n,), w, eps=torch.finfo(torch.float32).eps))


def test_fused_add_layer_norm_rounds_the_sum_to_the_input_dtype_first():
    x, r = torch.randn(8, 256, dtype=torch.float16), torch.randn(8, 256, dtype=torch.float16)
    y, total = FusedAddLayerNormFwdOp(256)(x, r)
    assert torch.equal(total, x + r)
    torch.testing.assert_close(y, F.layer_norm((x + r).float(), (256,)).half(), atol=0, rtol=0)


@pytest.mark.parametrize("op_class", [RMSNormFwdOp, LayerNormFwdOp, FusedAddRMSNormFwdOp, FusedAddLayerNormFwdOp])
def test_an_op_survives_deepcopy_and_pickle_with_its_params_and_target(op_class):
    import copy
    import pickle

    op = op_class((4, 8), eps=1e-3)
    x = torch.randn(2, 4, 8)
    args = (x, torch.randn(2, 4, 8)) if op_class.__name__.startswith("FusedAdd") else (x,)
    want = op(*args)
    for copied in (copy.deepcopy(op), pickle.loads(pickle.dumps(op))):
        assert type(copied) is op_class and copied.params == op.params and copied is not op
        assert copied.requested_target == op.requested_target
        got = copied(*args)
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            torch.testing.assert_close(g, w)
    on_acme = op_class(8, target="acme")  # the template backend's target, installed in the workspace
    assert copy.deepcopy(on_acme).requested_target == "acme"
    assert pickle.loads(pickle.dumps(on_acme)).requested_target == "acme"



def _record_call_specs(op) -> list:
    """The specs ``op`` builds on its cache misses, as it builds them (the op still gets them)."""
    built = []
    original = op.call_spec

    def call_spec(interface, *fields):
        built.append(original(interface, *fields))
        return built[-1]

    op.call_spec = call_spec
    return built


@pytest.mark.parametrize("op_class", FAMILIES["norm"], ids=lambda c: c.__name__)
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "misaligned"])
def test_call_specs_describes_a_call_as_its_forward_builds_the_spec(op_class, aligned):
    """``tileops explain`` asks ``call_specs`` with descriptions of the tensors; the forward builds
    the spec from the tensors themselves: for every choice of optional inputs both must agree,
    and on a GPU a pointer off the 16-byte grid in any vector input makes the call unaligned."""
    from tileops.core.tensor_description import TensorDescription

    def tensor(shape):
        storage = torch.randn(math.prod(shape) + 1)  # a view one element in is 4 bytes past alignment
        return (storage[:-1] if aligned else storage[1:]).view(shape)

    entry = op_class.manifest_entry()
    shapes = workload_for_shape(entry, (3, 64)).shapes
    optional = [t.name for t in entry.inputs if t.optional]
    for omitted in itertools.chain.from_iterable(itertools.combinations(optional, k) for k in range(len(optional) + 1)):
        op = op_class(64, eps=1e-3)
        built = _record_call_specs(op)
        inputs = {name: tensor(shape) for name, shape in shapes.items() if name not in omitted}
        op(**inputs)
        described = {name: TensorDescription(t.device, t.dtype, tuple(t.shape), t.data_ptr()) for name, t in inputs.items()}
        (interface,) = op_class.kernel_interfaces
        assert op.call_specs(torch.device("cpu"), described) == {interface: built[0]}, omitted
        # The CPU takes vector loads at any address: its calls do not read the pointers.
        assert built[0].aligned is True
        on_gpu = {name: dataclasses.replace(d, device=torch.device("cuda", 0)) for name, d in described.items()}
        assert op.call_specs(torch.device("cuda", 0), on_gpu)[interface].aligned is aligned, omitted


# -- row views: x and residual sliced from wider rows reach the kernel uncopied ------------------

ROW_VIEW_OPS = [
    (RMSNormFwdOp, False, {}),
    (LayerNormFwdOp, False, {}),
    (FusedAddRMSNormFwdOp, True, {}),
    (FusedAddLayerNormFwdOp, True, {}),
]


@pytest.mark.parametrize(("op_class", "fused", "_"), ROW_VIEW_OPS, ids=[c[0].__name__ for c in ROW_VIEW_OPS])
@pytest.mark.parametrize("leading", [(6,), (2, 3)], ids=["2d", "3d"])
def test_slices_of_wider_rows_give_what_their_contiguous_copies_give(op_class, fused, _, leading):
    n = 40
    qkv = torch.randn(*leading, 3 * n)
    x, residual = qkv[..., n:2 * n], torch.randn(*leading, n + 7)[..., 7:]
    weight = torch.randn(n)
    op = op_class(n)
    args = (x, residual, weight) if fused else (x, weight)
    expected = op(*(a.contiguous() for a in args))
    got = op(*args)
    for g, e in zip(got if fused else (got,), expected if fused else (expected,)):
        assert g.shape == e.shape and g.is_contiguous()
        torch.testing.assert_close(g, e, atol=0, rtol=0)


def _row_view_spy(interface, takes_row_views, seen):
    from tileops.backend import Kernel

    class Spy(Kernel, interface):
        devices = frozenset({"cpu"})

        @classmethod
        def entry_for(cls, call):
            seen.append(("spec", call))
            return call, cls

        def forward(self, x, residual, weight):
            seen.append(("tensors", x, residual))
            return torch.zeros_like(x, memory_format=torch.contiguous_format), x + residual

    Spy.takes_row_views = takes_row_views
    return Spy


@pytest.mark.parametrize("takes_row_views", [True, False])
def test_a_kernel_gets_row_views_at_their_pitch_only_where_it_takes_them(scoped_registry, takes_row_views):
    from tileops.backend import register_kernel_type
    from tileops.ops.norm import FusedAddRMSNormFwdInterface

    seen = []
    register_kernel_type(
        "FusedAddRMSNormFwdOp", "spy", _row_view_spy(FusedAddRMSNormFwdInterface, takes_row_views, seen)
    )
    n = 16
    x, residual = torch.randn(2, 3, 3 * n)[..., :n], torch.randn(2, 3, 2 * n)[..., n:]
    _, total = FusedAddRMSNormFwdOp(n)(x, residual)
    (_, spec), (_, got_x, got_residual) = seen
    assert spec.row_strides == (3 * n, 2 * n)
    assert got_x.shape == got_residual.shape == (6, n)
    if takes_row_views:  # views of the caller's memory, not copies
        assert got_x.data_ptr() == x.data_ptr() and got_x.stride() == (3 * n, 1)
        assert got_residual.data_ptr() == residual.data_ptr() and got_residual.stride() == (2 * n, 1)
    else:
        assert got_x.is_contiguous() and got_residual.is_contiguous() and got_x.data_ptr() != x.data_ptr()
    torch.testing.assert_close(total, x + residual)


def test_a_contiguous_call_keeps_the_spec_without_row_strides(scoped_registry):
    from tileops.backend import register_kernel_type
    from tileops.ops.norm import FusedAddRMSNormFwdInterface

    seen = []
    register_kernel_type("FusedAddRMSNormFwdOp", "spy", _row_view_spy(FusedAddRMSNormFwdInterface, True, seen))
    FusedAddRMSNormFwdOp(16)(torch.randn(6, 16), torch.randn(6, 16))
    (_, spec), _ = seen
    assert spec.row_strides is None


@pytest.mark.parametrize("layer", [False, True], ids=["rms_norm", "layer_norm"])
@pytest.mark.parametrize("leading", [(6,), (2, 3)], ids=["2d", "3d"])
def test_a_backward_op_reads_the_saved_row_view_as_its_contiguous_copy(layer, leading):
    from tileops.ops import LayerNormBwdOp, RMSNormBwdOp

    n = 40
    x = torch.randn(*leading, 3 * n)[..., n:2 * n]
    dy, weight = torch.randn(*leading, n), torch.randn(n)
    op = LayerNormBwdOp(n) if layer else RMSNormBwdOp(n)
    expected = op(dy, x.contiguous(), weight)
    got = op(dy, x, weight)
    assert got[0].shape == dy.shape and got[0].is_contiguous()
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=0, rtol=0)


def test_the_backward_kernel_gets_the_forwards_row_view_at_its_pitch(scoped_registry):
    from tileops.backend import Kernel, register_kernel_type
    from tileops.ops.norm import RMSNormBwdInterface

    seen = []

    class Spy(Kernel, RMSNormBwdInterface):
        devices = frozenset({"cpu"})
        takes_row_views = True

        @classmethod
        def entry_for(cls, call):
            seen.append(("spec", call))
            return call, cls

        def forward(self, dy, x, weight, rstd):
            seen.append(("tensors", dy, x, rstd))
            return torch.ones_like(dy), torch.ones_like(weight)

    register_kernel_type("RMSNormBwdOp", "spy", Spy)
    n = 16
    wide = torch.randn(2, 3, 3 * n, requires_grad=True)
    weight = torch.randn(n, requires_grad=True)
    RMSNormFwdOp(n)(wide[..., :n], weight).sum().backward()
    (_, spec), (_, dy, x, rstd) = seen
    assert spec.row_strides == (3 * n,)
    assert dy.shape == (6, n) and rstd.shape == (6,)
    assert x.data_ptr() == wide.data_ptr() and x.shape == (6, n) and x.stride() == (3 * n, 1)
    assert wide.grad[..., :n].eq(1).all() and not wide.grad[..., n:].any()


def test_gradients_reach_the_wider_tensor_a_row_view_was_sliced_from():
    n = 24
    qkv = torch.randn(5, 3 * n, dtype=torch.float64, requires_grad=True)
    residual = torch.randn(5, n, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(n, dtype=torch.float64, requires_grad=True)
    y, total = FusedAddRMSNormFwdOp(n)(qkv[:, n:2 * n], residual, weight)
    (y.sum() + total.square().sum()).backward()
    got = qkv.grad.clone(), residual.grad.clone(), weight.grad.clone()
    for t in (qkv, residual, weight):
        t.grad = None
    x = qkv[:, n:2 * n]
    s = x + residual
    (F.rms_norm(s, (n,), weight, torch.finfo(torch.float64).eps).sum() + s.square().sum()).backward()
    for g, e in zip(got, (qkv.grad, residual.grad, weight.grad)):
        torch.testing.assert_close(g, e)
    assert not got[0][:, :n].any() and not got[0][:, 2 * n:].any()


def test_a_compiled_step_through_a_row_view_gives_the_eager_gradients():
    # Under torch.compile the forward's and the backward's custom ops take the row view too.
    n = 24
    op = LayerNormFwdOp(n)

    def step(wide, weight, bias):
        return op(wide[:, n:2 * n], weight, bias).square().sum()

    grads = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        wide = torch.randn(5, 3 * n, generator=torch.Generator().manual_seed(0), requires_grad=True)
        weight, bias = torch.ones(n, requires_grad=True), torch.zeros(n, requires_grad=True)
        fn(wide, weight, bias).backward()
        grads.append((wide.grad, weight.grad, bias.grad))
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want)
    assert grads[1][0][:, n:2 * n].any() and not grads[1][0][:, :n].any()


def test_the_kit_and_the_demo_take_an_absent_parameter_gradient_for_none():
    # The conformance kit's empty-call check and the demo's reference comparison meet the
    # backward ops' absent outputs (no weight, no bias) as None on both sides.
    from tileops.cli.demo import reference_error
    from tileops.ops import RMSNormBwdOp
    from tileops.testing import check_empty_write

    entry = RMSNormBwdOp.manifest_entry()
    no_affine = next(w for w in entry.workloads if "weight" not in w.shapes)
    check_empty_write(RMSNormBwdOp(**no_affine.params), no_affine, torch.bfloat16, "cpu")
    dx = torch.ones(2, 4)
    assert reference_error(entry, torch.float32, {"dx": dx, "dweight": None}, {"dx": dx, "dweight": None})["within_tolerance"]
    assert not reference_error(entry, torch.float32, {"dx": dx, "dweight": None}, {"dx": dx, "dweight": torch.ones(4)})[
        "within_tolerance"
    ]
