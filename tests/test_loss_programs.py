"""The cross-entropy kernels: their launch rules, the kernel classes on CPU tensors (compilation
and the GPU replaced), and the compile tier (one representative build per program kind, compiled
for sm_90 in a fresh interpreter)."""

from __future__ import annotations

import pytest
import torch

from helpers import run_python, tuning_timed_by_config
from tileops.core import DeviceFacts
from tileops.kernels.cuda import loss as kernels
from tileops.kernels.cuda.loss import KERNELS, policy, programs
from tileops.ops.loss import (
    CrossEntropyBwdOp,
    CrossEntropyFusedInterface,
    CrossEntropyFwdOp,
    CrossEntropyGradInterface,
    CrossEntropyRowsInterface,
    CrossEntropyScaleInterface,
)

CUDA = torch.device("cuda", 0)


def test_the_rows_step_sizes_its_block_to_the_row_and_splits_few_rows():
    # Long rows: 512 threads that loop; a short row: the fewest threads that take it in one step.
    assert policy.rows_config(torch.bfloat16, 128256, True) == {"vec": 8, "threads": 512, "unroll": 4, "splits": 1}
    assert policy.rows_config(torch.float32, 1000, True)["threads"] == 64  # 250 accesses, 4 per thread
    assert policy.rows_config(torch.bfloat16, 1001, False)["vec"] == 1
    # An odd V in aligned tensors: 16-byte accesses over each row's middle, the grad step's too.
    assert policy.rows_config(torch.bfloat16, 50257, False, True) == {"vec": 8, "shifted": True, "threads": 512, "unroll": 4, "splits": 1}
    assert policy.grad_config(torch.float16, 1001, False, True) == {"vec": 8, "shifted": True, **policy.GRAD}
    assert all(c["shifted"] for c in policy.grad_candidates(torch.float16, 1001, False, True))
    assert policy.rows_config(torch.bfloat16, 15, False, True)["vec"] == 1  # under two accesses: no middle
    config = policy.rows_config(torch.bfloat16, 256000, True)
    # One row of 32000 accesses: 2 blocks per SM on 132 SMs, each span at least one 512 x 4 step.
    assert policy.split_count(config, 256000, 1, 132) == 15
    assert policy.split_count(config, 32000, 1, 132) == 1  # 4000 accesses: one step's worth
    assert [(rows, tier["splits"]) for rows, tier in policy.row_tiers(config, 256000, 132)] == [(1, 15), (4, 15), (16, 15), (64, 5)]
    assert policy.refusal(torch.float64, torch.int64) and policy.refusal(torch.bfloat16, torch.int16)
    assert policy.refusal(torch.bfloat16, torch.int32) is None


def test_the_fused_step_holds_half_the_rows_and_reads_them_back_from_their_end_where_they_overflow_l2():
    h200 = DeviceFacts("cuda", 90, 132, None, "H200", l2_bytes=60 * 2**20)
    h100 = DeviceFacts("cuda", 90, 132, None, "H100", l2_bytes=50 * 2**20)
    # 264 rows of 98 KiB fit in 60 MiB: the rows step's build, second pass forwards.
    assert policy.fused_config(torch.bfloat16, 50257, False, True, h200) == {"vec": 8, "shifted": True, "threads": 512, "unroll": 4}
    # 264 rows of 250 KiB (Llama 3's vocabulary) do not: 132 rows at once, read back from the end.
    llama3 = policy.fused_config(torch.bfloat16, 128256, True, True, h200)
    assert llama3 == {"vec": 8, "threads": 1024, "unroll": 4, "from_end": True}
    # The same row length in bytes decides in every dtype, and the L2's size where it is the limit.
    assert policy.fused_config(torch.float32, 64128, True, True, h200) == llama3 | {"vec": 4}
    assert policy.fused_config(torch.bfloat16, 100000, True, True, h200)["threads"] == 512  # 50.4 MiB
    assert policy.fused_config(torch.bfloat16, 100000, True, True, h100)["threads"] == 1024
    # Short rows keep their few threads; unknown facts keep the rows step's build.
    assert policy.fused_config(torch.bfloat16, 4096, True, True, h100)["threads"] == 128
    assert "from_end" not in policy.fused_config(torch.bfloat16, 256000, True, True)
    candidates = policy.fused_candidates(llama3, torch.bfloat16, 128256, True, True)
    assert candidates[0] == llama3 and len(candidates) == len({tuple(sorted(c.items())) for c in candidates})
    assert {"threads": 512, "from_end": True} | llama3 | {"threads": 512} in candidates
    assert llama3 | {"from_end": False} in candidates


def test_the_ops_tell_the_kernels_whether_rows_and_pointers_are_aligned():
    from tileops.core.tensor_description import TensorDescription
    from tileops.ops import LinearCrossEntropyFwdOp

    def specs(op, vocab, address=0):
        inputs = {"logits": TensorDescription(CUDA, torch.bfloat16, (8, vocab), address),
                  "target_ids": TensorDescription(CUDA, torch.int64, (8,))}
        return {(spec.aligned, spec.pointers_aligned) for spec in op.call_specs(CUDA, inputs).values()}

    assert specs(CrossEntropyFwdOp(), 32000) == {(True, True)}
    assert specs(CrossEntropyFwdOp(), 50257) == {(False, True)}  # the shifted programs
    assert specs(CrossEntropyFwdOp(), 32000, address=2) == {(False, False)}  # one element per access
    # The linear loss's chunks of logits are fresh allocations, aligned whatever V.
    linear = {"hidden_states": TensorDescription(CUDA, torch.bfloat16, (8, 64), 2),
              "weight": TensorDescription(CUDA, torch.bfloat16, (50257, 64)), "target_ids": TensorDescription(CUDA, torch.int64, (8,))}
    assert {(s.aligned, s.pointers_aligned) for s in LinearCrossEntropyFwdOp().call_specs(CUDA, linear).values()} == {(False, True)}


@pytest.fixture
def launches(monkeypatch):
    """Kernels built for cuda:0 with their programs and device facts replaced, so that the
    production forward runs on CPU tensors; the list of (config, tensors) launched."""
    from tileops.kernels.cuda import fast_launch
    from tileops.kernels.cuda import kernel as kernel_module

    launched = []

    def compiled(self, config, rank):
        return lambda *tensors: launched.append((config, tensors))

    monkeypatch.setattr(kernel_module, "compile_target", lambda device: {"kind": "cuda", "arch": "sm_90"})
    monkeypatch.setattr(kernel_module, "gpu_model", lambda device: "GPU")
    monkeypatch.setattr(kernel_module, "current_device_index", lambda: 0)
    monkeypatch.setattr(kernels, "current_device_index", lambda: 0)
    monkeypatch.setattr(fast_launch, "launcher", lambda *args, **kwargs: None)
    monkeypatch.setattr(kernels, "facts_for", lambda device: DeviceFacts("cuda", 90, 132, None, "GPU", l2_bytes=60 * 2**20))
    monkeypatch.setattr(kernel_module.TileLangKernel, "_launch_function", compiled)
    monkeypatch.setattr(kernels.CrossEntropyRowsKernel, "_launch_function", compiled)
    monkeypatch.setattr(kernels.CrossEntropyFusedKernel, "_launch_function", compiled)
    return launched


def test_the_rows_kernel_allocates_float32_rows_and_takes_a_split_build_for_few_rows(launches):
    op = CrossEntropyFwdOp(label_smoothing=0.1)
    kernel = KERNELS[CrossEntropyRowsInterface]["tilelang"](
        op.call_spec(CrossEntropyRowsInterface, CUDA, torch.bfloat16, 256000, torch.int64, True, True)
    )
    logits, target_ids = torch.zeros(2, 256000, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.long)
    loss, lse = kernel.forward(logits, target_ids)
    config, tensors = launches[-1]
    assert tensors[:2] == (logits, target_ids) and tensors[2] is loss and tensors[3] is lse
    assert loss.shape == lse.shape == (2,) and loss.dtype == lse.dtype == torch.float32
    assert config["splits"] == 15  # two rows: the rows<=4 build
    kernel.forward(torch.zeros(65, 256000, dtype=torch.bfloat16), torch.zeros(65, dtype=torch.long))
    assert launches[-1][0]["splits"] == 1


def test_tier_candidates_keep_at_least_two_spans_of_one_unrolled_step_each():
    config = policy.rows_config(torch.bfloat16, 256000, True)
    (_, tier), *_ = policy.row_tiers(config, 256000, 132)
    candidates = policy.tier_candidates(tier, 256000)
    assert candidates[0] == tier and len(candidates) == len({tuple(sorted(c.items())) for c in candidates}) == 5
    for candidate in candidates:
        assert 2 <= candidate["splits"] <= 32000 // (candidate["threads"] * candidate["unroll"])
        assert 32 <= candidate["threads"] <= policy.MAX_THREADS


def test_a_tune_request_on_a_call_of_few_rows_tunes_its_split_build_under_a_key_of_its_own(launches, monkeypatch, tmp_path):
    import json

    fastest = {"threads": 256, "splits": 30}
    tuning_timed_by_config(monkeypatch, tmp_path, launches, fastest)
    op = CrossEntropyFwdOp()
    spec = op.call_spec(CrossEntropyRowsInterface, CUDA, torch.bfloat16, 256000, torch.int64, True, True)
    kernel = KERNELS[CrossEntropyRowsInterface]["tilelang"](spec)
    tier = dict(policy.row_tiers(kernel.default_config(), 256000, 132))[4]
    kernel.request_tune()
    kernel.forward(torch.zeros(2, 256000, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.long))
    chosen = {**tier, **fastest}
    assert kernel.config["tuned_builds"] == {"rows<=4": chosen}
    assert launches[-1][0] == chosen  # the call itself ran what tuning chose
    stored = json.loads((tmp_path / "tuning" / "GPU.json").read_text())
    assert stored == {f"{kernel._tuning_key}/rows<=4": chosen}  # neither the main build nor another tier
    kernel.forward(torch.zeros(1, 256000, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.long))
    assert launches[-1][0] == dict(policy.row_tiers(kernel.default_config(), 256000, 132))[1]


def test_the_grad_kernel_writes_the_tensor_it_is_given(launches):
    op = CrossEntropyBwdOp(softcap=30.0)
    kernel = KERNELS[CrossEntropyGradInterface]["tilelang_grad"](
        op.call_spec(CrossEntropyGradInterface, CUDA, torch.bfloat16, 1000, torch.int32, False, False)
    )
    logits = torch.zeros(3, 1000, dtype=torch.bfloat16)
    rows = [torch.zeros(3, dtype=torch.int32)] + [torch.zeros(3) for _ in range(3)]
    assert kernel.forward(logits, *rows, logits) is logits  # in place: dlogits is the logits
    config, tensors = launches[-1]
    assert tensors[0] is logits and tensors[-1] is logits and config == {"vec": 1, **policy.GRAD}


def test_the_fused_kernel_runs_one_block_per_row_where_rows_fill_the_gpu_else_the_split_rows_step(launches):
    op = CrossEntropyFwdOp(lse_square_scale=1e-4)
    kernel = KERNELS[CrossEntropyFusedInterface]["tilelang_fused"](
        op.call_spec(CrossEntropyFusedInterface, CUDA, torch.bfloat16, 256000, torch.int64, True, True)
    )
    unit = torch.tensor(0.5)
    for rows, splits in ((2, 15), (65, None)):
        logits, target_ids = torch.zeros(rows, 256000, dtype=torch.bfloat16), torch.zeros(rows, dtype=torch.long)
        grad = torch.empty_like(logits)
        loss, lse = kernel.forward(logits, target_ids, unit, grad)
        config, tensors = launches[-1]
        assert tensors[:4] == (logits, target_ids, unit, grad) and tensors[4] is loss and tensors[5] is lse
        assert loss.shape == lse.shape == (rows,) and loss.dtype == lse.dtype == torch.float32
        assert config.get("splits") == splits
    # Rows of 500 KiB: two blocks' rows per SM would not fit the L2, one 1024-thread block's go.
    assert config == policy.fused_config(torch.bfloat16, 256000, True, True, kernel.facts)
    assert config["threads"] == 1024 and config["from_end"]


def test_the_scale_kernel_scales_the_gradient_it_is_given_as_one_flat_run(launches):
    op = CrossEntropyBwdOp()
    kernel = KERNELS[CrossEntropyScaleInterface]["tilelang_scale"](
        op.call_spec(CrossEntropyScaleInterface, CUDA, torch.bfloat16, 1000, torch.int64, True, True)
    )
    grad, factor = torch.zeros(3, 1000, dtype=torch.bfloat16), torch.tensor(2.0, dtype=torch.bfloat16)
    assert kernel.forward(grad, factor) is grad
    config, (flat, one) = launches[-1]
    assert flat.shape == (3000,) and flat.data_ptr() == grad.data_ptr() and one.shape == (1,)
    assert config == {"vec": 8, **policy.SCALE, "blocks": 8 * 132}


def test_a_program_of_every_kind_is_built_without_compiling():
    pytest.importorskip("tilelang")
    for vec, softcap in ((1, None), (8, 30.0)):
        programs.make_partial(torch.bfloat16, 1024, softcap, vec=vec, threads=64, unroll=2, splits=3)
        programs.make_finish(torch.bfloat16, 1024, torch.int32, softcap, splits=3, ignore_index=-100, smoothing=0.1, z_scale=1e-4)
        programs.make_grad(torch.bfloat16, 1024, torch.int64, softcap, vec=vec, threads=128, per_thread=2, smoothing=0.0)
        programs.make_fused(torch.bfloat16, 1024, torch.int64, softcap, vec=vec, threads=64, unroll=2,
                            ignore_index=-100, smoothing=0.1, z_scale=1e-4)
        programs.make_scale(torch.bfloat16, vec=vec, threads=128, per_thread=2, blocks=264)
    with pytest.raises(ValueError, match="bad configuration"):
        programs.make_partial(torch.bfloat16, 1001, None, vec=8, threads=64, unroll=2, splits=1)
    with pytest.raises(ValueError, match="unknown kind"):
        programs.compile_program("softmax", torch.bfloat16, 8, torch.int64, None, {})


# -- the compile tier ---------------------------------------------------------------------------

COMPILE = """
import torch
from tileops.kernels.cuda.loss import policy, programs
target = {"kind": "cuda", "arch": "sm_90"}
rows = policy.rows_config(torch.bfloat16, 128256, True)
# One build per kind: 16-byte and scalar accesses, soft-capping, a split row, both target dtypes.
for kind, dtype, vocab, target_dtype, softcap, config in [
    ("partial", torch.bfloat16, 128256, torch.int64, None, {**rows, "splits": 4}),
    ("finish", torch.float16, 1001, torch.int32, 30.0, {"splits": 4, "ignore_index": -100, "smoothing": 0.1, "z_scale": 1e-4}),
    ("grad", torch.bfloat16, 256000, torch.int64, 30.0, {**policy.grad_config(torch.bfloat16, 256000, True), "smoothing": 0.1}),
    ("grad", torch.float32, 1001, torch.int32, None, {**policy.grad_config(torch.float32, 1001, False), "smoothing": 0.0}),
    # An odd V in aligned tensors: 16-byte accesses over each row's aligned middle (shifted).
    ("partial", torch.bfloat16, 50257, torch.int64, None, policy.rows_config(torch.bfloat16, 50257, False, True)),
    ("grad", torch.bfloat16, 50257, torch.int64, None, {**policy.grad_config(torch.bfloat16, 50257, False, True), "smoothing": 0.0}),
    # A reduced loss's training step: both passes in one block per row, every option on.
    # (1024 threads reading the row back from its end: the rule's build for rows the L2 cannot hold.)
    ("fused", torch.bfloat16, 50257, torch.int32, 30.0,
     {**policy.fused_config(torch.bfloat16, 50257, False, True), "threads": 1024, "from_end": True, "ignore_index": -100,
      "smoothing": 0.1, "z_scale": 1e-4}),
    ("scale", torch.bfloat16, 0, torch.int64, None, policy.scale_config(torch.bfloat16, True, 132)),
]:
    kernel = programs.compile_program(kind, dtype, vocab, target_dtype, softcap, target, **config)
    source = kernel.get_kernel_source()
    body = source[source.index("__launch_bounds__"):]
    accesses = (body.count("(uint4*)") + body.count("(float4*)")) // 2  # each access casts both sides
    hinted = [body.count(f"tileops_load_{priority}(") for priority in ("evict_last", "evict_first")]
    print(kind, accesses, *hinted, "tanhf" in body, "exp2f" in body, "CUDART_NAN_F" in body)
"""


@pytest.mark.compile
def test_one_build_per_kind_compiles_for_sm90_with_16_byte_accesses_where_aligned(tmp_path):
    result = run_python(COMPILE, env={"TILELANG_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [line.split() for line in result.stdout.splitlines() if line.split()[0] in programs.KINDS]
    # kind, 16-byte accesses in the source (an unrolled loop shows one), loads "evict last" and
    # "evict first", tanh (soft-capping), exp2, NaN for a target out of range
    assert lines == [
        ["partial", "1", "0", "0", "False", "True", "False"],
        ["finish", "0", "0", "0", "True", "True", "True"],
        ["grad", "2", "0", "0", "True", "True", "False"],
        ["grad", "0", "0", "0", "False", "True", "False"],
        ["partial", "1", "0", "0", "False", "True", "False"],
        ["grad", "2", "0", "0", "False", "True", "False"],
        # The row's first read keeps it in L2 for the second, which lets it go; the gradient's write.
        ["fused", "1", "1", "1", "True", "True", "True"],
        ["scale", "2", "0", "0", "False", "False", "False"],
    ], result.stdout[-3000:]
