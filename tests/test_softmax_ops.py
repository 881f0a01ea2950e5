"""The softmax family on the CPU: every small manifest workload against the reference, the
semantics of torch.softmax / torch.log_softmax (dim, the output dtype, -inf entries), gradients
(gradcheck in float64, against torch's autograd in float16, bfloat16 and float32, with an
output dtype), compiled training and inference, bad calls, and the bench peers' table."""

from __future__ import annotations

import pytest
import torch

from helpers import train_side_by_side
from tileops.backend import OpArgumentError
from tileops.ops import FAMILIES, LogSoftmaxBwdOp, LogSoftmaxFwdOp, SoftmaxBwdOp, SoftmaxFwdOp
from tileops.testing import check_workload, workload_cases

#: The CPU tier runs workloads up to this many elements in all; larger ones run in the GPU tier.
CPU_ELEMENTS = 1 << 21

CASES = [case for case in workload_cases(FAMILIES["softmax"]) if case.elements <= CPU_ELEMENTS]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_small_workload_matches_the_reference_on_cpu(case):
    op = case.op_class(**case.workload.params)
    check_workload(op, case.workload, case.dtype, "cpu")


#: (op class, torch's function)
FORWARDS = [(SoftmaxFwdOp, torch.softmax), (LogSoftmaxFwdOp, torch.log_softmax)]
FORWARD_IDS = ["softmax", "log_softmax"]


@pytest.mark.parametrize(("op_class", "function"), FORWARDS, ids=FORWARD_IDS)
@pytest.mark.parametrize("dim", [0, 1, -1, -2, 2])
def test_every_dim_as_torch(op_class, function, dim):
    x = torch.randn(5, 6, 7) * 4
    y = op_class(dim)(x)
    torch.testing.assert_close(y, function(x, dim))
    assert y.is_contiguous()


@pytest.mark.parametrize(("op_class", "function"), FORWARDS, ids=FORWARD_IDS)
@pytest.mark.parametrize(
    ("given", "wanted"),
    [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.float16, torch.bfloat16), (torch.float32, torch.float64)],
    ids=str,
)
def test_the_output_dtype_as_torch(op_class, function, given, wanted):
    x = (torch.randn(3, 257, dtype=torch.float64) * 5).to(given)
    y = op_class(out_dtype=wanted)(x)
    assert y.dtype == wanted
    atol, rtol = op_class.manifest_entry().tolerance[wanted]
    # x is converted to the output dtype first, as torch does (a narrower dtype rounds x).
    torch.testing.assert_close(y, function(x.to(wanted).double(), -1).to(wanted), atol=atol, rtol=rtol)
    torch.testing.assert_close(y, function(x, -1, dtype=wanted), atol=atol, rtol=rtol)


@pytest.mark.parametrize(("op_class", "function"), FORWARDS, ids=FORWARD_IDS)
def test_one_instance_takes_inputs_of_every_dtype_into_one_output_dtype(op_class, function):
    """The CPU implementation built for a float32 input computes it as it is: an input of
    another dtype into the same output dtype must not reuse that build."""
    op = op_class(out_dtype=torch.float32)
    x = torch.randn(3, 257, dtype=torch.float64) * 5
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.float16):
        y = op(x.to(dtype))
        assert y.dtype == torch.float32, dtype
        torch.testing.assert_close(y, function(x.to(dtype), -1, dtype=torch.float32))


@pytest.mark.parametrize(("op_class", "function"), FORWARDS, ids=FORWARD_IDS)
def test_masked_entries_and_fully_masked_rows_as_torch(op_class, function):
    x = torch.randn(4, 9)
    x[0, :4] = float("-inf")  # a masked prefix
    x[1, ::2] = float("-inf")
    x[2] = float("-inf")  # a fully masked row: NaN, as torch
    y, expected = op_class()(x), function(x, -1)
    torch.testing.assert_close(y, expected, equal_nan=True)
    assert y[2].isnan().all()


def test_rows_of_one_element_and_a_strided_view():
    assert torch.equal(SoftmaxFwdOp()(torch.randn(6, 1)), torch.ones(6, 1))
    assert torch.equal(LogSoftmaxFwdOp()(torch.randn(6, 1)), torch.zeros(6, 1))
    wide = torch.randn(8, 64)
    torch.testing.assert_close(SoftmaxFwdOp()(wide[:, ::3]), torch.softmax(wide[:, ::3], -1))


def test_out_buffers_are_filled_and_returned():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    out = torch.empty(4, 8, dtype=torch.float32)
    assert SoftmaxFwdOp(out_dtype=torch.float32)(x, out=out) is out
    torch.testing.assert_close(out, torch.softmax(x, -1, dtype=torch.float32))


# -- gradients ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("op_class", "function"), FORWARDS, ids=FORWARD_IDS)
@pytest.mark.parametrize("dim", [-1, 0])
def test_gradcheck_in_float64(op_class, function, dim):
    x = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(op_class(dim), (x,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("op_class", "function"), FORWARDS, ids=FORWARD_IDS)
@pytest.mark.parametrize("out_dtype", [None, torch.float32], ids=["same", "to-float32"])
def test_gradients_match_torch_autograd(op_class, function, dtype, out_dtype):
    ours = (torch.randn(4, 7, 33, dtype=torch.float64) * 2).to(dtype).requires_grad_()
    theirs = ours.detach().clone().requires_grad_()
    op = op_class(-1, out_dtype)
    y = op(ours)
    assert type(y.grad_fn).__name__ == f"{op_class.__name__}Backward"
    dy = torch.randn(y.shape, dtype=y.dtype)
    y.backward(dy)
    expected = function(theirs, -1, dtype=out_dtype)
    expected.backward(dy)
    atol, rtol = op_class.backward_class().manifest_entry().tolerance[dtype]
    torch.testing.assert_close(y, expected, atol=atol, rtol=rtol)
    assert ours.grad.dtype == dtype
    torch.testing.assert_close(ours.grad, theirs.grad, atol=atol, rtol=rtol)


def test_the_forward_saves_nothing_and_the_backward_reads_y():
    for forward, backward in ((SoftmaxFwdOp, "SoftmaxBwdOp"), (LogSoftmaxFwdOp, "LogSoftmaxBwdOp")):
        entry = forward.manifest_entry().backward
        assert entry.op == backward and list(entry.saves) == [] and dict(entry.grads) == {"x": "dx"}
        assert [t.name for t in forward.backward_class().manifest_entry().inputs] == ["dy", "y"]
    y = torch.softmax(torch.randn(5, 11, dtype=torch.float64), -1)
    dy = torch.randn(5, 11, dtype=torch.float64)
    torch.testing.assert_close(SoftmaxBwdOp()(dy, y), y * (dy - (dy * y).sum(-1, keepdim=True)))
    logy = y.log()
    torch.testing.assert_close(LogSoftmaxBwdOp(0)(dy, logy), dy - logy.exp() * dy.sum(0, keepdim=True))


class _Head(torch.nn.Module):
    """A projection, then a softmax over the last dimension and a log-softmax over the first."""

    def __init__(self, softmax, log_softmax):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(16, 40)
        self.softmax, self.log_softmax = softmax, log_softmax

    def forward(self, x):
        return self.log_softmax(self.softmax(self.proj(x)) * 3)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_model_trains_as_the_same_model_with_torch_ops(compiled):
    ours = _Head(SoftmaxFwdOp(out_dtype=torch.float32), LogSoftmaxFwdOp(0))
    theirs = _Head(lambda h: torch.softmax(h, -1, dtype=torch.float32), lambda h: torch.log_softmax(h, 0))
    losses = train_side_by_side([ours, theirs], torch.randn(6, 5, 16), torch.randn(6, 5, 40), compiled=compiled)
    torch.testing.assert_close(losses[0], losses[1], atol=1e-5, rtol=1e-5)
    assert losses[0][-1] < losses[0][0]


@pytest.mark.parametrize(("op_class", "function"), FORWARDS, ids=FORWARD_IDS)
def test_compiled_inference_needs_no_graph_break(op_class, function):
    torch._dynamo.reset()
    op = op_class(1, torch.float32)
    x = torch.randn(3, 10, 4, dtype=torch.bfloat16)
    compiled = torch.compile(lambda t: op(t), fullgraph=True)
    torch.testing.assert_close(compiled(x), function(x, 1, dtype=torch.float32))


# -- bad calls ------------------------------------------------------------------------------------

def test_bad_calls_name_the_op_the_argument_what_was_expected_and_got():
    with pytest.raises(OpArgumentError, match=r"SoftmaxFwdOp: row_dim must name a dimension of x .*bound: batch=\(4,\), N=8"):
        SoftmaxFwdOp(2)(torch.randn(4, 8))
    with pytest.raises(OpArgumentError, match=r"LogSoftmaxFwdOp: argument 'x' expected dtype float16 or bfloat16 or float32 or float64, got torch.int64"):
        LogSoftmaxFwdOp()(torch.ones(4, 8, dtype=torch.int64))
    with pytest.raises(OpArgumentError, match=r"SoftmaxFwdOp: out_dtype must be a floating-point dtype .*out_dtype=torch.int32"):
        SoftmaxFwdOp(out_dtype=torch.int32)
    with pytest.raises(OpArgumentError, match=r"SoftmaxFwdOp: param 'row_dim' expected an int, got 'last'"):
        SoftmaxFwdOp("last")
    with pytest.raises(OpArgumentError, match=r"SoftmaxBwdOp: argument 'y' must have the shape of 'dy'"):
        SoftmaxBwdOp()(torch.randn(4, 8), torch.randn(4, 9))
    with pytest.raises(OpArgumentError, match=r"LogSoftmaxBwdOp: argument 'y' must have the dtype of 'dy'"):
        LogSoftmaxBwdOp()(torch.randn(4, 8), torch.randn(4, 8, dtype=torch.float16))
    with pytest.raises(OpArgumentError, match=r"SoftmaxFwdOp: argument 'x' expected shape"):
        SoftmaxFwdOp()(torch.tensor(1.0))
    with pytest.raises(OpArgumentError, match=r"SoftmaxFwdOp: output buffer 'out' expected shape \(4, 8\) and dtype torch.float32"):
        SoftmaxFwdOp(out_dtype=torch.float32)(torch.randn(4, 8, dtype=torch.bfloat16), out=torch.empty(4, 8, dtype=torch.bfloat16))


# -- the bench peers ------------------------------------------------------------------------------

class _Recorder:
    """Stands for Liger's autograd function: records how it is called, computes with torch."""

    def __init__(self):
        self.calls = []

    def apply(self, *args):
        self.calls.append(args)
        return torch.softmax(args[0], -1)


def test_the_quack_peer_takes_rows_of_the_last_dimension_and_gives_the_input_shape_back():
    from tileops.ops.softmax import command_line

    where, adapter = command_line.PEERS["SoftmaxFwdOp"]["quack"]
    assert where == "quack:softmax"
    assert command_line.PEERS["LogSoftmaxFwdOp"]["quack"] == (None, "has no log-softmax")
    calls = []

    def softmax(rows):  # quack's softmax takes (rows, n) only
        calls.append(rows.shape)
        assert rows.dim() == 2
        return torch.softmax(rows, -1)

    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(adapter(softmax, {"x": x}, {"row_dim": -1, "out_dtype": None})(), torch.softmax(x, -1))
    assert calls == [(6, 8)]
    assert adapter(softmax, {"x": x}, {"row_dim": 1, "out_dtype": None}) == "normalises over the last dimension only"


def test_the_peer_table_names_family_ops_and_calls_liger_as_it_is_called():
    import importlib

    from tileops.ops.softmax import OPS, command_line

    assert set(command_line.PEERS) <= {op_class.__name__ for op_class in OPS}
    where, adapter = command_line.PEERS["SoftmaxFwdOp"]["Liger"]
    module, colon, attribute = where.partition(":")
    assert colon and module == "liger_kernel.ops.softmax" and attribute == "LigerSoftmaxFunction"
    assert command_line.PEERS["LogSoftmaxFwdOp"]["Liger"] == (None, "has no log-softmax")
    x = torch.randn(4, 8)
    recorder = _Recorder()
    torch.testing.assert_close(adapter(recorder, {"x": x}, {"row_dim": -1, "out_dtype": None})(), torch.softmax(x, -1))
    assert recorder.calls == [(x,)]
    assert adapter(recorder, {"x": x}, {"row_dim": 0, "out_dtype": None}) == "normalises over the last dimension only"
    assert adapter(recorder, {"x": x}, {"row_dim": 1, "out_dtype": torch.float64}) == "returns the input's dtype only"
    try:
        liger = importlib.import_module(module)
    except ImportError:
        return  # the bench extra is not installed: the name is checked where it is
    assert hasattr(liger, attribute)
