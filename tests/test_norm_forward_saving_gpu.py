"""GPU tier: the norm kernels' ``forward_saving`` on CUDA, for every variant of the four kinds.

It must return what ``forward`` returns, bit for bit, and the statistics the backward reads,
written by the same pass: rstd (after the mean, for the layer-norm kinds), float32 of x's
leading shape, against float64 torch on the same rows (the rounded x + residual for the fused
kinds). The kernels are built directly (``entry_for``), each variant on a row length the policy
serves with it. They need a CUDA GPU (``pytest -m gpu``); elsewhere they skip.
"""

from __future__ import annotations

import pytest
import torch

from tileops.kernels.cuda.norm import KERNELS, policy
from tileops.ops.norm import (
    FusedAddLayerNormFwdInterface,
    FusedAddRMSNormFwdInterface,
    LayerNormFwdInterface,
    RMSNormFwdInterface,
)

pytestmark = pytest.mark.gpu

FORWARDS = (RMSNormFwdInterface, LayerNormFwdInterface, FusedAddRMSNormFwdInterface, FusedAddLayerNormFwdInterface)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
EPS = 1e-5
CASES = [
    pytest.param(cls, dtype, affine, id=f"{key}-{str(dtype).removeprefix('torch.')}-{'affine' if affine else 'bare'}")
    for interface in FORWARDS
    for key, cls in KERNELS[interface].items()
    for dtype in DTYPES
    for affine in (True, False)
]


def _row_length(kind: str, variant: str, dtype: torch.dtype) -> int:
    """A row length the policy serves with ``variant`` in ``dtype``, one that also reaches the
    variant's extra builds where it has them on the shapes below."""
    if variant == "register":
        # 16-bit rows of 1-4 KiB have a few-row build (rms_norm, add_layer_norm: the 1- and
        # 3-row calls); add_rms_norm's 4097 16-bit rows of 1536 (12 MiB) take its evict-first one.
        n = {"rms_norm": 1024, "layer_norm": 256, "add_rms_norm": 1536, "add_layer_norm": 1024}[kind]
        n = 512 if kind == "add_layer_norm" and dtype == torch.float32 else n  # its float32 limit: 2 KiB
    elif variant == "shared":
        n = 4104  # past the register variant's 8 KiB in 16 bits; 513 vectors: a partial last step
    elif variant == "streamed":
        n = 16384
    else:
        # The scalar variant caches up to 16 elements per thread (1001) and streams longer rows.
        n = 20001 if dtype == torch.float16 else 1001
    assert policy.refusal(kind, variant, n, dtype, True) is None, (kind, variant, n, dtype)
    return n


def _expected_statistics(rows: torch.Tensor, layer: bool) -> tuple[torch.Tensor, ...]:
    """(mean, rstd) of each row for the layer norms (biased variance), (rstd,) for the rms ones,
    in float64."""
    rows = rows.double()
    if layer:
        mean = rows.mean(-1)
        variance = (rows - mean.unsqueeze(-1)).square().mean(-1)
        return mean, (variance + EPS).rsqrt()
    return ((rows.square().mean(-1) + EPS).rsqrt(),)


@pytest.mark.parametrize(("cls", "dtype", "affine"), CASES)
def test_forward_saving_returns_forwards_result_and_the_statistics_of_the_same_pass(cls, dtype, affine):
    kind, variant = cls.kind, cls.variant
    layer, fused = kind.endswith("layer_norm"), kind.startswith("add_")
    n = _row_length(kind, variant, dtype)
    device = torch.device("cuda", torch.cuda.current_device())
    call = cls.call_spec(device, n, dtype, EPS, affine, affine and layer, True)
    kernel = cls.entry_for(call)[1]()
    weight = torch.randn(n, device=device, dtype=dtype) if affine else None
    bias = torch.randn(n, device=device, dtype=dtype) if affine and layer else None
    # One row as a 1-D x, 3 rows in three dimensions, 4097 rows (a partial last block) in two;
    # the kernels compiled per affine combination see every rank once, the bare ones two shapes.
    shapes = [(n,), (1, 3, n), (4097, n)] if affine else [(3, n), (4097, n)]
    for shape in shapes:
        x = torch.randn(shape, device=device, dtype=dtype) * 2 + 0.5  # rows with a mean to find
        args = (x, torch.randn_like(x)) if fused else (x,)
        args += (weight, bias) if layer else (weight,)
        expected = kernel.forward(*args)
        result, statistics = kernel.forward_saving(*args)
        if fused:
            assert type(result) is tuple and len(result) == 2, shape
            assert torch.equal(result[0], expected[0]) and torch.equal(result[1], expected[1]), shape
        else:
            assert torch.equal(result, expected), shape
        assert type(statistics) is tuple and len(statistics) == (2 if layer else 1) == kernel.saved_count
        for got, want, name in zip(statistics, _expected_statistics(result[1] if fused else x, layer),
                                   ("mean", "rstd") if layer else ("rstd",)):
            assert (got.shape, got.dtype, got.device) == (x.shape[:-1], torch.float32, x.device), (name, shape)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6, msg=lambda m, what=(name, shape): f"{what}: {m}")
