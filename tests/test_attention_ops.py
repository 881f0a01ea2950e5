"""The attention ops on the CPU: every small manifest workload against the reference, the
semantics against torch's scaled_dot_product_attention (GQA, causal alignment, sliding window,
scale, both layouts), the log-sum-exp, gradients (gradcheck in float64, the lse's gradient,
16-bit autograd against SDPA's), compiled training, strided inputs from a fused qkv projection,
empty sequences, bad calls and the bench peers' adapters."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import train_side_by_side
from tileops.backend import OpArgumentError
from tileops.ops import FAMILIES
from tileops.ops.attention import AttentionBwdOp, AttentionFwdOp
from tileops.ops.attention import cpu as attention_cpu
from tileops.testing import check_workload, workload_cases

#: The CPU tier runs workloads up to this many input elements; larger ones run in the GPU tier.
CPU_ELEMENTS = 1 << 21

CASES = [
    case for case in workload_cases([AttentionFwdOp, AttentionBwdOp]) if case.elements <= CPU_ELEMENTS
]


def test_the_cpu_tier_covers_every_edge_case_workload():
    names = {case.workload.name for case in CASES}
    assert {"odd-s300-h4x2-d64-causal", "sq1-sk777-h8x2-d128-causal", "sq64-sk1-h4x4-d64-full",
            "sq200-sk130-h4x4-d128-causal", "window-s520-h4x2-d64-causal-w128", "bhsd-s384-h4x4-d128-causal",
            "mqa-s256-h8x1-d128-full", "tiny-s9-h2x1-d16-causal"} <= names


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_small_workload_matches_the_reference_on_cpu(case):
    op = case.op_class(**case.workload.params)
    check_workload(op, case.workload, case.dtype, "cpu")


# -- semantics, against torch ---------------------------------------------------------------------


def _sdpa(q, k, v, *, causal=False, window=None, scale=None, qkv_layout="bshd"):
    layout = qkv_layout
    """o and lse by torch (float64), with flash-attn's bottom-right causal and window masks."""
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    q, k, v = q.double(), k.double(), v.double()
    s_q, s_k = q.shape[2], k.shape[2]
    i = torch.arange(s_q)[:, None] + s_k - s_q
    j = torch.arange(s_k)[None, :]
    keep = torch.ones(s_q, s_k, dtype=torch.bool)
    if causal:
        keep &= j <= i
    if window is not None:
        keep &= j >= i - window
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)
    lse = torch.logsumexp(scores.masked_fill(~keep, -math.inf), -1)
    o = torch.where(keep.any(-1)[:, None], o, 0)  # SDPA gives NaN for a row with no key; the op 0
    return (o.transpose(1, 2) if layout == "bshd" else o), (lse if layout == "bshd" else lse.transpose(1, 2))


def _qkv(b, s_q, s_k, h_q, h_kv, d, dtype=torch.float32, layout="bshd", grad=False):
    def make(s, h):
        shape = (b, s, h, d) if layout == "bshd" else (b, h, s, d)
        return torch.randn(shape, dtype=dtype).requires_grad_(grad)

    return make(s_q, h_q), make(s_k, h_kv), make(s_k, h_kv)


CALLS = [  # (b, s_q, s_k, h_q, h_kv, d, params)
    (2, 37, 37, 4, 4, 32, {}),
    (2, 37, 37, 8, 2, 32, {"causal": True}),  # GQA
    (1, 20, 50, 4, 1, 16, {"causal": True}),  # MQA, S_q < S_k: the queries are the last 20 rows
    (1, 50, 20, 4, 2, 16, {"causal": True}),  # S_q > S_k: the first 30 rows see no key
    (2, 64, 64, 4, 2, 16, {"causal": True, "window": 8}),
    (2, 40, 60, 2, 2, 16, {"window": 5}),  # a window without causal: every key right of the start
    (1, 33, 33, 4, 4, 64, {"scale": 0.3}),
    (2, 45, 30, 8, 4, 32, {"causal": True, "qkv_layout": "bhsd"}),
    (1, 1, 77, 8, 2, 64, {"causal": True}),  # one new token
    (1, 16, 1, 2, 2, 16, {}),  # one key
]


@pytest.mark.parametrize(("b", "s_q", "s_k", "h_q", "h_kv", "d", "params"), CALLS)
def test_o_and_lse_are_torchs_softmax_attention_with_flash_attn_masks(b, s_q, s_k, h_q, h_kv, d, params):
    layout = params.get("qkv_layout", "bshd")
    q, k, v = _qkv(b, s_q, s_k, h_q, h_kv, d, layout=layout)
    o, lse = AttentionFwdOp(**params)(q, k, v)
    want_o, want_lse = _sdpa(q, k, v, **params)
    torch.testing.assert_close(o, want_o.float(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, want_lse.float(), atol=2e-5, rtol=2e-5)
    assert lse.dtype == torch.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize(("s_q", "s_k", "params"), [(50, 20, {"causal": True}), (40, 60, {"causal": True, "window": 7})])
def test_masked_calls_taken_in_chunks_of_rows_give_torchs_values_and_gradients(monkeypatch, layout, s_q, s_k, params):
    # A mask of one row's width per chunk: every chunk boundary of a long sequence is crossed here.
    monkeypatch.setattr(attention_cpu, "MASK_BYTES", s_k * 8 * 3)
    q, k, v = _qkv(2, s_q, s_k, 4, 2, 16, dtype=torch.float64, layout=layout, grad=True)
    o, lse = AttentionFwdOp(**params, qkv_layout=layout)(q, k, v)
    theirs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    want_o, want_lse = _sdpa(*theirs, **params, qkv_layout=layout)
    torch.testing.assert_close(o, want_o, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, want_lse.float())
    do = torch.randn_like(o)
    o.backward(do)
    want_o.backward(do)
    for mine, torchs in zip((q, k, v), theirs):  # the backward reads the float32 lse
        torch.testing.assert_close(mine.grad, torchs.grad, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(("s_q", "s_k", "params"), [(9, 5, {"causal": True}), (12, 20, {"causal": True, "window": 4}), (7, 7, {})])
def test_the_math_serving_cuda_fallbacks_matches_the_cpu_flash_kernels(s_q, s_k, params):
    # On the CPU torch's flash kernels serve; the math reference serves CUDA's other calls.
    from tileops.ops.attention.interfaces import AttentionCall

    q, k, v = _qkv(2, s_q, s_k, 4, 2, 16, dtype=torch.float64)
    call = AttentionCall(torch.device("cpu"), torch.float64, 16, 4, 2, params.get("causal", False), params.get("window"), 0.3, "bshd")
    o, lse = attention_cpu.MathAttention(call).forward(q, k, v)
    want_o, want_lse = attention_cpu.TorchAttention(call).forward(q, k, v)
    torch.testing.assert_close(o, want_o)
    torch.testing.assert_close(lse, want_lse)
    do = torch.randn_like(o)
    got = attention_cpu.MathAttentionBwd(call).forward(do, q, k, v, o, lse, None)
    want = attention_cpu.TorchAttentionBwd(call).forward(do, q, k, v, o, lse, None)
    for mine, theirs in zip(got, want):  # both read the float32 lse
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-6)


def test_causal_with_more_queries_than_keys_leaves_the_first_rows_empty():
    q, k, v = _qkv(1, 6, 4, 2, 2, 8)
    o, lse = AttentionFwdOp(causal=True)(q, k, v)
    assert torch.all(o[:, :2] == 0) and torch.all(lse[:, :, :2] == -math.inf)
    assert torch.isfinite(lse[:, :, 2:]).all() and o[:, 2:].abs().sum() > 0


def test_gqa_is_mha_over_repeated_key_value_heads():
    q, k, v = _qkv(2, 19, 23, 8, 2, 16)
    grouped = AttentionFwdOp(causal=True)(q, k, v)
    repeated = AttentionFwdOp(causal=True)(q, k.repeat_interleave(4, 2), v.repeat_interleave(4, 2))
    for a, b in zip(grouped, repeated):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_the_layouts_agree():
    q, k, v = _qkv(2, 17, 21, 4, 2, 16)
    o, lse = AttentionFwdOp(causal=True, window=6)(q, k, v)
    o2, lse2 = AttentionFwdOp(causal=True, window=6, qkv_layout="bhsd")(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    torch.testing.assert_close(o2.transpose(1, 2), o, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse2.transpose(1, 2), lse, atol=1e-6, rtol=1e-6)


def test_q_k_v_sliced_from_a_fused_qkv_projection():
    qkv = torch.randn(2, 33, 4 + 2 + 2, 32)  # (B, S, H_q + 2 H_kv, D)
    q, k, v = qkv[:, :, :4], qkv[:, :, 4:6], qkv[:, :, 6:]
    assert not q.is_contiguous()
    got = AttentionFwdOp(causal=True)(q, k, v)
    want = AttentionFwdOp(causal=True)(q.contiguous(), k.contiguous(), v.contiguous())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_an_empty_key_sequence_gives_zero_and_minus_infinity_and_zero_gradients():
    q = torch.randn(2, 5, 4, 16, requires_grad=True)
    k = torch.randn(2, 0, 2, 16, requires_grad=True)
    v = torch.randn(2, 0, 2, 16, requires_grad=True)
    o, lse = AttentionFwdOp()(q, k, v)
    assert torch.equal(o, torch.zeros_like(o)) and torch.all(lse == -math.inf) and lse.shape == (2, 4, 5)
    o.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


# -- gradients --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("b", "s_q", "s_k", "h_q", "h_kv", "d", "params"), CALLS[:9])
def test_gradcheck_in_float64(b, s_q, s_k, h_q, h_kv, d, params):
    op = AttentionFwdOp(**params)
    layout = params.get("qkv_layout", "bshd")
    small = (1, min(s_q, 6), min(s_k, 7) if s_k > 1 else 1, min(h_q, 4), min(h_kv, 2), 8)
    small = (*small[:3], small[3] - small[3] % small[4], small[4], small[5])
    if s_q > s_k:  # keep the case: more queries than keys
        small = (1, 7, 4, *small[3:])
    q, k, v = _qkv(*small, dtype=torch.float64, layout=layout, grad=True)
    # lse is float32 (for every input dtype): its numerical derivative is float32's, so o is checked here
    assert torch.autograd.gradcheck(lambda *t: op(*t)[0], (q, k, v))


def test_the_gradient_through_lse_reaches_q_and_k():
    q, k, v = _qkv(1, 9, 11, 4, 2, 16, dtype=torch.float64, grad=True)
    o, lse = AttentionFwdOp(causal=True)(q, k, v)
    (o.square().sum() + lse.sum()).backward()
    theirs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    want_o, want_lse = _sdpa(*theirs, causal=True)
    (want_o.square().sum() + want_lse.sum()).backward()
    for mine, torchs in zip((q, k, v), theirs):
        torch.testing.assert_close(mine.grad, torchs.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_gradients_match_sdpa_autograd(dtype):
    q, k, v = _qkv(2, 24, 24, 8, 2, 32, dtype=dtype, grad=True)
    o, _ = AttentionFwdOp(causal=True)(q, k, v)
    do = torch.randn_like(o)
    o.backward(do)
    theirs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in theirs), is_causal=True, enable_gqa=True)
    want.transpose(1, 2).backward(do)
    atol, rtol = AttentionBwdOp.manifest_entry().tolerance[dtype]
    torch.testing.assert_close(o, want.transpose(1, 2).detach(), atol=atol, rtol=rtol)
    for mine, torchs in zip((q, k, v), theirs):
        torch.testing.assert_close(mine.grad, torchs.grad, atol=atol, rtol=rtol)


def test_the_forward_saves_nothing_and_its_backward_reads_o_and_lse():
    declared = AttentionFwdOp.manifest_entry().backward
    assert declared.op == "AttentionBwdOp" and list(declared.saves) == []
    assert dict(declared.grads) == {"q": "dq", "k": "dk", "v": "dv"}
    q, k, v = _qkv(1, 5, 5, 2, 2, 8, grad=True)
    o, lse = AttentionFwdOp()(q, k, v)
    assert type(o.grad_fn).__name__ == "AttentionFwdOpBackward"


class _Block(torch.nn.Module):
    """A causal GQA attention layer: fused qkv projection, attention, output projection."""

    def __init__(self, attention):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.Linear(32, (4 + 2 + 2) * 8, bias=False)
        self.out = torch.nn.Linear(32, 32, bias=False)
        self.attention = attention

    def forward(self, x):
        qkv = self.qkv(x).unflatten(-1, (8, 8))
        o = self.attention(qkv[:, :, :4], qkv[:, :, 4:6], qkv[:, :, 6:])
        return self.out(o.flatten(-2))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_an_attention_layer_trains_as_the_same_layer_with_sdpa(compiled):
    torch._dynamo.reset()
    op = AttentionFwdOp(causal=True)
    ours = _Block(lambda q, k, v: op(q, k, v)[0])
    theirs = _Block(
        lambda q, k, v: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        ).transpose(1, 2)
    )
    losses = train_side_by_side([ours, theirs], torch.randn(3, 10, 32), torch.randn(3, 10, 32), compiled=compiled)
    torch.testing.assert_close(losses[0], losses[1], atol=1e-5, rtol=1e-5)
    assert losses[0][-1] < losses[0][0]


def test_compiled_inference_needs_no_graph_break():
    torch._dynamo.reset()
    op = AttentionFwdOp(causal=True, window=4)
    q, k, v = _qkv(2, 12, 12, 4, 2, 16)
    compiled = torch.compile(lambda *t: op(*t), fullgraph=True)
    for a, b in zip(compiled(q, k, v), op(q, k, v)):
        torch.testing.assert_close(a, b)


# -- bad calls ------------------------------------------------------------------------------------


def test_bad_calls_name_the_op_and_what_is_wrong():
    q, k, v = _qkv(2, 8, 8, 6, 4, 16)
    with pytest.raises(OpArgumentError, match=r"AttentionFwdOp: the query heads must be a multiple of the key/value heads"):
        AttentionFwdOp()(q, k, v)
    q, k, v = _qkv(2, 8, 8, 4, 2, 16)
    with pytest.raises(OpArgumentError, match=r"AttentionFwdOp: argument 'v' must have the shape of 'k'"):
        AttentionFwdOp()(q, k, v[:, :7])
    with pytest.raises(OpArgumentError, match=r"AttentionFwdOp: argument 'k' expected shape \[B, K1, K2, D\] with B=2"):
        AttentionFwdOp()(q, k[..., :8], v[..., :8])
    with pytest.raises(OpArgumentError, match=r"AttentionFwdOp: argument 'k' must have the dtype of 'q'"):
        AttentionFwdOp()(q, k.half(), v.half())
    with pytest.raises(OpArgumentError, match=r"AttentionFwdOp: qkv_layout must be 'bshd' or 'bhsd'"):
        AttentionFwdOp(qkv_layout="sbhd")
    with pytest.raises(OpArgumentError, match=r"AttentionFwdOp: window must be null or non-negative"):
        AttentionFwdOp(window=-1)
    with pytest.raises(OpArgumentError, match=r"AttentionBwdOp: scale must be null or positive"):
        AttentionBwdOp(scale=0.0)
    with pytest.raises(OpArgumentError, match=r"AttentionBwdOp: argument 'lse' expected dtype float32"):
        o, lse = AttentionFwdOp()(q, k, v)
        AttentionBwdOp()(o, q, k, v, o, lse.double(), None)
    with pytest.raises(OpArgumentError, match=r"AttentionFwdOp: too many positional arguments; it takes \(\*, causal=False"):
        AttentionFwdOp(True)  # the params are keyword-only


# -- the bench peers --------------------------------------------------------------------------------


def test_the_peer_table_names_family_ops_and_the_adapters_call_as_the_op_computes(monkeypatch):
    import contextlib

    import torch.nn.attention

    from tileops.ops.attention import command_line

    pinned = []  # the CPU has neither backend: record the one pinned and let torch choose
    monkeypatch.setattr(torch.nn.attention, "sdpa_kernel", lambda backend: pinned.append(backend) or contextlib.nullcontext())

    assert set(command_line.PEERS) <= {op_class.__name__ for op_class in FAMILIES["attention"]}
    assert list(command_line.PEERS["AttentionFwdOp"]) == ["SDPA flash", "SDPA cuDNN", "flash-attn"]
    q, k, v = _qkv(2, 16, 16, 4, 2, 32)
    inputs = {"q": q, "k": k, "v": v}
    for column in ("SDPA flash", "SDPA cuDNN"):
        where, adapter = command_line.PEERS["AttentionFwdOp"][column]
        assert where == "torch.nn.functional:scaled_dot_product_attention"
        params = {"causal": True, "window": None, "scale": None, "qkv_layout": "bshd"}
        call = adapter(lambda *a, **kw: F.scaled_dot_product_attention(*a, **kw), inputs, params)
        torch.testing.assert_close(call(), AttentionFwdOp(causal=True)(q, k, v)[0], atol=1e-5, rtol=1e-5)
        assert pinned[-1].name == ("FLASH_ATTENTION" if column == "SDPA flash" else "CUDNN_ATTENTION")
        assert "sliding window" in adapter(None, inputs, {**params, "window": 4})
        assert "top left" in adapter(None, {"q": q, "k": k[:, :9], "v": v[:, :9]}, params)
    _, flash = command_line.PEERS["AttentionFwdOp"]["flash-attn"]
    seen = []
    flash(lambda *a, **kw: seen.append(kw), inputs, {"causal": True, "window": 7, "scale": 0.1, "qkv_layout": "bshd"})()
    assert seen == [{"causal": True, "softmax_scale": 0.1, "window_size": (7, -1)}]
