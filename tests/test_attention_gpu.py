"""GPU tier: the attention ops' TileLang kernels on CUDA (Hopper), forward and backward, against a
float64 reference, over every manifest workload, the edge cases, autograd eagerly and under
``torch.compile(fullgraph=True)``, and a CUDA-graph capture.

They need a CUDA GPU (``pytest -m gpu``); elsewhere they skip. The full reference of a 16k-token
workload is a S x S matrix per head (minutes in float64), so the reference here is computed for a
sample of query rows (o, lse, dq: each row's keys all read) and of key rows (dk, dv: every query
row read, with the o and lse the backward op is given, as its contract says): exact, in float64,
and cheap. Outputs are compared elementwise within the manifest's tolerance and, since long
sequences make o and the gradients small, by their error relative to the reference's norm.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import compile_attention_programs, few_tests_selected, off_the_grid, workload_params
from tileops.ops.attention import AttentionBwdInterface, AttentionBwdOp, AttentionFwdInterface, AttentionFwdOp
from tileops.testing import workload_cases

pytestmark = pytest.mark.gpu

FORWARD_CASES = list(workload_cases([AttentionFwdOp]))
BACKWARD_CASES = list(workload_cases([AttentionBwdOp]))
#: Error relative to the reference's norm, per dtype: forward (one rounding of o and of P) and
#: backward (P and dS rounded for the tensor-core products, sums over up to 16k rows).
RELATIVE = {
    torch.bfloat16: (1.5e-2, 3e-2),
    torch.float16: (3e-3, 1e-2),
    torch.float32: (1e-5, 1e-4),
    torch.float64: (1e-10, 1e-6),
}
SAMPLE = 192  # query rows and key rows the reference computes
#: Input elements from which a workload's test runs alone (``large_memory``): its float64
#: reference holds (B, H_q, SAMPLE, S_k) scores and q, k and v widened to H_q heads, GiBs for the
#: 16k-token workloads; eight of them beside each other ran the GPU out of memory.
LARGE = 1 << 24


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _served_by_tilelang(dtype, head_dim):
    return _hopper() and dtype in (torch.float16, torch.bfloat16) and head_dim in (64, 128, 256)


def _calls():
    """(params, dtype, D, H_q, H_kv) of every call the tests below make."""
    for case in FORWARD_CASES + BACKWARD_CASES:
        params = case.workload.params
        q, k = case.workload.shapes["q"], case.workload.shapes["k"]
        heads = 2 if params.get("qkv_layout", "bshd") == "bshd" else 1
        yield params, case.dtype, q[3], q[heads], k[heads]
    for dtype in (torch.bfloat16, torch.float16):
        for _, _, _, h_q, h_kv, d, params in EDGES:
            yield params, dtype, d, h_q, h_kv
        yield {"causal": True}, dtype, 128, 16, 4  # the autograd tests
    yield {"causal": True}, torch.bfloat16, 128, 32, 8  # fused qkv
    yield {"causal": True}, torch.bfloat16, 128, 8, 2  # the CUDA graph


@pytest.fixture(scope="module", autouse=True)
def _built_in_parallel(request):
    """Compile the programs of every call the tests make in several processes at once (TileLang's
    lowering and nvcc take seconds per program, and hold the interpreter); TileLang's disk cache
    then hands them to the kernels the tests build, so that the tests only launch."""
    if not _hopper() or few_tests_selected(request):
        yield
        return
    device = torch.device("cuda", torch.cuda.current_device())
    calls = set()
    for params, dtype, head_dim, h_q, h_kv in _calls():
        if _served_by_tilelang(dtype, head_dim):
            call = AttentionFwdOp(**params).call_spec(AttentionFwdInterface, device, dtype, head_dim, h_q, h_kv)
            assert AttentionBwdOp(**params).call_spec(AttentionBwdInterface, device, dtype, head_dim, h_q, h_kv) == call
            calls.add(call)
    compile_attention_programs(calls, "programs")
    yield


# -- the float64 reference on sampled rows ----------------------------------------------------------


class Reference:
    """A call's tensors in (B, H, S, D) float64, and the reference on sampled rows."""

    def __init__(self, q, k, v, *, causal=False, window=None, scale=None, qkv_layout="bshd"):
        self.bshd = qkv_layout == "bshd"
        self.q, self.k, self.v = (self.heads_first(t).double() for t in (q, k, v))
        self.group = self.q.shape[1] // self.k.shape[1]
        self.s_q, self.s_k = self.q.shape[2], self.k.shape[2]
        self.causal, self.window = causal, window
        self.scale = scale if scale is not None else self.q.shape[3] ** -0.5

    def heads_first(self, t):
        return t.transpose(1, 2) if self.bshd else t

    def rows_first(self, lse):
        """An lse-shaped tensor as (B, H, S_q)."""
        return lse if self.bshd else lse.transpose(1, 2)

    def keep(self, rows, cols):
        i = rows[:, None] + (self.s_k - self.s_q)
        j = cols[None, :]
        keep = torch.ones(len(rows), len(cols), dtype=torch.bool, device=rows.device)
        if self.causal:
            keep &= j <= i
        if self.window is not None:
            keep &= j >= i - self.window
        return keep

    def scores(self, rows, cols):
        """(B, H_q, rows, cols) scaled scores, -inf where masked."""
        k = self.k[:, :, cols].repeat_interleave(self.group, 1)
        s = self.q[:, :, rows] @ k.transpose(-1, -2) * self.scale
        return s.masked_fill(~self.keep(rows, cols), -math.inf)

    def forward_rows(self, rows):
        """o (B, H_q, R, D) and lse (B, H_q, R) of query ``rows``."""
        s = self.scores(rows, torch.arange(self.s_k, device=rows.device))
        lse = torch.logsumexp(s, -1)
        p = torch.where(torch.isfinite(s), torch.exp(s - lse[..., None]), 0)
        return p @ self.v.repeat_interleave(self.group, 1), lse

    def backward_rows(self, do, o, lse, rows, cols):
        """dq of query ``rows`` (B, H_q, R, D) and dk, dv of key ``cols`` (B, H_kv, C, D), given
        do, o and lse (the op's layout) as the backward op is."""
        do = self.heads_first(do).double()
        o = self.heads_first(o).double()
        lse = self.rows_first(lse).double()
        delta = (do * o).sum(-1)
        every_key = torch.arange(self.s_k, device=rows.device)
        every_row = torch.arange(self.s_q, device=rows.device)
        v = self.v.repeat_interleave(self.group, 1)
        k = self.k.repeat_interleave(self.group, 1)

        def gradients(q_rows, key_cols):
            s = self.scores(q_rows, key_cols)
            p = torch.where(torch.isfinite(s), torch.exp(s - lse[:, :, q_rows, None]), 0)
            dp = do[:, :, q_rows] @ v[:, :, key_cols].transpose(-1, -2)
            return p, p * (dp - delta[:, :, q_rows, None])

        _, ds = gradients(rows, every_key)
        dq = ds @ k * self.scale
        p, ds = gradients(every_row, cols)
        grouped = lambda t: t.unflatten(1, (self.k.shape[1], self.group)).sum(2)  # noqa: E731
        dv = grouped(p.transpose(-1, -2) @ do)
        dk = grouped(ds.transpose(-1, -2) @ self.q) * self.scale
        return dq, dk, dv


def _sample(n, device, generator):
    """Up to SAMPLE indices of n: the first and last, the edges of 64- and 128-row tiles, and random ones."""
    if n <= SAMPLE:
        return torch.arange(n, device=device)
    edges = {i for i in (0, n - 1, 63, 64, 127, 128, n - 64, n - 128) if 0 <= i < n}
    picked = torch.randperm(n, generator=generator)[: SAMPLE - len(edges)].tolist()
    return torch.tensor(sorted(edges | set(picked)), device=device)


def _close(what, got, want, dtype, tolerance, relative):
    """Elementwise within the manifest's tolerance, and the RMS error relative to the reference's."""
    got, want = got.double(), want.to(got.dtype).double()  # the reference rounded once, as the manifest's
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got)) and torch.equal(got[~finite], want[~finite]), f"{what}: infinities differ"
    got, want = got[finite], want[finite]
    atol, rtol = tolerance
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")
    if want.numel():
        # Root-mean-square error within ``relative`` of the reference's, plus a hundredth of the
        # manifest's atol: a gradient that is zero in exact arithmetic (one key) is rounding.
        error, size = (got - want).square().mean().sqrt().item(), want.square().mean().sqrt().item()
        allowed = relative * size + atol / 100
        assert error <= allowed, f"{what}: RMS error {error:.2e}, more than {allowed:.2e} (reference RMS {size:.2e})"


def _inputs(shapes, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator).to("cuda", dtype) for shape in shapes]


def check_forward(op, q, k, v, seed=0):
    dtype, params = q.dtype, op.params
    o, lse = op(q, k, v)
    ref = Reference(q, k, v, **params)
    rows = _sample(ref.s_q, q.device, torch.Generator().manual_seed(seed))
    want_o, want_lse = ref.forward_rows(rows)
    got_o = ref.heads_first(o)[:, :, rows]
    got_lse = ref.rows_first(lse)[:, :, rows]
    tolerance = AttentionFwdOp.manifest_entry().tolerance[dtype]
    _close("o", got_o, want_o, dtype, tolerance, RELATIVE[dtype][0])
    _close("lse", got_lse, want_lse, dtype, tolerance, RELATIVE[dtype][0])
    return o, lse


def check_backward(forward, q, k, v, seed=0):
    """The backward op on the forward's o and lse against the reference; the backward op."""
    dtype = q.dtype
    o, lse = forward(q, k, v)
    (do,) = _inputs([tuple(q.shape)], dtype, seed=seed + 1)
    backward = AttentionBwdOp(**forward.params)
    dq, dk, dv = backward(do, q, k, v, o, lse)
    ref = Reference(q, k, v, **forward.params)
    generator = torch.Generator().manual_seed(seed)
    rows, cols = _sample(ref.s_q, q.device, generator), _sample(ref.s_k, q.device, generator)
    want_dq, want_dk, want_dv = ref.backward_rows(do, o, lse, rows, cols)
    tolerance = AttentionBwdOp.manifest_entry().tolerance[dtype]
    relative = RELATIVE[dtype][1]
    _close("dq", ref.heads_first(dq)[:, :, rows], want_dq, dtype, tolerance, relative)
    _close("dk", ref.heads_first(dk)[:, :, cols], want_dk, dtype, tolerance, relative)
    _close("dv", ref.heads_first(dv)[:, :, cols], want_dv, dtype, tolerance, relative)
    return backward


def _expected_key(dtype, head_dim):
    return "tilelang" if _served_by_tilelang(dtype, head_dim) else "torch_cuda"


# -- every workload ---------------------------------------------------------------------------------


@pytest.mark.parametrize("case", workload_params(FORWARD_CASES, large=LARGE))
def test_every_forward_workload_matches_the_reference_on_cuda(case):
    shapes = case.workload.shapes
    q, k, v = _inputs([shapes["q"], shapes["k"], shapes["v"]], case.dtype)
    op = AttentionFwdOp(**case.workload.params)
    check_forward(op, q, k, v)
    assert [key for key, _ in op.built_kernels()] == [_expected_key(case.dtype, shapes["q"][3])]


@pytest.mark.parametrize("case", workload_params(BACKWARD_CASES, large=LARGE))
def test_every_backward_workload_matches_the_reference_on_cuda(case):
    shapes = case.workload.shapes
    q, k, v = _inputs([shapes["q"], shapes["k"], shapes["v"]], case.dtype)
    backward = check_backward(AttentionFwdOp(**case.workload.params), q, k, v)
    assert [key for key, _ in backward.built_kernels()] == [_expected_key(case.dtype, shapes["q"][3])]


# -- edge cases -------------------------------------------------------------------------------------

EDGES = [  # (b, s_q, s_k, h_q, h_kv, d, params)
    (1, 1, 1, 4, 4, 128, {}),
    (2, 1, 1000, 32, 8, 128, {"causal": True}),  # one new token over a long prefix
    (2, 1000, 1, 8, 8, 64, {}),  # one key
    (1, 129, 129, 4, 4, 64, {"causal": True}),  # one row past a 128-row tile
    (1, 300, 129, 8, 8, 256, {"causal": True}),  # more queries than keys: 171 empty rows
    (1, 70, 500, 8, 1, 128, {"causal": True}),  # MQA, fewer queries than keys
    (2, 4096, 4096, 8, 2, 128, {"causal": True, "window": 511}),
    (1, 1000, 1000, 4, 4, 128, {"window": 100, "qkv_layout": "bhsd"}),
    (3, 257, 511, 6, 2, 64, {"scale": 0.2}),
    (64, 64, 64, 8, 8, 128, {"causal": True}),  # many short sequences
    (1, 2000, 2000, 2, 2, 256, {"causal": True, "window": 0}),  # a window of one key: the diagonal
]


def _edge_inputs(b, s_q, s_k, h_q, h_kv, d, params, dtype):
    bshd = params.get("qkv_layout", "bshd") == "bshd"
    q_shape = (b, s_q, h_q, d) if bshd else (b, h_q, s_q, d)
    kv_shape = (b, s_k, h_kv, d) if bshd else (b, h_kv, s_k, d)
    return _inputs([q_shape, kv_shape, kv_shape], dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("b", "s_q", "s_k", "h_q", "h_kv", "d", "params"), EDGES)
def test_edge_cases_forward_and_backward(b, s_q, s_k, h_q, h_kv, d, params, dtype):
    q, k, v = _edge_inputs(b, s_q, s_k, h_q, h_kv, d, params, dtype)
    op = AttentionFwdOp(**params)
    check_forward(op, q, k, v)
    backward = check_backward(op, q, k, v)
    assert [key for key, _ in op.built_kernels()] == [_expected_key(dtype, d)]
    assert [key for key, _ in backward.built_kernels()] == [_expected_key(dtype, d)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_every_forward_tuning_candidate_matches_the_reference(head_dim, causal):
    # request_tune may choose any of them: wider key tiles end past the keys more often, and
    # straddle the causal diagonal with more of their columns.
    from tileops.kernels.cuda.attention import policy, programs
    from tileops.kernels.cuda.compile import entry_function
    from tileops.kernels.cuda.device import compile_target

    if not _hopper():
        pytest.skip("the attention kernels need Hopper (sm_90)")
    q, k, v = _edge_inputs(2, 300, 700, 8, 2, head_dim, {}, torch.bfloat16)
    call = AttentionFwdOp(causal=causal).call_spec(AttentionFwdInterface, q.device, q.dtype, head_dim, 8, 2)
    ref = Reference(q, k, v, causal=causal)
    rows = _sample(ref.s_q, q.device, torch.Generator().manual_seed(0))
    want_o, want_lse = ref.forward_rows(rows)
    tolerance = AttentionFwdOp.manifest_entry().tolerance[q.dtype]
    for config in policy.forward_candidates(head_dim):
        o, lse = torch.empty_like(q), torch.empty(2, 8, 300, device="cuda")
        entry_function(programs.compile_forward(call, compile_target(q.device), **config))(q, k, v, o, lse)
        _close(f"o {config}", ref.heads_first(o)[:, :, rows], want_o, q.dtype, tolerance, RELATIVE[q.dtype][0])
        _close(f"lse {config}", lse[:, :, rows], want_lse, q.dtype, tolerance, RELATIVE[q.dtype][0])


def test_rows_that_see_no_key_are_zero_with_minus_infinity_and_get_no_gradient():
    q, k, v = _edge_inputs(1, 300, 129, 8, 8, 128, {}, torch.bfloat16)
    q.requires_grad_()
    o, lse = AttentionFwdOp(causal=True)(q, k, v)
    assert torch.all(o[:, :171] == 0) and torch.all(lse[:, :, :171] == -math.inf)
    assert torch.isfinite(lse[:, :, 171:]).all()
    o.float().square().sum().backward()
    assert torch.all(q.grad[:, :171] == 0) and torch.isfinite(q.grad).all()


def test_q_k_v_sliced_from_a_fused_qkv_projection():
    qkv = torch.randn(2, 1000, 32 + 8 + 8, 128, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv[:, :, :32], qkv[:, :, 32:40], qkv[:, :, 40:]
    assert not q.is_contiguous()
    op = AttentionFwdOp(causal=True)
    got = op(q, k, v)
    want = op(q.contiguous(), k.contiguous(), v.contiguous())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    check_backward(op, q, k, v)


def test_q_k_v_off_the_16_byte_grid_give_the_aligned_result():
    # Contiguous views 2 bytes past an aligned address: the kernels' loads would fault there.
    q, k, v = _edge_inputs(2, 300, 300, 4, 2, 128, {}, torch.bfloat16)
    shifted = [off_the_grid(t) for t in (q, k, v)]
    assert all(t.is_contiguous() and t.data_ptr() % 16 for t in shifted)
    op = AttentionFwdOp(causal=True)
    for a, b in zip(op(*shifted), op(q, k, v)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    check_backward(op, *shifted)


def test_other_head_sizes_and_dtypes_are_served_by_plain_torch_on_cuda():
    for dtype, d in ((torch.bfloat16, 96), (torch.float32, 128)):
        q, k, v = _edge_inputs(2, 300, 300, 4, 2, d, {}, dtype)
        op = AttentionFwdOp(causal=True)
        check_forward(op, q, k, v)
        assert [key for key, _ in op.built_kernels()] == ["torch_cuda"]


# -- autograd, torch.compile, CUDA graphs -----------------------------------------------------------


def _sdpa_gradients(q, k, v, do, causal):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves), is_causal=causal, enable_gqa=True)
    return torch.autograd.grad(o.transpose(1, 2), leaves, do.double())


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_autograd_gives_sdpas_gradients(compiled, dtype):
    torch._dynamo.reset()
    q, k, v = (t.requires_grad_() for t in _edge_inputs(2, 1024, 1024, 16, 4, 128, {}, dtype))
    op = AttentionFwdOp(causal=True)
    run = torch.compile(lambda *t: op(*t)[0], fullgraph=True) if compiled else (lambda *t: op(*t)[0])
    o = run(q, k, v)
    (do,) = _inputs([tuple(q.shape)], dtype, seed=3)
    o.backward(do)
    for name, got, want in zip("qkv", (q.grad, k.grad, v.grad), _sdpa_gradients(q, k, v, do, True)):
        _close(f"d{name}", got, want, dtype, AttentionBwdOp.manifest_entry().tolerance[dtype], RELATIVE[dtype][1])
    assert [key for key, _ in op.backward_op.built_kernels()] == ["tilelang"]


def test_a_training_step_replays_in_a_cuda_graph():
    q, k, v = (t.requires_grad_() for t in _edge_inputs(2, 512, 512, 8, 2, 128, {}, torch.bfloat16))
    op = AttentionFwdOp(causal=True)
    (do,) = _inputs([tuple(q.shape)], torch.bfloat16, seed=5)

    def step():
        o, _ = op(q, k, v)
        return torch.autograd.grad(o, (q, k, v), do)

    want = step()  # builds the kernels outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, want):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)  # dq's float32 atomics add in any order
