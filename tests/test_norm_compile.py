"""Compile tier: every TileLang norm implementation lowers and compiles for sm_90 here.

Compilation runs in a subprocess (TileLang aborts the process where no toolkit is found) with
TileLang's cache in a temporary folder, so every kernel is really compiled.
"""

from __future__ import annotations

import pytest

from helpers import run_python

pytestmark = pytest.mark.compile

# One build per variant, at a row length it serves; between them every kind and dtype family
# (each build is a few seconds of lowering and nvcc: the GPU tier runs every combination).
CASES = [
    ("rms_norm", "register", 4096, "bfloat16"),
    ("add_layer_norm", "register", 1024, "float32"),
    ("add_rms_norm", "shared", 16384, "float16"),
    ("layer_norm", "streamed", 65536, "bfloat16"),
    ("add_layer_norm", "scalar", 1000, "bfloat16"),
    ("rms_norm", "scalar", 100003, "float32"),
]

SCRIPT = """
import torch
from tileops.kernels.cuda.norm import policy, programs
for kind, variant, n, dtype in CASES:
    dtype = getattr(torch, dtype)
    has_bias = kind.endswith("layer_norm")
    assert policy.REFUSALS[variant](n, dtype, True) is None, policy.REFUSALS[variant](n, dtype, True)
    kernel = programs.compile_config(kind, n, dtype, 1e-5, True, has_bias, {"kind": "cuda", "arch": "sm_90"},
                                     **policy.launch_config(kind, variant, n, dtype))
    source = kernel.get_kernel_source()
    assert "__global__" in source
    # The streamed variant keeps its row on chip between its two passes by eviction priority alone.
    prioritised = "ld.global.L1::evict_last.L2::cache_hint" in source
    assert prioritised == (variant == "streamed"), (kind, variant, prioritised)
    print("compiled", kind, variant, n, len(source))
"""


def test_one_build_per_variant_compiles_for_sm90(tmp_path):
    result = run_python(f"CASES = {CASES!r}" + SCRIPT, env={"TILELANG_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-4000:]
    compiled = [line.split()[1:4] for line in result.stdout.splitlines() if line.startswith("compiled ")]
    assert compiled == [[kind, variant, str(n)] for kind, variant, n, _ in CASES], result.stdout[-2000:]


LEADING_DIMS = """
import torch
from tileops.kernels.cuda.norm import policy, programs
target = {"kind": "cuda", "arch": "sm_90"}
# Every leading-dimension count for one variant; the others share the row indexing (one each).
for kind, variant, n, dtype, leadings in [("rms_norm", "register", 4096, torch.bfloat16, (0, 1, 2, 3)),
                                          ("add_layer_norm", "shared", 16384, torch.float16, (3,)),
                                          ("layer_norm", "streamed", 65536, torch.bfloat16, (2,)),
                                          ("add_rms_norm", "scalar", 1000, torch.float32, (0,))]:
    config = policy.launch_config(kind, variant, n, dtype)
    for leading, sizes in [(0, []), (1, ["m"]), (2, ["m0", "m1"]), (3, ["m0", "m1", "m2"])]:
        if leading not in leadings:
            continue
        kernel = programs.compile_config(kind, n, dtype, 1e-5, True, kind.endswith("layer_norm"), target,
                                         leading=leading, **config)
        source = kernel.get_kernel_source()
        declaration = next(line for line in source.splitlines() if "__global__" in line and "_kernel(" in line)
        parameters = declaration[declaration.index("_kernel(") + 8 : declaration.rindex(")")].split(",")
        assert [p.split()[-1] for p in parameters if p.split()[0] == "int"] == sizes, declaration
    print("compiled with leading dimensions:", kind, variant, leadings)
"""


def test_kernels_for_any_number_of_leading_dimensions_compile(tmp_path):
    # The device code takes one size per leading dimension and serves their product of rows.
    result = run_python(LEADING_DIMS, env={"TILELANG_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("compiled with leading dimensions") == 4, result.stdout[-2000:]


PRE_AMPERE = """
import torch
from tileops.kernels.cuda.norm import policy, programs
config = policy.launch_config("layer_norm", "streamed", 16384, torch.bfloat16)
for arch in ("sm_75", "sm_80"):
    kernel = programs.compile_config("layer_norm", 16384, torch.bfloat16, 1e-5, True, True,
                                     {"kind": "cuda", "arch": arch}, **config)
    print(arch, "createpolicy" in kernel.get_kernel_source())
"""


def test_the_streamed_variant_loads_plainly_for_gpus_without_cache_policies(tmp_path):
    # Eviction-priority loads with an L2 policy need sm_80; older GPUs get the same kernel without them.
    result = run_python(PRE_AMPERE, env={"TILELANG_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-4000:]
    verdicts = [line for line in result.stdout.splitlines() if line.startswith("sm_")]
    assert verdicts == ["sm_75 False", "sm_80 True"], result.stdout[-2000:]


EVICT_FIRST = """
import torch
from tileops.kernels.cuda.norm import policy, programs
target = {"kind": "cuda", "arch": "sm_90"}
for kind, n, dtype in [("add_rms_norm", 4096, torch.bfloat16), ("add_layer_norm", 1000, torch.float32)]:
    config = policy.launch_config(kind, "register", n, dtype)
    has_bias = kind == "add_layer_norm"
    plain = programs.compile_config(kind, n, dtype, 1e-5, True, has_bias, target, **config).get_kernel_source()
    second = programs.compile_config(kind, n, dtype, 1e-5, True, has_bias, target, evict_first_inputs=True,
                                     **config).get_kernel_source()
    loads = sorted(line.split("(&(")[2].split("[")[0] for line in second.splitlines()
                   if "tileops_load_evict_first((&(" in line)
    print(kind, "createpolicy" in plain, "createpolicy.fractional.L2::evict_first" in second, loads)
"""


def test_the_fused_register_kernels_second_build_loads_x_and_the_residual_evict_first(tmp_path):
    result = run_python(EVICT_FIRST, env={"TILELANG_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("add_")]
    assert lines == [f"{kind} False True ['r', 'x']" for kind in ("add_rms_norm", "add_layer_norm")], result.stdout[-2000:]


FEW_ROWS = """
import torch
from tileops.kernels.cuda.norm import builds, policy, programs
target = {"kind": "cuda", "arch": "sm_90"}
# The variants selection picks for these bf16 rows (tests/test_norm_programs.py).
# A longer rms row's few-row build stages it in shared memory with the weight loaded early.
for kind, n, variant in [("layer_norm", 2048, "streamed"), ("add_layer_norm", 2048, "shared"),
                         ("rms_norm", 1024, "register"), ("add_layer_norm", 1024, "register"),
                         ("add_rms_norm", 5120, "shared")]:
    config = policy.launch_config(kind, variant, n, torch.bfloat16)
    few_rows = builds.few_row_config(kind, n, torch.bfloat16, config)
    has_bias = kind.endswith("layer_norm")
    kernel = programs.compile_config(kind, n, torch.bfloat16, 1e-5, True, has_bias, target, leading=2, **few_rows)
    print(kind, n, "__global__" in kernel.get_kernel_source())
# A decode build: a 7168-wide fp16 row over 256 threads, weight loaded with x and the residual.
config = policy.launch_config("add_rms_norm", "shared", 7168, torch.float16)
decode = builds.decode_config("add_rms_norm", 7168, torch.float16, config)
kernel = programs.compile_config("add_rms_norm", 7168, torch.float16, 1e-5, True, False, target, leading=1, **decode)
print("add_rms_norm", 7168, "__global__" in kernel.get_kernel_source())
"""


def test_the_few_row_and_decode_builds_compile_for_sm90(tmp_path):
    result = run_python(FEW_ROWS, env={"TILELANG_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [line for line in result.stdout.splitlines() if line.endswith(("True", "False"))]
    assert lines == ["layer_norm 2048 True", "add_layer_norm 2048 True", "rms_norm 1024 True", "add_layer_norm 1024 True",
                     "add_rms_norm 5120 True", "add_rms_norm 7168 True"]


LAUNCHER = """
import torch
from tileops.kernels.cuda.compile import entry_function
from tileops.kernels.cuda.norm import policy, programs
config = policy.launch_config("rms_norm", "register", 1024, torch.bfloat16)
kernel = programs.compile_config("rms_norm", 1024, torch.bfloat16, 1e-6, True, False, {"kind": "cuda", "arch": "sm_90"},
                                 **config)
entry = entry_function(kernel)
named = "void __launch_bounds__" in kernel.get_kernel_source() and " tileops_norm_rms_norm_kernel(" in kernel.get_kernel_source()
print(type(entry).__name__, named, entry is not kernel, entry.release_gil)
"""


def test_launches_call_the_entry_function_directly_keep_the_gil_and_name_the_kernel(tmp_path):
    result = run_python(LAUNCHER, env={"TILELANG_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-4000:]
    # The CUDA kernel is named after the build (compile.kernel_name), not TileLang's main_kernel.
    assert result.stdout.split()[-3:] == ["True", "True", "False"], result.stdout[-2000:]


def test_kernel_names_are_the_leading_words_of_a_build_identity():
    from tileops.kernels.cuda.compile import kernel_name

    assert kernel_name(("activation", "gated_bwd", "silu", 2, (("vec", 8),))) == "tileops_activation_gated_bwd_silu"
    assert kernel_name(("decode-merge", 1.5, 32)) == "tileops_decode_merge"
    assert kernel_name("attention_fwd") == "tileops_attention_fwd"


LOWER_CANDIDATES = """
import torch, tilelang
from tvm.target import Target
target = Target({"kind": "cuda", "arch": "sm_90"})
from tileops.kernels.cuda.norm import policy, programs
# One shape per variant: a variant's candidates differ in launch numbers, not in program shape.
shapes = [("rms_norm", "register", 4096), ("add_layer_norm", "shared", 1000), ("add_rms_norm", "streamed", 65536),
          ("layer_norm", "scalar", 1001)]
count = 0
for kind, variant, n in shapes:
    has_bias = kind.endswith("layer_norm")
    for config in policy.tuning_candidates(kind, variant, n, torch.bfloat16):
        program = programs.make_program(kind, n, torch.bfloat16, 1e-5, True, has_bias, **config)
        with target:
            tilelang.lower(program, target=target)
        count += 1
print("lowered", count)
"""


def test_every_tuning_candidate_lowers_for_sm90(tmp_path):
    result = run_python(LOWER_CANDIDATES, env={"TILELANG_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-4000:]
    assert int(result.stdout.split()[-1]) == 45, result.stdout


PARALLEL_COMPILE = """
import threading, torch
from concurrent.futures import ThreadPoolExecutor
from tileops.kernels.cuda.norm import policy, programs
target = {"kind": "cuda", "arch": "sm_90"}
configs = policy.tuning_candidates("layer_norm", "shared", 1000, torch.bfloat16)[:4]
configs.append(configs[0])  # the same configuration twice: compiled once, one kernel object

def compile_one(config):
    return programs.compile_config("layer_norm", 1000, torch.bfloat16, 1e-5, True, True, target, **config)

with ThreadPoolExecutor(len(configs)) as pool:
    kernels = list(pool.map(compile_one, configs))
assert kernels[0] is kernels[-1]
assert len({id(k) for k in kernels}) == 4
assert all("__global__" in k.get_kernel_source() for k in kernels)
print("compiled", len(set(map(id, kernels))))
"""


def test_tuning_candidates_compile_in_parallel_threads(tmp_path):
    result = run_python(PARALLEL_COMPILE, env={"TILELANG_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.split()[-1] == "4", result.stdout


ROW_VIEWS = """
import torch
from tileops.kernels.cuda.norm import policy, programs
target = {"kind": "cuda", "arch": "sm_90"}
# x and the residual at pitches of their own: every row start a multiple of the 16-byte vector,
# so the loads stay 16-byte vectors at the pitch (a fused projection's third, a padded buffer).
config = policy.launch_config("add_rms_norm", "register", 4096, torch.bfloat16)
source = programs.compile_config("add_rms_norm", 4096, torch.bfloat16, 1e-6, True, False, target,
                                 row_strides=(3 * 4096, 4096 + 64), **config).get_kernel_source()
loads = [line for line in source.splitlines() if "*(uint4*)(x + " in line or "*(uint4*)(r + " in line]
assert any("12288" in line for line in loads) and any("4160" in line for line in loads), loads
# The backward reads the forward's x where it lies too (dy and dx stay contiguous).
from tileops.kernels.cuda.norm import backward_policy, backward_programs
config = backward_policy.launch_config("rms_norm", "register", 4096, torch.bfloat16)
source = backward_programs.compile_row_kernel("rms_norm", 4096, torch.bfloat16, True, target, x_pitch=3 * 4096,
                                              **config).get_kernel_source()
loads = [line for line in source.splitlines() if "*(uint4*)(x + " in line]
assert loads and all("12288" in line for line in loads), loads
print("compiled row views")
"""


def test_a_build_for_row_views_reads_them_at_their_pitch_in_16_byte_vectors(tmp_path):
    result = run_python(ROW_VIEWS, env={"TILELANG_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-4000:]
    assert "compiled row views" in result.stdout, result.stdout[-2000:]
