"""The variable-length attention ops on the CPU: the small manifest workloads against the
reference, the semantics against the dense AttentionFwdOp and torch's SDPA run one sequence at a
time (empty sequences, S_q != S_k causal, GQA, MQA, windows, scale), lse, gradients (gradcheck in
float64, lse's gradient, 16-bit autograd), compiled training, bad offsets refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import train_side_by_side
from tileops.backend import OpArgumentError
from tileops.ops import AttentionFwdOp
from tileops.ops.attention import VarlenAttentionBwdOp, VarlenAttentionFwdOp
from tileops.testing import check_workload, workload_cases

#: The CPU tier runs workloads up to this many input elements, in float32 and float64 (16-bit
#: matmuls are slow on CPUs); the larger ones and the 16-bit dtypes run in the GPU tier.
CPU_ELEMENTS = 1 << 20

CASES = [
    case for case in workload_cases([VarlenAttentionFwdOp, VarlenAttentionBwdOp])
    if case.elements <= CPU_ELEMENTS and case.dtype in (torch.float32, torch.float64)
]


def test_the_cpu_tier_covers_every_edge_case_workload():
    names = {case.workload.name for case in CASES}
    edges = {w.name for w in VarlenAttentionFwdOp.manifest_entry().workloads if not w.name.startswith("packed-")}
    assert edges <= names


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_small_workload_matches_the_reference_on_cpu(case):
    check_workload(case.op_class(**case.workload.params), case.workload, case.dtype, "cpu")


def _offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _packed(lengths_q, lengths_k, h_q, h_kv, d, dtype=torch.float64, grad=False):
    def make(total, heads):
        return torch.randn(total, heads, d, dtype=dtype).requires_grad_(grad)

    q, k, v = make(sum(lengths_q), h_q), make(sum(lengths_k), h_kv), make(sum(lengths_k), h_kv)
    return q, k, v, _offsets(lengths_q), _offsets(lengths_k)


def _per_sequence(q, k, v, cu_q, cu_k, **params):
    """o and lse by the dense AttentionFwdOp, one sequence at a time (o = 0, lse = -inf for a
    sequence without keys)."""
    dense = AttentionFwdOp(**params)
    o = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), -torch.inf, dtype=torch.float32)
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.stop > rows.start and keys.stop > keys.start:
            o_b, lse_b = dense(q[rows][None], k[keys][None], v[keys][None])
            o[rows], lse[:, rows] = o_b[0], lse_b[0]
    return o, lse


LENGTHS = [  # (S_q per sequence, S_k per sequence, H_q, H_kv, D, params)
    ([5, 0, 17, 1, 9], [7, 3, 12, 0, 9], 4, 2, 16, {}),
    ([5, 0, 17, 1, 9], [7, 3, 12, 0, 9], 4, 2, 16, {"causal": True}),  # S_q > S_k and S_q < S_k, bottom right
    ([12, 12], [12, 12], 8, 1, 32, {"causal": True}),  # MQA
    ([20, 3, 40], [20, 3, 40], 4, 4, 16, {"causal": True, "window": 4}),
    ([20, 3, 40], [25, 1, 33], 4, 2, 16, {"window": 6, "scale": 0.2}),
    ([0, 0, 6], [0, 4, 6], 2, 1, 8, {"causal": True}),  # leading empty sequences
]


@pytest.mark.parametrize(("lengths_q", "lengths_k", "h_q", "h_kv", "d", "params"), LENGTHS)
def test_each_sequence_attends_to_its_own_keys_as_the_dense_op(lengths_q, lengths_k, h_q, h_kv, d, params):
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, h_q, h_kv, d)
    o, lse = VarlenAttentionFwdOp(**params)(q, k, v, cu_q, cu_k)
    want_o, want_lse = _per_sequence(q, k, v, cu_q, cu_k, **params)
    torch.testing.assert_close(o, want_o)
    torch.testing.assert_close(lse, want_lse)


def test_a_sequence_matches_sdpa_and_rows_without_keys_are_zero_with_minus_infinity():
    q, k, v, cu_q, cu_k = _packed([6, 4], [3, 0], 4, 2, 16)
    o, lse = VarlenAttentionFwdOp(causal=True)(q, k, v, cu_q, cu_k)
    # sequence 0: 6 queries over 3 keys, bottom-right causal: the first 3 rows see nothing
    i, j = torch.arange(6)[:, None] - 3, torch.arange(3)[None, :]
    want = F.scaled_dot_product_attention(q[:6].transpose(0, 1), k[:3].transpose(0, 1), v[:3].transpose(0, 1),
                                          attn_mask=j <= i, enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(o[3:6], want[3:6])
    assert not o[:3].any() and torch.equal(lse[:, :3], torch.full((4, 3), -torch.inf))
    assert not o[6:].any() and bool((lse[:, 6:] == -torch.inf).all())  # sequence 1 has no key


def test_calls_without_a_query_or_a_key_need_no_kernel():
    q = torch.randn(0, 2, 8)
    o, lse = VarlenAttentionFwdOp()(q, q, q, _offsets([0, 0]), _offsets([0, 0]))
    assert o.shape == (0, 2, 8) and lse.shape == (2, 0)
    q, k, v, cu_q, cu_k = _packed([3, 2], [0, 0], 2, 2, 8)
    o, lse = VarlenAttentionFwdOp()(q, k, v, cu_q, cu_k)
    assert not o.any() and bool((lse == -torch.inf).all())
    dq, dk, dv = VarlenAttentionBwdOp()(o, q, k, v, o, lse, cu_q, cu_k)
    assert not dq.any() and dk.shape == k.shape == dv.shape


@pytest.mark.parametrize("with_dlse", [False, True], ids=["o", "o-and-lse"])
def test_the_packed_math_serving_cuda_fallbacks_matches_the_cpu_implementation(with_dlse):
    # On the CPU each sequence runs through the dense kernel; the packed math serves CUDA only.
    from tileops.ops.attention import varlen_cpu
    from tileops.ops.attention.varlen_interfaces import VarlenAttentionCall

    q, k, v, cu_q, cu_k = _packed([5, 0, 9, 4], [7, 2, 6, 0], 4, 2, 16)
    call = VarlenAttentionCall(torch.device("cpu"), torch.float64, 16, 4, 2, True, 5, 0.3)
    o, lse = varlen_cpu.MathVarlenAttention(call).forward(q, k, v, cu_q, cu_k)
    want_o, want_lse = varlen_cpu.TorchVarlenAttention(call).forward(q, k, v, cu_q, cu_k)
    torch.testing.assert_close(o, want_o)
    torch.testing.assert_close(lse, want_lse)
    do, dlse = torch.randn_like(o), (torch.randn_like(lse) if with_dlse else None)
    got = varlen_cpu.MathVarlenAttentionBwd(call).forward(do, q, k, v, o, lse, cu_q, cu_k, dlse)
    want = varlen_cpu.TorchVarlenAttentionBwd(call).forward(do, q, k, v, o, lse, cu_q, cu_k, dlse)
    for mine, theirs in zip(got, want):  # both read the float32 lse
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("params", [{"causal": True}, {"window": 2, "scale": 0.3}], ids=["causal", "window"])
def test_gradcheck_in_float64(params):
    # an empty sequence, one with more queries than keys, one with fewer; GQA
    q, k, v, cu_q, cu_k = _packed([4, 0, 1, 3], [2, 3, 4, 3], 4, 2, 4, grad=True)
    op = VarlenAttentionFwdOp(**params)
    # lse is float32 (for every input dtype): its numerical derivative is float32's, so o is checked here
    assert torch.autograd.gradcheck(lambda *t: op(*t, cu_q, cu_k)[0], (q, k, v), fast_mode=True)


def test_the_gradients_of_o_and_lse_match_the_dense_op_per_sequence():
    lengths_q, lengths_k = [5, 0, 9, 4], [7, 2, 6, 0]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 4, 2, 16, grad=True)
    o, lse = VarlenAttentionFwdOp(causal=True)(q, k, v, cu_q, cu_k)
    (o.square().sum() + torch.where(lse.isfinite(), lse, 0).sum()).backward()
    theirs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    want_o, want_lse = _per_sequence(*theirs, cu_q, cu_k, causal=True)
    (want_o.square().sum() + torch.where(want_lse.isfinite(), want_lse, 0).sum()).backward()
    for mine, dense in zip((q, k, v), theirs):
        torch.testing.assert_close(mine.grad, dense.grad, atol=1e-5, rtol=1e-5)
    assert type(o.grad_fn).__name__ == "VarlenAttentionFwdOpBackward"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_16_and_32_bit_autograd_matches_sdpa_per_sequence(dtype):
    q, k, v, cu_q, cu_k = _packed([9, 14], [9, 14], 8, 2, 32, dtype=dtype, grad=True)
    o, _ = VarlenAttentionFwdOp(causal=True)(q, k, v, cu_q, cu_k)
    do = torch.randn_like(o)
    o.backward(do)
    theirs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    want = torch.cat([
        F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in theirs), is_causal=True, enable_gqa=True).transpose(0, 1)
        for a, b in ((0, 9), (9, 23))
    ])
    want.backward(do)
    atol, rtol = VarlenAttentionBwdOp.manifest_entry().tolerance[dtype]
    for mine, torchs in zip((q, k, v), theirs):
        torch.testing.assert_close(mine.grad, torchs.grad, atol=atol, rtol=rtol)


class _PackedBlock(torch.nn.Module):
    """A causal GQA attention layer over a packed batch: fused qkv projection, attention, output."""

    def __init__(self, attention):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.Linear(32, (4 + 2 + 2) * 8, bias=False)
        self.out = torch.nn.Linear(32, 32, bias=False)
        self.attention = attention

    def forward(self, x):
        qkv = self.qkv(x).unflatten(-1, (8, 8))
        return self.out(self.attention(qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]).flatten(-2))


def test_a_compiled_packed_attention_layer_trains_as_sdpa_per_sequence():
    torch._dynamo.reset()
    op = VarlenAttentionFwdOp(causal=True)
    cu = _offsets([4, 7, 1])
    bounds = [(0, 4), (4, 11), (11, 12)]
    ours = _PackedBlock(lambda q, k, v: op(q, k, v, cu, cu)[0])
    theirs = _PackedBlock(lambda q, k, v: torch.cat([
        F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
                                       is_causal=True, enable_gqa=True).transpose(0, 1)
        for a, b in bounds
    ]))
    losses = train_side_by_side([ours, theirs], torch.randn(12, 32), torch.randn(12, 32), compiled=True)
    torch.testing.assert_close(losses[0], losses[1], atol=1e-5, rtol=1e-5)
    assert losses[0][-1] < losses[0][0]


# -- bad calls ------------------------------------------------------------------------------------


def test_bad_offsets_are_refused_by_name():
    q, k, v, cu_q, cu_k = _packed([3, 4], [3, 4], 4, 2, 8, dtype=torch.float32)
    op = VarlenAttentionFwdOp()
    with pytest.raises(OpArgumentError, match=r"VarlenAttentionFwdOp: argument 'cu_seqlens_q' expected dtype int32, got torch.int64"):
        op(q, k, v, cu_q.long(), cu_k)
    with pytest.raises(OpArgumentError, match=r"VarlenAttentionFwdOp: argument 'cu_seqlens_k' expected shape \[B1\] with B1=3"):
        op(q, k, v, cu_q, cu_k[:2])
    with pytest.raises(OpArgumentError, match=r"'cu_seqlens_q' must hold the cumulative sequence lengths.*decreases from 5 to 3 at entry 2"):
        op(q, k, v, torch.tensor([0, 5, 3, 7], dtype=torch.int32), _offsets([3, 4, 0]))
    with pytest.raises(OpArgumentError, match=r"'cu_seqlens_k' must hold .* end at k's 7 rows; it ends at 6"):
        op(q, k, v, cu_q, torch.tensor([0, 3, 6], dtype=torch.int32))
    with pytest.raises(OpArgumentError, match=r"'cu_seqlens_q' must hold .* it starts at 1"):
        VarlenAttentionBwdOp()(q, q, k, v, q, torch.zeros(4, 7), torch.tensor([1, 3, 7], dtype=torch.int32), cu_k)
    with pytest.raises(OpArgumentError, match=r"VarlenAttentionFwdOp: the query heads must be a multiple of the key/value heads"):
        op(q[:, :3], k, v, cu_q, cu_k)
    with pytest.raises(OpArgumentError, match=r"VarlenAttentionFwdOp: cu_seqlens_q and cu_seqlens_k hold B \+ 1 offsets, B >= 1"):
        op(q[:0], k[:0], v[:0], cu_q[:1], cu_k[:1])
    with pytest.raises(OpArgumentError, match=r"VarlenAttentionFwdOp: window must be null or non-negative"):
        VarlenAttentionFwdOp(window=-2)
    with pytest.raises(OpArgumentError, match=r"VarlenAttentionFwdOp: too many positional arguments; it takes \(\*, causal=False"):
        VarlenAttentionFwdOp(True)  # the params are keyword-only


# -- the bench peers --------------------------------------------------------------------------------


def test_the_peers_call_as_the_op_computes_and_refuse_what_they_cannot():
    from tileops.ops.attention import command_line

    assert list(command_line.PEERS["VarlenAttentionFwdOp"]) == ["SDPA per sequence", "flash-attn"]
    q, k, v, cu_q, cu_k = _packed([5, 0, 9], [5, 0, 9], 4, 2, 16, dtype=torch.float32)
    inputs = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    params = {"causal": True, "window": None, "scale": None}
    where, sdpa = command_line.PEERS["VarlenAttentionFwdOp"]["SDPA per sequence"]
    assert where == "torch.nn.functional:scaled_dot_product_attention"
    pieces = sdpa(F.scaled_dot_product_attention, inputs, params)()
    o, _ = VarlenAttentionFwdOp(causal=True)(q, k, v, cu_q, cu_k)
    torch.testing.assert_close(torch.cat([p.transpose(0, 1) for p in pieces]), o, atol=1e-5, rtol=1e-5)
    assert "sliding window" in sdpa(None, inputs, {**params, "window": 3})
    assert "top left" in sdpa(None, {**inputs, "cu_seqlens_k": _offsets([6, 0, 8])}, params)
    where, flash = command_line.PEERS["VarlenAttentionFwdOp"]["flash-attn"]
    assert where == "flash_attn:flash_attn_varlen_func"
    seen = []
    flash(lambda *a, **kw: seen.append((a[5:], kw)), inputs, {"causal": True, "window": 7, "scale": 0.1})()
    assert seen == [((9, 9), {"causal": True, "softmax_scale": 0.1, "window_size": (7, -1)})]
