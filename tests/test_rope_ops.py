"""The rope family on the CPU: every small manifest workload against the reference; against
Hugging Face's formulas written out here (Llama's rotate_half, GPT-NeoX's partial rotation,
GPT-J's rotate_every_two); GQA, 3-D token layouts, q and k sliced from a fused qkv tensor,
decode positions that are not contiguous; gradients (gradcheck in float64, and against torch's
autograd of the formula); a compiled training step; bad calls."""

from __future__ import annotations

import pytest
import torch

from tileops.backend import OpArgumentError, register_kernel_type
from tileops.ops import FAMILIES, RotaryEmbeddingBwdOp, RotaryEmbeddingFwdOp, RotaryEmbeddingInplaceFwdOp
from tileops.ops.rope.cpu import TorchCpuRotaryEmbedding
from tileops.testing import check_workload, workload_cases

#: The CPU tier runs workloads up to this many elements in all; larger ones run in the GPU tier.
CPU_ELEMENTS = 1 << 23

CASES = [case for case in workload_cases(FAMILIES["rope"]) if case.elements <= CPU_ELEMENTS]
DEVICE = "cpu"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_small_workload_matches_the_reference(case):
    op = case.op_class(**case.workload.params)
    check_workload(op, case.workload, case.dtype, DEVICE)


# -- Hugging Face's formulas, written out (transformers is not a dependency) -------------------

def rotate_half(x):
    """transformers.models.llama.modeling_llama.rotate_half."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' Llama apply_rotary_pos_emb: q, k (batch, heads, seq, D); cos, sin (batch, seq, D)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def apply_partial_rotary_pos_emb(q, k, cos, sin):
    """GPT-NeoX / Phi: the first cos.shape[-1] columns rotated, the rest passed through."""
    rotary = cos.shape[-1]
    q_rot, k_rot = apply_rotary_pos_emb(q[..., :rotary], k[..., :rotary], cos, sin)
    return torch.cat((q_rot, q[..., rotary:]), -1), torch.cat((k_rot, k[..., rotary:]), -1)


def rotate_every_two(x):
    """transformers.models.gptj.modeling_gptj.rotate_every_two."""
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)


def apply_rotary_pos_emb_gptj(tensor, sin, cos):
    """transformers' GPT-J: tensor (batch, seq, heads, rotary); sin, cos (batch, seq, rotary / 2)."""
    sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
    cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
    return (tensor * cos) + (rotate_every_two(tensor) * sin)


def llama_caches(positions, dim, base=10000.0, dtype=torch.float32):
    """cos and sin of Llama's rotary embedding for positions 0..positions-1: cat(freqs, freqs)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = torch.outer(torch.arange(positions).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def gptj_table(positions, dim, base=10000.0):
    """GPT-J's embed_positions: [sin | cos] of the half-width frequencies."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64) / dim))
    sinusoid = torch.einsum("i , j -> i j", torch.arange(positions, dtype=torch.int64).float(), inv_freq).float()
    return torch.cat((torch.sin(sinusoid), torch.cos(sinusoid)), dim=1)


def _qk(batch, seq, heads_q, heads_k, dim, dtype=torch.float32, device=DEVICE):
    q = torch.randn(batch, seq, heads_q, dim, dtype=dtype, device=device)
    k = torch.randn(batch, seq, heads_k, dim, dtype=dtype, device=device)
    return q, k


# GQA 32/8 and 28/4 (Llama 3, Qwen2) shrunk, MHA, MQA.
HEADS = [(8, 2), (7, 1), (4, 4), (6, 3)]


@pytest.mark.parametrize(("heads_q", "heads_k"), HEADS, ids=lambda h: str(h))
@pytest.mark.parametrize("cache_dtype", ["float32", "input", "float16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_llama_neox_matches_hugging_face(heads_q, heads_k, dtype, cache_dtype):
    q, k = _qk(2, 9, heads_q, heads_k, 64, dtype)
    cos, sin = llama_caches(32, 64, dtype=dtype if cache_dtype == "input" else getattr(torch, cache_dtype))
    position_ids = torch.tensor([list(range(9)), [3, 17, 4, 31, 0, 0, 12, 5, 30]])
    q_rot, k_rot = RotaryEmbeddingFwdOp()(q.to(DEVICE), k.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), position_ids.to(DEVICE))
    q_ref, k_ref = apply_rotary_pos_emb(
        q.double().transpose(1, 2), k.double().transpose(1, 2), cos.double()[position_ids], sin.double()[position_ids]
    )
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(q_rot.cpu(), q_ref.transpose(1, 2).to(dtype), atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(k_rot.cpu(), k_ref.transpose(1, 2).to(dtype), atol=tolerance, rtol=tolerance)
    assert q_rot.shape == q.shape and k_rot.shape == k.shape and q_rot.dtype == k_rot.dtype == dtype


@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(80, 32), (64, 16), (10, 6), (9, 4), (128, 128)])
def test_partial_rotation_matches_gpt_neox(head_dim, rotary_dim):
    q, k = _qk(2, 5, 4, 2, head_dim)
    cos, sin = llama_caches(16, rotary_dim)
    position_ids = torch.tensor([[0, 1, 2, 3, 4], [9, 2, 15, 7, 7]])
    q_rot, k_rot = RotaryEmbeddingFwdOp(rotary_dim)(q, k, cos, sin, position_ids)
    q_ref, k_ref = apply_partial_rotary_pos_emb(
        q.transpose(1, 2), k.transpose(1, 2), cos[position_ids], sin[position_ids]
    )
    torch.testing.assert_close(q_rot, q_ref.transpose(1, 2))
    torch.testing.assert_close(k_rot, k_ref.transpose(1, 2))
    torch.testing.assert_close(q_rot[..., rotary_dim:], q[..., rotary_dim:], atol=0, rtol=0)  # passed through


@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(256, 64), (64, 64), (10, 6)])
def test_interleaved_matches_gpt_j(head_dim, rotary_dim):
    q, k = _qk(2, 6, 4, 4, head_dim)
    table = gptj_table(32, rotary_dim)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 5], [31, 8, 8, 1, 20, 2]])
    sincos = table[position_ids]
    sin_half, cos_half = torch.split(sincos, sincos.shape[-1] // 2, dim=-1)
    q_ref = torch.cat((apply_rotary_pos_emb_gptj(q[..., :rotary_dim], sin_half, cos_half), q[..., rotary_dim:]), -1)
    k_ref = torch.cat((apply_rotary_pos_emb_gptj(k[..., :rotary_dim], sin_half, cos_half), k[..., rotary_dim:]), -1)
    # The op's caches are rotary_dim wide, each angle for both columns of its pair, as GPT-J repeats them.
    cos = torch.repeat_interleave(table[:, rotary_dim // 2 :], 2, -1)
    sin = torch.repeat_interleave(table[:, : rotary_dim // 2], 2, -1)
    q_rot, k_rot = RotaryEmbeddingFwdOp(rotary_dim, "interleaved")(q, k, cos, sin, position_ids)
    torch.testing.assert_close(q_rot, q_ref)
    torch.testing.assert_close(k_rot, k_ref)


def test_three_dimensional_tokens_match_the_four_dimensional_call():
    q, k = _qk(3, 4, 8, 2, 64)
    cos, sin = llama_caches(64, 64)
    position_ids = torch.randint(0, 64, (3, 4))
    op = RotaryEmbeddingFwdOp()
    q4, k4 = op(q, k, cos, sin, position_ids)
    q3, k3 = op(q.reshape(12, 8, 64), k.reshape(12, 2, 64), cos, sin, position_ids.reshape(12))
    assert q3.shape == (12, 8, 64) and k3.shape == (12, 2, 64)
    torch.testing.assert_close(q3, q4.reshape(12, 8, 64), atol=0, rtol=0)
    torch.testing.assert_close(k3, k4.reshape(12, 2, 64), atol=0, rtol=0)


def test_q_and_k_sliced_from_a_fused_qkv_tensor():
    batch, seq, heads_q, heads_k, dim = 2, 5, 8, 2, 64
    qkv = torch.randn(batch, seq, (heads_q + 2 * heads_k) * dim)
    q = qkv[..., : heads_q * dim].view(batch, seq, heads_q, dim)
    k = qkv[..., heads_q * dim : (heads_q + heads_k) * dim].view(batch, seq, heads_k, dim)
    assert not q.is_contiguous() and not k.is_contiguous()
    cos, sin = llama_caches(16, dim)
    position_ids = torch.arange(seq).expand(batch, seq)  # a broadcast view: not contiguous either
    before = qkv.clone()
    q_rot, k_rot = RotaryEmbeddingFwdOp()(q, k, cos, sin, position_ids)
    q_ref, k_ref = RotaryEmbeddingFwdOp()(q.contiguous(), k.contiguous(), cos, sin, position_ids.contiguous())
    torch.testing.assert_close(q_rot, q_ref, atol=0, rtol=0)
    torch.testing.assert_close(k_rot, k_ref, atol=0, rtol=0)
    assert torch.equal(qkv, before)  # out of place: the fused tensor is not written


@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_in_place_rotates_q_and_k_where_they_are_slices_included(style):
    batch, seq, heads_q, heads_k, dim = 2, 5, 8, 2, 64
    qv = torch.randn(batch, seq, (heads_q + heads_k) * dim, dtype=torch.bfloat16)  # a fused [q | v]
    q = qv[..., : heads_q * dim].view(batch, seq, heads_q, dim)
    k = torch.randn(batch, seq, heads_k, dim, dtype=torch.bfloat16)
    v_before = qv[..., heads_q * dim :].clone()
    cos, sin = llama_caches(16, 32)
    position_ids = torch.tensor([[0, 1, 2, 3, 4], [11, 3, 15, 0, 7]])
    q_want, k_want = RotaryEmbeddingFwdOp(32, style)(q, k, cos, sin, position_ids)
    q_out, k_out = RotaryEmbeddingInplaceFwdOp(32, style)(q, k, cos, sin, position_ids)
    assert q_out is q and k_out is k
    torch.testing.assert_close(q, q_want, atol=0, rtol=0)
    torch.testing.assert_close(k, k_want, atol=0, rtol=0)
    assert torch.equal(qv[..., heads_q * dim :], v_before)  # v untouched


def test_in_place_q_and_k_of_one_fused_tensor_rotate_where_they_are():
    # The two slices' memory ranges interleave, but they share no element: the overlap rule
    # compares views of the same strides element by element.
    qkv = torch.randn(2, 5, 12 * 64)
    q, k = qkv[..., : 8 * 64].view(2, 5, 8, 64), qkv[..., 8 * 64 : 10 * 64].view(2, 5, 2, 64)
    v_before = qkv[..., 10 * 64 :].clone()
    cos, sin = llama_caches(16, 64)
    position_ids = torch.tensor([[0, 1, 2, 3, 4], [9, 3, 15, 0, 7]])
    q_want, k_want = RotaryEmbeddingFwdOp()(q, k, cos, sin, position_ids)
    q_out, k_out = RotaryEmbeddingInplaceFwdOp()(q, k, cos, sin, position_ids)
    assert q_out is q and k_out is k
    torch.testing.assert_close(q, q_want, atol=0, rtol=0)
    torch.testing.assert_close(k, k_want, atol=0, rtol=0)
    assert torch.equal(qkv[..., 10 * 64 :], v_before)  # v untouched


def test_in_place_q_and_k_that_share_elements_are_refused_naming_both():
    qkv = torch.randn(2, 5, 12 * 64)
    q, k = qkv[..., : 8 * 64].view(2, 5, 8, 64), qkv[..., 7 * 64 : 9 * 64].view(2, 5, 2, 64)  # head 7 in both
    cos, sin = llama_caches(16, 64)
    with pytest.raises(OpArgumentError, match=r"RotaryEmbeddingInplaceFwdOp: argument 'q' and argument 'k' share memory"):
        RotaryEmbeddingInplaceFwdOp()(q, k, cos, sin, torch.zeros(2, 5, dtype=torch.int64))


def test_decode_with_positions_that_are_not_contiguous():
    # Four sequences at different lengths, one new token each: (batch, 1, heads, D).
    q, k = _qk(4, 1, 8, 2, 128)
    cos, sin = llama_caches(4096, 128)
    position_ids = torch.tensor([[4095], [0], [17], [1023]])
    q_rot, k_rot = RotaryEmbeddingFwdOp()(q, k, cos, sin, position_ids)
    for b, position in enumerate(position_ids[:, 0].tolist()):
        q_ref, k_ref = apply_rotary_pos_emb(q[b : b + 1].transpose(1, 2), k[b : b + 1].transpose(1, 2),
                                            cos[position][None, None], sin[position][None, None])
        torch.testing.assert_close(q_rot[b : b + 1], q_ref.transpose(1, 2))
        torch.testing.assert_close(k_rot[b : b + 1], k_ref.transpose(1, 2))


def test_position_zero_is_the_identity_and_a_rotation_keeps_each_pair_norm():
    q, k = _qk(1, 3, 4, 2, 64)
    cos, sin = llama_caches(8, 64)
    q_rot, k_rot = RotaryEmbeddingFwdOp()(q, k, cos, sin, torch.tensor([[0, 5, 7]]))
    torch.testing.assert_close(q_rot[:, 0], q[:, 0], atol=0, rtol=0)
    pair_norm = q[..., :32].square() + q[..., 32:].square()
    torch.testing.assert_close(q_rot[..., :32].square() + q_rot[..., 32:].square(), pair_norm)


# -- gradients ------------------------------------------------------------------------------------

STYLES = [(None, "neox", 8), (4, "neox", 10), (None, "interleaved", 8), (6, "interleaved", 9)]


@pytest.mark.parametrize(("rotary_dim", "style", "head_dim"), STYLES, ids=str)
def test_gradcheck_in_float64(rotary_dim, style, head_dim):
    op = RotaryEmbeddingFwdOp(rotary_dim, style)
    q = torch.randn(2, 3, 4, head_dim, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, 2, head_dim, dtype=torch.float64, requires_grad=True)
    width = head_dim if rotary_dim is None else rotary_dim
    # Arbitrary caches, not angles: the backward is the exact transpose for any cache.
    cos, sin = torch.randn(2, 8, width, dtype=torch.float64).unbind(0)
    position_ids = torch.tensor([[5, 1, 7], [0, 2, 2]])
    assert torch.autograd.gradcheck(lambda a, b: op(a, b, cos, sin, position_ids), (q, k))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("rotary_dim", "style", "head_dim"), STYLES, ids=str)
def test_gradients_match_torch_autograd_of_the_formula(rotary_dim, style, head_dim, dtype):
    width = head_dim if rotary_dim is None else rotary_dim
    q, k = (t.requires_grad_() for t in _qk(2, 5, 4, 2, head_dim, dtype))
    cos, sin = llama_caches(16, width)
    if style == "interleaved":  # each angle for both columns of its pair
        cos, sin = (torch.repeat_interleave(t[:, : width // 2], 2, -1) for t in (cos, sin))
    position_ids = torch.tensor([[0, 1, 2, 3, 4], [15, 3, 9, 9, 0]])
    q_rot, k_rot = RotaryEmbeddingFwdOp(rotary_dim, style)(q, k, cos, sin, position_ids)
    assert type(q_rot.grad_fn).__name__ == "RotaryEmbeddingFwdOpBackward"
    dq_rot, dk_rot = torch.randn_like(q_rot), torch.randn_like(k_rot)
    torch.autograd.backward((q_rot, k_rot), (dq_rot, dk_rot))

    q_ref, k_ref = (t.detach().double().requires_grad_() for t in (q, k))
    c, s = cos.double()[position_ids].unsqueeze(-2), sin.double()[position_ids].unsqueeze(-2)
    rotate = rotate_half if style == "neox" else lambda x: torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)
    outputs = [torch.cat((x[..., :width] * c + rotate(x[..., :width]) * s, x[..., width:]), -1) for x in (q_ref, k_ref)]
    torch.autograd.backward(outputs, (dq_rot.double(), dk_rot.double()))
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(q.grad, q_ref.grad.to(dtype), atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(k.grad, k_ref.grad.to(dtype), atol=tolerance, rtol=tolerance)


def test_the_backward_op_is_the_rotation_by_minus_theta():
    q, k = _qk(2, 4, 4, 2, 64)
    cos, sin = llama_caches(16, 64)
    position_ids = torch.tensor([[1, 2, 3, 4], [9, 9, 0, 15]])
    q_rot, k_rot = RotaryEmbeddingFwdOp()(q, k, cos, sin, position_ids)
    q_back, k_back = RotaryEmbeddingBwdOp()(q_rot, k_rot, cos, sin, position_ids)
    torch.testing.assert_close(q_back, q)
    torch.testing.assert_close(k_back, k)
    q_minus, k_minus = RotaryEmbeddingFwdOp()(q_rot, k_rot, cos, -sin, position_ids)
    torch.testing.assert_close(q_minus, q_back)
    torch.testing.assert_close(k_minus, k_back)


def test_cos_sin_and_positions_get_no_gradient():
    q, k = (t.requires_grad_() for t in _qk(1, 2, 2, 2, 8))
    cos, sin = (t.requires_grad_() for t in llama_caches(4, 8))
    q_rot, k_rot = RotaryEmbeddingFwdOp()(q, k, cos, sin, torch.tensor([[0, 3]]))
    (q_rot.sum() + k_rot.sum()).backward()
    assert q.grad is not None and k.grad is not None and cos.grad is None and sin.grad is None


class _Attention(torch.nn.Module):
    """A tiny GQA attention block: fused qkv projection, rotary embedding, attention."""

    def __init__(self, rope, hidden=32, heads_q=4, heads_k=2, dim=8):
        super().__init__()
        torch.manual_seed(0)
        self.heads_q, self.heads_k, self.dim = heads_q, heads_k, dim
        self.qkv = torch.nn.Linear(hidden, (heads_q + 2 * heads_k) * dim)
        self.out = torch.nn.Linear(heads_q * dim, hidden)
        self.rope = rope
        cos, sin = llama_caches(16, dim)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def forward(self, x, position_ids):
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).split((self.heads_q * self.dim, self.heads_k * self.dim, self.heads_k * self.dim), -1)
        q = q.view(batch, seq, self.heads_q, self.dim)
        k = k.view(batch, seq, self.heads_k, self.dim)
        v = v.view(batch, seq, self.heads_k, self.dim)
        q, k = self.rope(q, k, self.cos, self.sin, position_ids)
        attention = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        return self.out(attention.transpose(1, 2).reshape(batch, seq, -1))


def _torch_rope(q, k, cos, sin, position_ids):
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos[position_ids], sin[position_ids])
    return q_ref.transpose(1, 2), k_ref.transpose(1, 2)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_an_attention_block_trains_as_with_hugging_face_rope(compiled):
    torch._dynamo.reset()
    models = [_Attention(RotaryEmbeddingFwdOp()), _Attention(_torch_rope)]
    runs = [torch.compile(m, fullgraph=True) if compiled else m for m in models]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    data, target = torch.randn(2, 6, 32), torch.randn(2, 6, 32)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]])
    losses = [[], []]
    for _ in range(4):
        for run, optimizer, history in zip(runs, optimizers, losses):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(run(data, position_ids), target)
            loss.backward()
            optimizer.step()
            history.append(loss.item())
    torch.testing.assert_close(losses[0], losses[1], atol=1e-5, rtol=1e-5)
    assert losses[0][-1] < losses[0][0]


def test_compiled_inference_needs_no_graph_break():
    torch._dynamo.reset()
    op = RotaryEmbeddingFwdOp(32, "interleaved")
    q, k = _qk(2, 3, 4, 2, 64)
    cos, sin = llama_caches(8, 32)
    position_ids = torch.tensor([[0, 1, 2], [5, 6, 7]])
    compiled = torch.compile(lambda *tensors: op(*tensors), fullgraph=True)
    for got, want in zip(compiled(q, k, cos, sin, position_ids), op(q, k, cos, sin, position_ids)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_the_in_place_op_compiles_and_rotates_the_callers_tensors(backend):
    # A custom op cannot return its inputs: it declares q and k written and returns placeholders,
    # and the traced call returns the caller's q and k (slices of a fused qkv tensor here).
    torch._dynamo.reset()
    op = RotaryEmbeddingInplaceFwdOp(32)
    qkv = torch.randn(2, 3, (4 + 2 * 2) * 64)
    q, k = qkv[..., : 4 * 64].view(2, 3, 4, 64), qkv[..., 4 * 64 : 6 * 64].view(2, 3, 2, 64)
    cos, sin = llama_caches(8, 32)
    position_ids = torch.tensor([[0, 1, 2], [5, 6, 7]])
    want_q, want_k = RotaryEmbeddingFwdOp(32)(q, k, cos, sin, position_ids)

    def rotate_then_use(q, k):
        q_out, k_out = op(q, k, cos, sin, position_ids)
        return q_out is q and k_out is k, q_out * 2, k_out.sum(-1)

    returned_inputs, doubled, summed = torch.compile(rotate_then_use, backend=backend, fullgraph=True)(q, k)
    assert returned_inputs
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(k, want_k)
    torch.testing.assert_close(doubled, want_q * 2)
    torch.testing.assert_close(summed, want_k.sum(-1))


# -- bad calls ------------------------------------------------------------------------------------

def test_bad_calls_name_the_op_and_the_argument():
    q, k = _qk(2, 3, 4, 2, 64)
    cos, sin = llama_caches(8, 64)
    position_ids = torch.zeros(2, 3, dtype=torch.int64)
    op = RotaryEmbeddingFwdOp()
    with pytest.raises(OpArgumentError, match=r"RotaryEmbeddingFwdOp: argument 'k' expected shape \[\*tokens, Hkv, D\]"):
        op(q, k[:, :2], cos, sin, position_ids)
    with pytest.raises(OpArgumentError, match=r"RotaryEmbeddingFwdOp: argument 'k' expected shape"):
        op(q, k[..., :32], cos, sin, position_ids)
    with pytest.raises(OpArgumentError, match=r"RotaryEmbeddingFwdOp: argument 'k' must have the dtype of 'q'"):
        op(q, k.half(), cos, sin, position_ids)
    with pytest.raises(OpArgumentError, match=r"RotaryEmbeddingFwdOp: argument 'position_ids' expected dtype int64"):
        op(q, k, cos, sin, position_ids.int())
    with pytest.raises(OpArgumentError, match=r"RotaryEmbeddingFwdOp: argument 'position_ids' expected shape"):
        op(q, k, cos, sin, position_ids[:, :2])
    with pytest.raises(OpArgumentError, match=r"RotaryEmbeddingFwdOp: argument 'sin' must have the shape of 'cos'"):
        op(q, k, cos, sin[:, :32], position_ids)
    with pytest.raises(OpArgumentError, match=r"RotaryEmbeddingFwdOp: the caches need at least one position"):
        op(q, k, cos[:0], sin[:0], position_ids)
    with pytest.raises(OpArgumentError, match=r"RotaryEmbeddingFwdOp: the caches' width R must be the rotated width"):
        op(q, k, cos[:, :32], sin[:, :32], position_ids)
    with pytest.raises(OpArgumentError, match=r"RotaryEmbeddingFwdOp: rotary_dim must be at most the head size D"):
        RotaryEmbeddingFwdOp(96)(q, k, llama_caches(8, 96)[0], llama_caches(8, 96)[1], position_ids)
    with pytest.raises(OpArgumentError, match=r"RotaryEmbeddingFwdOp: rotary_dim must be a positive even number"):
        RotaryEmbeddingFwdOp(7)
    with pytest.raises(OpArgumentError, match=r"RotaryEmbeddingFwdOp: style must be 'neox' or 'interleaved'"):
        RotaryEmbeddingFwdOp(style="gptj")
    with pytest.raises(OpArgumentError, match=r"RotaryEmbeddingBwdOp: param 'style' expected a str"):
        RotaryEmbeddingBwdOp(style=1)
    with pytest.raises(OpArgumentError, match=r"RotaryEmbeddingFwdOp: the rotated width must be even"):
        op(q[..., :63], k[..., :63], cos[:, :63], sin[:, :63], position_ids)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_positions_outside_the_caches_are_refused_on_the_cpu_naming_the_first(compiled):
    q, k = _qk(2, 3, 4, 2, 64)
    cos, sin = llama_caches(8, 64)
    ops = (RotaryEmbeddingFwdOp(), RotaryEmbeddingBwdOp(), RotaryEmbeddingInplaceFwdOp())
    for position in (8, -1, 100):
        # A negative position is refused too: counted from the end, it would take another's angle.
        position_ids = torch.tensor([[0, 1, 2], [3, 4, position]])
        for op in ops:
            call = torch.compile(op, fullgraph=True) if compiled else op
            name = type(op).__name__
            with pytest.raises(OpArgumentError, match=rf"{name}: argument 'position_ids' holds {position} at \(1, 2\); "
                                                      r"expected positions in \[0, 8\) \(the rows of cos and sin\)"):
                call(q.clone(), k.clone(), cos, sin, position_ids)
    flat = torch.tensor([0, 1, 2, 3, 4, 9])  # (tokens,) positions of 3-D q and k
    with pytest.raises(OpArgumentError, match=r"holds 9 at 5; expected positions in \[0, 8\)"):
        RotaryEmbeddingFwdOp()(q.flatten(0, 1), k.flatten(0, 1), cos, sin, flat)


# -- the bench's peer -----------------------------------------------------------------------------

class _LigerRecorder:
    """Stands for LigerRopeFunction: q, k (batch, heads, seq, D) and cos, sin (batch, seq, D)."""

    def __init__(self):
        self.calls = []

    def apply(self, q, k, cos, sin):
        self.calls.append((q.shape, k.shape, cos.shape))
        return apply_rotary_pos_emb(q, k, cos, sin)


def test_the_liger_peer_takes_ligers_layout_and_refuses_what_it_cannot_take():
    from tileops.ops.rope import command_line

    where, adapter = command_line.PEERS["RotaryEmbeddingFwdOp"]["Liger"]
    assert where == "liger_kernel.ops.rope:LigerRopeFunction"
    q, k = _qk(2, 5, 8, 2, 64)
    cos, sin = llama_caches(16, 64)
    inputs = {"q": q, "k": k, "cos": cos, "sin": sin, "position_ids": torch.randint(0, 16, (2, 5))}
    recorder = _LigerRecorder()
    q_peer, k_peer = adapter(recorder, inputs, {"rotary_dim": None, "style": "neox"})()
    assert recorder.calls == [((2, 8, 5, 64), (2, 2, 5, 64), (2, 5, 64))]
    for got, want in zip((q_peer, k_peer), RotaryEmbeddingFwdOp()(*inputs.values())):
        torch.testing.assert_close(got, want)
    assert adapter(recorder, inputs, {"style": "interleaved"}) == "rotates halves (the neox style) only"
    assert adapter(recorder, inputs, {"rotary_dim": 32}) == "rotates whole heads only, not a partial rotary_dim"
    three_d = {**inputs, "q": q.flatten(0, 1), "k": k.flatten(0, 1)}
    assert adapter(recorder, three_d, {}) == "takes (batch, seq, heads, D) q and k only"


class _ShapeRecordingRope(TorchCpuRotaryEmbedding):
    """A backend's rotary embedding on the CPU, taking the interface's (T, heads, D) tensors:
    records the shapes of q and position_ids."""

    general = False
    takes_any_shape = False
    seen: list = []

    def forward(self, q, k, cos, sin, position_ids):
        self.seen.append((tuple(q.shape), tuple(position_ids.shape)))
        return super().forward(q, k, cos, sin, position_ids)


class _AnyShapeRecordingRope(_ShapeRecordingRope):
    takes_any_shape = True
    seen: list = []


@pytest.mark.parametrize(("implementation", "given"), [(_ShapeRecordingRope, ((6, 4, 8), (6,))),
                                                       (_AnyShapeRecordingRope, ((2, 3, 4, 8), (2, 3)))])
def test_an_implementation_gets_tokens_flattened_unless_it_takes_any_shape(scoped_registry, implementation, given):
    implementation.seen.clear()
    register_kernel_type("RotaryEmbeddingFwdOp", "recording", implementation)
    q, k = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 2, 8)
    cos, sin = torch.randn(16, 8), torch.randn(16, 8)
    positions = torch.randint(0, 16, (2, 3))
    q_rot, k_rot = RotaryEmbeddingFwdOp()(q, k, cos, sin, positions)
    expected = apply_rotary_pos_emb(q, k, cos[positions], sin[positions], unsqueeze_dim=2)
    torch.testing.assert_close((q_rot, k_rot), expected)
    assert implementation.seen == [given]
