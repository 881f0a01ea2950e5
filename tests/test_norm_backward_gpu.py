"""GPU tier: the norm family's TileLang backward kernels, called directly, against float64 torch
autograd on odd sizes, every dtype, with and without weight, 3-D and unaligned inputs.

They need a CUDA GPU (``pytest -m gpu``); elsewhere they skip.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import math
import os

import pytest
import torch
import torch.nn.functional as F

from helpers import few_tests_selected, off_the_grid, xdist_share
from tileops.kernels.cuda.norm.backward import BACKWARD_KERNELS
from tileops.ops.norm import (
    FusedAddLayerNormBwdInterface,
    FusedAddRMSNormBwdInterface,
    LayerNormBwdInterface,
    RMSNormBwdInterface,
)

pytestmark = pytest.mark.gpu

INTERFACES = {"rms_norm": RMSNormBwdInterface, "layer_norm": LayerNormBwdInterface,
              "add_rms_norm": FusedAddRMSNormBwdInterface, "add_layer_norm": FusedAddLayerNormBwdInterface}
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# 1, 7: element-wise; 1000-5120: x and dy in registers; 16384: streamed, the column sums in shared
# memory; 65536: streamed, the sums added into global memory (16-bit types).
SIZES = [1, 7, 1000, 4096, 5120, 16384, 65536]
ROWS = [1, 3, 4097]
EPS = 1e-5
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def _table(kind):
    return BACKWARD_KERNELS[INTERFACES[kind]]


def _call(kind, n, dtype, has_weight, aligned=True, has_bias=None):
    spec = INTERFACES[kind].call_spec
    has_bias = kind.endswith("layer_norm") if has_bias is None else has_bias
    return spec(device=torch.device("cuda", 0), n=n, dtype=dtype, eps=EPS, has_weight=has_weight,
                has_bias=has_bias, aligned=aligned)


def _selected(kind, call):
    """The first class of the table that serves the call (the table is in preference order)."""
    return next((key, cls) for key, cls in _table(kind).items() if cls.refusal(call) is None)


_built: dict[tuple, object] = {}


def _kernel(cls, call):
    key = (cls, call)
    if key not in _built:
        _built[key] = cls.entry_for(call)[1]()
    return _built[key]


@pytest.fixture(scope="module", autouse=True)
def _build_concurrently(request):
    """Compile the kernels the tests call in parallel threads first (compilation is per build
    identity). Under pytest-xdist every test process runs this fixture: each builds its share of
    the kernels with its share of the cores, and TileLang's disk cache hands the others' to it when
    its tests call them (when each of 12 processes built all 144 kernels of the time, no test had
    run after 220 s)."""
    if few_tests_selected(request):
        return
    share, processes = xdist_share()
    calls = [(kind, _call(kind, n, dtype, weight)) for kind, n, dtype, weight in
             itertools.product(INTERFACES, SIZES, DTYPES, (True, False))][share::processes]
    threads = max(1, (os.cpu_count() or 2) // processes)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda kind_call: _kernel(_selected(*kind_call)[1], kind_call[1]), calls))


def _reference(kind, dy, x, w, dres):
    """Gradients in float64 by autograd, and the float32 statistics the forward would save."""
    n = x.shape[-1]
    x64 = x.double().requires_grad_()
    w64 = (w.double() if w is not None else torch.ones(n, dtype=torch.float64, device=x.device)).requires_grad_()
    b64 = torch.zeros(n, dtype=torch.float64, device=x.device, requires_grad=True)
    if kind.endswith("layer_norm"):
        y = F.layer_norm(x64, (n,), w64, b64, EPS)
        mean = x64.detach().mean(-1)
        rstd = torch.rsqrt(x64.detach().var(-1, unbiased=False) + EPS)
    else:
        y = F.rms_norm(x64, (n,), w64, EPS)
        mean = None
        rstd = torch.rsqrt(x64.detach().pow(2).mean(-1) + EPS)
    y.backward(dy.double())
    dx = x64.grad + (dres.double() if dres is not None else 0)
    stats = (mean.float(), rstd.float()) if mean is not None else (rstd.float(),)
    return dx, w64.grad, b64.grad, stats


def _check(kind, kernel, dy, x, w, dres):
    dx_ref, dw_ref, db_ref, stats = _reference(kind, dy, x, w, dres)
    args = (dy, dres, x, w, *stats) if kind.startswith("add_") else (dy, x, w, *stats)
    result = kernel.forward(*args)
    atol, rtol = TOLERANCE[dy.dtype]
    m = dy.numel() // dy.shape[-1]
    assert result[0].shape == dy.shape and result[0].dtype == dy.dtype
    # dx is rstd times terms of g's size that cancel: their rounding scales with rstd, which is
    # 1 / sqrt(eps) = 316 on one-element layer-norm rows (variance 0, dx 0 exactly).
    dx_atol = atol * max(1.0, float(stats[-1].max()))
    torch.testing.assert_close(result[0].double(), dx_ref, atol=dx_atol, rtol=rtol)
    if not (kernel.params.call.has_weight or kernel.params.call.has_bias):
        # Nothing to differentiate but x: the kernel sums no parameter gradient.
        assert all(grad is None for grad in result[1:]), [type(grad).__name__ for grad in result[1:]]
        return
    sums_atol = atol * max(1.0, math.sqrt(m))  # sums over m rows
    torch.testing.assert_close(result[1].double(), dw_ref, atol=sums_atol, rtol=rtol)
    if kind.endswith("layer_norm"):
        torch.testing.assert_close(result[2].double(), db_ref, atol=sums_atol, rtol=rtol)
    for grad in result[1:]:
        assert grad.shape == (dy.shape[-1],) and grad.dtype == dy.dtype


def _inputs(kind, shape, dtype, has_weight):
    n = shape[-1]
    x, dy = torch.randn(shape, device="cuda", dtype=dtype), torch.randn(shape, device="cuda", dtype=dtype)
    w = torch.randn(n, device="cuda", dtype=dtype) if has_weight else None
    dres = torch.randn(shape, device="cuda", dtype=dtype) if kind.startswith("add_") else None
    return dy, x, w, dres


@pytest.mark.parametrize("kind", list(INTERFACES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("has_weight", [True, False], ids=["weight", "no_weight"])
def test_gradients_match_float64_autograd(kind, dtype, n, has_weight):
    call = _call(kind, n, dtype, has_weight)
    _, cls = _selected(kind, call)
    kernel = _kernel(cls, call)
    for m in ROWS:
        m = min(m, max(1, (1 << 24) // n))
        _check(kind, kernel, *_inputs(kind, (m, n), dtype, has_weight))


@pytest.mark.parametrize("kind", list(INTERFACES))
@pytest.mark.parametrize("n", [7, 5120, 65536])
def test_a_call_without_weight_or_bias_writes_dx_alone(kind, n):
    # One launch of the row kernel built without column sums: a row a slot, any row count.
    call = _call(kind, n, torch.bfloat16, False, has_bias=False)
    kernel = _kernel(_selected(kind, call)[1], call)
    for m in ROWS:
        _check(kind, kernel, *_inputs(kind, (min(m, (1 << 24) // n), n), torch.bfloat16, False))


@pytest.mark.parametrize("kind", list(INTERFACES))
def test_leading_dimensions_are_taken_as_rows(kind):
    call = _call(kind, 4096, torch.bfloat16, True)
    kernel = _kernel(_selected(kind, call)[1], call)
    _check(kind, kernel, *_inputs(kind, (2, 3, 4096), torch.bfloat16, True))
    _check(kind, kernel, *_inputs(kind, (4096,), torch.bfloat16, True))


@pytest.mark.parametrize("kind", list(INTERFACES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unaligned_inputs_go_to_the_scalar_variant_and_are_correct(kind, dtype):
    n, m = 4096, 5
    call = _call(kind, n, dtype, True, aligned=False)
    key, cls = _selected(kind, call)
    assert key == f"{kind}_bwd_scalar"
    dy, x, w, dres = _inputs(kind, (m, n), dtype, True)

    shifted = [None if t is None else off_the_grid(t) for t in (dy, x, w, dres)]
    _check(kind, _kernel(cls, call), *shifted)


@pytest.mark.parametrize("kind", list(INTERFACES))
def test_every_variant_that_serves_a_call_is_correct(kind):
    # The streamed variant serves aligned rows of any length (selection prefers the register one).
    for n in (4096, 65536):
        call = _call(kind, n, torch.bfloat16, True)
        for cls in _table(kind).values():
            if cls.refusal(call) is None:
                _check(kind, _kernel(cls, call), *_inputs(kind, (33, n), torch.bfloat16, True))


@pytest.mark.parametrize("kind", list(INTERFACES))
def test_column_sums_kept_out_of_a_small_shared_memory_are_correct(kind, monkeypatch):
    # As on a GPU that gives a block 24 KiB: the register mode's sums of 8192 bf16 columns (32-64 KiB)
    # and the streamed mode's of 16384 would not fit; the streamed variant with the sums in global
    # memory serves both.
    from tileops.kernels.cuda.norm import backward

    monkeypatch.setattr(backward, "shared_memory_per_block", lambda device: 24 * 1024)
    for n in (8192, 16384):
        call = _call(kind, n, torch.bfloat16, True)
        key, cls = _selected(kind, call)
        assert key.endswith("_streamed"), key
        kernel = cls.entry_for(call)[1]()
        assert kernel.params.config["acc"] == "global", kernel.params.config
        _check(kind, kernel, *_inputs(kind, (300, n), torch.bfloat16, True))


def test_float64_is_refused_with_a_reason():
    for kind in INTERFACES:
        for cls in _table(kind).values():
            assert "torch implementation serves it" in cls.refusal(_call(kind, 4096, torch.float64, True))
