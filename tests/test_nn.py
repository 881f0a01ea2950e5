"""``tileops.nn``: the norm modules as drop-ins for torch's, on the CPU."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F

import tileops.nn as tnn


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (lambda: tnn.RMSNorm((4, 16), eps=1e-6), lambda: torch.nn.RMSNorm((4, 16), eps=1e-6)),
        (lambda: tnn.RMSNorm(64), lambda: torch.nn.RMSNorm(64)),
        (lambda: tnn.LayerNorm(64), lambda: torch.nn.LayerNorm(64)),
        (lambda: tnn.LayerNorm(64, bias=False), lambda: torch.nn.LayerNorm(64, bias=False)),
        (lambda: tnn.LayerNorm(64, elementwise_affine=False), lambda: torch.nn.LayerNorm(64, elementwise_affine=False)),
    ],
    ids=["rms-2d-shape", "rms", "layer", "layer-no-bias", "layer-no-affine"],
)
def test_a_module_loads_torchs_checkpoint_and_back_and_computes_and_trains_alike(ours, theirs):
    torch.manual_seed(0)
    mine, reference = ours(), theirs()
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    buffer = io.BytesIO()
    torch.save(reference.state_dict(), buffer)
    buffer.seek(0)
    mine.load_state_dict(torch.load(buffer))
    assert mine.state_dict().keys() == reference.state_dict().keys()
    reference.load_state_dict(mine.state_dict())

    shape = (3, 5, *mine.normalized_shape)
    x = torch.randn(shape, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    torch.testing.assert_close(mine(x), reference(x_ref))
    mine(x).square().sum().backward()
    reference(x_ref).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    for a, b in zip(mine.parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_the_fused_modules_return_the_norm_and_the_residual_sum():
    x, residual = torch.randn(2, 32), torch.randn(2, 32)
    y, total = tnn.FusedAddRMSNorm(32)(x, residual)
    torch.testing.assert_close(total, x + residual)
    torch.testing.assert_close(y, F.rms_norm(x + residual, (32,), torch.ones(32)))
    y, total = tnn.FusedAddLayerNorm(32)(x, residual)
    torch.testing.assert_close(y, F.layer_norm(x + residual, (32,)))
    assert set(tnn.FusedAddLayerNorm(32).state_dict()) == {"weight", "bias"}


def test_float32_parameters_serve_bfloat16_inputs_and_receive_float32_gradients():
    norm = tnn.RMSNorm(64)
    x = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    y = norm(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert norm.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16


def test_modules_take_a_target_and_copy_and_compile():
    norm = tnn.LayerNorm(16, target="builtin")
    assert norm.op.requested_target == "builtin"
    assert "target=builtin" in repr(norm)
    clone = copy.deepcopy(norm)
    assert clone.op is not norm.op and clone.op.requested_target == "builtin"
    compiled = torch.compile(norm, fullgraph=True)
    x = torch.randn(3, 16, requires_grad=True)
    compiled(x).sum().backward()
    torch.testing.assert_close(norm(x), F.layer_norm(x, (16,)))
    assert norm.weight.grad is not None


# -- the MLP, rotary, attention and loss modules ---------------------------------------------------


def test_the_gated_activations_take_gate_and_up_or_one_packed_tensor():
    gate, up = torch.randn(3, 5, 8), torch.randn(3, 5, 8)
    torch.testing.assert_close(tnn.SwiGLU()(gate, up), F.silu(gate) * up)
    torch.testing.assert_close(tnn.GeGLU("tanh")(gate, up), F.gelu(gate, approximate="tanh") * up)
    packed = torch.cat((gate, up), -1)
    torch.testing.assert_close(tnn.SwiGLU(d=8)(packed), F.silu(gate) * up)
    torch.testing.assert_close(tnn.GeGLU(d=8)(packed), F.gelu(gate) * up)
    with pytest.raises(TypeError, match=r"SwiGLU: a packed \[gate \| up\] input needs the half width d at construction"):
        tnn.SwiGLU()(packed)


@pytest.mark.parametrize(("activation", "formula"), [("silu", F.silu), ("gelu_tanh", lambda x: F.gelu(x, approximate="tanh"))])
def test_the_gated_mlp_loads_a_llama_mlp_checkpoint_and_trains_alike(activation, formula):
    torch.manual_seed(0)
    mlp = tnn.GatedMLP(16, 32, activation, bias=True)
    assert set(mlp.state_dict()) == {f"{name}_proj.{p}" for name in ("gate", "up", "down") for p in ("weight", "bias")}
    x = torch.randn(2, 3, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y = mlp(x)
    expected = F.linear(formula(F.linear(x_ref, mlp.gate_proj.weight, mlp.gate_proj.bias)) * F.linear(x_ref, mlp.up_proj.weight, mlp.up_proj.bias),
                        mlp.down_proj.weight, mlp.down_proj.bias)
    torch.testing.assert_close(y, expected)
    (dx,) = torch.autograd.grad(y.square().sum(), x)
    (dx_ref,) = torch.autograd.grad(expected.square().sum(), x_ref)
    torch.testing.assert_close(dx, dx_ref)
    with pytest.raises(ValueError, match=r"GatedMLP: activation must be one of \['gelu', 'gelu_tanh', 'silu'\], got 'relu'"):
        tnn.GatedMLP(16, 32, "relu")


@pytest.mark.parametrize(("activation", "formula"), [("silu", F.silu), ("gelu", F.gelu)])
def test_the_packed_gated_mlp_loads_a_phi3_mlp_checkpoint_and_trains_alike(activation, formula):
    torch.manual_seed(0)
    mlp = tnn.PackedGatedMLP(16, 32, activation)
    assert set(mlp.state_dict()) == {"gate_up_proj.weight", "down_proj.weight"}
    assert mlp.gate_up_proj.weight.shape == (64, 16)
    assert mlp.act.packed_op.params["consume_inputs"]  # the fused projection's output takes its gradient
    x = torch.randn(2, 3, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y = mlp(x)
    gate, up = F.linear(x_ref, mlp.gate_up_proj.weight).chunk(2, dim=-1)  # transformers' Phi3MLP: the gate first
    expected = F.linear(formula(gate) * up, mlp.down_proj.weight)
    torch.testing.assert_close(y, expected)
    dx, dw = torch.autograd.grad(y.square().sum(), (x, mlp.gate_up_proj.weight))
    dx_ref, dw_ref = torch.autograd.grad(expected.square().sum(), (x_ref, mlp.gate_up_proj.weight))
    torch.testing.assert_close(dx, dx_ref)
    torch.testing.assert_close(dw, dw_ref)
    with pytest.raises(ValueError, match=r"PackedGatedMLP: activation must be one of \['gelu', 'gelu_tanh', 'silu'\], got 'relu'"):
        tnn.PackedGatedMLP(16, 32, "relu")


def test_rotary_embedding_rotates_as_llama_and_leaves_the_rest_of_a_partial_head():
    rope = tnn.RotaryEmbedding(8, max_positions=32, base=500.0)
    assert rope.state_dict() == {}
    q, k = torch.randn(2, 5, 4, 12), torch.randn(2, 5, 2, 12)
    positions = torch.tensor([[0, 1, 2, 3, 4], [31, 7, 9, 0, 2]])
    q_rot, k_rot = rope(q, k, positions)
    inv_freq = 1.0 / (500.0 ** (torch.arange(0, 8, 2).float() / 8))
    angles = positions[..., None].float() * inv_freq
    cos, sin = torch.cat((angles, angles), -1).cos()[:, :, None], torch.cat((angles, angles), -1).sin()[:, :, None]

    def rotated(x):
        head, rest = x[..., :8], x[..., 8:]
        half = torch.cat((-head[..., 4:], head[..., :4]), -1)
        return torch.cat((head * cos + half * sin, rest), -1)

    torch.testing.assert_close(q_rot, rotated(q))
    torch.testing.assert_close(k_rot, rotated(k))
    with pytest.raises(ValueError, match="RotaryEmbedding: dim must be even"):
        tnn.RotaryEmbedding(7, 16)


def test_attention_is_sdpa_with_bottom_right_causal_masking_and_gqa():
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)  # (B, H, S, D)
    attention = tnn.Attention(causal=True, qkv_layout="bhsd")
    i, j = torch.arange(3)[:, None], torch.arange(6)[None, :]
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=j <= i + 3, enable_gqa=True)
    torch.testing.assert_close(attention(q, k, v), expected)
    assert "causal=True" in repr(attention)


@pytest.mark.parametrize(
    ("options", "shape"),
    [({}, (6, 11)), ({"reduction": "sum", "label_smoothing": 0.1}, (6, 11)), ({"reduction": "none", "ignore_index": 2}, (6, 11)),
     ({}, (2, 11, 3)), ({"reduction": "none"}, (2, 11, 3, 2)), ({}, (11,))],
    ids=["mean", "sum-smoothing", "none-ignore", "class-dim-1", "none-class-dim-1", "one-sample"],
)
def test_cross_entropy_loss_is_torchs(options, shape):
    torch.manual_seed(0)
    logits = torch.randn(shape, requires_grad=True)
    target = torch.randint(0, 11, shape[:1] + shape[2:] if len(shape) > 1 else ())
    if target.dim():
        target.view(-1)[0] = -100 if "ignore_index" not in options else options["ignore_index"]
    logits_ref = logits.detach().clone().requires_grad_()
    loss, expected = tnn.CrossEntropyLoss(**options)(logits, target), torch.nn.CrossEntropyLoss(**options)(logits_ref, target)
    torch.testing.assert_close(loss, expected)
    loss.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(logits.grad, logits_ref.grad)


def test_cross_entropy_loss_adds_z_loss_and_soft_caps_and_refuses_what_it_does_not_do():
    logits, target = torch.randn(8, 50), torch.randint(0, 50, (8,))
    capped = 5.0 * torch.tanh(logits / 5.0)
    expected = F.cross_entropy(capped, target) + 1e-2 * torch.logsumexp(capped, -1).square().mean()
    torch.testing.assert_close(tnn.CrossEntropyLoss(lse_square_scale=1e-2, softcap=5.0)(logits, target), expected)
    with pytest.raises(ValueError, match=r"CrossEntropyLoss: class weights \(weight=\) are not supported"):
        tnn.CrossEntropyLoss(torch.ones(50))
    with pytest.raises(ValueError, match="CrossEntropyLoss: reduction must be one of 'mean', 'sum', 'none', got 'avg'"):
        tnn.CrossEntropyLoss(reduction="avg")
    with pytest.raises(TypeError, match="CrossEntropyLoss: target must hold class indices"):
        tnn.CrossEntropyLoss()(logits, torch.softmax(logits, -1))
    # A target of another shape is refused, as torch refuses it, not flattened into other rows.
    for got, want in (((8, 1), r"\(8,\)"), ((1, 8), r"\(8,\)")):
        with pytest.raises(ValueError, match=rf"CrossEntropyLoss: target must have the shape of input \(8, 50\) without its "
                                             rf"class dimension \(dim 1, as in torch\), {want}; got \({got[0]}, {got[1]}\)"):
            tnn.CrossEntropyLoss()(logits, target.view(got))
    with pytest.raises(ValueError, match=r"input \(2, 8, 5\) without its class dimension \(dim 1, as in torch\), \(2, 5\); got \(2, 8\)"):
        tnn.CrossEntropyLoss()(torch.randn(2, 8, 5), torch.zeros(2, 8, dtype=torch.long))
    one = torch.randn(50)  # one sample: torch takes a target of () or (1,), and gives a loss of ()
    for given in (torch.tensor(3), torch.tensor([3])):
        assert tnn.CrossEntropyLoss(reduction="none")(one, given).shape == F.cross_entropy(one, given, reduction="none").shape == ()


def test_linear_cross_entropy_loss_is_the_lm_head_then_the_loss():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 40)
    hidden = torch.randn(2, 7, 16, requires_grad=True)
    target = torch.randint(0, 40, (2, 7))
    target[0, 0] = -100
    loss = tnn.LinearCrossEntropyLoss(label_smoothing=0.1)(hidden, head.weight, target, head.bias)
    loss.backward()
    dweight, head.weight.grad = head.weight.grad, None
    hidden_ref = hidden.detach().clone().requires_grad_()
    expected = F.cross_entropy(head(hidden_ref).flatten(0, 1), target.flatten(), label_smoothing=0.1)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(hidden.grad, hidden_ref.grad)
    torch.testing.assert_close(dweight, head.weight.grad)
    with pytest.raises(ValueError, match="LinearCrossEntropyLoss: reduction must be one of 'mean', 'sum', got 'none'"):
        tnn.LinearCrossEntropyLoss(reduction="none")
    with pytest.raises(ValueError, match=r"LinearCrossEntropyLoss: target must have the shape of hidden_states \(2, 7, 16\) "
                                         r"without H, \(2, 7\); got \(7, 2\)"):
        tnn.LinearCrossEntropyLoss()(hidden, head.weight, target.t(), head.bias)


def test_the_new_modules_compile_and_take_a_target():
    mlp, rope = tnn.GatedMLP(16, 32, target="builtin"), tnn.RotaryEmbedding(8, 16, target="builtin")
    attention, loss = tnn.Attention(causal=True, target="builtin"), tnn.CrossEntropyLoss(target="builtin")
    assert {m.op.requested_target for m in (mlp.act, rope, attention, loss)} == {"builtin"}
    head = torch.nn.Linear(16, 20)

    def step(x, target):
        h = mlp(x)  # (B, S, 16) as 2 heads of 8
        q, k = rope(h.view(2, 5, 2, 8), h.view(2, 5, 2, 8), torch.arange(5).expand(2, 5))
        o = attention(q, k, h.view(2, 5, 2, 8)).reshape(2, 5, 16)
        return loss(head(o).flatten(0, 1), target.flatten())

    x, target = torch.randn(2, 5, 16), torch.randint(0, 20, (2, 5))
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(x, target)
    compiled.backward()
    torch.testing.assert_close(compiled, step(x, target))
    assert mlp.gate_proj.weight.grad is not None
