"""GPU tier: the variable-length attention ops' TileLang kernels on CUDA (Hopper), forward and
backward, against a float64 reference computed one sequence at a time, over every manifest
workload and the edge cases (empty sequences, sequences shorter than a tile, one token, causal
with more queries than keys, windows, MQA, head sizes 64/128/256), autograd eagerly and under
``torch.compile(fullgraph=True)`` against SDPA per sequence, the plain-torch fallback on CUDA,
and a training step captured in a CUDA graph and replayed with other lengths of the same totals.

They need a CUDA GPU (``pytest -m gpu``); elsewhere they skip. Outputs are compared elementwise
within the manifest's tolerance and by their RMS error relative to the reference's
(``test_attention_gpu._close``).
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from helpers import compile_attention_programs, few_tests_selected, off_the_grid, workload_params
from test_attention_gpu import RELATIVE, _close
from tileops.ops.attention import (
    VarlenAttentionBwdInterface,
    VarlenAttentionBwdOp,
    VarlenAttentionFwdInterface,
    VarlenAttentionFwdOp,
)
from tileops.testing import workload_cases, workload_inputs

pytestmark = pytest.mark.gpu

FORWARD_CASES = list(workload_cases([VarlenAttentionFwdOp]))
BACKWARD_CASES = list(workload_cases([VarlenAttentionBwdOp]))

EDGES = [  # (query lengths, key lengths, H, HK, D, params)
    ([0, 5, 0, 1, 127, 129, 0, 300], [0, 5, 3, 1, 127, 129, 8, 300], 8, 2, 128, {"causal": True}),
    ([1], [1], 4, 4, 64, {}),  # one token
    ([1, 1, 1, 1], [700, 3, 1, 64], 8, 1, 128, {"causal": True}),  # one query per sequence, MQA
    ([300, 200, 64], [100, 64, 1], 4, 2, 128, {"causal": True}),  # more queries than keys: early rows see nothing
    ([130, 257, 3], [333, 400, 65], 4, 4, 64, {"causal": True}),  # fewer queries than keys
    ([520, 7, 260], [520, 7, 260], 4, 2, 64, {"causal": True, "window": 100}),
    ([300, 45], [280, 60], 4, 4, 128, {"window": 33, "scale": 0.07}),
    ([63, 64, 65, 127, 128, 129], [63, 64, 65, 127, 128, 129], 2, 2, 256, {"causal": True}),
    ([2000, 17, 1000], [2000, 17, 1000], 16, 4, 128, {}),
]


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _served_by_tilelang(dtype, head_dim):
    return _hopper() and dtype in (torch.float16, torch.bfloat16) and head_dim in (64, 128, 256)


def _calls():
    """(params, dtype, D, H, HK) of every call the tests below make."""
    for case in FORWARD_CASES + BACKWARD_CASES:
        q, k = case.workload.shapes["q"], case.workload.shapes["k"]
        yield case.workload.params, case.dtype, q[2], q[1], k[1]
    for dtype in (torch.bfloat16, torch.float16):
        for _, _, heads_q, heads_kv, d, params in EDGES:
            yield params, dtype, d, heads_q, heads_kv
        yield {"causal": True}, dtype, 128, 16, 4  # the autograd tests and the CUDA graph


@pytest.fixture(scope="module", autouse=True)
def _built_in_parallel(request):
    """Compile the programs of every call the tests make in several processes at once; TileLang's
    disk cache then hands them to the kernels the tests build, so that the tests only launch."""
    if not _hopper() or few_tests_selected(request):
        yield
        return
    device = torch.device("cuda", torch.cuda.current_device())
    calls = set()
    for params, dtype, head_dim, h_q, h_kv in _calls():
        if _served_by_tilelang(dtype, head_dim):
            call = VarlenAttentionFwdOp(**params).call_spec(VarlenAttentionFwdInterface, device, dtype, head_dim, h_q, h_kv)
            assert VarlenAttentionBwdOp(**params).call_spec(VarlenAttentionBwdInterface, device, dtype, head_dim, h_q, h_kv) == call
            calls.add(call)
    compile_attention_programs(calls, "varlen_programs")
    yield


# -- the float64 reference, one sequence at a time --------------------------------------------------


def reference(q, k, v, cu_q, cu_k, *, causal=False, window=None, scale=None, do=None, dlse=None):
    """(o, lse) in float64, and with ``do`` (and ``dlse``) also (dq, dk, dv), by autograd through
    each sequence's explicit scores."""
    scale = scale if scale is not None else q.shape[2] ** -0.5
    group = q.shape[1] // k.shape[1]
    tensors = [t.detach().double().requires_grad_(do is not None) for t in (q, k, v)]
    qd, kd, vd = tensors
    o = torch.zeros_like(qd)
    lse = torch.full((q.shape[1], q.shape[0]), -torch.inf, dtype=torch.float64, device=q.device)
    outputs, sums = [], []
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(bounds_q) - 1):
        (q0, q1), (k0, k1) = bounds_q[b : b + 2], bounds_k[b : b + 2]
        s_q, s_k = q1 - q0, k1 - k0
        if s_q == 0 or s_k == 0:
            continue
        i = torch.arange(s_q, device=q.device)[:, None] + s_k - s_q
        j = torch.arange(s_k, device=q.device)[None, :]
        keep = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device)
        if causal:
            keep &= j <= i
        if window is not None:
            keep &= j >= i - window
        scores = qd[q0:q1].transpose(0, 1) @ kd[k0:k1].transpose(0, 1).repeat_interleave(group, 0).transpose(-1, -2) * scale
        scores = scores.masked_fill(~keep, -torch.inf)
        row_lse = torch.logsumexp(scores, -1)
        weights = torch.where(keep, torch.exp(scores - torch.where(row_lse.isfinite(), row_lse, 0)[..., None]), 0)
        outputs.append((q0, q1, (weights @ vd[k0:k1].transpose(0, 1).repeat_interleave(group, 0)).transpose(0, 1)))
        sums.append((q0, q1, row_lse))
    for q0, q1, value in outputs:
        o = o.index_copy(0, torch.arange(q0, q1, device=q.device), value)
    for q0, q1, value in sums:
        lse = lse.index_copy(1, torch.arange(q0, q1, device=q.device), value)
    if do is None:
        return o.detach(), lse.detach()
    finite = lse.isfinite()
    grad_lse = torch.zeros_like(lse) if dlse is None else dlse.double()
    objective = (o * do.double()).sum() + torch.where(finite, lse * grad_lse, 0).sum()
    return (o.detach(), lse.detach(), *torch.autograd.grad(objective, tensors))


def _offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def _packed(lengths_q, lengths_k, h_q, h_kv, d, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    make = lambda total, heads: torch.randn(total, heads, d, generator=generator).to("cuda", dtype)  # noqa: E731
    return make(sum(lengths_q), h_q), make(sum(lengths_k), h_kv), make(sum(lengths_k), h_kv), _offsets(lengths_q), _offsets(lengths_k)


def check(params, q, k, v, cu_q, cu_k, *, backward=True, seed=0):
    """The forward, and the backward on the forward's o and lse with a random do and dlse,
    against the reference; returns the forward op."""
    dtype = q.dtype
    forward = VarlenAttentionFwdOp(**params)
    o, lse = forward(q, k, v, cu_q, cu_k)
    generator = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(q.shape, generator=generator).to("cuda", dtype)
    dlse = torch.randn(lse.shape, generator=generator).to("cuda")
    want = reference(q, k, v, cu_q, cu_k, **params, do=do if backward else None, dlse=dlse)
    relative = RELATIVE[dtype]
    tolerance = VarlenAttentionFwdOp.manifest_entry().tolerance[dtype]
    _close("o", o, want[0], dtype, tolerance, relative[0])
    _close("lse", lse, want[1].float(), torch.float32, tolerance, relative[0])
    if backward:
        grads = VarlenAttentionBwdOp(**params)(do, q, k, v, o, lse, cu_q, cu_k, dlse)
        tolerance = VarlenAttentionBwdOp.manifest_entry().tolerance[dtype]
        for name, got, expected in zip(("dq", "dk", "dv"), grads, want[2:]):
            _close(name, got, expected, dtype, tolerance, relative[1])
    expected_key = "tilelang" if _served_by_tilelang(dtype, q.shape[2]) else "torch_cuda"
    assert [key for key, _ in forward.built_kernels()] == [expected_key]
    return forward


# -- every workload ---------------------------------------------------------------------------------


@pytest.mark.parametrize("case", workload_params(FORWARD_CASES))
def test_every_forward_workload_matches_the_reference_on_cuda(case):
    inputs = workload_inputs(VarlenAttentionFwdOp.manifest_entry(), case.workload, case.dtype, "cuda")
    check(case.workload.params, *inputs.values(), backward=False)


@pytest.mark.parametrize("case", workload_params(BACKWARD_CASES))
def test_every_backward_workload_matches_the_reference_on_cuda(case):
    entry = VarlenAttentionFwdOp.manifest_entry()
    shapes = case.workload.shapes
    workload = type(case.workload)(
        case.workload.name,
        {n: shapes[n] for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")},
        case.workload.dtypes,
        case.workload.params,
    )
    inputs = workload_inputs(entry, workload, case.dtype, "cuda")
    check(case.workload.params, *inputs.values())


# -- edge cases -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("lengths_q", "lengths_k", "h_q", "h_kv", "d", "params"), EDGES)
def test_edge_cases_forward_and_backward(lengths_q, lengths_k, h_q, h_kv, d, params, dtype):
    check(params, *_packed(lengths_q, lengths_k, h_q, h_kv, d, dtype))


def test_rows_without_keys_are_zero_with_minus_infinity_and_get_no_gradient():
    q, k, v, cu_q, cu_k = _packed([200, 50], [64, 0], 4, 2, 128, torch.bfloat16)
    o, lse = VarlenAttentionFwdOp(causal=True)(q, k, v, cu_q, cu_k)
    assert not o[:136].any() and bool((lse[:, :136] == -torch.inf).all())  # 200 queries over 64 keys
    assert not o[200:].any() and bool((lse[:, 200:] == -torch.inf).all())  # a sequence without keys
    dq, _, _ = VarlenAttentionBwdOp(causal=True)(torch.ones_like(o), q, k, v, o, lse, cu_q, cu_k)
    assert not dq[:136].any() and not dq[200:].any()


def test_q_k_v_off_the_16_byte_grid_are_served_as_aligned_ones():
    # Contiguous views 2 bytes past an aligned address: the kernels' loads would fault there.
    q, k, v, cu_q, cu_k = _packed([40, 130], [64, 130], 4, 2, 128, torch.bfloat16)
    shifted = [off_the_grid(t) for t in (q, k, v)]
    assert all(t.is_contiguous() and t.data_ptr() % 16 for t in shifted)
    check({"causal": True}, *shifted, cu_q, cu_k)


def test_other_head_sizes_and_dtypes_are_served_by_plain_torch_on_cuda():
    check({"causal": True}, *_packed([40, 0, 70], [50, 9, 70], 4, 2, 96, torch.bfloat16))
    check({"window": 9}, *_packed([40, 70], [50, 70], 4, 2, 64, torch.float32))


def _per_sequence_sdpa(q, k, v, bounds):
    return torch.cat(
        [
            F.scaled_dot_product_attention(
                q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), is_causal=True, enable_gqa=True
            ).transpose(0, 1)
            for a, b in bounds
        ]
    )


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_autograd_gives_sdpas_gradients_per_sequence(compiled, dtype):
    torch._dynamo.reset()
    lengths = [300, 1, 1000, 77]
    q, k, v, cu, _ = _packed(lengths, lengths, 16, 4, 128, dtype)
    bounds = list(zip(cu.tolist(), cu.tolist()[1:]))
    op = VarlenAttentionFwdOp(causal=True)

    def attention(*tensors):
        return op(*tensors, cu, cu)[0]

    run = torch.compile(attention, fullgraph=True) if compiled else attention
    ours = [t.clone().requires_grad_() for t in (q, k, v)]
    theirs = [t.clone().requires_grad_() for t in (q, k, v)]
    o = run(*ours)
    do = torch.randn_like(o)
    o.backward(do)
    want = _per_sequence_sdpa(*theirs, bounds)
    want.backward(do)
    relative = RELATIVE[dtype]
    _close("o", o.detach(), want.detach(), dtype, VarlenAttentionFwdOp.manifest_entry().tolerance[dtype], relative[0])
    for name, mine, torchs in zip(("dq", "dk", "dv"), ours, theirs):
        _close(name, mine.grad, torchs.grad, dtype, VarlenAttentionBwdOp.manifest_entry().tolerance[dtype], relative[1])
    assert [key for key, _ in op.backward_op.built_kernels()] == ["tilelang"]


def test_a_training_step_captured_in_a_cuda_graph_replays_with_other_lengths():
    lengths = [512, 100, 412]
    q, k, v, cu, _ = _packed(lengths, lengths, 16, 4, 128, torch.bfloat16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    op = VarlenAttentionFwdOp(causal=True)
    do = torch.randn_like(q)

    def step():
        o, _ = op(q, k, v, cu, cu)
        return (o, *torch.autograd.grad(o, (q, k, v), do))

    step()  # builds the kernels outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for new_lengths in ([512, 100, 412], [1, 1000, 23], [0, 1024, 0]):
        cu.copy_(_offsets(new_lengths))  # the same total: the graph's grid serves any lengths
        graph.replay()
        torch.cuda.synchronize()
        want = step()
        # dq is summed with atomics, in an order that varies: equal within the backward's tolerance
        atol, rtol = VarlenAttentionBwdOp.manifest_entry().tolerance[torch.bfloat16]
        for name, a, b in zip(("o", "dq", "dk", "dv"), captured, want):
            where = f"{name} after lengths {new_lengths}"
            torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m, where=where: f"{where}: {m}")
