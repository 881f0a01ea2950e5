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
