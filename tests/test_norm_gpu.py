"""GPU tier: the norm family's TileLang kernels on CUDA, against the fp32 torch reference.

They need a CUDA GPU (``pytest -m gpu``, or ``tools/gpu-tier.sh``); elsewhere they skip.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tileops.ops import FAMILIES, FusedAddLayerNormFwdOp, FusedAddRMSNormFwdOp, LayerNormFwdOp, RMSNormFwdOp
from tileops.testing import check_workload, workload_cases

pytestmark = pytest.mark.gpu

CASES = list(workload_cases(FAMILIES["norm"]))
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_workload_matches_the_reference_on_cuda(case):
    op = case.op_class(**case.workload.params)
    check_workload(op, case.workload, case.dtype, "cuda")
    assert op.target == "builtin"
    assert all(key != "torch_cpu" for key, _ in op.built_kernels())


def _reference_layer_norm(x, w, b, eps=1e-5):
    return F.layer_norm(x.float(), (x.shape[-1],), w.float(), b.float(), eps).to(x.dtype)


def _reference_rms_norm(x, w):
    return F.rms_norm(x.float(), (x.shape[-1],), w.float(), torch.finfo(x.dtype).eps).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [1, 2, 7, 8, 100, 1000, 1024, 4095, 4096, 5000, 8192, 16384, 65536, 100000])
@pytest.mark.parametrize("rows", [1, 3, 129])
def test_every_row_length_is_served_and_correct(n, rows, dtype):
    if rows * n > 1 << 24:
        rows = 2
    x = torch.randn(rows, n, device="cuda", dtype=dtype)
    w, b = torch.randn(n, device="cuda", dtype=dtype), torch.randn(n, device="cuda", dtype=dtype)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(LayerNormFwdOp(n)(x, w, b), _reference_layer_norm(x, w, b), atol=atol, rtol=rtol)
    torch.testing.assert_close(RMSNormFwdOp(n)(x, w), _reference_rms_norm(x, w), atol=atol, rtol=rtol)
    r = torch.randn_like(x)
    y, total = FusedAddRMSNormFwdOp(n)(x, r, w)
    torch.testing.assert_close(total, x + r, atol=0, rtol=0)
    torch.testing.assert_close(y, _reference_rms_norm(x + r, w), atol=atol, rtol=rtol)
    y, total = FusedAddLayerNormFwdOp(n)(x, r, w, b)
    torch.testing.assert_close(y, _reference_layer_norm(x + r, w, b), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_misaligned_and_non_contiguous_inputs(dtype):
    n = 4096
    atol, rtol = TOLERANCE[dtype]
    storage = torch.randn(4 * n + 1, device="cuda", dtype=dtype)
    misaligned = storage[1:].view(4, n)  # contiguous, but 2 or 4 bytes past a 16-byte boundary
    assert misaligned.data_ptr() % 16 != 0
    w, b = torch.randn(n, device="cuda", dtype=dtype), torch.randn(n, device="cuda", dtype=dtype)
    op = LayerNormFwdOp(n)
    torch.testing.assert_close(op(misaligned, w, b), _reference_layer_norm(misaligned, w, b), atol=atol, rtol=rtol)
    assert "layer_norm_scalar" in {key for key, _ in op.built_kernels()}
    strided = torch.randn(n, 6, device="cuda", dtype=dtype).t()
    torch.testing.assert_close(op(strided, w, b), _reference_layer_norm(strided, w, b), atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    ("n", "key"),
    [(256, "layer_norm"), (1000, "layer_norm_streamed"), (1001, "layer_norm_scalar"), (4096, "layer_norm_shared"),
     (16384, "layer_norm_streamed")],
    ids=lambda v: str(v),
)
def test_every_variant_serves_calls_without_weight_or_bias(n, key):
    # The kernels are compiled per affine combination (weight and bias are left out of the
    # launch, not passed as None).
    dtype, (atol, rtol) = torch.bfloat16, TOLERANCE[torch.bfloat16]
    x = torch.randn(5, n, device="cuda", dtype=dtype)
    w, b = torch.randn(n, device="cuda", dtype=dtype), torch.randn(n, device="cuda", dtype=dtype)
    layer = LayerNormFwdOp(n)
    for weight, bias in [(None, None), (w, None), (None, b)]:
        expected = F.layer_norm(x.float(), (n,), None if weight is None else weight.float(),
                                None if bias is None else bias.float(), 1e-5).to(dtype)
        torch.testing.assert_close(layer(x, weight, bias), expected, atol=atol, rtol=rtol)
    expected = F.rms_norm(x.float(), (n,), eps=torch.finfo(dtype).eps).to(dtype)
    torch.testing.assert_close(RMSNormFwdOp(n)(x), expected, atol=atol, rtol=rtol)
    assert [built for built, _ in layer.built_kernels()] == [key] * 3


def test_batch_dimensions_out_buffers_and_no_affine():
    x = torch.randn(2, 3, 5, 256, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    y = RMSNormFwdOp(256)(x, out=out)
    assert y is out
    torch.testing.assert_close(y, F.rms_norm(x.float(), (256,), eps=torch.finfo(torch.bfloat16).eps).bfloat16(), atol=1.6e-2, rtol=1.6e-2)
    z = LayerNormFwdOp((5, 256))(x)
    torch.testing.assert_close(z, F.layer_norm(x.float(), (5, 256)).bfloat16(), atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize("n", [1000, 1001, 4096, 16384, 131072], ids=lambda n: f"n{n}")
def test_inputs_of_any_rank_are_served_without_a_view_and_correct(n):
    # The TileLang kernels take the caller's (..., n) tensors as they are: rank 1 (one row), and
    # ranks 3 and 4 with sizes of 1, as decode steps pass them. Their outputs are tensors of
    # their own, not views of (m, n) results. The sizes reach every variant: 1001 the scalar
    # one, 131072 the streamed one of every kind, 1000 and 16384 the streamed single norms.
    dtype, (atol, rtol) = torch.bfloat16, TOLERANCE[torch.bfloat16]
    w, b = torch.randn(n, device="cuda", dtype=dtype), torch.randn(n, device="cuda", dtype=dtype)
    rms, layer, add_rms, add_layer = RMSNormFwdOp(n), LayerNormFwdOp(n), FusedAddRMSNormFwdOp(n), FusedAddLayerNormFwdOp(n)
    for shape in [(n,), (2, 3, n), (1, 1, 2, n)]:
        x, r = torch.randn(shape, device="cuda", dtype=dtype), torch.randn(shape, device="cuda", dtype=dtype)
        results = [rms(x, w), layer(x, w, b), *add_rms(x, r, w), *add_layer(x, r, w, b)]
        assert all(t.shape == x.shape and t._base is None for t in results), [t.shape for t in results]
        expected = [_reference_rms_norm(x, w), _reference_layer_norm(x, w, b), _reference_rms_norm(x + r, w), x + r,
                    _reference_layer_norm(x + r, w, b), x + r]
        for got, want in zip(results, expected):
            torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    assert all(len(op.built_kernels()) == 1 for op in (rms, layer, add_rms, add_layer))  # one kernel, every rank


def test_calls_capture_in_a_cuda_graph_after_one_warm_up():
    op = FusedAddRMSNormFwdOp(4096)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    r, w = torch.randn_like(x), torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    op(x, r, w)  # warm-up: selects and builds
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, total = op(x, r, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(total, x + r, atol=0, rtol=0)
    torch.testing.assert_close(y, _reference_rms_norm(x + r, w), atol=1.6e-2, rtol=1.6e-2)


def _rows_straddling_the_l2(n: int, dtype: torch.dtype) -> int:
    """An even number of rows of ``n`` whose fused call (x, the residual, y and the sum) is at most
    16/15 of this GPU's L2, as close to it as rows go: a call the evict-first build serves."""
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    return l2_bytes * 16 // (15 * 4 * dtype.itemsize) // n // 2 * 2


@pytest.mark.parametrize("op_class", [FusedAddRMSNormFwdOp, FusedAddLayerNormFwdOp], ids=lambda c: c.__name__)
def test_fused_calls_whose_input_straddles_the_l2_take_the_evict_first_build_with_equal_results(op_class):
    # x of 16/15 of the L2 over four (8192 rows of 1024 bf16 on a 60 MiB L2, also as two halves)
    # takes the second build of the register kernel; 64 and twice as many rows the first. Both
    # builds compute alike.
    n, dtype = 1024, torch.bfloat16
    op = op_class(n)
    params = [torch.randn(n, device="cuda", dtype=dtype) for _ in range(2 if op_class is FusedAddLayerNormFwdOp else 1)]
    reference = _reference_layer_norm if op_class is FusedAddLayerNormFwdOp else _reference_rms_norm
    rows = _rows_straddling_the_l2(n, dtype)
    for shape in [(64, n), (2 * rows, n), (rows, n), (2, rows // 2, n)]:
        x, r = torch.randn(shape, device="cuda", dtype=dtype), torch.randn(shape, device="cuda", dtype=dtype)
        y, total = op(x, r, *params)
        torch.testing.assert_close(total, x + r, atol=0, rtol=0)
        torch.testing.assert_close(y, reference(x + r, *params), atol=1.6e-2, rtol=1.6e-2)
        ((_, kernel),) = op.built_kernels()
        plain_y, plain_total = torch.empty_like(x), torch.empty_like(x)
        kernel.compiled["main"][x.dim()](x, r, *params, plain_y, plain_total)
        assert torch.equal(y, plain_y) and torch.equal(total, plain_total), shape
    assert kernel.config["variant"] == "register"
    assert sorted(kernel.compiled["evict_first"]) == [2, 3]  # built for the two calls that straddle the L2 only


@pytest.mark.parametrize("op_class", [FusedAddRMSNormFwdOp, FusedAddLayerNormFwdOp], ids=lambda c: c.__name__)
def test_rows_beyond_the_gpus_shared_memory_per_block_are_streamed_and_correct(op_class, monkeypatch):
    # As on a GPU that gives a block 64 KiB (sm_86 and sm_89 give 99): the fused kinds' rows of 80 KB
    # would be parked in shared memory, whose launch would fail there; the streamed variant serves them.
    from tileops.kernels.cuda import norm as norm_kernels

    monkeypatch.setattr(norm_kernels, "shared_memory_per_block", lambda device: 64 * 1024)
    kernel = _calls_compute_as_the_reference_and_the_main_build(op_class, 40000, torch.bfloat16, [(3, 40000), (300, 40000)])
    assert kernel.config["variant"] == "streamed"


def _calls_compute_as_the_reference_and_the_main_build(op_class, n, dtype, shapes):
    """Calls of ``op_class(n)`` on inputs of each shape against the reference and against the
    main build of the kernel that served them (the same kernel for every shape); that kernel."""
    atol, rtol = TOLERANCE[dtype]
    fused, layer = op_class in (FusedAddRMSNormFwdOp, FusedAddLayerNormFwdOp), op_class in (LayerNormFwdOp, FusedAddLayerNormFwdOp)
    op = op_class(n)
    params = [torch.randn(n, device="cuda", dtype=dtype) for _ in range(2 if layer else 1)]
    reference = _reference_layer_norm if layer else _reference_rms_norm
    for shape in shapes:
        x, r = torch.randn(shape, device="cuda", dtype=dtype), torch.randn(shape, device="cuda", dtype=dtype)
        y, total = op(x, r, *params) if fused else (op(x, *params), x)
        torch.testing.assert_close(total, x + r if fused else x, atol=0, rtol=0)
        torch.testing.assert_close(y, reference(total, *params), atol=atol, rtol=rtol)
        ((_, kernel),) = op.built_kernels()
        main_y, main_total = torch.empty_like(x), torch.empty_like(x)
        kernel.compiled["main"][x.dim()](*((x, r) if fused else (x,)), *params, main_y, *((main_total,) if fused else ()))
        torch.testing.assert_close(y, main_y, atol=atol, rtol=rtol)
    return kernel


@pytest.mark.parametrize(
    ("op_class", "n", "dtype"),
    [(LayerNormFwdOp, 2048, torch.bfloat16), (LayerNormFwdOp, 768, torch.float16), (FusedAddLayerNormFwdOp, 2048, torch.bfloat16),
     (FusedAddLayerNormFwdOp, 1024, torch.float16), (RMSNormFwdOp, 1024, torch.bfloat16),
     (RMSNormFwdOp, 5120, torch.bfloat16), (FusedAddRMSNormFwdOp, 3584, torch.float16)],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_calls_of_at_most_eight_rows_per_sm_take_the_few_row_build_and_compute_alike(op_class, n, dtype):
    # Rows of 1.5-4 KiB: from a row per SM (the decode build's) up to eight rows per SM (any rank)
    # one row per block in registers (longer rms rows: their launch with the weight loaded early),
    # more rows the main build; both against the reference, and the few-row build close to the
    # main one.
    few = 8 * torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [(1, n), (256, n), (few, n), (2, few // 2, n), (few + 1, n), (4 * few, n)]
    kernel = _calls_compute_as_the_reference_and_the_main_build(op_class, n, dtype, shapes)
    few_rows = kernel.config["few_row_build"]
    assert (few_rows["rows"], few_rows["max_rows"]) == (1, few) and few_rows["mode"] in ("register", "shared")
    assert sorted(kernel.compiled["few_rows"]) == [2, 3]  # built for the calls of at most eight rows per SM only


DECODE_CASES = [(FusedAddRMSNormFwdOp, 7168, torch.float16), (RMSNormFwdOp, 14336, torch.float32),
                (LayerNormFwdOp, 3072, torch.bfloat16), (FusedAddLayerNormFwdOp, 5120, torch.bfloat16),
                (RMSNormFwdOp, 128, torch.bfloat16)]


@pytest.mark.parametrize(("op_class", "n", "dtype"), DECODE_CASES,
                         ids=[f"{c.__name__}-{n}-{str(d)[6:]}" for c, n, d in DECODE_CASES])
def test_calls_of_at_most_a_row_per_sm_take_the_decode_build_and_compute_alike(op_class, n, dtype):
    # Decode rows (one per block in registers, weight and bias loaded with x) against the
    # reference and the main build, up to a row per SM (any rank); one more row leaves it.
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [(1, n), (7, n), (2, 3, n), (sms, n), (sms + 1, n)]
    kernel = _calls_compute_as_the_reference_and_the_main_build(op_class, n, dtype, shapes)
    decode = kernel.config["decode_build"]
    assert (decode["mode"], decode["rows"], decode["preload"], decode["max_rows"]) == ("register", 1, True, sms)
    assert sorted(kernel.compiled["decode"]) == [2, 3]


def test_a_tune_request_on_a_few_row_call_tunes_the_few_row_build_alone(capfd):
    from tileops.kernels.cuda import tuning

    op = LayerNormFwdOp(1536)
    x = torch.randn(200, 1536, device="cuda", dtype=torch.bfloat16)  # more rows than SMs: not the decode build
    w, b = torch.randn(1536, device="cuda", dtype=torch.bfloat16), torch.randn(1536, device="cuda", dtype=torch.bfloat16)
    op(x, w, b)
    ((_, kernel),) = op.built_kernels()
    main = {key: kernel.config[key] for key in ("tpr", "rows", "mode", "preload")}
    op.request_tune()
    y = op(x, w, b)
    err = capfd.readouterr().err
    assert "(few_rows build)" in err and "chose {" in err, err
    assert kernel._launch_device == x.device.index  # the request is settled
    few_rows = kernel.build_plan(kernel.default_config()).builds["few_rows"]
    assert tuning.chosen(kernel._gpu_model, f"{kernel._tuning_key}/few_rows", few_rows) is not None
    assert tuning.chosen(kernel._gpu_model, kernel._tuning_key, kernel.default_config()) is None  # main untouched
    assert {key: kernel.config[key] for key in main} == main
    torch.testing.assert_close(y, _reference_layer_norm(x, w, b), atol=1.6e-2, rtol=1.6e-2)


def test_a_graph_captures_a_fused_call_whose_evict_first_build_is_not_built_yet():
    # Warmed up on decode rows only: the captured call (straddling the L2) is the first to want
    # the second build, which compiles and loads while the stream captures, and the replay
    # computes right.
    op = FusedAddRMSNormFwdOp(1024)
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    op(*(torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16) for _ in range(2)), w)
    ((_, kernel),) = op.built_kernels()
    assert not kernel.compiled["evict_first"]
    rows = _rows_straddling_the_l2(1024, torch.bfloat16)
    x, r = (torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, total = op(x, r, w)
    assert sorted(kernel.compiled["evict_first"]) == [2]
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(total, x + r, atol=0, rtol=0)
    torch.testing.assert_close(y, _reference_rms_norm(x + r, w), atol=1.6e-2, rtol=1.6e-2)


def test_request_tune_times_candidates_once_keeps_the_result_correct_and_shows_the_config(capfd):
    # A shape no other test builds, so this process has not tuned it yet.
    n, rows = 1000, 1536
    op = FusedAddLayerNormFwdOp(n)
    x, r = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16), torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    w, b = torch.randn(n, device="cuda", dtype=torch.bfloat16), torch.randn(n, device="cuda", dtype=torch.bfloat16)
    op(x, r, w, b)
    ((key, kernel),) = op.built_kernels()
    default = dict(kernel.config)
    assert default["variant"] in ("register", "shared") and {"tpr", "rows", "vec"} <= default.keys()
    assert "tuning" not in capfd.readouterr().err  # never tunes unless asked

    op.request_tune()
    y, total = op(x, r, w, b)
    err = capfd.readouterr().err
    assert "tuning FusedAddLayerNorm" in err and "chose {" in err, err
    torch.testing.assert_close(total, x + r, atol=0, rtol=0)
    torch.testing.assert_close(y, _reference_layer_norm(x + r, w, b), atol=1.6e-2, rtol=1.6e-2)
    tuned = dict(kernel.config)
    assert tuned["variant"] == default["variant"]

    other = FusedAddLayerNormFwdOp(n)  # same build identity: starts with the tuned configuration
    other(x, r, w, b)
    ((_, other_kernel),) = other.built_kernels()
    assert other_kernel.config == tuned
    other.request_tune()
    other(x, r, w, b)
    assert "tuning" not in capfd.readouterr().err  # tuned once per identity


@pytest.mark.parametrize(
    ("op_class", "n", "key"),
    [
        (RMSNormFwdOp, 4096, "rms_norm"),
        (LayerNormFwdOp, 4096, "layer_norm_shared"),
        (RMSNormFwdOp, 100000, "rms_norm_streamed"),
        (FusedAddRMSNormFwdOp, 4095, "add_rms_norm_scalar"),
    ],
    ids=["register", "shared", "streamed", "scalar"],
)
@pytest.mark.large_memory  # 8-16 GiB each: beside other tests' processes the GPU can run out
def test_inputs_of_more_than_2_31_elements_are_indexed_in_64_bits(op_class, n, key):
    # Batch x sequence x hidden passes 2**31 elements in real models; offsets computed in 32
    # bits would wrap and read or write the wrong rows. The first and last rows are checked
    # against the reference computed on them alone.
    rows = (1 << 31) // n + 2
    x = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16).normal_()
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    ends = torch.cat([x[:2], x[-3:]])
    op = op_class(n)
    if op_class is FusedAddRMSNormFwdOp:
        y, total = op(x, torch.ones_like(x), w)
        torch.testing.assert_close(torch.cat([total[:2], total[-3:]]), ends + 1, atol=0, rtol=0)
        del total
        expected = _reference_rms_norm(ends + 1, w)
    elif op_class is LayerNormFwdOp:
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        y = op(x, w, b)
        expected = _reference_layer_norm(ends, w, b)
    else:
        y = op(x, w)
        expected = _reference_rms_norm(ends, w)
    assert {k for k, _ in op.built_kernels()} == {key}
    torch.testing.assert_close(torch.cat([y[:2], y[-3:]]), expected, atol=1.6e-2, rtol=1.6e-2)


def test_request_tune_on_a_3d_call_times_candidates_of_that_rank(capfd):
    # Tuning compiles and launches each candidate with the call's own tensors, here (2, 640, n):
    # the candidates must be built for three dimensions, or every launch would be refused.
    # (More rows than the few-row build serves: tuning it is another test's.)
    n = 768  # a row length no other test tunes
    op = RMSNormFwdOp(n)
    x, w = torch.randn(2, 640, n, device="cuda", dtype=torch.bfloat16), torch.randn(n, device="cuda", dtype=torch.bfloat16)
    op(x, w)
    op.request_tune()
    y = op(x, w)
    err = capfd.readouterr().err
    assert "tuning RMSNorm" in err and "on 1280 rows" in err and "chose {" in err and "(default " in err, err
    assert "failed to compile or launch" not in err, err
    torch.testing.assert_close(y, _reference_rms_norm(x, w), atol=1.6e-2, rtol=1.6e-2)


def test_large_fp16_values_do_not_overflow_and_constant_rows_give_the_bias():
    # Squares of fp16 values above 256 exceed fp16's range: the statistics must be float32.
    x = torch.full((4, 4096), 300.0, device="cuda", dtype=torch.float16)
    x[1] = torch.linspace(-600, 600, 4096, device="cuda", dtype=torch.float16)
    w = torch.randn(4096, device="cuda", dtype=torch.float16)
    b = torch.randn(4096, device="cuda", dtype=torch.float16)
    y = RMSNormFwdOp(4096)(x, w)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, _reference_rms_norm(x, w), atol=2e-3, rtol=2e-3)
    z = LayerNormFwdOp(4096)(x, w, b)
    torch.testing.assert_close(z[0], b, atol=2e-3, rtol=2e-3)  # a constant row has no deviation
    torch.testing.assert_close(z, _reference_layer_norm(x, w, b), atol=2e-3, rtol=2e-3)


def test_calls_run_on_the_callers_current_stream():
    op = RMSNormFwdOp(4096)
    source = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    x = torch.zeros_like(source)
    op(x, w)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # delays what follows on this stream by some milliseconds
        x.copy_(source)
        y = op(x, w)  # on another stream it would run at once, on the zeros
    torch.cuda.synchronize()
    torch.testing.assert_close(y, _reference_rms_norm(source, w), atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("n", [256, 1000, 1001, 4096, 16384, 131072], ids=lambda n: f"n{n}")
def test_row_views_are_read_where_they_lie_and_give_the_contiguous_results(n, dtype):
    # x and residual sliced from wider rows (a fused projection's third, a padded buffer): each
    # variant reads them at their pitch, uncopied, and computes what it computes on copies. The
    # sizes reach every variant, as in the test above; 130 rows take the few-row builds, 1100 not.
    w, b = torch.randn(n, device="cuda", dtype=dtype), torch.randn(n, device="cuda", dtype=dtype)
    atol, rtol = TOLERANCE[dtype]
    for rows in (130, 1100) if n < 65536 else (3,):
        wide = torch.randn(2, rows // 2, 3 * n, device="cuda", dtype=dtype)
        x, r = wide[..., n:2 * n], torch.randn(2, rows // 2, n + 64, device="cuda", dtype=dtype)[..., 32:n + 32]
        ops = RMSNormFwdOp(n), LayerNormFwdOp(n), FusedAddRMSNormFwdOp(n), FusedAddLayerNormFwdOp(n)
        views = [ops[0](x, w), ops[1](x, w, b), *ops[2](x, r, w), *ops[3](x, r, w, b)]
        xc, rc = x.contiguous(), r.contiguous()
        copies = [ops[0](xc, w), ops[1](xc, w, b), *ops[2](xc, rc, w), *ops[3](xc, rc, w, b)]
        for got, want in zip(views, copies):
            assert got.shape == x.shape and got.is_contiguous()
            torch.testing.assert_close(got, want, atol=0, rtol=0)
        torch.testing.assert_close(views[0], _reference_rms_norm(x, w), atol=atol, rtol=rtol)
        torch.testing.assert_close(views[4], _reference_layer_norm(x + r, w, b), atol=atol, rtol=rtol)
        for op, pitches in zip(ops, [(3 * n,), (3 * n,), (3 * n, n + 64), (3 * n, n + 64)]):
            assert any(kernel.params.row_strides == pitches for _, kernel in op.built_kernels()), op


@pytest.mark.parametrize("n", [1001, 4096, 65536], ids=lambda n: f"n{n}")
def test_the_backward_reads_the_forwards_row_view_where_it_lies(n):
    # The gradient of a norm over a slice of wider rows: the backward kernels (scalar, register
    # and streamed variants by n) read x at its pitch, uncopied, and compute what they compute
    # on a copy; dweight and dbias too (2 rows: the row kernel and the reduction).
    from tileops.ops import LayerNormBwdOp, RMSNormBwdOp

    dtype = torch.bfloat16
    w = torch.randn(n, device="cuda", dtype=dtype)
    for rows in (2, 130):
        x = torch.randn(rows, 3 * n, device="cuda", dtype=dtype)[:, n:2 * n]
        dy = torch.randn(rows, n, device="cuda", dtype=dtype)
        for op in RMSNormBwdOp(n), LayerNormBwdOp(n):
            views, copies = op(dy, x, w), op(dy, x.contiguous(), w)
            for got, want in zip(views, copies):
                torch.testing.assert_close(got, want, atol=0, rtol=0)
            assert any(kernel.params.call.row_strides == (3 * n,) for _, kernel in op.built_kernels()), op


def test_a_row_view_whose_pitch_is_off_the_vector_grid_is_served_by_the_scalar_variant():
    n, dtype = 4096, torch.bfloat16
    x = torch.randn(5, n + 4, device="cuda", dtype=dtype)[:, :n]  # rows 8200 bytes apart
    w = torch.randn(n, device="cuda", dtype=dtype)
    op = RMSNormFwdOp(n)
    torch.testing.assert_close(op(x, w), _reference_rms_norm(x, w), atol=1.6e-2, rtol=1.6e-2)
    assert [key for key, kernel in op.built_kernels() if kernel.params.row_strides] == ["rms_norm_scalar"]
