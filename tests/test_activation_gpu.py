"""GPU tier: the activation family's TileLang kernels on CUDA, against the float64 reference.

They need a CUDA GPU (``pytest -m gpu``); elsewhere they skip.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tileops.ops import (
    FAMILIES,
    GeGLUFwdOp,
    GELUFwdOp,
    PackedGeGLUBwdOp,
    PackedGeGLUFwdOp,
    PackedGeGLUInplaceBwdOp,
    PackedSwiGLUBwdOp,
    PackedSwiGLUFwdOp,
    PackedSwiGLUInplaceBwdOp,
    SiLUFwdOp,
    SwiGLUFwdOp,
)
from helpers import workload_params
from tileops.testing import check_workload, workload_cases

pytestmark = pytest.mark.gpu

CASES = list(workload_cases(FAMILIES["activation"]))
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _tolerance(op_class, dtype):
    return op_class.manifest_entry().tolerance[dtype]


@pytest.mark.parametrize("case", workload_params(CASES))
def test_every_workload_matches_the_reference_on_cuda(case):
    op = case.op_class(**case.workload.params)
    check_workload(op, case.workload, case.dtype, "cuda")
    assert op.target == "builtin"
    assert [key for key, _ in op.built_kernels()] == ["tilelang"]


def _act(name):
    return {
        "silu": F.silu,
        "gelu": F.gelu,
        "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    }[name]


#: (op, activation) per forward form: elementwise, gated, packed.
UNARY = [(SiLUFwdOp(), "silu"), (GELUFwdOp(), "gelu"), (GELUFwdOp("tanh"), "gelu_tanh")]
GATED = [(SwiGLUFwdOp(), "silu"), (GeGLUFwdOp(), "gelu"), (GeGLUFwdOp("tanh"), "gelu_tanh")]
PACKED = [(PackedSwiGLUFwdOp, {}, "silu"), (PackedGeGLUFwdOp, {}, "gelu"), (PackedGeGLUFwdOp, {"approximate": "tanh"}, "gelu_tanh")]


def _float64_gradients(function, inputs, dy):
    wide = [t.detach().double().requires_grad_() for t in inputs]
    y = function(*wide)
    return y, torch.autograd.grad(y, wide, dy.double())


def _check(op, function, inputs, dtype):
    """Forward and gradients of ``op`` on ``inputs`` against float64 autograd of ``function``."""
    inputs = [t.detach().requires_grad_() for t in inputs]
    y = op(*inputs)
    dy = torch.randn_like(y)
    y.backward(dy)
    expected, gradients = _float64_gradients(function, inputs, dy)
    atol, rtol = _tolerance(type(op), dtype)
    torch.testing.assert_close(y, expected.to(dtype), atol=atol, rtol=rtol)
    atol, rtol = _tolerance(type(op).backward_class(), dtype)
    for tensor, expected_gradient in zip(inputs, gradients):
        torch.testing.assert_close(tensor.grad, expected_gradient.to(dtype), atol=atol, rtol=rtol)


# Lengths around the 16-byte access and the launch rule's small/main boundary, odd and prime ones.
LENGTHS = [1, 2, 7, 8, 9, 1001, 4096, 11008, 14335, 270337, 540672, 540680, 1 << 22]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", LENGTHS)
def test_every_length_forward_and_backward(n, dtype):
    x = torch.randn(n, device="cuda", dtype=dtype) * 3
    up = torch.randn(n, device="cuda", dtype=dtype)
    for op, name in UNARY:
        _check(op, _act(name), [x], dtype)
    for op, name in GATED:
        _check(op, lambda g, u, name=name: _act(name)(g) * u, [x, up], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [1, 3, 8, 1000, 1001, 11008, 14336])
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_the_packed_form_every_width_forward_and_backward(d, rows, dtype):
    x = torch.randn(rows, 2 * d, device="cuda", dtype=dtype) * 3
    for op_class, params, name in PACKED:
        function = lambda t, name=name: _act(name)(t[..., :d]) * t[..., d:]  # noqa: E731
        _check(op_class(d, **params), function, [x], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [3, 1001, 14336])
def test_the_packed_gradient_written_over_x_is_the_packed_backwards_to_the_bit(d, dtype):
    # d of 3 and 1001: the scalar programs; 14336: 16-byte accesses.
    x = torch.randn(5, 2 * d, device="cuda", dtype=dtype) * 3
    dy = torch.randn(5, d, device="cuda", dtype=dtype)
    for out_of_place, in_place in [(PackedSwiGLUBwdOp(d), PackedSwiGLUInplaceBwdOp(d)),
                                   (PackedGeGLUBwdOp(d, "tanh"), PackedGeGLUInplaceBwdOp(d, "tanh"))]:
        expected = out_of_place(dy, x)
        written = x.clone()
        assert in_place(dy, written) is written
        assert torch.equal(written, expected)
        assert [key for key, _ in in_place.built_kernels()] == ["tilelang"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("leading", "d", "extra"), [
    ((5,), 11008, 0),  # the halves of a fused gate-up projection: 16-byte accesses
    ((2, 3), 4096, 8),  # 3-D, rows a whole access further apart
    ((7,), 1001, 0),  # an odd width: the scalar row-view programs
    ((4,), 4096, 3),  # a pitch that is not a whole access: scalar too
    ((300,), 8, 0),  # rows of one access
])
def test_row_views_are_read_where_they_lie_forward_and_backward(leading, d, extra, dtype):
    wide = torch.randn(*leading, 2 * d + extra, device="cuda", dtype=dtype) * 3
    gate, up = wide[..., :d], wide[..., d + extra : 2 * d + extra]
    assert not gate.is_contiguous() and gate.stride(-2) == 2 * d + extra
    for op, name in UNARY:
        _check(op, _act(name), [gate], dtype)
        assert any(kernel.params.row_strides == (2 * d + extra,) for _, kernel in op.built_kernels())
    for op, name in GATED:
        _check(op, lambda g, u, name=name: _act(name)(g) * u, [gate, up], dtype)
        pitches = {kernel.params.row_strides for _, kernel in op.built_kernels()}
        assert (2 * d + extra,) * 2 in pitches
    # The backward op on its own, on the forward's row views, against its contiguous copies (a
    # pitch that is not a whole access takes the scalar build there, the copies the vector one:
    # float32 results may differ in the last bit where the compiler contracts otherwise).
    dy = torch.randn(*leading, d, device="cuda", dtype=dtype)
    for op, _ in GATED:
        backward = type(op).backward_class()(**{k: v for k, v in op.params.items() if k != "consume_inputs"})
        atol, rtol = _tolerance(type(backward), dtype)
        for got, expected in zip(backward(dy, gate, up), backward(dy, gate.contiguous(), up.contiguous())):
            torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)
        assert any(kernel.params.row_strides == (d, 2 * d + extra, 2 * d + extra) for _, kernel in backward.built_kernels())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_misaligned_non_contiguous_and_3d_inputs(dtype):
    base = torch.randn(4, 3, 2 * 4096 + 8, device="cuda", dtype=dtype)
    misaligned = base.view(-1)[1 : 1 + 4 * 3 * 4096].view(4, 3, 4096)  # data pointer off by one element
    strided = base[..., :4096]  # rows of a wider tensor: read at their pitch (a row view)
    up = torch.randn(4, 3, 4096, device="cuda", dtype=dtype)
    for tensor in (misaligned, strided):
        for op, name in UNARY:
            _check(op, _act(name), [tensor], dtype)
        for op, name in GATED:
            _check(op, lambda g, u, name=name: _act(name)(g) * u, [tensor, up], dtype)
    packed = base[..., : 2 * 4096]  # [gate | up] sliced from a wider fused projection
    for op_class, params, name in PACKED:
        function = lambda t, name=name: _act(name)(t[..., :4096]) * t[..., 4096:]  # noqa: E731
        _check(op_class(4096, **params), function, [packed], dtype)


def test_the_two_forms_agree_exactly_on_cuda():
    x = torch.randn(64, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    gate, up = (half.contiguous() for half in x.chunk(2, -1))
    assert torch.equal(PackedSwiGLUFwdOp(14336)(x), SwiGLUFwdOp()(gate, up))
    assert torch.equal(PackedGeGLUFwdOp(14336, "tanh")(x), GeGLUFwdOp("tanh")(gate, up))


def test_extreme_values_stay_finite_where_torchs_do():
    x = torch.tensor([-1e4, -100.0, -20.0, 0.0, 20.0, 100.0, 1e4, 6e4] * 2, device="cuda", dtype=torch.float16)
    for op, name in UNARY:
        torch.testing.assert_close(op(x), _act(name)(x.double()).half(), atol=2e-3, rtol=2e-3)


def test_float64_on_cuda_is_served_by_plain_torch():
    x = torch.randn(8, 64, device="cuda", dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(SiLUFwdOp(), (x,))
    op = PackedSwiGLUFwdOp(32)
    op(x.detach())
    assert [key for key, _ in op.built_kernels()] == ["torch_float64"]


def test_calls_capture_in_a_cuda_graph_after_one_warm_up():
    x = torch.randn(16, 2 * 11008, device="cuda", dtype=torch.bfloat16)
    op = PackedSwiGLUFwdOp(11008)
    op(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = op(x)
    x.normal_()
    graph.replay()
    torch.testing.assert_close(y, (F.silu(x[:, :11008].float()) * x[:, 11008:].float()).bfloat16(), atol=1.6e-2, rtol=1.6e-2)


def test_a_tensor_of_more_than_2_31_elements_is_computed_to_its_end():
    n = (1 << 31) + 1024 + 8  # 64-bit lengths and indices: the last accesses lie past 2**31
    x = torch.empty(n, device="cuda", dtype=torch.bfloat16).uniform_(-4, 4)
    y = SiLUFwdOp()(x)
    for part in (slice(0, 4096), slice((1 << 31) - 4096, (1 << 31) + 4096), slice(n - 4096, n)):
        torch.testing.assert_close(y[part], F.silu(x[part].float()).bfloat16(), atol=1.6e-2, rtol=1.6e-2)
    del y
    torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_every_tuning_candidate_computes_as_the_reference(dtype):
    # request_tune may choose any of them; 5000 elements leave a partial block.
    from tileops.kernels.cuda.activation import KERNELS, policy
    from tileops.ops.activation import ActivationFwdInterface, GatedFwdInterface

    device = torch.device("cuda", torch.cuda.current_device())
    gate, up = torch.randn(5000, device="cuda", dtype=dtype), torch.randn(5000, device="cuda", dtype=dtype)
    silu = KERNELS[ActivationFwdInterface]["tilelang"](SiLUFwdOp().call_spec(ActivationFwdInterface, device, dtype, True))
    swiglu = KERNELS[GatedFwdInterface]["tilelang"](SwiGLUFwdOp().call_spec(GatedFwdInterface, device, dtype, True))
    atol, rtol = _tolerance(SiLUFwdOp, dtype)
    for kernel, inputs, expected in [
        (silu, (gate,), F.silu(gate.double())),
        (swiglu, (gate, up), F.silu(gate.double()) * up.double()),
    ]:
        for config in policy.tuning_candidates(dtype, True):
            y = torch.empty_like(gate)
            kernel._launch_function(config, 1)(*inputs, y)
            torch.testing.assert_close(y.double(), expected, atol=atol, rtol=rtol, msg=lambda m, config=config: f"{config}: {m}")
