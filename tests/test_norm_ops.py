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
