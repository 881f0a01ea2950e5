"""The softmax kernels: their launch policy, the kernel classes on CPU tensors (compilation and
the GPU replaced: which build serves which call, the split build's two launches and workspace,
the output dtype), and the compile tier (one representative build per kernel kind and variant,
compiled for sm_90 in a fresh interpreter)."""

from __future__ import annotations

import pytest
import torch

from helpers import run_python, tuning_timed_by_config
from tileops.core import DeviceFacts
from tileops.kernels.cuda import softmax as kernels
from tileops.kernels.cuda.softmax import KERNELS, policy, programs
from tileops.ops.softmax import SoftmaxBwdInterface, SoftmaxCall, SoftmaxFwdInterface, SoftmaxFwdOp

CUDA = torch.device("cuda", 0)


def _call(n, dtype=torch.bfloat16, out_dtype=None, log=False, aligned=True):
    return SoftmaxCall(CUDA, n, dtype, out_dtype or dtype, log, aligned)


def test_rows_up_to_32768_elements_stay_in_registers_and_longer_ones_stream():
    assert policy.REGISTER_MAX_N == 32768
    assert policy.refusal("register", 32768, torch.float32, torch.float32) is None
    assert "streamed variant serves it" in policy.refusal("register", 32769, torch.bfloat16, torch.bfloat16)
    assert policy.refusal("streamed", 262144 * 4, torch.bfloat16, torch.float32) is None
    assert "float64" in policy.refusal("streamed", 8, torch.float64, torch.float64)
    assert "float64" in policy.refusal("register", 8, torch.bfloat16, torch.float64)


@pytest.mark.parametrize("n", [1, 7, 256, 1001, 4096, 32000, 32768])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("aligned", [True, False])
def test_a_register_thread_holds_at_most_32_elements_and_blocks_have_128_threads(n, dtype, aligned):
    if aligned and n * dtype.itemsize % 16:
        return
    config = policy.launch_config("register", n, dtype, aligned)
    tpr = config["threads"] // config["rows"]
    assert tpr & (tpr - 1) == 0 and config["threads"] >= min(128, tpr) and config["threads"] <= 1024
    assert -(-n // config["vec"] // tpr) * config["vec"] <= 32
    assert config["vec"] == (16 // dtype.itemsize if aligned else 1)


@pytest.mark.parametrize(
    ("n", "dtype"),
    [(1001, torch.bfloat16), (30001, torch.bfloat16), (30522, torch.float16), (1001, torch.float32), (50257, torch.bfloat16), (151937, torch.float32)],
    ids=str,
)
def test_rows_that_are_not_whole_accesses_in_aligned_tensors_take_16_byte_accesses_over_their_middle(n, dtype):
    vec = 16 // dtype.itemsize
    for variant in ("register", "streamed"):
        if policy.refusal(variant, n, dtype, dtype):
            continue
        config = policy.launch_config(variant, n, dtype, False, pointers_aligned=True, softmax_forward=True)
        assert config["vec"] == vec and config["shifted"] is True
        # A row's first 2 * vec threads read its edges, one element each.
        assert config["threads"] // config.get("rows", 1) >= 2 * vec
        for candidate in policy.tuning_candidates(variant, n, dtype, False, pointers_aligned=True):
            assert candidate["shifted"] and candidate["threads"] // candidate.get("rows", 1) >= 2 * vec
        # A data pointer off the grid leaves one element per access.
        unaligned = policy.launch_config(variant, n, dtype, False)
        assert unaligned["vec"] == 1 and "shifted" not in unaligned
    split = policy.split_config(n, dtype, policy.launch_config("streamed", n, dtype, False, pointers_aligned=True), 132)
    assert split is None or (split["vec"] == vec and split["shifted"] is True)


def test_a_shifted_softmax_forward_row_halves_its_threads_as_an_aligned_one_does():
    # The halved build is held to two blocks per SM, so the edge element and the row's geometry
    # it holds too do not push it to one.
    for n in (20001, 30522, 32767):
        halved = policy.launch_config("register", n, torch.bfloat16, False, pointers_aligned=True, softmax_forward=True)
        aligned = policy.launch_config("register", n // 8 * 8, torch.bfloat16, True, softmax_forward=True)
        assert halved == {**aligned, "shifted": True} == {
            "variant": "register", "vec": 8, "threads": 512, "rows": 1, "keep": False, "shifted": True
        }


def test_rows_too_short_for_edges_on_both_sides_take_one_element_per_access():
    # Under 2 * vec elements, or so few accesses that a row has fewer threads than its edges.
    for n, dtype in ((9, torch.bfloat16), (33, torch.float16), (7, torch.float32)):
        config = policy.launch_config("register", n, dtype, False, pointers_aligned=True)
        assert config["vec"] == 1 and "shifted" not in config


def test_tuning_tries_half_the_threads_of_a_full_width_register_row_without_kept_exponentials():
    default, *others = policy.tuning_candidates("register", 32000, torch.bfloat16, True)
    assert default == policy.launch_config("register", 32000, torch.bfloat16, True) and default["threads"] == 1024
    half = [c for c in others if c["threads"] == 512]
    assert half == [{**default, "threads": 512, "keep": False}]  # 64 elements a thread: no room to keep exponentials
    # Where half the threads still hold at most 32 elements each (float32: 16 a thread by default), they keep them.
    assert all("keep" not in c for c in policy.tuning_candidates("register", 4096, torch.float32, True))
    # A softmax forward's wide row starts there, and tries the threads that keep exponentials.
    default, *others = policy.tuning_candidates("register", 32000, torch.bfloat16, True, softmax_forward=True)
    assert default == {"variant": "register", "vec": 8, "threads": 512, "rows": 1, "keep": False}
    assert others == [{"variant": "register", "vec": 8, "threads": 1024, "rows": 1}]


@pytest.mark.parametrize("n", [1, 7, 256, 1001, 4096, 8192, 11008, 16384, 20000, 32000, 32768])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("aligned", [True, False])
def test_a_softmax_forward_row_of_512_threads_or_more_takes_half_of_them_and_keeps_no_exponentials(n, dtype, aligned):
    if aligned and n * dtype.itemsize % 16:
        return
    kept = policy.launch_config("register", n, dtype, aligned)
    config = policy.launch_config("register", n, dtype, aligned, softmax_forward=True)
    if kept["threads"] // kept["rows"] < 512 or not aligned:  # narrower rows, element-wise accesses: kept exponentials
        assert config == kept
        return
    assert config == {**kept, "threads": kept["threads"] // 2, "keep": False}
    assert -(-n // config["vec"] // config["threads"]) * config["vec"] <= 64  # the most a thread holds


H100 = DeviceFacts("cuda", 90, 132, 227 * 1024, "H100", threads_per_sm=2048, l2_bytes=50 * 2**20)
H200 = DeviceFacts("cuda", 90, 132, 227 * 1024, "H200", threads_per_sm=2048, l2_bytes=60 * 2**20)


def test_a_streamed_softmax_forward_takes_512_thread_blocks_where_the_rows_they_hold_fit_in_l2():
    def threads(n, dtype, facts, softmax_forward=True):
        config = policy.launch_config("streamed", n, dtype, True, softmax_forward=softmax_forward, facts=facts)
        return config["threads"], config["unroll"]

    # 132 SMs x 4 blocks of 512 threads: rows of up to 97 KiB on 50 MiB of L2, 116 KiB on 60.
    assert threads(40000, torch.bfloat16, H100) == threads(36000, torch.float16, H100) == (512, 8)
    assert threads(50304, torch.bfloat16, H100) == (1024, 4) and threads(50304, torch.bfloat16, H200) == (512, 8)
    assert threads(100000, torch.bfloat16, H200) == threads(40000, torch.float32, H200) == (1024, 4)
    # Unknown facts, a log-softmax or a backward (not measured): the 1024-thread blocks.
    assert threads(40000, torch.bfloat16, None) == threads(40000, torch.bfloat16, H100, softmax_forward=False) == (1024, 4)
    # Tuning times the other block sizes beside it, each once.
    candidates = policy.tuning_candidates("streamed", 40000, torch.bfloat16, True, softmax_forward=True, facts=H100)
    assert candidates[0]["threads"] == 512 and len(candidates) == 5
    assert {(c["threads"], c["unroll"]) for c in candidates} == {(512, 8), (1024, 4), (512, 4), (1024, 2)}
    assert [c for c in candidates if c.get("from_end")] == [{**candidates[0], "from_end": True}]


def test_tuning_also_times_a_streamed_row_s_second_pass_from_the_row_s_end():
    default, *others = policy.tuning_candidates("streamed", 131072, torch.bfloat16, True, facts=H200)
    assert "from_end" not in default and [c for c in others if c.get("from_end")] == [{**default, "from_end": True}]
    # The split build (few rows) reads its chunks forwards: a chunk's second pass reads from L2 anyway.
    assert "from_end" not in policy.split_config(131072, torch.bfloat16, default, 132)
    with pytest.raises(ValueError, match="from_end"):
        programs.make_program("forward", 131072, torch.bfloat16, torch.bfloat16, False, variant="streamed", vec=8,
                              threads=256, phase="partial", chunks=8, from_end=True)
    with pytest.raises(ValueError, match="from_end"):
        programs.make_program("forward", 4096, torch.bfloat16, torch.bfloat16, False, variant="register", vec=8,
                              threads=512, from_end=True)


def test_the_split_build_gives_one_row_about_two_blocks_per_sm_in_chunks_of_16_kib():
    config = policy.launch_config("streamed", 262144, torch.bfloat16, True)
    assert policy.split_config(262144, torch.bfloat16, config, 132)["chunks"] == 32  # 512 KiB / 16 KiB
    assert policy.split_config(1 << 22, torch.float32, config, 132)["chunks"] == 264  # capped at 2 per SM
    assert policy.split_config(40000, torch.bfloat16, config, 132)["chunks"] == 4
    assert policy.split_config(12000, torch.bfloat16, config, 132) is None  # 24000 bytes: no two chunks
    assert policy.split_rows(132) == 131


@pytest.fixture
def launches(monkeypatch):
    """Kernels built for cuda:0 with their programs, device facts and the C++ launcher replaced,
    so that the production forward runs on CPU tensors; the list of (config, rank, tensors)."""
    from tileops.kernels.cuda import fast_launch
    from tileops.kernels.cuda import kernel as kernel_module

    launched = []

    def compiled(self, config, rank):
        return lambda *tensors: launched.append((config, rank, tensors))

    monkeypatch.setattr(kernel_module, "compile_target", lambda device: {"kind": "cuda", "arch": "sm_90"})
    monkeypatch.setattr(kernel_module, "gpu_model", lambda device: "GPU")
    monkeypatch.setattr(kernel_module, "current_device_index", lambda: 0)
    monkeypatch.setattr(fast_launch, "launcher", lambda *args, **kwargs: None)
    monkeypatch.setattr(kernels, "facts_for", lambda device: DeviceFacts("cuda", 90, 132, None, "GPU"))
    monkeypatch.setattr(kernels.programs, "compile_program", lambda *args, **config: ("compiled", config))
    monkeypatch.setattr(kernels, "entry_function", lambda kernel: lambda *tensors: launched.append((kernel[1], 2, tensors)))
    monkeypatch.setattr(kernel_module.TileLangKernel, "_launch_function", compiled)
    return launched


def test_a_register_kernel_allocates_y_in_the_output_dtype(launches):
    kernel = KERNELS[SoftmaxFwdInterface]["softmax"](_call(4096, out_dtype=torch.float32))
    x = torch.zeros(3, 4096, dtype=torch.bfloat16)
    y = kernel.forward(x)
    config, rank, tensors = launches[-1]
    assert rank == 2 and tensors[0] is x and tensors[1] is y and y.dtype == torch.float32 and y.shape == x.shape
    assert config == policy.launch_config("register", 4096, torch.bfloat16, True)


def test_few_long_rows_take_the_split_build_in_two_launches_through_a_workspace(launches):
    kernel = KERNELS[SoftmaxFwdInterface]["softmax_streamed"](_call(262144))
    x = torch.zeros(131, 262144, dtype=torch.bfloat16)
    y = kernel.forward(x)
    (partial, _, (x1, ws1)), (finish, _, (x2, ws2, y2)) = launches[-2:]
    assert partial["phase"] == "partial" and finish["phase"] == "finish" and partial["chunks"] == 32
    assert x1 is x2 is x and ws1 is ws2 and ws1.shape == (131, 32, 2) and ws1.dtype == torch.float32 and y2 is y
    launches.clear()
    kernel.forward(torch.zeros(132, 262144, dtype=torch.bfloat16))  # one row per SM or more: one launch
    (config, _, tensors), = launches
    assert config == policy.launch_config("streamed", 262144, torch.bfloat16, True) and len(tensors) == 2
    assert kernel.config["split_build"]["max_rows"] == 131


def test_split_candidates_halve_and_double_the_chunks_within_the_rule_s_limits():
    config = policy.launch_config("streamed", 262144, torch.bfloat16, True)
    split = policy.split_config(262144, torch.bfloat16, config, 132)
    candidates = policy.split_candidates(262144, torch.bfloat16, split)
    assert candidates[0] == split and len(candidates) == 6
    assert {c["chunks"] for c in candidates} == {16, 32}  # 64 chunks would be 8 KiB each
    assert {c["threads"] for c in candidates} == {128, 256, 512}
    few = policy.split_config(40000, torch.bfloat16, config, 132)
    assert {c["chunks"] for c in policy.split_candidates(40000, torch.bfloat16, few)} == {2, 4}


def test_a_tune_request_on_a_call_of_few_rows_tunes_the_split_build_under_a_key_of_its_own(launches, monkeypatch, tmp_path):
    import json

    fastest = {"chunks": 16, "threads": 512}
    tuning_timed_by_config(monkeypatch, tmp_path, launches, fastest)
    kernel = KERNELS[SoftmaxFwdInterface]["softmax_streamed"](_call(262144))
    split = policy.split_config(262144, torch.bfloat16, kernel.default_config(), 132)
    kernel.request_tune()
    kernel.forward(torch.zeros(2, 262144, dtype=torch.bfloat16))
    chosen = {**split, **fastest}
    assert kernel.config["tuned_builds"] == {"split": chosen}
    assert launches[-1][0] == {**chosen, "phase": "finish"}  # the call itself ran what tuning chose
    assert launches[-1][2][1].shape == (2, 16, 2)  # with a workspace of the chosen chunks
    stored = json.loads((tmp_path / "tuning" / "GPU.json").read_text())
    assert stored == {f"{kernel._tuning_key}/split": chosen}  # the main build's key is not tuned
    launches.clear()
    kernel.forward(torch.zeros(132, 262144, dtype=torch.bfloat16))
    assert launches[-1][0] == policy.launch_config("streamed", 262144, torch.bfloat16, True)


def test_the_backward_kernels_take_dy_and_y_then_dx(launches):
    kernel = KERNELS[SoftmaxBwdInterface]["softmax_bwd_streamed"](_call(65536, torch.float16, log=True))
    dy, y = torch.zeros(2, 65536, dtype=torch.float16), torch.zeros(2, 65536, dtype=torch.float16)
    dx = kernel.forward(dy, y)
    (_, _, (a, b, ws)), (_, _, (c, d, ws2, out)) = launches[-2:]
    assert (a, b, c, d) == (dy, y, dy, y) and ws is ws2 and out is dx and dx.dtype == torch.float16


def test_the_ops_call_a_call_aligned_only_when_rows_fill_16_byte_accesses():
    from tileops.core.tensor_description import TensorDescription

    def spec(op, shape, dtype, address=0):
        return op.call_specs(CUDA, {"x": TensorDescription(CUDA, dtype, shape, address)})[SoftmaxFwdInterface]

    assert spec(SoftmaxFwdOp(), (4, 1000), torch.bfloat16).aligned is True
    assert spec(SoftmaxFwdOp(), (4, 1001), torch.bfloat16).aligned is False
    assert spec(SoftmaxFwdOp(), (4, 1000), torch.bfloat16, address=2).aligned is False
    moved = spec(SoftmaxFwdOp(0, torch.float32), (1000, 3), torch.bfloat16, address=2)  # a moved dim is a fresh copy
    assert moved.aligned is True and moved.n == 1000 and moved.out_dtype == torch.float32
    # Rows that are not whole accesses in an aligned tensor: the shifted programs' call.
    assert (spec(SoftmaxFwdOp(), (4, 1001), torch.bfloat16).pointers_aligned, spec(SoftmaxFwdOp(), (4, 1000), torch.bfloat16).pointers_aligned) == (True, True)
    assert spec(SoftmaxFwdOp(), (4, 1001), torch.bfloat16, address=2).pointers_aligned is False
    assert spec(SoftmaxFwdOp(0), (1001, 3), torch.bfloat16, address=2).pointers_aligned is True


def test_a_program_of_every_kind_variant_and_phase_is_built_without_compiling():
    pytest.importorskip("tilelang")
    for kind in programs.KINDS:
        for log in (False, True):
            programs.make_program(kind, 4096, torch.bfloat16, torch.bfloat16, log, variant="register", vec=8, threads=512, rows=1)
            programs.make_program(kind, 33, torch.float16, torch.float16, log, variant="register", vec=1, threads=128, rows=16)
            programs.make_program(kind, 1001, torch.float16, torch.float16, log, variant="register", vec=8, threads=128, rows=4, shifted=True)
            for phase, chunks in (("whole", 1), ("partial", 8), ("finish", 8)):
                programs.make_program(kind, 65536, torch.float32, torch.float32, log, variant="streamed", vec=4, threads=256, phase=phase, chunks=chunks)
                programs.make_program(kind, 65537, torch.bfloat16, torch.bfloat16, log, variant="streamed", vec=8, threads=256, phase=phase, chunks=chunks, shifted=True)
    with pytest.raises(ValueError, match="dx in dy's dtype"):
        programs.make_program("backward", 64, torch.bfloat16, torch.float32, False, variant="register", vec=8, threads=8)
    with pytest.raises(ValueError, match="bad launch configuration"):
        programs.make_program("forward", 1001, torch.bfloat16, torch.bfloat16, False, variant="register", vec=8, threads=128)
    with pytest.raises(ValueError, match="a shifted program needs"):  # 8 threads a row for 16 edge elements
        programs.make_program("forward", 1001, torch.bfloat16, torch.bfloat16, False, variant="register", vec=8, threads=128, rows=16, shifted=True)


# -- the compile tier ---------------------------------------------------------------------------

COMPILE = """
import torch
from tileops.kernels.cuda.softmax import policy, programs
target = {"kind": "cuda", "arch": "sm_90"}
bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
streamed = policy.launch_config("streamed", 262144, bf16, True)
split = policy.split_config(262144, bf16, streamed, 132)
# One build per kind and variant (and split phase): vector and scalar accesses, an output dtype.
for name, kind, n, dtype, out_dtype, log, config in [
    ("register", "forward", 4096, bf16, f32, False, policy.launch_config("register", 4096, bf16, True)),
    ("register-scalar", "forward", 1001, f16, f16, True, policy.launch_config("register", 1001, f16, False)),
    ("register-bwd", "backward", 32000, bf16, bf16, False, policy.launch_config("register", 32000, bf16, True)),
    ("register-recomputed", "forward", 32000, bf16, bf16, False, policy.launch_config("register", 32000, bf16, True, softmax_forward=True)),
    ("streamed", "forward", 262144, bf16, bf16, True, streamed),
    ("split-partial", "forward", 262144, bf16, bf16, False, {**split, "phase": "partial"}),
    ("split-finish", "forward", 262144, bf16, bf16, False, {**split, "phase": "finish"}),
    ("streamed-bwd", "backward", 131072, f32, f32, True, policy.launch_config("streamed", 131072, f32, True)),
    # Rows that are not whole accesses in aligned tensors: 16-byte accesses over their middle.
    ("register-shifted", "forward", 30001, bf16, bf16, False, policy.launch_config("register", 30001, bf16, False, pointers_aligned=True)),
    ("streamed-shifted-bwd", "backward", 50257, f16, f16, False, policy.launch_config("streamed", 50257, f16, False, pointers_aligned=True)),
]:
    source = programs.compile_program(kind, n, dtype, out_dtype, log, target, **config).get_kernel_source()
    body = source[source.index("__launch_bounds__"):]
    bounds = body[len("__launch_bounds__("):body.index(")")].split(", ")  # threads, and the blocks per SM asked for
    print(name, "uint4" in body or "float4" in body, body.count("tileops_load_evict"), "exp2f" in body, "logf" in body,
          bounds[1] if len(bounds) > 1 else 1)
"""


@pytest.mark.compile
def test_one_build_per_kind_compiles_for_sm90_with_16_byte_accesses_where_tensors_are_aligned(tmp_path):
    result = run_python(COMPILE, env={"TILELANG_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [line.split() for line in result.stdout.splitlines() if line and not line.startswith("tileops:")]
    # name, 16-byte accesses, prioritised loads (pass 1 evict_last, pass 2 evict_first), exp (as exp2), log,
    # blocks per SM ptxas must fit (the halved build's two: at most 64 registers a thread)
    assert lines == [
        ["register", "True", "0", "True", "False", "1"],
        ["register-scalar", "False", "0", "True", "True", "1"],
        ["register-bwd", "True", "0", "False", "False", "1"],
        ["register-recomputed", "True", "0", "True", "False", "2"],
        ["streamed", "True", "2", "True", "True", "1"],
        ["split-partial", "False", "1", "True", "False", "1"],  # writes only its (max, sum): no vector store
        ["split-finish", "True", "1", "True", "False", "1"],
        ["streamed-bwd", "True", "3", "True", "False", "1"],
        ["register-shifted", "True", "0", "True", "False", "1"],
        ["streamed-shifted-bwd", "True", "4", "False", "False", "1"],  # dy and y in both passes (softmax's)
    ], result.stdout[-3000:]
