"""The activation family on the CPU: every small manifest workload against the reference,
gradients (gradcheck in float64, and against torch's autograd in float16, bfloat16 and
float32), a compiled training step, both forms of the gated ops, and bad calls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import train_side_by_side
from tileops.backend import OpArgumentError, OpNotAvailableError, register_kernel_type
from tileops.ops import (
    FAMILIES,
    GeGLUBwdOp,
    GeGLUFwdOp,
    GELUBwdOp,
    GELUFwdOp,
    PackedGeGLUBwdOp,
    PackedGeGLUFwdOp,
    PackedSwiGLUBwdOp,
    PackedSwiGLUFwdOp,
    SiLUFwdOp,
    SwiGLUBwdOp,
    SwiGLUFwdOp,
)
from tileops.ops.activation.cpu import TorchCpuGated, TorchCpuGatedBwd, TorchCpuPackedGated
from tileops.testing import check_workload, workload_cases

#: The CPU tier runs workloads up to this many elements in all; larger ones run in the GPU tier.
CPU_ELEMENTS = 1 << 23

CASES = [case for case in workload_cases(FAMILIES["activation"]) if case.elements <= CPU_ELEMENTS]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_small_workload_matches_the_reference_on_cpu(case):
    op = case.op_class(**case.workload.params)
    check_workload(op, case.workload, case.dtype, "cpu")


# -- each forward, as torch writes it ---------------------------------------------------------

def _torch_gated(activation, approximate="none"):
    if activation == "silu":
        return lambda gate, up: F.silu(gate) * up
    return lambda gate, up: F.gelu(gate, approximate=approximate) * up


#: (name, op, the same function in torch over the op's inputs, how to make the inputs of shape s)
FORMS = [
    ("silu", SiLUFwdOp(), F.silu, 1),
    ("gelu", GELUFwdOp(), F.gelu, 1),
    ("gelu-tanh", GELUFwdOp("tanh"), lambda x: F.gelu(x, approximate="tanh"), 1),
    ("swiglu", SwiGLUFwdOp(), _torch_gated("silu"), 2),
    ("geglu", GeGLUFwdOp(), _torch_gated("gelu"), 2),
    ("geglu-tanh", GeGLUFwdOp("tanh"), _torch_gated("gelu", "tanh"), 2),
    ("packed-swiglu", PackedSwiGLUFwdOp(6), lambda x: _torch_gated("silu")(*x.chunk(2, -1)), "packed"),
    ("packed-geglu", PackedGeGLUFwdOp(6), lambda x: _torch_gated("gelu")(*x.chunk(2, -1)), "packed"),
    ("packed-geglu-tanh", PackedGeGLUFwdOp(6, "tanh"), lambda x: _torch_gated("gelu", "tanh")(*x.chunk(2, -1)), "packed"),
]
FORM_IDS = [form[0] for form in FORMS]


def _inputs(kind, dtype, *, grad=True, shape=(2, 3, 6)):
    if kind == "packed":  # the packed ops of FORMS have d = 6
        shapes = [(*shape[:-1], 12)]
    else:
        shapes = [shape] * kind
    return [(torch.randn(s, dtype=torch.float64) * 2).to(dtype).requires_grad_(grad) for s in shapes]


@pytest.mark.parametrize(("name", "op", "reference", "kind"), FORMS, ids=FORM_IDS)
def test_gradcheck_in_float64(name, op, reference, kind):
    assert torch.autograd.gradcheck(op, tuple(_inputs(kind, torch.float64)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("name", "op", "reference", "kind"), FORMS, ids=FORM_IDS)
def test_gradients_match_torch_autograd(name, op, reference, kind, dtype):
    ours = _inputs(kind, dtype, shape=(4, 7, 6))
    theirs = [t.detach().clone().requires_grad_() for t in ours]
    dy = torch.randn(op(*ours).shape, dtype=dtype)
    y = op(*ours)
    y.backward(dy)
    expected = reference(*theirs)
    expected.backward(dy)
    atol, rtol = type(op).backward_class().manifest_entry().tolerance[dtype]
    torch.testing.assert_close(y, expected, atol=atol, rtol=rtol)
    for mine, torchs in zip(ours, theirs):
        torch.testing.assert_close(mine.grad, torchs.grad, atol=atol, rtol=rtol)


def test_the_two_forms_of_the_gated_ops_agree_forward_and_backward():
    x = torch.randn(3, 4, 32, dtype=torch.float64)
    gate, up = x.chunk(2, -1)
    for packed, plain in ((PackedSwiGLUFwdOp(16), SwiGLUFwdOp()), (PackedGeGLUFwdOp(16, "tanh"), GeGLUFwdOp("tanh"))):
        torch.testing.assert_close(packed(x), plain(gate, up))
    dy = torch.randn(3, 4, 16, dtype=torch.float64)
    dgate, dup = SwiGLUBwdOp()(dy, gate.contiguous(), up.contiguous())
    torch.testing.assert_close(PackedSwiGLUBwdOp(16)(dy, x), torch.cat([dgate, dup], -1))


def test_the_activations_save_nothing_and_the_backward_reads_the_inputs():
    entry = SwiGLUFwdOp.manifest_entry().backward
    assert entry.op == "SwiGLUBwdOp" and list(entry.saves) == [] and dict(entry.grads) == {"gate": "dgate", "up": "dup"}
    assert dict(PackedSwiGLUFwdOp.manifest_entry().backward.grads) == {"x": "dx"}
    gate = torch.randn(8, 16, requires_grad=True)
    y = SwiGLUFwdOp()(gate, torch.randn(8, 16))  # up needs no gradient: only dgate is used
    assert type(y.grad_fn).__name__ == "SwiGLUFwdOpBackward"
    y.sum().backward()
    assert gate.grad is not None


def test_any_leading_shape_and_non_contiguous_inputs():
    x = torch.randn(6, 40, dtype=torch.float32)[:, ::2]  # (6, 20), not contiguous
    torch.testing.assert_close(SiLUFwdOp()(x), F.silu(x))
    torch.testing.assert_close(SwiGLUFwdOp()(x, x.t().contiguous().t()), F.silu(x) * x)
    assert SiLUFwdOp()(torch.randn(())).shape == ()
    fused = torch.randn(2, 3, 4, 64)[..., :48]  # the packed form sliced out of a wider tensor
    torch.testing.assert_close(PackedSwiGLUFwdOp(24)(fused), F.silu(fused[..., :24]) * fused[..., 24:])


def test_out_buffers_are_filled_and_returned():
    gate, up = torch.randn(4, 8), torch.randn(4, 8)
    out = torch.empty(4, 8)
    assert SwiGLUFwdOp()(gate, up, out=out) is out
    torch.testing.assert_close(out, F.silu(gate) * up)
    half = torch.empty(4, 4)
    assert PackedGeGLUFwdOp(4)(gate, out=half) is half
    torch.testing.assert_close(half, F.gelu(gate[:, :4]) * gate[:, 4:])


class _MLP(torch.nn.Module):
    """A gated MLP as models write it: a fused gate-up projection, the packed SwiGLU, the down
    projection; then a GELU, for a second op in the same graph."""

    def __init__(self, hidden, intermediate, packed, activation):
        super().__init__()
        torch.manual_seed(0)
        self.gate_up = torch.nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = torch.nn.Linear(intermediate, hidden, bias=False)
        self.packed, self.activation = packed, activation

    def forward(self, x):
        return self.activation(self.down(self.packed(self.gate_up(x))))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_gated_mlp_trains_as_the_same_mlp_with_torch_ops(compiled):
    ours = _MLP(32, 48, PackedSwiGLUFwdOp(48), GELUFwdOp("tanh"))
    theirs = _MLP(32, 48, lambda h: F.silu(h[..., :48]) * h[..., 48:], lambda h: F.gelu(h, approximate="tanh"))
    losses = train_side_by_side([ours, theirs], torch.randn(4, 6, 32), torch.randn(4, 6, 32), compiled=compiled)
    torch.testing.assert_close(losses[0], losses[1], atol=1e-5, rtol=1e-5)
    assert losses[0][-1] < losses[0][0]


# -- a backward written over its inputs (consume_inputs=True) ----------------------------------

#: (forward op, its options, the backward op that computes the same gradients as new tensors)
CONSUMING = [(SwiGLUFwdOp, {}, SwiGLUBwdOp()), (GeGLUFwdOp, {"approximate": "tanh"}, GeGLUBwdOp("tanh"))]


def _projected(dtype, *, seed=0):
    """x and the gate and up projections' weights of a small MLP, each requiring grad."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype).requires_grad_()
            for shape in ((3, 5, 16), (24, 16), (24, 16))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize(("op_class", "options", "backward"), CONSUMING, ids=["swiglu", "geglu-tanh"])
def test_consume_inputs_writes_the_gradients_over_the_projections_and_changes_no_gradient(op_class, options, backward, dtype):
    gradients = []
    for consume in (False, True):
        x, w_gate, w_up = _projected(dtype)
        gate, up = x @ w_gate.t(), x @ w_up.t()
        values = gate.detach().clone(), up.detach().clone()
        y = op_class(**options, consume_inputs=consume)(gate, up)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
        y.backward(dy)
        gradients.append([t.grad for t in (x, w_gate, w_up)])
        if consume:  # gate and up now hold their gradients, as the backward op computes them
            for written, expected in zip((gate, up), backward(dy, *values)):
                assert torch.equal(written.detach(), expected)
        else:
            assert torch.equal(gate.detach(), values[0]) and torch.equal(up.detach(), values[1])
    for ordinary, consumed in zip(*gradients):
        assert torch.equal(ordinary, consumed)


def test_consumed_inputs_carry_their_own_gradients_so_no_tensor_of_their_size_is_allocated():
    x, w_gate, w_up = _projected(torch.float32)
    gate, up = x @ w_gate.t(), x @ w_up.t()
    addresses = {"gate": gate.data_ptr(), "up": up.data_ptr()}
    arrived = {}
    gate.register_hook(lambda grad: arrived.__setitem__("gate", grad.data_ptr()))
    up.register_hook(lambda grad: arrived.__setitem__("up", grad.data_ptr()))
    SwiGLUFwdOp(consume_inputs=True)(gate, up).sum().backward()
    assert arrived == addresses


#: The packed forms: (forward op, its options, the backward op that computes dx as a new tensor)
CONSUMING_PACKED = [
    (PackedSwiGLUFwdOp, {"d": 24}, PackedSwiGLUBwdOp(24)),
    (PackedGeGLUFwdOp, {"d": 24, "approximate": "tanh"}, PackedGeGLUBwdOp(24, "tanh")),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize(("op_class", "options", "backward"), CONSUMING_PACKED, ids=["swiglu", "geglu-tanh"])
def test_consume_inputs_writes_the_packed_gradient_over_the_fused_projection_and_changes_no_gradient(
    op_class, options, backward, dtype
):
    gradients = []
    for consume in (False, True):
        x, w_gate, w_up = _projected(dtype)
        fused = x @ torch.cat([w_gate, w_up]).t()  # a fused gate-up projection: (3, 5, 48)
        value = fused.detach().clone()
        y = op_class(**options, consume_inputs=consume)(fused)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
        y.backward(dy)
        gradients.append([t.grad for t in (x, w_gate, w_up)])
        if consume:  # the projection now holds its gradient, as the backward op computes it
            assert torch.equal(fused.detach(), backward(dy, value))
        else:
            assert torch.equal(fused.detach(), value)
    for ordinary, consumed in zip(*gradients):
        assert torch.equal(ordinary, consumed)


def test_a_consumed_packed_input_carries_its_own_gradient_and_a_leaf_is_never_written():
    x, w_gate, w_up = _projected(torch.float32)
    fused = x @ torch.cat([w_gate, w_up]).t()
    arrived = []
    fused.register_hook(lambda grad: arrived.append(grad.data_ptr()))
    PackedSwiGLUFwdOp(24, consume_inputs=True)(fused).sum().backward()
    assert arrived == [fused.data_ptr()]
    leaf = torch.randn(4, 48, requires_grad=True)
    value = leaf.detach().clone()
    PackedSwiGLUFwdOp(24, consume_inputs=True)(leaf).square().sum().backward()
    assert torch.equal(leaf.detach(), value) and leaf.grad is not None


def _leaves():
    return torch.randn(4, 16, requires_grad=True), torch.randn(4, 16, requires_grad=True)


def _projection_and_data():  # up is the caller's tensor, outside the graph
    return torch.randn(4, 8, requires_grad=True) @ torch.randn(8, 16), torch.randn(4, 16)


def _halves_of_one_projection():  # views, not contiguous
    return (torch.randn(4, 8, requires_grad=True) @ torch.randn(8, 32)).chunk(2, -1)


def _contiguous_views():  # contiguous views of one projection, whose base someone else may read
    return (torch.randn(8, 8, requires_grad=True) @ torch.randn(8, 16)).split(4)


def _one_tensor_twice():
    gate = torch.randn(4, 8, requires_grad=True) @ torch.randn(8, 16)
    return gate, gate


@pytest.mark.parametrize(
    "make", [_leaves, _projection_and_data, _halves_of_one_projection, _contiguous_views, _one_tensor_twice],
    ids=["leaves", "caller-data", "non-contiguous-views", "a-view", "one-tensor-twice"],
)
def test_consume_inputs_never_writes_over_what_the_caller_may_read(make):
    torch.manual_seed(0)
    gate, up = make()
    values = gate.detach().clone(), up.detach().clone()
    y = SwiGLUFwdOp(consume_inputs=True)(gate, up)
    expected = F.silu(values[0]) * values[1]
    torch.testing.assert_close(y, expected)
    y.square().sum().backward()
    assert torch.equal(gate.detach(), values[0]) and torch.equal(up.detach(), values[1])


def test_consume_inputs_refuses_a_second_backward_and_a_node_that_saved_an_input_refuses_to_read_it():
    x, w_gate, w_up = _projected(torch.float32)
    y = SwiGLUFwdOp(consume_inputs=True)(x @ w_gate.t(), x @ w_up.t())
    y.sum().backward(retain_graph=True)
    with pytest.raises(OpNotAvailableError, match=r"SwiGLUFwdOp\(consume_inputs=True\): a second backward through one "
                                                  r"call \(retain_graph=True\) cannot run: the first wrote its gradients "
                                                  r"over gate, up; build the op with consume_inputs=False"):
        y.sum().backward()
    # A node recorded before the op's that saved gate: the op's backward runs first and writes
    # over gate, and that node then refuses it (torch's version check) instead of reading a gradient.
    x, w_gate, w_up = _projected(torch.float32)
    gate, up = x @ w_gate.t(), x @ w_up.t()
    other = (gate * torch.randn(gate.shape, requires_grad=True)).sum()
    y = SwiGLUFwdOp(consume_inputs=True)(gate, up)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (y.sum() + other).backward()


def test_a_compiled_step_of_a_consuming_op_computes_the_ordinary_gradients():
    torch._dynamo.reset()
    results = []
    for consume in (False, True):
        x, w_gate, w_up = _projected(torch.float32)
        op = SwiGLUFwdOp(consume_inputs=consume)
        step = torch.compile(lambda x, a, b, op=op: op(x @ a.t(), x @ b.t()).square().sum(), fullgraph=True)
        step(x, w_gate, w_up).backward()
        results.append([t.grad for t in (x, w_gate, w_up)])
    for ordinary, consumed in zip(*results):
        torch.testing.assert_close(ordinary, consumed)


@pytest.mark.parametrize(("name", "op", "reference", "kind"), FORMS, ids=FORM_IDS)
def test_compiled_inference_needs_no_graph_break(name, op, reference, kind):
    torch._dynamo.reset()  # each form traces the same function anew
    inputs = _inputs(kind, torch.float32, grad=False)
    compiled = torch.compile(lambda *tensors: op(*tensors), fullgraph=True)
    torch.testing.assert_close(compiled(*inputs), reference(*inputs))


# -- bad calls ------------------------------------------------------------------------------------

def test_bad_calls_name_the_op_and_the_argument():
    with pytest.raises(OpArgumentError, match=r"SwiGLUFwdOp: argument 'up' must have the shape of 'gate'"):
        SwiGLUFwdOp()(torch.randn(4, 8), torch.randn(4, 9))
    with pytest.raises(OpArgumentError, match=r"SwiGLUFwdOp: argument 'up' must have the dtype of 'gate'"):
        SwiGLUFwdOp()(torch.randn(4, 8), torch.randn(4, 8, dtype=torch.float16))
    with pytest.raises(OpArgumentError, match=r"SiLUFwdOp: argument 'x' expected dtype"):
        SiLUFwdOp()(torch.ones(4, dtype=torch.int32))
    with pytest.raises(OpArgumentError, match=r"PackedSwiGLUFwdOp: x's last dimension must be 2 \* d"):
        PackedSwiGLUFwdOp(8)(torch.randn(4, 15))
    with pytest.raises(OpArgumentError, match=r"PackedSwiGLUBwdOp: dy's last dimension must be d"):
        PackedSwiGLUBwdOp(8)(torch.randn(4, 7), torch.randn(4, 16))
    with pytest.raises(OpArgumentError, match=r"GELUFwdOp: approximate must be 'none' or 'tanh'"):
        GELUFwdOp("exact")
    with pytest.raises(OpArgumentError, match=r"GELUBwdOp: param 'approximate' expected a str"):
        GELUBwdOp(approximate=True)
    with pytest.raises(OpArgumentError, match=r"PackedGeGLUFwdOp: d must be at least 1"):
        PackedGeGLUFwdOp(0)
    # One packed tensor given to the two-tensor op: the error says which op takes it.
    with pytest.raises(OpArgumentError, match=r"SwiGLUFwdOp: missing required input 'up': the up projection, of "
                                              r"gate's shape \(one tensor holding both halves goes to PackedSwiGLUFwdOp\)"):
        SwiGLUFwdOp()(torch.randn(4, 16))


# -- the bench peers ------------------------------------------------------------------------------

class _Recorder:
    """Stands for a Liger autograd function: records how it is called, computes with torch."""

    def __init__(self, compute):
        self.compute, self.calls = compute, []

    def apply(self, *args):
        self.calls.append(args)
        return self.compute(*args)


def test_the_peer_table_names_family_ops_and_calls_liger_as_it_is_called():
    import importlib

    from tileops.ops.activation import OPS, command_line

    assert set(command_line.PEERS) <= {op_class.__name__ for op_class in OPS}
    for columns in command_line.PEERS.values():
        for where, adapter in columns.values():
            if where is None:
                assert isinstance(adapter, str) and adapter
            else:
                module, colon, attribute = where.partition(":")
                assert colon and module.startswith("liger_kernel.") and attribute.isidentifier()
    gate, up = torch.randn(4, 8), torch.randn(4, 8)
    (where, swiglu), = command_line.PEERS["SwiGLUFwdOp"].values()
    recorder = _Recorder(lambda a, b: F.silu(a) * b)
    torch.testing.assert_close(swiglu(recorder, {"gate": gate, "up": up}, {})(), F.silu(gate) * up)
    assert recorder.calls == [(gate, up)]
    (_, packed), = command_line.PEERS["PackedSwiGLUFwdOp"].values()
    recorder = _Recorder(lambda x: F.silu(x[..., :4]) * x[..., 4:])
    torch.testing.assert_close(packed(recorder, {"x": gate}, {"d": 4})(), F.silu(gate[:, :4]) * gate[:, 4:])
    (_, geglu), = command_line.PEERS["GeGLUFwdOp"].values()
    assert geglu(_Recorder(None), {"gate": gate, "up": up}, {"approximate": "none"}) == "computes the tanh approximation only"
    try:
        liger = importlib.import_module(where.partition(":")[0])
    except ImportError:
        return  # the bench extra is not installed: the names are checked where it is
    for columns in command_line.PEERS.values():
        for where, _ in columns.values():
            if where is not None:
                module, _, attribute = where.partition(":")
                assert hasattr(importlib.import_module(module), attribute), where
    assert liger is not None


class _ShapeRecordingGated(TorchCpuGated):
    """A backend's SwiGLU on the CPU, taking the interface's 1-D tensors: records their shapes."""

    general = False
    takes_any_shape = False
    seen: list = []

    def forward(self, gate, up):
        self.seen.append(tuple(gate.shape))
        return super().forward(gate, up)


class _AnyShapeRecordingGated(_ShapeRecordingGated):
    takes_any_shape = True
    seen: list = []


class _ShapeRecordingPacked(TorchCpuPackedGated):
    general = False
    takes_any_shape = False
    seen: list = []

    def forward(self, x):
        self.seen.append(tuple(x.shape))
        return super().forward(x)


class _AnyShapeRecordingPacked(_ShapeRecordingPacked):
    takes_any_shape = True
    seen: list = []


@pytest.mark.parametrize(("op_class", "implementation", "given"), [
    (SwiGLUFwdOp, _ShapeRecordingGated, (48,)),
    (SwiGLUFwdOp, _AnyShapeRecordingGated, (2, 3, 8)),
    (PackedSwiGLUFwdOp, _ShapeRecordingPacked, (6, 16)),
    (PackedSwiGLUFwdOp, _AnyShapeRecordingPacked, (2, 3, 16)),
])
def test_an_implementation_gets_the_interfaces_shape_unless_it_takes_any(scoped_registry, op_class, implementation, given):
    # The in-tree CPU implementations take any shape (no views on a small call); a backend's
    # that does not declare it keeps the interface's contract, and its results come back in the
    # caller's shape, returned or written into out=.
    implementation.seen.clear()
    register_kernel_type(op_class.__name__, "recording", implementation)
    gate, up = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    if op_class is SwiGLUFwdOp:
        op, inputs = SwiGLUFwdOp(), (gate, up)
    else:
        op, inputs = PackedSwiGLUFwdOp(8), (torch.cat((gate, up), -1),)
    expected = F.silu(gate) * up
    torch.testing.assert_close(op(*inputs), expected)
    out = torch.empty(2, 3, 8)
    assert op(*inputs, out=out) is out
    torch.testing.assert_close(out, expected)
    assert implementation.seen == [given, given]


class _RowViewRecordingGated(TorchCpuGated):
    """A SwiGLU implementation on the CPU that records its call spec and the tensors it gets."""

    general = False
    takes_any_shape = False
    seen: list = []

    @classmethod
    def entry_for(cls, call):
        cls.seen.append(("spec", call))
        return super().entry_for(call)

    def forward(self, gate, up):
        self.seen.append(("tensors", gate, up))
        return super().forward(gate, up)


class _RowViewTakingGated(_RowViewRecordingGated):
    takes_row_views = True
    seen: list = []


class _RowViewTakingGatedBwd(TorchCpuGatedBwd):
    general = False
    takes_row_views = True
    seen: list = []

    def forward(self, dy, gate, up):
        self.seen.append((dy, gate, up))
        return super().forward(dy, gate, up)


@pytest.mark.parametrize("implementation", [_RowViewTakingGated, _RowViewRecordingGated], ids=["takes", "copies"])
def test_the_halves_of_a_fused_gate_up_projection_reach_a_kernel_as_row_views_only_where_it_takes_them(
    scoped_registry, implementation
):
    implementation.seen.clear()
    register_kernel_type("SwiGLUFwdOp", "recording", implementation)
    d = 24
    gate, up = torch.randn(2, 3, 2 * d).chunk(2, -1)  # (2, 3, 24) each, rows 48 apart
    y = SwiGLUFwdOp()(gate, up)
    torch.testing.assert_close(y, F.silu(gate) * up)
    assert y.shape == gate.shape and y.is_contiguous()
    (_, spec), (_, got_gate, got_up) = implementation.seen
    assert (spec.width, spec.row_strides) == (d, (2 * d, 2 * d))
    if implementation.takes_row_views:  # (m, width) views of the caller's memory, not copies
        assert got_gate.shape == got_up.shape == (6, d)
        assert got_gate.data_ptr() == gate.data_ptr() and got_gate.stride() == (2 * d, 1)
        assert got_up.data_ptr() == up.data_ptr() and got_up.stride() == (2 * d, 1)
    else:  # the interface's contiguous 1-D tensors
        assert got_gate.shape == (6 * d,) and got_gate.is_contiguous() and got_gate.data_ptr() != gate.data_ptr()
    implementation.seen.clear()
    SwiGLUFwdOp()(gate.contiguous(), up.contiguous())
    (_, spec), _ = implementation.seen
    assert (spec.width, spec.row_strides) == (0, None)  # a contiguous call's spec, as before


def test_the_backward_reads_the_forwards_row_views_where_they_lie(scoped_registry):
    _RowViewTakingGatedBwd.seen.clear()
    register_kernel_type("SwiGLUBwdOp", "recording", _RowViewTakingGatedBwd)
    gate_up = torch.randn(5, 2 * 16, requires_grad=True)
    gate, up = gate_up.chunk(2, -1)
    SwiGLUFwdOp()(gate, up).sum().backward()
    expected = gate_up.detach().clone().requires_grad_()
    g, u = expected.chunk(2, -1)
    (F.silu(g) * u).sum().backward()
    torch.testing.assert_close(gate_up.grad, expected.grad)
    ((dy, got_gate, got_up),) = _RowViewTakingGatedBwd.seen
    assert got_gate.stride() == got_up.stride() == (32, 1) and got_up.data_ptr() == up.data_ptr()
