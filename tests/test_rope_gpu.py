"""GPU tier: the rope family's TileLang kernels on CUDA, against the manifest's reference, Hugging
Face's formulas (written out in ``test_rope_ops``) and the CPU implementation: every workload,
both kernel variants, GQA, 3-D tokens, q and k sliced from a fused qkv tensor, decode positions
that are not contiguous, float32 and 16-bit caches, gradients and a compiled training step, and
the in-place op on slices.

They need a CUDA GPU (``pytest -m gpu``, or ``tools/gpu-tier.sh``); elsewhere they skip.
"""

from __future__ import annotations

import pytest
import torch

from helpers import off_the_grid
from test_rope_ops import apply_rotary_pos_emb, gptj_table, llama_caches, rotate_every_two
from tileops.ops import FAMILIES, RotaryEmbeddingBwdOp, RotaryEmbeddingFwdOp, RotaryEmbeddingInplaceFwdOp
from tileops.testing import check_workload, workload_cases

pytestmark = pytest.mark.gpu

CASES = list(workload_cases(FAMILIES["rope"]))
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _served_by(op) -> set[str]:
    return {key for key, _ in op.built_kernels()}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_workload_matches_the_reference_on_cuda(case):
    op = case.op_class(**case.workload.params)
    check_workload(op, case.workload, case.dtype, "cuda")
    assert op.target == "builtin"
    expected = {"torch_float64"} if case.dtype == torch.float64 else {"tilelang", "tilelang_general"}
    assert _served_by(op) <= expected, _served_by(op)


@pytest.mark.parametrize(("heads_q", "heads_k"), [(32, 8), (64, 8), (28, 4), (8, 1)], ids=str)
@pytest.mark.parametrize("cache_dtype", ["float32", "input"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_llama_neox_matches_hugging_face_on_cuda(heads_q, heads_k, dtype, cache_dtype):
    q = torch.randn(2, 33, heads_q, 128, dtype=dtype, device="cuda")
    k = torch.randn(2, 33, heads_k, 128, dtype=dtype, device="cuda")
    cos, sin = (t.cuda() for t in llama_caches(4096, 128, dtype=torch.float32 if cache_dtype == "float32" else dtype))
    position_ids = torch.stack((torch.arange(33), torch.randint(0, 4096, (33,)))).cuda()
    op = RotaryEmbeddingFwdOp()
    q_rot, k_rot = op(q, k, cos, sin, position_ids)
    assert _served_by(op) == {"tilelang"}
    q_ref, k_ref = apply_rotary_pos_emb(
        q.double().transpose(1, 2), k.double().transpose(1, 2), cos.double()[position_ids], sin.double()[position_ids]
    )
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(q_rot, q_ref.transpose(1, 2).to(dtype), atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(k_rot, k_ref.transpose(1, 2).to(dtype), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(256, 64), (64, 64), (10, 6), (9, 4)])
def test_interleaved_matches_gpt_j_on_cuda(head_dim, rotary_dim, dtype):
    q = torch.randn(2, 6, 4, head_dim, dtype=dtype, device="cuda")
    k = torch.randn(2, 6, 2, head_dim, dtype=dtype, device="cuda")
    table = gptj_table(32, rotary_dim).cuda()
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 5], [31, 8, 8, 1, 20, 2]], device="cuda")
    sin_half, cos_half = torch.split(table[position_ids].double(), rotary_dim // 2, dim=-1)
    sin_full = torch.repeat_interleave(sin_half[:, :, None, :], 2, 3)
    cos_full = torch.repeat_interleave(cos_half[:, :, None, :], 2, 3)

    def reference(x):
        rotated = x.double()[..., :rotary_dim]
        return torch.cat((rotated * cos_full + rotate_every_two(rotated) * sin_full, x.double()[..., rotary_dim:]), -1)

    cos = torch.repeat_interleave(table[:, rotary_dim // 2 :], 2, -1)
    sin = torch.repeat_interleave(table[:, : rotary_dim // 2], 2, -1)
    q_rot, k_rot = RotaryEmbeddingFwdOp(rotary_dim, "interleaved")(q, k, cos, sin, position_ids)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(q_rot, reference(q).to(dtype), atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(k_rot, reference(k).to(dtype), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("op_class", [RotaryEmbeddingFwdOp, RotaryEmbeddingBwdOp])
@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_both_variants_equal_the_cpu_implementation(op_class, style, dtype):
    """The vectorised kernel on aligned tensors, the general one on tensors one element off."""
    op = op_class(96, style)
    cos, sin = torch.randn(2, 64, 96).unbind(0)
    position_ids = torch.randint(0, 64, (3, 5))
    q, k = torch.randn(3, 5, 12, 128).to(dtype), torch.randn(3, 5, 4, 128).to(dtype)
    want = op_class(96, style)(q, k, cos, sin, position_ids)
    aligned = op(q.cuda(), k.cuda(), cos.cuda(), sin.cuda(), position_ids.cuda())
    assert _served_by(op) == {"tilelang"}
    shifted = off_the_grid(q.cuda())  # 2 or 4 bytes past a 16-byte boundary
    general = op(shifted, k.cuda(), cos.cuda(), sin.cuda(), position_ids.cuda())
    assert _served_by(op) == {"tilelang", "tilelang_general"}
    for got in (aligned, general):
        for tensor, expected in zip(got, want):
            torch.testing.assert_close(tensor.cpu(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_three_dimensional_tokens_and_a_fused_qkv_slice_on_cuda():
    tokens, heads_q, heads_k, dim = 37, 32, 8, 128
    qkv = torch.randn(tokens, (heads_q + 2 * heads_k) * dim, dtype=torch.bfloat16, device="cuda")
    q = qkv[:, : heads_q * dim].view(tokens, heads_q, dim)
    k = qkv[:, heads_q * dim : (heads_q + heads_k) * dim].view(tokens, heads_k, dim)
    cos, sin = (t.cuda() for t in llama_caches(8192, dim))
    position_ids = torch.randint(0, 8192, (tokens,), device="cuda")
    before = qkv.clone()
    q_rot, k_rot = RotaryEmbeddingFwdOp()(q, k, cos, sin, position_ids)
    q_cpu, k_cpu = RotaryEmbeddingFwdOp()(q.cpu(), k.cpu(), cos.cpu(), sin.cpu(), position_ids.cpu())
    torch.testing.assert_close(q_rot.cpu(), q_cpu, atol=1.6e-2, rtol=1.6e-2)
    torch.testing.assert_close(k_rot.cpu(), k_cpu, atol=1.6e-2, rtol=1.6e-2)
    assert torch.equal(qkv, before)


def test_one_token_decode_at_scattered_positions_on_cuda():
    q = torch.randn(64, 1, 32, 128, dtype=torch.float16, device="cuda")
    k = torch.randn(64, 1, 8, 128, dtype=torch.float16, device="cuda")
    cos, sin = (t.cuda() for t in llama_caches(131072, 128))
    position_ids = torch.randint(0, 131072, (64, 1), device="cuda")
    q_rot, k_rot = RotaryEmbeddingFwdOp()(q, k, cos, sin, position_ids)
    q_cpu, k_cpu = RotaryEmbeddingFwdOp()(q.cpu(), k.cpu(), cos.cpu(), sin.cpu(), position_ids.cpu())
    torch.testing.assert_close(q_rot.cpu(), q_cpu, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(k_rot.cpu(), k_cpu, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gradients_on_cuda_equal_those_on_cpu(dtype):
    cos, sin = llama_caches(64, 128)
    position_ids = torch.randint(0, 64, (2, 9))
    leaves = {}
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        q = torch.randn(2, 9, 28, 128, dtype=dtype).to(device).requires_grad_()
        k = torch.randn(2, 9, 4, 128, dtype=dtype).to(device).requires_grad_()
        q_rot, k_rot = RotaryEmbeddingFwdOp()(q, k, cos.to(device), sin.to(device), position_ids.to(device))
        (q_rot.float().square().sum() + k_rot.float().sum()).backward()
        leaves[device] = (q.grad.cpu(), k.grad.cpu())
    for got, want in zip(leaves["cuda"], leaves["cpu"]):
        torch.testing.assert_close(got, want, atol=TOLERANCE[dtype] * 4, rtol=TOLERANCE[dtype])


def test_float64_gradcheck_on_cuda():
    op = RotaryEmbeddingFwdOp(6, "interleaved")
    q = torch.randn(2, 3, 4, 10, dtype=torch.float64, device="cuda", requires_grad=True)
    k = torch.randn(2, 3, 2, 10, dtype=torch.float64, device="cuda", requires_grad=True)
    cos, sin = torch.randn(2, 8, 6, dtype=torch.float64, device="cuda").unbind(0)
    position_ids = torch.tensor([[5, 1, 7], [0, 2, 2]], device="cuda")
    assert torch.autograd.gradcheck(lambda a, b: op(a, b, cos, sin, position_ids), (q, k))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_positions_outside_the_caches_read_zeros_on_cuda_without_a_fault(dtype):
    # Not refused on CUDA (that would synchronise): the TileLang kernels and the float64
    # implementation alike read cos = sin = 0 there, so those tokens' rotated columns are 0.
    cos, sin = (t.to("cuda", dtype) for t in llama_caches(8, 64))
    q = torch.randn(1, 4, 4, 64, device="cuda", dtype=dtype)
    k = torch.randn(1, 4, 2, 64, device="cuda", dtype=dtype)
    position_ids = torch.tensor([[1, 8, -3, 5]], device="cuda")
    op = RotaryEmbeddingFwdOp()
    q_rot, k_rot = op(q, k, cos, sin, position_ids)
    inside = RotaryEmbeddingFwdOp()(q[:, [0, 3]], k[:, [0, 3]], cos, sin, position_ids[:, [0, 3]])
    torch.testing.assert_close(q_rot[:, [0, 3]], inside[0], atol=0, rtol=0)
    torch.testing.assert_close(k_rot[:, [0, 3]], inside[1], atol=0, rtol=0)
    assert not q_rot[:, 1:3].any() and not k_rot[:, 1:3].any()
    torch.cuda.synchronize()  # no device-side fault was left behind


def test_a_compiled_training_step_on_cuda_needs_no_graph_break():
    torch._dynamo.reset()
    op = RotaryEmbeddingFwdOp()
    cos, sin = (t.cuda() for t in llama_caches(128, 64))
    position_ids = torch.arange(16, device="cuda").expand(2, 16)
    q = torch.randn(2, 16, 8, 64, device="cuda", requires_grad=True)
    k = torch.randn(2, 16, 2, 64, device="cuda", requires_grad=True)

    @torch.compile(fullgraph=True)
    def step(q, k):
        q_rot, k_rot = op(q, k, cos, sin, position_ids)
        return (q_rot.square().sum() + (k_rot * 3).sum())

    step(q, k).backward()
    q_ref, k_ref = (t.detach().clone().requires_grad_() for t in (q, k))
    q_rot, k_rot = apply_rotary_pos_emb(q_ref.transpose(1, 2), k_ref.transpose(1, 2), cos[position_ids], sin[position_ids])
    (q_rot.square().sum() + (k_rot * 3).sum()).backward()
    torch.testing.assert_close(q.grad, q_ref.grad)
    torch.testing.assert_close(k.grad, k_ref.grad)


@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_in_place_on_cuda_writes_what_the_out_of_place_op_returns(style):
    tokens, heads_q, heads_k, dim = 19, 32, 8, 128
    qv = torch.randn(tokens, (heads_q + heads_k) * dim, dtype=torch.bfloat16, device="cuda")
    q = qv[:, : heads_q * dim].view(tokens, heads_q, dim)  # a strided slice of a fused [q | v]
    k = torch.randn(tokens, heads_k, dim, dtype=torch.bfloat16, device="cuda")
    cos, sin = torch.randn(2, 64, 96, device="cuda").unbind(0)
    position_ids = torch.randint(0, 64, (tokens,), device="cuda")
    q_want, k_want = RotaryEmbeddingFwdOp(96, style)(q, k, cos, sin, position_ids)
    op = RotaryEmbeddingInplaceFwdOp(96, style)
    q_out, k_out = op(q, k, cos, sin, position_ids)
    assert q_out is q and k_out is k and _served_by(op) == {"tilelang"}
    torch.testing.assert_close(q, q_want, atol=0, rtol=0)
    torch.testing.assert_close(k, k_want, atol=0, rtol=0)
