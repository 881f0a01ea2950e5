"""The norm backward kernels' launch rules (``backward_policy``; CPU: no tilelang, no GPU), their
key table, and the compile tier: one representative build per kernel kind lowers and compiles for sm_90."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import run_python
from tileops.kernels.cuda.norm import KERNELS
from tileops.kernels.cuda.norm import backward_policy as policy
from tileops.kernels.cuda.norm import backward_programs as programs
from tileops.kernels.cuda.norm.backward import BACKWARD_KERNELS

KINDS = policy.KINDS
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
LENGTHS = [1, 7, 8, 64, 1000, 1024, 4096, 5120, 7168, 8192, 16384, 32768, 65536, 100000, 262144]


def _served_by(kind, n, dtype, aligned=True):
    return [v for v in policy.VARIANTS if policy.refusal(kind, v, n, dtype, aligned) is None]


def test_the_backward_tables_join_the_ops_table_with_their_keys():
    for interface, table in BACKWARD_KERNELS.items():
        assert KERNELS[interface] is table
        kind = next(iter(table)).removesuffix("_bwd")
        assert list(table) == [f"{kind}_bwd", f"{kind}_bwd_streamed", f"{kind}_bwd_scalar"]
        assert [cls.general for cls in table.values()] == [False, False, True]
        assert all(cls.takes_any_shape for cls in table.values())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_length_and_alignment_is_served_and_float64_is_refused(kind, dtype):
    for n in LENGTHS + [n + 1 for n in LENGTHS]:
        assert "scalar" in _served_by(kind, n, dtype, aligned=False)
        served = _served_by(kind, n, dtype)
        assert served[-1] == "scalar"
        assert ("streamed" in served) == (n * dtype.itemsize % 16 == 0)
    reason = policy.refusal(kind, "scalar", 4096, torch.float64, True)
    assert "float64" in reason and "torch implementation serves it" in reason


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_launch_rules_fit_the_hardware_for_every_length(kind, dtype):
    for n in LENGTHS:
        for variant in _served_by(kind, n, dtype):
            config = policy.launch_config(kind, variant, n, dtype)
            tpr, rows, vec = config["tpr"], config["rows"], config["vec"]
            assert tpr & (tpr - 1) == 0 and tpr * rows <= 1024 and n % vec == 0, (n, config)
            assert vec * dtype.itemsize in (dtype.itemsize, 16), config
            if variant == "register":
                assert config["unroll"] <= 4 and tpr * config["unroll"] * vec >= n, (n, config)
            sum_bytes = policy.shared_sum_bytes(kind, n, config)
            if config["acc"] == "shared":  # every column's sums, within the shared memory given to them
                assert policy.parts_of(kind) * n * rows * 4 <= sum_bytes <= 128 * 1024, (n, config)
            elif variant != "register":  # the streamed modes add into global memory only where they must
                assert config["acc"] == "global" and sum_bytes > 128 * 1024, (n, config)
            assert 1 <= policy.blocks_per_sm(kind, n, dtype, config) <= 2048 // (tpr * rows)


@pytest.mark.parametrize("kind", KINDS)
def test_column_sums_beyond_the_gpus_shared_memory_per_block_move_out_of_it(kind):
    # sm_86 and sm_89 give a block 99 KiB of shared memory: the streamed mode keeps the sums of
    # 16384-column rows there in 64-128 KiB, the register mode those of 8192 bf16 columns in 32-64 KiB.
    small = 99 * 1024
    for n in (16384, 32768):
        everywhere = policy.launch_config(kind, "streamed", n, torch.bfloat16)
        fitted = policy.launch_config(kind, "streamed", n, torch.bfloat16, shared_per_block=small)
        assert policy.block_shared_bytes(kind, n, fitted) <= small, fitted
        moved = policy.block_shared_bytes(kind, n, everywhere) > small
        assert fitted == ({**everywhere, "acc": "global"} if moved else everywhere)
    n, dtype = 8192, torch.bfloat16
    register = policy.launch_config(kind, "register", n, dtype)
    need = policy.block_shared_bytes(kind, n, register)
    assert policy.refusal(kind, "register", n, dtype, True, shared_per_block=need) is None
    reason = policy.refusal(kind, "register", n, dtype, True, shared_per_block=need - 1)
    if register["acc"] == "shared":
        assert reason == (f"a row of 16384 bytes takes {need} bytes of shared memory a block (its column sums) and "
                          f"this GPU gives a block at most {need - 1}: the 'streamed' variant serves it")
    else:  # the sums in registers: only the reduction's partials in shared memory
        assert need <= 1024 and reason is None


def test_the_next_row_is_loaded_ahead_where_it_costs_no_block():
    def config(kind, n, dtype=torch.bfloat16):
        return policy.launch_config(kind, "register", n, dtype)

    assert config("rms_norm", 4096)["prefetch"] and config("rms_norm", 8192)["prefetch"]
    assert config("add_rms_norm", 4096)["prefetch"] and config("add_layer_norm", 7168)["prefetch"]
    assert not config("layer_norm", 4096)["prefetch"]  # its two column sums fill the registers
    assert not config("add_layer_norm", 2560)["prefetch"]  # the same, at two vectors per thread
    for dtype in DTYPES:
        for n in LENGTHS:
            for kind in ("rms_norm", "layer_norm"):
                if "register" not in _served_by(kind, n, dtype):
                    continue
                chosen = config(kind, n, dtype)
                without = {**chosen, "prefetch": False}
                if chosen["prefetch"]:
                    assert policy.blocks_per_sm(kind, n, dtype, chosen) == policy.blocks_per_sm(kind, n, dtype, without)
    assert all(not policy.launch_config("rms_norm", variant, 4096, torch.bfloat16).get("prefetch")
               for variant in ("streamed", "scalar"))


def test_fused_kinds_take_the_vectors_per_thread_that_leave_the_fewest_lanes_idle():
    def shape(kind, n, dtype=torch.bfloat16):
        config = policy.launch_config(kind, "register", n, dtype)
        return config["tpr"], config["unroll"], config["acc"], config["prefetch"]

    # bf16 rows of 96 vectors: 32 threads of three leave none idle; 128 of one would leave 32.
    assert shape("add_rms_norm", 768) == (32, 3, "register", True)
    assert shape("add_rms_norm", 2048) == (256, 1, "register", True)
    assert shape("add_rms_norm", 1536) == (64, 3, "register", True)
    # Four vectors a thread would put add_layer_norm's two column sums in shared memory.
    assert shape("add_layer_norm", 1536) == (256, 1, "register", True)
    assert shape("add_layer_norm", 2560) == (256, 2, "register", False)
    # Rows too long for 256 threads of four vectors keep the default two vectors per thread.
    assert shape("add_rms_norm", 8192) == (512, 2, "shared", True)
    for kind in ("add_rms_norm", "add_layer_norm"):
        for dtype in DTYPES:
            row_vectors = {n: n * dtype.itemsize // 16 for n in LENGTHS}
            for n in LENGTHS:
                if "register" not in _served_by(kind, n, dtype):
                    continue
                chosen = policy.launch_config(kind, "register", n, dtype)
                if chosen["tpr"] > policy.BLOCK_THREADS or chosen["acc"] != "register":
                    continue  # no candidate fits: the default two vectors
                idle = chosen["tpr"] * chosen["unroll"] - row_vectors[n]
                for vectors in (1, 2, 4):
                    other = policy.launch_config(kind, "register", n, dtype, vectors=vectors)
                    if other["tpr"] <= policy.BLOCK_THREADS and other["acc"] == "register":
                        assert idle <= other["tpr"] * other["unroll"] - row_vectors[n], (kind, dtype, n, vectors)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sm_count", [1, 78, 132])
def test_partial_rows_are_sane_for_every_row_count(kind, sm_count):
    for n, dtype in [(1, torch.float32), (1000, torch.bfloat16), (4096, torch.bfloat16), (65536, torch.float16)]:
        for variant in _served_by(kind, n, dtype):
            config = policy.launch_config(kind, variant, n, dtype)
            resident = sm_count * policy.blocks_per_sm(kind, n, dtype, config) * config["rows"]
            for m in [1, 2, 3, 100, 4097, 65536, 1 << 20]:
                slots = policy.partial_rows(kind, m, n, dtype, config, sm_count)
                assert slots % config["rows"] == 0 and config["rows"] <= slots <= resident, (m, slots)
                # no block without a row; and never more slots than rows (beyond one block's)
                assert slots <= max(m, 1) + config["rows"] - 1, (m, slots)
                if m >= 1 << 20 and n >= 1000:  # many rows: every SM holds as many blocks as fit
                    assert slots == resident


def test_partials_grow_with_the_rows_until_the_sms_are_full():
    config = policy.launch_config("rms_norm", "register", 4096, torch.bfloat16)
    counts = [policy.partial_rows("rms_norm", m, 4096, torch.bfloat16, config, 132) for m in (1, 64, 132, 4096, 65536)]
    assert counts == sorted(counts) and counts[0] == 1 and counts[-1] == 132 * policy.blocks_per_sm(
        "rms_norm", 4096, torch.bfloat16, config)


def test_long_rows_take_one_slot_per_sm_their_registers_allow():
    # The streamed mode's 512-thread blocks need about 100 registers a thread: one block an SM,
    # though the threads alone would allow four; the element-wise mode counts threads.
    for kind in KINDS:
        config = policy.launch_config(kind, "streamed", 16384, torch.bfloat16)
        assert config["tpr"] * config["rows"] == 512 and policy.blocks_per_sm(kind, 16384, torch.bfloat16, config) == 1
        assert policy.partial_rows(kind, 16384, 16384, torch.bfloat16, config, 132) == 132
        scalar = policy.launch_config(kind, "scalar", 1001, torch.float32)
        assert policy.blocks_per_sm(kind, 1001, torch.float32, scalar) == policy.THREADS_PER_SM // (scalar["tpr"] * scalar["rows"])


@pytest.mark.parametrize(
    ("kind", "x_pitch"), [("add_rms_norm", 8192), ("rms_norm", 4000), ("layer_norm", 8196)],
    ids=["the-fused-kinds-read-the-saved-sum", "shorter-than-a-row", "off-the-vector-grid"],
)
def test_a_backward_program_refuses_an_x_pitch_it_cannot_read(kind, x_pitch):
    config = policy.launch_config(kind, "register", 4096, torch.bfloat16)
    with pytest.raises(ValueError, match="the single norms' x only, at least N and a whole number of vectors"):
        programs.make_program(kind, 4096, torch.bfloat16, True, x_pitch=x_pitch, **config)


# -- compile tier ------------------------------------------------------------------------------

SCRIPT = """
import json, sys, torch
from tileops.kernels.cuda.norm import backward_policy as policy
from tileops.kernels.cuda.norm import backward_programs as programs
kind, variant, n, dtype, *mode = json.loads({case!r})
dtype = getattr(torch, dtype)
assert policy.refusal(kind, variant, n, dtype, True) is None
target = {{"kind": "cuda", "arch": "sm_90"}}
config = policy.launch_config(kind, variant, n, dtype)
if mode[:1] == ["no_sums"]:  # no weight and bias, or frozen ones: dx alone, no partials
    has_weight = mode == ["no_sums", "frozen"]
    rows = programs.compile_row_kernel(kind, n, dtype, has_weight, target, **config, column_sums=False).get_kernel_source()
    assert "__global__" in rows and "partial" not in rows, "a call with no parameter to sum writes no partial sums"
else:
    rows = programs.compile_row_kernel(kind, n, dtype, True, target, **config, direct=mode == ["direct"]).get_kernel_source()
    reduce = programs.compile_reduce_kernel(n, dtype, policy.parts_of(kind), target).get_kernel_source()
    assert "__global__" in rows and "__global__" in reduce
    assert ("partial" in rows) != (mode == ["direct"]), "partials where the sums go to the reduce kernel, only there"
assert "atomic" not in rows.lower(), "the column sums are per-slot partials, not atomics"
print("compiled", kind, variant, n, config["acc"])
"""

# One build per kernel kind, each in another mode (CI has two cores): registers with the sums in
# registers and in shared memory (both loading the next row ahead, the fused one its
# dresidual_sum early too), the fused rule's several rows a block of three vectors a thread with
# the next rows ahead, the 16-byte streamed mode with its sums in global and in shared memory,
# and the element-wise one (sums in shared memory); the direct build of one-row calls (dweight and
# dbias written by the row kernel); and a build without column sums that reads a weight (a call
# whose parameters are frozen; one without weight or bias is that build less the weight's loads).
CASES = [
    ("rms_norm", "register", 4096, "bfloat16"),
    ("add_layer_norm", "register", 7168, "bfloat16"),
    ("add_rms_norm", "register", 1536, "float16"),
    ("add_rms_norm", "streamed", 65536, "float16"),
    ("layer_norm", "streamed", 16384, "bfloat16"),
    ("layer_norm", "scalar", 1001, "float32"),
    ("layer_norm", "register", 4096, "bfloat16", "direct"),
    ("add_rms_norm", "register", 5120, "bfloat16", "no_sums", "frozen"),
]


@pytest.mark.compile
@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_one_build_per_kind_compiles_for_sm90(case, tmp_path):
    result = run_python(SCRIPT.format(case=json.dumps(case)), env={"TILELANG_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.splitlines()[-1].startswith(f"compiled {case[0]} {case[1]} {case[2]}"), result.stdout[-2000:]


# -- the kernel classes on CPU tensors ----------------------------------------------------------


@pytest.fixture
def launches(monkeypatch):
    """Backward kernels built for cuda:0 with their programs, device facts and the C++ launcher
    replaced, so that the production forward runs on CPU tensors; the list of (program, tensors)
    launched, a program being ("rows", has_weight, config) or ("reduce",)."""
    from tileops.core import DeviceFacts
    from tileops.kernels.cuda import fast_launch
    from tileops.kernels.cuda import kernel as kernel_module
    from tileops.kernels.cuda.norm import backward as backward_module

    launched = []
    monkeypatch.setattr(kernel_module, "compile_target", lambda device: {"kind": "cuda", "arch": "sm_90"})
    monkeypatch.setattr(kernel_module, "gpu_model", lambda device: "GPU")
    monkeypatch.setattr(kernel_module, "current_device_index", lambda: 0)
    monkeypatch.setattr(fast_launch, "launcher", lambda *args, **kwargs: None)
    monkeypatch.setattr(backward_module, "facts_for", lambda device: DeviceFacts("cuda", 90, 132, None, "GPU"))
    monkeypatch.setattr(backward_module, "shared_memory_per_block", lambda device: 227 * 1024)
    monkeypatch.setattr(programs, "compile_row_kernel", lambda kind, n, dtype, has_weight, target, **config: ("rows", has_weight, config))
    monkeypatch.setattr(programs, "compile_reduce_kernel", lambda *args: ("reduce",))
    monkeypatch.setattr(backward_module, "entry_function", lambda program: lambda *tensors: launched.append((program, tensors)))
    return launched


def _backward_kernel(op, interface, key, has_weight, has_bias):
    spec = op.call_spec(interface, torch.device("cuda", 0), torch.bfloat16, has_weight, has_bias, True)
    return BACKWARD_KERNELS[interface][key](spec)


def test_a_call_without_weight_or_bias_runs_the_row_kernel_alone_and_sums_no_parameter_gradient(launches):
    from tileops.ops.norm import LayerNormBwdInterface, LayerNormBwdOp, RMSNormBwdInterface, RMSNormBwdOp

    dy, x, rstd = torch.zeros(8, 4096, dtype=torch.bfloat16), torch.zeros(8, 4096, dtype=torch.bfloat16), torch.zeros(8)
    kernel = _backward_kernel(RMSNormBwdOp([4096]), RMSNormBwdInterface, "rms_norm_bwd", False, False)
    dx, dweight = kernel.forward(dy, x, None, rstd)
    ((program, tensors),) = launches  # one launch, no reduce kernel
    assert program[:2] == ("rows", False) and program[2]["column_sums"] is False
    # dy, x and rstd as rows (views of the caller's), then dx: nothing else
    assert [t.data_ptr() for t in tensors] == [dy.data_ptr(), x.data_ptr(), rstd.data_ptr(), dx.data_ptr()]
    assert dweight is None
    assert dx.shape == dy.shape and dx.dtype == torch.bfloat16

    # With a weight: the row kernel writes partials, the reduce kernel sums them into dweight.
    launches.clear()
    weight = torch.ones(4096, dtype=torch.bfloat16)
    dx, dweight = _backward_kernel(RMSNormBwdOp([4096]), RMSNormBwdInterface, "rms_norm_bwd", True, False).forward(
        dy, x, weight, rstd
    )
    (rows, row_tensors), (reduce, reduce_tensors) = launches
    assert rows[:2] == ("rows", True) and "column_sums" not in rows[2] and reduce == ("reduce",)
    assert row_tensors[-1] is reduce_tensors[0] and reduce_tensors[1] is dweight and dweight.shape == (4096,)

    # A LayerNorm with a bias and no weight still sums: dbias is wanted (the op drops dweight).
    launches.clear()
    mean = torch.zeros(8)
    dx, dweight, dbias = _backward_kernel(LayerNormBwdOp([4096]), LayerNormBwdInterface, "layer_norm_bwd", False, True).forward(
        dy, x, None, mean, rstd
    )
    assert [program[0] for program, _ in launches] == ["rows", "reduce"] and dbias.shape == (4096,)


def test_a_call_whose_parameters_are_frozen_reads_the_weight_and_sums_no_gradient(launches):
    from tileops.ops.norm import LayerNormBwdInterface, LayerNormBwdOp, RMSNormBwdInterface, RMSNormBwdOp

    dy, x, rstd = torch.zeros(8, 4096, dtype=torch.bfloat16), torch.zeros(8, 4096, dtype=torch.bfloat16), torch.zeros(8)
    weight = torch.ones(4096, dtype=torch.bfloat16)
    kernel = _backward_kernel(RMSNormBwdOp([4096], skip_outputs=["dweight"]), RMSNormBwdInterface, "rms_norm_bwd", True, False)
    assert kernel.params.call.parameter_gradients is False
    dx, dweight = kernel.forward(dy, x, weight, rstd)
    ((program, tensors),) = launches  # one launch, no reduce kernel
    # Built with the weight (dx = rstd * (dy * weight - ...)) and without column sums.
    assert program[:2] == ("rows", True) and program[2]["column_sums"] is False
    assert [t.data_ptr() for t in tensors] == [dy.data_ptr(), x.data_ptr(), weight.data_ptr(), rstd.data_ptr(), dx.data_ptr()]
    assert dweight is None

    # A LayerNorm whose bias alone is frozen still sums: dweight is wanted (the op drops dbias).
    launches.clear()
    mean = torch.zeros(8)
    op = LayerNormBwdOp([4096], skip_outputs="dbias")
    kernel = _backward_kernel(op, LayerNormBwdInterface, "layer_norm_bwd", True, True)
    assert kernel.params.call.parameter_gradients is True
    kernel.forward(dy, x, weight, mean, rstd)
    assert [program[0] for program, _ in launches] == ["rows", "reduce"]
