"""GPU tier: training through the norm ops on CUDA.

Forward and backward run on the TileLang kernels (the forward saves its statistics, the
backward reads them); gradients are compared with float64 torch autograd, a pre-norm block
trains as the same block with torch ops (eager and compiled), and a training step captures in a
CUDA graph. They need a CUDA GPU (``pytest -m gpu``); elsewhere they skip.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import train_side_by_side
from tileops.ops import FusedAddLayerNormFwdOp, FusedAddRMSNormFwdOp, LayerNormFwdOp, RMSNormFwdOp

pytestmark = pytest.mark.gpu

FORWARD_OPS = [RMSNormFwdOp, LayerNormFwdOp, FusedAddRMSNormFwdOp, FusedAddLayerNormFwdOp]
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3.2e-2}


def _reference(op_class, n):
    """The torch computation of ``op_class`` in float64 (eps as the op's default)."""
    rms = "RMS" in op_class.__name__

    def norm(x, weight, bias=None):
        if rms:
            return F.rms_norm(x, (n,), weight, None)
        return F.layer_norm(x, (n,), weight, bias, 1e-5)

    if not op_class.__name__.startswith("FusedAdd"):
        return norm

    def fused(x, residual, weight, bias=None):
        total = x + residual
        return norm(total, weight, bias), total

    return fused


def _inputs(op_class, shape, dtype):
    n = shape[-1]
    tensors = [torch.randn(shape, device="cuda", dtype=dtype)]
    if op_class.__name__.startswith("FusedAdd"):
        tensors.append(torch.randn(shape, device="cuda", dtype=dtype))
    tensors.append(1 + 0.1 * torch.randn(n, device="cuda", dtype=dtype))
    if "LayerNorm" in op_class.__name__:
        tensors.append(0.1 * torch.randn(n, device="cuda", dtype=dtype))
    return [t.requires_grad_() for t in tensors]


def _backward_matches_float64_autograd(op, inputs):
    """One backward through ``op`` against float64 torch autograd on the CPU: each input's
    gradient within its dtype's tolerance, and None where the reference's is (frozen)."""
    n = inputs[0].shape[-1]
    reference = [t.detach().cpu().double().requires_grad_(t.requires_grad) for t in inputs]
    outputs = op(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    grads = [torch.randn_like(o) for o in outputs]
    torch.autograd.backward(outputs, grads)
    expected = _reference(type(op), n)(*reference)
    expected = expected if isinstance(expected, tuple) else (expected,)
    torch.autograd.backward(expected, [g.cpu().double() for g in grads])
    tolerance = TOLERANCE[inputs[0].dtype]
    rows = inputs[0].numel() // n
    for got, want in zip(inputs, reference):
        assert (got.grad is None) == (want.grad is None)
        if want.grad is not None:
            # A parameter gradient sums over the rows: its absolute tolerance grows with their root.
            scale = rows**0.5 if got.dim() == 1 else 1.0
            torch.testing.assert_close(got.grad.cpu().double(), want.grad, atol=tolerance * scale, rtol=tolerance)


@pytest.mark.parametrize("op_class", FORWARD_OPS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(1, 4096), (3, 1000), (129, 5120), (2, 33, 2048), (4, 65536)], ids=str)
def test_gradients_on_the_tilelang_kernels_match_float64_autograd(op_class, dtype, shape):
    op = op_class(shape[-1])
    _backward_matches_float64_autograd(op, _inputs(op_class, shape, dtype))
    # The forward ran a TileLang kernel (which saved the statistics) and so did the backward.
    assert all(key not in {"torch_cpu", "torch_float64"} for key, _ in op.built_kernels())
    assert [key for key, _ in op.backward_op.built_kernels()] and all(
        key.endswith(("_bwd", "_bwd_streamed", "_bwd_scalar")) for key, _ in op.backward_op.built_kernels()
    )


@pytest.mark.parametrize("op_class", FORWARD_OPS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("shape", [(1, 4096), (3, 1000), (129, 5120), (4, 65536)], ids=str)
def test_frozen_parameters_train_the_rest_on_the_row_kernel_alone(op_class, shape):
    # LoRA freezes the norms' parameters: the backward kernel reads the weight for dx and sums
    # nothing.
    op = op_class(shape[-1])
    inputs = _inputs(op_class, shape, torch.bfloat16)
    for parameter in inputs[-2 if "LayerNorm" in op_class.__name__ else -1:]:
        parameter.requires_grad_(False)
    _backward_matches_float64_autograd(op, inputs)
    skipping = op.backward_op_for([t.requires_grad for t in inputs], [True] * len(inputs))
    assert not op.backward_op.built_kernels() and all(
        key.endswith(("_bwd", "_bwd_streamed", "_bwd_scalar")) for key, _ in skipping.built_kernels()
    )


def test_float64_is_differentiable_on_cuda_for_gradcheck():
    x = torch.randn(3, 24, device="cuda", dtype=torch.float64, requires_grad=True)
    w = torch.randn(24, device="cuda", dtype=torch.float64, requires_grad=True)
    b = torch.randn(24, device="cuda", dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(LayerNormFwdOp(24), (x, w, b))
    assert torch.autograd.gradcheck(RMSNormFwdOp(24), (x, w))


class _PreNormBlock(torch.nn.Module):
    def __init__(self, n: int, tileops: bool) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList([torch.nn.Parameter(1 + 0.1 * torch.randn(n)) for _ in range(2)])
        self.linears = torch.nn.ModuleList([torch.nn.Linear(n, n) for _ in range(2)])
        self.tileops = tileops
        if tileops:
            self.first = RMSNormFwdOp(n)
            self.fused = FusedAddRMSNormFwdOp(n)

    def forward(self, x):
        w1, w2 = self.weights
        if self.tileops:
            h = self.linears[0](self.first(x, w1))
            y, residual = self.fused(h, x, w2)
        else:
            h = self.linears[0](F.rms_norm(x, (x.shape[-1],), w1))
            residual = h + x
            y = F.rms_norm(residual, (x.shape[-1],), w2)
        return self.linears[1](y) + residual


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_pre_norm_block_trains_on_cuda_as_the_same_block_with_torch_ops(compiled):
    torch.manual_seed(0)
    ours, theirs = _PreNormBlock(1024, True).cuda(), _PreNormBlock(1024, False).cuda()
    theirs.load_state_dict(ours.state_dict())
    data, target = torch.randn(8, 64, 1024, device="cuda"), torch.randn(8, 64, 1024, device="cuda")
    losses = train_side_by_side([ours, theirs], data, target, compiled=compiled)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-3, atol=1e-4)
    assert losses[0][-1] < losses[0][0]


def test_a_forward_and_backward_step_captures_in_a_cuda_graph():
    op = FusedAddRMSNormFwdOp(4096)
    x, residual = (torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    weight = torch.ones(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)

    def step():
        y, total = op(x, residual, weight)
        return torch.autograd.grad((y, total), (x, weight), (dy, dy))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        eager = step()  # builds every kernel before the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, eager):
        torch.testing.assert_close(a, b)
