"""GPU tier: the softmax family's TileLang kernels on CUDA, against the float64 reference.

They need a CUDA GPU (``pytest -m gpu``); elsewhere they skip.
"""

from __future__ import annotations

import pytest
import torch

from tileops.ops import FAMILIES, LogSoftmaxFwdOp, SoftmaxBwdOp, SoftmaxFwdOp
from helpers import workload_params
from tileops.testing import check_workload, workload_cases

pytestmark = pytest.mark.gpu

CASES = list(workload_cases(FAMILIES["softmax"]))
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FORWARDS = [(SoftmaxFwdOp, torch.softmax), (LogSoftmaxFwdOp, torch.log_softmax)]
FORWARD_IDS = ["softmax", "log_softmax"]


@pytest.mark.parametrize("case", workload_params(CASES))
def test_every_workload_matches_the_reference_on_cuda(case):
    op = case.op_class(**case.workload.params)
    check_workload(op, case.workload, case.dtype, "cuda")
    assert op.target == "builtin"
    assert {key for key, _ in op.built_kernels()} <= set(
        ["softmax", "softmax_streamed", "softmax_bwd", "softmax_bwd_streamed"]
    )


def _tolerance(op_class, dtype):
    return op_class.manifest_entry().tolerance[dtype]


def _check(op_class, function, x, out_dtype=None, row_dim=-1):
    """Forward and gradient of the op on x against float64 autograd of torch's function."""
    x = x.detach().requires_grad_()
    op = op_class(row_dim, out_dtype)
    y = op(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    expected = function(x.detach().to(out_dtype or x.dtype).double(), row_dim)
    # The backward op takes y as the forward returned it, rounded to its dtype, as torch's own
    # backward does; the reference is the float64 gradient formula on that y. (From the float64 y
    # instead, a 16-bit y's rounding, times a row's sum of dy, made a few of millions of entries
    # miss the tolerance at random.)
    rounded, incoming = y.detach().double(), dy.double()
    if function is torch.log_softmax:
        gradient = incoming - rounded.exp() * incoming.sum(row_dim, keepdim=True)
    else:
        gradient = rounded * (incoming - (incoming * rounded).sum(row_dim, keepdim=True))
    out = out_dtype or x.dtype
    atol, rtol = _tolerance(op_class, out)
    torch.testing.assert_close(y, expected.to(out), atol=atol, rtol=rtol, equal_nan=True)
    # dx is computed in y's dtype and rounded to x's by autograd: the coarser tolerance of the two.
    backward = op_class.backward_class()
    coarse = max((x.dtype, out), key=lambda dtype: _tolerance(backward, dtype)[1])
    atol, rtol = _tolerance(backward, coarse)
    torch.testing.assert_close(x.grad.double(), gradient, atol=atol, rtol=rtol, equal_nan=True)
    return op


# Row lengths around every boundary: 1, odd, the 16-byte access, the register variant's 32768,
# vocabularies (50257: rows that are not whole accesses, streamed), and up to 262144; row counts
# around the split build's (fewer rows than SMs).
LENGTHS = [1, 2, 7, 8, 1000, 1001, 4096, 32000, 32768, 32769, 50257, 65536, 128256, 151936, 262144]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("rows", [1, 5, 131, 300])
def test_every_length_and_row_count_forward_and_backward(n, rows, dtype):
    if rows * n > 1 << 26:
        pytest.skip("covered by the workloads")
    x = torch.randn(rows, n, device="cuda", dtype=dtype) * 3
    for op_class, function in FORWARDS:
        _check(op_class, function, x)


@pytest.mark.parametrize("n", [30001, 50257])
def test_rows_that_are_not_whole_accesses_take_16_byte_accesses_over_their_middle(n):
    x = torch.randn(300, n, device="cuda", dtype=torch.bfloat16) * 3
    op = _check(SoftmaxFwdOp, torch.softmax, x)
    for built in (op, op.backward_op):
        ((_, kernel),) = built.built_kernels()
        assert kernel.config["shifted"] is True and kernel.config["vec"] == 8


@pytest.mark.parametrize(("op_class", "function"), FORWARDS, ids=FORWARD_IDS)
@pytest.mark.parametrize("n", [1001, 32000, 151936])
def test_an_output_dtype_wider_and_narrower(op_class, function, n):
    x = torch.randn(9, n, device="cuda", dtype=torch.bfloat16) * 4
    op = _check(op_class, function, x, out_dtype=torch.float32)
    assert op(x.detach()).dtype == torch.float32
    _check(op_class, function, x.float(), out_dtype=torch.bfloat16)
    _check(op_class, function, x.half(), out_dtype=torch.bfloat16)


@pytest.mark.parametrize(("op_class", "function"), FORWARDS, ids=FORWARD_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_other_dims_misaligned_and_strided_rows(op_class, function, dtype):
    base = torch.randn(6, 4, 4096 + 8, device="cuda", dtype=dtype) * 2
    misaligned = base.view(-1)[1 : 1 + 6 * 4 * 4096].view(6, 4, 4096)  # a data pointer off by one element
    strided = base[..., :4096]  # rows of a wider tensor: copied to contiguous by the call path
    for x in (misaligned, strided):
        _check(op_class, function, x)
    _check(op_class, function, base, row_dim=0)
    _check(op_class, function, base[:, :, :1000], row_dim=1)


@pytest.mark.parametrize(("op_class", "function"), FORWARDS, ids=FORWARD_IDS)
@pytest.mark.parametrize("n", [100, 30001, 32000, 50257, 262144])
@pytest.mark.parametrize("rows", [2, 200])
def test_masked_entries_and_fully_masked_rows_as_torch(op_class, function, n, rows):
    x = torch.randn(rows, n, device="cuda")
    x[0, : n // 2] = float("-inf")  # a masked prefix: the online max starts at -inf
    x[1] = float("-inf")  # fully masked: NaN, as torch
    x[-1, 1::3] = float("-inf")
    y = op_class()(x.bfloat16())
    torch.testing.assert_close(y, function(x.bfloat16().double(), -1).bfloat16(), atol=1.6e-2, rtol=1.6e-2, equal_nan=True)
    assert y[1].isnan().all() and not y[0].isnan().any()


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("n", [4096, 32000, 30001])
def test_every_register_tuning_candidate_computes_the_rows_as_torch(n, log):
    # request_tune may choose any candidate, half-width ones without kept exponentials included.
    from tileops.kernels.cuda.device import compile_target
    from tileops.kernels.cuda.softmax import policy, programs

    x = torch.randn(300, n, device="cuda", dtype=torch.bfloat16) * 4
    expected = (torch.log_softmax if log else torch.softmax)(x.double(), -1)
    target = compile_target(x.device)
    aligned = n % 8 == 0  # else the rows are not whole accesses: the shifted programs
    for config in policy.tuning_candidates("register", n, torch.bfloat16, aligned, pointers_aligned=True):
        y = torch.empty_like(x)
        programs.compile_program("forward", n, torch.bfloat16, torch.bfloat16, log, target, **config)(x, y)
        torch.testing.assert_close(y.double(), expected, atol=1e-3 if not log else 3e-2, rtol=1.6e-2, msg=lambda m, config=config: f"{config}: {m}")


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("n", [150000, 150001])
def test_every_streamed_tuning_candidate_computes_the_rows_as_torch_forward_and_backward(n, log):
    # Pass 2 read from the row's end included: request_tune may choose either direction.
    from tileops.kernels.cuda.device import compile_target
    from tileops.kernels.cuda.softmax import policy, programs

    x = torch.randn(200, n, device="cuda", dtype=torch.bfloat16) * 4
    dy = torch.randn_like(x)
    y64 = (torch.log_softmax if log else torch.softmax)(x.double(), -1)
    y = y64.bfloat16()
    dx64 = dy.double() - y.double().exp() * dy.double().sum(-1, keepdim=True) if log else y.double() * (
        dy.double() - (dy.double() * y.double()).sum(-1, keepdim=True)
    )
    target = compile_target(x.device)
    aligned = n % 8 == 0
    for kind in programs.KINDS:
        candidates = policy.tuning_candidates(
            "streamed", n, torch.bfloat16, aligned, pointers_aligned=True, softmax_forward=kind == "forward" and not log
        )
        assert any(c.get("from_end") for c in candidates)
        for config in candidates:
            out = torch.empty_like(x)
            kernel = programs.compile_program(kind, n, torch.bfloat16, torch.bfloat16, log, target, **config)
            if kind == "forward":
                kernel(x, out)
                expected, atol = y64, (3e-2 if log else 1e-3)
            else:
                kernel(dy, y, out)
                expected, atol = dx64, (3e-2 if log else 1e-3)
            torch.testing.assert_close(out.double(), expected, atol=atol, rtol=1.6e-2, msg=lambda m, c=config, k=kind: f"{k} {c}: {m}")


def test_compiled_training_matches_eager():
    x = torch.randn(64, 32000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    op = SoftmaxFwdOp(out_dtype=torch.float32)

    def step(t):
        return (op(t) * torch.arange(32000, device="cuda")).sum()

    step(x).backward()
    eager = x.grad.clone()
    x.grad = None
    torch.compile(step, fullgraph=True)(x).backward()
    torch.testing.assert_close(x.grad, eager)


def test_float64_on_cuda_is_served_by_plain_torch():
    x = torch.randn(4, 33, device="cuda", dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(SoftmaxFwdOp(), (x,))
    op = SoftmaxBwdOp()
    op(x.detach(), x.detach())
    assert [key for key, _ in op.built_kernels()] == ["torch_float64"]


def test_calls_capture_in_a_cuda_graph_after_one_warm_up():
    for n in (4096, 262144):  # the register kernel, and the split build (its workspace inside the graph)
        x = torch.randn(4, n, device="cuda", dtype=torch.bfloat16)
        op = SoftmaxFwdOp()
        op(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = op(x)
        x.normal_()
        graph.replay()
        torch.testing.assert_close(y, torch.softmax(x.double(), -1).bfloat16(), atol=1e-3, rtol=1.6e-2)


@pytest.mark.large_memory
def test_a_tensor_of_more_than_2_31_elements_is_computed_to_its_end():
    x = torch.randn(16400, 131072, device="cuda", dtype=torch.bfloat16)  # 2.15e9 elements: 64-bit rows
    y = LogSoftmaxFwdOp()(x)
    for rows in (slice(0, 2), slice(16382, 16400)):
        torch.testing.assert_close(y[rows], torch.log_softmax(x[rows].double(), -1).bfloat16(), atol=1.6e-2, rtol=1.6e-2)
    del x, y
    torch.cuda.empty_cache()


@pytest.mark.parametrize("n", [40000, 262144])
def test_every_split_build_tuning_candidate_computes_as_torch_forward_and_backward(n):
    # request_tune on a call of few long rows may choose any of them (other chunk and thread counts).
    from tileops.kernels.cuda.softmax import KERNELS, policy
    from tileops.ops.softmax import SoftmaxBwdInterface, SoftmaxCall, SoftmaxFwdInterface

    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(3, n, device="cuda", dtype=torch.bfloat16) * 4
    dy = torch.randn_like(x)
    expected = torch.softmax(x.double(), -1)
    expected_log = torch.log_softmax(x.double(), -1)
    y = expected.bfloat16()
    expected_dx = y.double() * (dy.double() - (dy.double() * y.double()).sum(-1, keepdim=True))
    sides = [
        (SoftmaxFwdInterface, "softmax_streamed", False, (x,), expected, 1e-3),
        (SoftmaxFwdInterface, "softmax_streamed", True, (x,), expected_log, 3e-2),
        (SoftmaxBwdInterface, "softmax_bwd_streamed", False, (dy, y), expected_dx, 1e-3),
    ]
    for interface, key, log, inputs, reference, atol in sides:
        kernel = KERNELS[interface][key](SoftmaxCall(device, n, torch.bfloat16, torch.bfloat16, log, True))
        split = kernel.build_plan(kernel.default_config()).builds["split"]
        for config in policy.split_candidates(n, torch.bfloat16, split):
            out = torch.empty_like(x)
            kernel._launch_function(config, 2)(*inputs, out)
            torch.testing.assert_close(out.double(), reference, atol=atol, rtol=1.6e-2, msg=lambda m, config=config, key=key: f"{key} {config}: {m}")
