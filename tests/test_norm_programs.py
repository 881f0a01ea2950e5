"""The norm kernels' launch policy (which variant serves, which configuration and builds),
the shared TileLang kernel base class they run on, and the store of tuned configurations
(pure Python: no tilelang, no GPU)."""

from __future__ import annotations

import ast
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import fresh_tuning_store, run_python, tuning_timed_by_config
from tileops.kernels.cuda.norm import KERNELS, builds, policy, programs
from tileops.kernels.cuda.powers import pow2_ceil
from tileops.ops import FusedAddLayerNormFwdOp, FusedAddRMSNormFwdOp, LayerNormFwdOp, RMSNormFwdOp

OPS = {"rms_norm": RMSNormFwdOp, "layer_norm": LayerNormFwdOp, "add_rms_norm": FusedAddRMSNormFwdOp,
       "add_layer_norm": FusedAddLayerNormFwdOp}


def _selected_variant(kind: str, n: int, dtype: torch.dtype, aligned: bool = True) -> str:
    """The variant selection picks for a call on a CUDA device, as an op picks it."""
    op = OPS[kind](n)
    (interface,) = op.kernel_interfaces
    implementations = op.implementations()[interface]
    call = op.call_spec(interface, torch.device("cuda", 0), dtype, True, kind.endswith("layer_norm"), aligned)
    return implementations.classes[implementations.select(call)].variant

SHAPES = [
    ("rms_norm", "register", 4096, torch.bfloat16),
    ("layer_norm", "register", 256, torch.float16),
    ("add_layer_norm", "shared", 1000, torch.bfloat16),
    ("rms_norm", "shared", 65536, torch.bfloat16),
    ("layer_norm", "shared", 32768, torch.float32),
    ("add_rms_norm", "streamed", 100000, torch.bfloat16),
    ("layer_norm", "scalar", 1001, torch.float32),
]


@pytest.mark.parametrize(
    ("kind", "n", "variant"),
    [
        ("layer_norm", 512, "register"),
        ("layer_norm", 520, "streamed"),
        ("layer_norm", 2048, "streamed"),
        ("layer_norm", 2056, "shared"),
        ("layer_norm", 16376, "shared"),
        ("layer_norm", 16384, "streamed"),
        ("add_layer_norm", 1024, "register"),
        ("add_layer_norm", 1032, "shared"),
        ("add_layer_norm", 65536, "shared"),
        ("add_layer_norm", 65544, "streamed"),
        ("rms_norm", 4096, "register"),
        ("rms_norm", 16376, "shared"),
        ("rms_norm", 16384, "streamed"),
        ("add_rms_norm", 4104, "shared"),
        ("add_rms_norm", 65536, "shared"),
        ("rms_norm", 4095, "scalar"),
    ],
)
def test_bf16_rows_go_to_the_variant_measured_fastest_for_their_length(kind, n, variant):
    # The boundaries `tileops explain` reports: registers up to 8 KiB rows (1 KiB for
    # layer_norm, 2 KiB for add_layer_norm), shared memory up to 128 KiB, then streamed;
    # the single norms go streamed from 32 KiB rows, layer_norm also up to 4 KiB rows;
    # rows that 16-byte vectors cannot cover go to the scalar variant.
    assert _selected_variant(kind, n, torch.bfloat16) == variant


def test_the_layer_norm_register_refusal_names_the_kind_and_its_limit():
    reason = policy.refusal("add_layer_norm", "register", 2048, torch.bfloat16, True)
    assert reason == "add_layer_norm rows over 2048 bytes run faster in the 'shared' variant (this row is 4096 bytes)"


def test_the_shared_refusals_of_the_single_norms_name_the_streamed_variant_and_the_row_size():
    long_row = policy.refusal("rms_norm", "shared", 16384, torch.bfloat16, True)
    assert long_row == "rms_norm rows of 32768 bytes or more run faster in the 'streamed' variant (this row is 32768 bytes)"
    short_row = policy.refusal("layer_norm", "shared", 1000, torch.float32, True)
    assert short_row == "layer_norm rows of at most 4096 bytes run faster in the 'streamed' variant (this row is 4000 bytes)"
    assert policy.refusal("layer_norm", "shared", 4096, torch.bfloat16, True) is None


# sm_86 and sm_89 give a block at most 99 KiB of shared memory; sm_90 227 KiB.
_SMALL_SHARED_PER_BLOCK = 99 * 1024


# The single norms' rows of 32 KiB or more go streamed on every GPU; the fused kinds' are parked.
@pytest.mark.parametrize("kind", ["add_rms_norm", "add_layer_norm"])
def test_rows_the_shared_variant_would_park_beyond_the_gpus_shared_memory_go_streamed(kind, monkeypatch):
    from tileops.kernels.cuda import norm as norm_kernels

    long_row, medium_row = 60000, 40000  # 16-bit rows of 120 and 80 KB
    monkeypatch.setattr(norm_kernels, "shared_memory_per_block", lambda device: _SMALL_SHARED_PER_BLOCK)
    assert _selected_variant(kind, long_row, torch.bfloat16) == "streamed"
    assert _selected_variant(kind, medium_row, torch.bfloat16) == "shared"
    reason = policy.shared_memory_refusal(kind, long_row, torch.bfloat16, _SMALL_SHARED_PER_BLOCK)
    assert reason.startswith("a row of 120000 bytes takes ") and "gives a block at most 101376" in reason, reason
    assert reason.endswith("the 'streamed' variant serves it"), reason
    monkeypatch.setattr(norm_kernels, "shared_memory_per_block", lambda device: 227 * 1024)
    assert _selected_variant(kind, long_row, torch.bfloat16) == "shared"
    # Unknown (no GPU here, or a device that does not say): the variant's own limit.
    assert policy.shared_memory_refusal(kind, long_row, torch.bfloat16, None) is None


def test_tuning_candidates_fit_the_gpus_shared_memory_per_block():
    n, dtype = 12296, torch.bfloat16  # 24 KB rows: a block of several would not fit 99 KiB
    everywhere = policy.tuning_candidates("add_rms_norm", "shared", n, dtype)
    small = policy.tuning_candidates("add_rms_norm", "shared", n, dtype, _SMALL_SHARED_PER_BLOCK)
    assert small[0] == everywhere[0] and len(small) < len(everywhere)
    assert all(policy.shared_bytes(n, dtype, config) <= _SMALL_SHARED_PER_BLOCK for config in small)
    assert any(policy.shared_bytes(n, dtype, config) > _SMALL_SHARED_PER_BLOCK for config in everywhere)


@pytest.mark.parametrize(("kind", "variant", "n", "dtype"), SHAPES)
def test_tuning_candidates_start_with_the_default_and_fit_the_block(kind, variant, n, dtype):
    candidates = policy.tuning_candidates(kind, variant, n, dtype)
    assert candidates[0] == policy.launch_config(kind, variant, n, dtype)
    assert len(candidates) == len({tuple(sorted(c.items())) for c in candidates})  # no config twice
    for config in candidates:
        assert config["tpr"] & (config["tpr"] - 1) == 0 and config["tpr"] * config["rows"] <= 1024, config
        assert config["mode"] == candidates[0]["mode"] and config["vec"] == candidates[0]["vec"], config
        if config["mode"] == "shared":  # the rows a block parks must fit the shared memory the variant uses
            per_thread = -(-(n // config["vec"]) // config["tpr"])
            assert per_thread * config["tpr"] * config["rows"] * config["vec"] * dtype.itemsize <= 128 * 1024, config
        if config["mode"] == "register":
            assert config["tpr"] <= 256, config


def test_longer_rows_than_fit_a_block_twice_get_one_row_per_block_in_shared_mode():
    for config in policy.tuning_candidates("rms_norm", "shared", 65536, torch.bfloat16):
        assert config["rows"] == 1, config



@pytest.mark.parametrize(
    ("n", "dtype", "threads_per_row"),
    [(1024, torch.bfloat16, 64), (512, torch.float16, 32), (512, torch.float32, 64), (1000, torch.bfloat16, 32)],
)
def test_fused_add_layer_norm_rows_of_a_power_of_two_of_vectors_spread_over_more_threads(n, dtype, threads_per_row):
    # Two vectors per thread where the row is a power of two of 16-byte vectors, four otherwise
    # (docs/perf/h200-add-layer-norm-threads-2026-11-29.txt); never below 16 threads per row.
    config = policy.launch_config("add_layer_norm", "register", n, dtype)
    assert (config["tpr"], config["rows"]) == (threads_per_row, 128 // threads_per_row)
    assert policy.launch_config("add_layer_norm", "register", 256, torch.bfloat16)["tpr"] == 16

# -- tuned configurations: one store per GPU model for every family ----------------------------

MODEL = "NVIDIA H200"
KEY = "norm/rms_norm/register/1000/bfloat16/1e-06/True/False"
CONFIG = {"vec": 8, "tpr": 32, "rows": 16, "mode": "register", "unroll": 4, "preload": True}


def _python(code: str, cache: Path):
    return run_python(code, env={"TILEOPS_CACHE_DIR": str(cache)})


def test_entry_keys_name_the_family_kind_and_identity():
    from tileops.kernels.cuda import tuning

    key = tuning.entry_key("norm", "rms_norm", ("register", 1000, torch.bfloat16, 1e-06, True, False))
    assert key == KEY


def test_a_tuned_configuration_is_found_by_a_later_process_on_the_same_gpu_model_only(tmp_path):
    stored = _python(
        f"from tileops.kernels.cuda import tuning\ntuning.remember({MODEL!r}, {KEY!r}, {CONFIG!r})\n"
        f"print(tuning.store_path({MODEL!r}))",
        tmp_path,
    )
    assert stored.returncode == 0, stored.stderr
    assert Path(stored.stdout.strip()) == tmp_path / "tuning" / "NVIDIA_H200.json"
    found = _python(f"from tileops.kernels.cuda import tuning\nprint(tuning.chosen({MODEL!r}, {KEY!r}, {CONFIG!r}))", tmp_path)
    assert found.returncode == 0, found.stderr
    assert ast.literal_eval(found.stdout.strip()) == CONFIG
    other = _python(f"from tileops.kernels.cuda import tuning\nprint(tuning.chosen('NVIDIA H100', {KEY!r}, {CONFIG!r}))", tmp_path)
    assert other.stdout.strip() == "None"


def test_families_share_one_file_and_concurrent_writers_keep_each_others_entries(tmp_path):
    # Four processes remember an entry each at once (two families): the lock keeps all four.
    code = """
import sys
from tileops.kernels.cuda import tuning
family, index = sys.argv[1], int(sys.argv[2])
for step in range(20):
    tuning.remember("NVIDIA H200", f"{family}/kind/{index}", {"tpr": step})
"""
    script = tmp_path / "write.py"
    script.write_text(code)
    env = {**os.environ, "TILEOPS_CACHE_DIR": str(tmp_path)}
    writers = [subprocess.Popen([sys.executable, "-P", str(script), family, str(index)], env=env)
               for family, index in [("norm", 0), ("norm", 1), ("softmax", 2), ("softmax", 3)]]
    assert [writer.wait(timeout=120) for writer in writers] == [0, 0, 0, 0]
    stored = json.loads((tmp_path / "tuning" / "NVIDIA_H200.json").read_text())
    assert stored == {"norm/kind/0": {"tpr": 19}, "norm/kind/1": {"tpr": 19}, "softmax/kind/2": {"tpr": 19},
                      "softmax/kind/3": {"tpr": 19}}


def test_an_unreadable_store_warns_and_is_replaced_by_the_next_tuning(tmp_path):
    (tmp_path / "tuning").mkdir()
    (tmp_path / "tuning" / "NVIDIA_H200.json").write_text("{not json")
    found = _python(
        "import warnings\nwarnings.simplefilter('always')\n"
        f"from tileops.kernels.cuda import tuning\nprint(tuning.chosen({MODEL!r}, {KEY!r}, {CONFIG!r}))",
        tmp_path,
    )
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == "None"
    assert "were not read" in found.stderr and "NVIDIA_H200.json" in found.stderr
    config = {**CONFIG, "tpr": 64}
    replaced = _python(f"from tileops.kernels.cuda import tuning\ntuning.remember({MODEL!r}, {KEY!r}, {config!r})", tmp_path)
    assert replaced.returncode == 0, replaced.stderr
    found = _python(f"from tileops.kernels.cuda import tuning\nprint(tuning.chosen({MODEL!r}, {KEY!r}, {CONFIG!r}))", tmp_path)
    assert ast.literal_eval(found.stdout.strip()) == config, found.stderr  # tuning replaced the unreadable file


def test_a_store_that_is_not_a_json_object_is_treated_as_unreadable(tmp_path):
    (tmp_path / "tuning").mkdir()
    (tmp_path / "tuning" / "NVIDIA_H200.json").write_text("[1, 2]")
    found = _python(f"from tileops.kernels.cuda import tuning\nprint(tuning.chosen({MODEL!r}, {KEY!r}, {CONFIG!r}))", tmp_path)
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == "None" and "expected a JSON object, found list" in found.stderr


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ("[8, 32]", "a list, not an object"),  # corrupt: not a configuration
        ('{"vec": 8, "tpr": [32]}', "'tpr' holds a list"),
        ('{"vec": 8, "tpr": 32}', "its keys ['tpr', 'vec'] are not the kernel's"),  # another kernel's keys
        ('{"vec": 8, "tpr": "32", "rows": 16, "mode": "register", "unroll": 4, "preload": true}', "'tpr' is a str"),
    ],
    ids=["not-an-object", "not-plain-values", "other-keys", "mistyped"],
)
def test_a_corrupt_or_mistyped_entry_is_ignored_with_a_warning_and_the_others_are_kept(tmp_path, entry, problem):
    (tmp_path / "tuning").mkdir()
    other = "norm/layer_norm/shared/1000/bfloat16/1e-05/True/True"
    (tmp_path / "tuning" / "NVIDIA_H200.json").write_text(f'{{"{KEY}": {entry}, "{other}": {json.dumps(CONFIG)}}}')
    code = (
        "import warnings\nwarnings.simplefilter('always')\nfrom tileops.kernels.cuda import tuning\n"
        f"print(tuning.chosen({MODEL!r}, {KEY!r}, {CONFIG!r}))\nprint(tuning.chosen({MODEL!r}, {other!r}, {CONFIG!r}))"
    )
    found = _python(code, tmp_path)
    assert found.returncode == 0, found.stderr
    assert found.stdout.splitlines()[0] == "None"
    assert ast.literal_eval(found.stdout.splitlines()[1]) == CONFIG
    assert "is ignored" in found.stderr and problem in found.stderr, found.stderr


def test_an_unwritable_store_keeps_the_configuration_for_the_process_and_says_so(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    code = (
        "import warnings\nwarnings.simplefilter('always')\nfrom tileops.kernels.cuda import tuning\n"
        f"tuning.remember({MODEL!r}, {KEY!r}, {{'tpr': 64}})\nprint(tuning.chosen({MODEL!r}, {KEY!r}, {{'tpr': 1}}))"
    )
    result = _python(code, blocker / "cache")  # a folder below a file cannot be created
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "{'tpr': 64}"
    assert "holds for this process only" in result.stderr


# -- the tuning loop, with the GPU timing replaced by given figures -----------------------------


def _tune_with(monkeypatch, tmp_path, figures, key_suffix, broken=()):
    """Run ``tuning.tune`` over candidates timed at ``figures`` µs (the first is the default);
    candidates whose index is in ``broken`` fail to compile."""
    tuning = fresh_tuning_store(monkeypatch, tmp_path)
    candidates = [{"tpr": 32 * (i + 1)} for i in range(len(figures))]

    def compile_candidate(config):
        index = candidates.index(config)
        if index in broken:
            raise ValueError(f"candidate {index} does not compile")
        return lambda *tensors: index

    def timed(fn, **_):
        return figures[fn()]

    monkeypatch.setattr(tuning, "gpu_time_us", timed)
    key = f"norm/rms_norm/register/{key_suffix}"
    return tuning, key, candidates, tuning.tune("GPU", key, candidates, compile_candidate, (), "RMSNormKernel test")


def test_tuning_keeps_the_fastest_candidate_and_stores_it(monkeypatch, tmp_path, capfd):
    tuning, key, candidates, config = _tune_with(monkeypatch, tmp_path, [10.0, 8.0, 9.0], 1)
    assert config == candidates[1]
    assert tuning.chosen("GPU", key, candidates[0]) == candidates[1]
    assert "tuning RMSNormKernel test: chose {'tpr': 64} at 8.00 us (default 10.00 us)" in capfd.readouterr().err
    assert json.loads((tmp_path / "tuning" / "GPU.json").read_text()) == {key: candidates[1]}


def test_tuning_keeps_the_default_unless_beaten_by_three_percent(monkeypatch, tmp_path):
    _, _, candidates, config = _tune_with(monkeypatch, tmp_path, [10.0, 9.8, 9.9], 2)
    assert config == candidates[0]


def test_tuning_skips_candidates_that_fail_and_says_how_many(monkeypatch, tmp_path, capfd):
    _, _, candidates, config = _tune_with(monkeypatch, tmp_path, [10.0, 5.0, 9.0], 3, broken=(1,))
    assert config == candidates[2]
    assert "1 candidate(s) failed to compile or launch" in capfd.readouterr().err


def test_tuning_with_no_candidate_that_runs_names_every_failure(monkeypatch, tmp_path):
    with pytest.raises(RuntimeError, match="no candidate ran:\n.*candidate 0 does not compile\n.*candidate 1"):
        _tune_with(monkeypatch, tmp_path, [10.0, 5.0], 4, broken=(0, 1))


# -- the shared kernel base class, on CPU tensors (compilation and the GPU replaced) ------------


class _Launches:
    """Stands in for compiled programs: records (build config, rank, tensors) of each launch."""

    def __init__(self) -> None:
        self.launched = []

    def compiled(self, kernel, config, rank):
        def launch(*tensors):
            self.launched.append((config, rank, tensors))

        return launch


@pytest.fixture
def cpu_kernels(monkeypatch):
    """Kernels built for cuda:0 with their programs, device facts and the C++ launcher replaced,
    so that the production forward runs on CPU tensors."""
    from tileops.core import DeviceFacts
    from tileops.kernels.cuda import fast_launch
    from tileops.kernels.cuda import kernel as kernel_module
    from tileops.kernels.cuda import norm as norm_kernels

    launches = _Launches()
    h200 = DeviceFacts("cuda", 90, 132, None, "GPU", l2_bytes=60 * 2**20)
    monkeypatch.setattr(norm_kernels, "facts_for", lambda device: h200)
    monkeypatch.setattr(kernel_module, "compile_target", lambda device: {"kind": "cuda", "arch": "sm_90"})
    monkeypatch.setattr(kernel_module, "gpu_model", lambda device: "GPU")
    monkeypatch.setattr(kernel_module, "current_device_index", lambda: 0)
    monkeypatch.setattr(fast_launch, "launcher", lambda *args, **kwargs: None)
    monkeypatch.setattr(kernel_module.TileLangKernel, "_launch_function",
                        lambda self, config, rank: launches.compiled(self, config, rank))
    return launches


def _norm_kernel(kind, variant, n, dtype, has_weight=True, has_bias=False):
    op = OPS[kind](n)
    (interface,) = op.kernel_interfaces
    call = op.call_spec(interface, torch.device("cuda", 0), dtype, has_weight, has_bias, True)
    key = next(key for key, cls in KERNELS[interface].items() if cls.variant == variant)
    return KERNELS[interface][key](call)


def test_a_norm_kernel_passes_its_arguments_in_order_leaving_out_absent_ones_then_outputs_like_x(cpu_kernels):
    kernel = _norm_kernel("add_layer_norm", "register", 1024, torch.bfloat16, has_bias=True)
    x, r, b = torch.zeros(2, 3, 1024, dtype=torch.bfloat16), torch.ones(2, 3, 1024, dtype=torch.bfloat16), torch.ones(1024)
    y, total = kernel.forward(x, r, None, b)
    config, rank, tensors = cpu_kernels.launched[-1]
    assert rank == 3 and config == kernel.build_plan(kernel.default_config()).builds["decode"]  # 6 rows
    assert tensors[:3] == (x, r, b) and tensors[3] is y and tensors[4] is total
    assert y.shape == total.shape == x.shape and y.dtype == x.dtype
    assert kernel.forward(x, r, weight=None, bias=b)[0].shape == x.shape  # keywords bind as the interface's
    with pytest.raises(TypeError, match=r"forward takes \(x, residual, weight, bias\)"):
        kernel.forward(x, r, None)


@pytest.mark.parametrize(
    ("kind", "n", "dtype", "rows", "build"),
    [
        # Decode build up to a row per SM (132 here); few-row build up to eight rows per SM of 1-4
        # KiB; evict-first over 10 and up to 16 MiB of x (the four tensors straddle a 60 MiB L2).
        ("rms_norm", 4096, torch.bfloat16, 1, "decode"),
        ("rms_norm", 4096, torch.bfloat16, 132, "decode"),
        ("rms_norm", 4096, torch.bfloat16, 133, "few_rows"),  # rows over 4 KiB: the weight loaded early
        ("rms_norm", 4096, torch.bfloat16, 1057, "main"),
        ("add_rms_norm", 7168, torch.float16, 1, "decode"),
        ("rms_norm", 14336, torch.float32, 8, "decode"),
        ("layer_norm", 2048, torch.bfloat16, 132, "decode"),
        ("layer_norm", 2048, torch.bfloat16, 133, "few_rows"),
        ("layer_norm", 2048, torch.bfloat16, 1056, "few_rows"),  # eight rows per SM
        ("layer_norm", 2048, torch.bfloat16, 1057, "main"),
        ("add_rms_norm", 4096, torch.bfloat16, 1280, "main"),  # 10 MiB: not over it
        ("add_rms_norm", 4096, torch.bfloat16, 1281, "evict_first"),
        ("add_rms_norm", 4096, torch.bfloat16, 2048, "evict_first"),  # 16 MiB
        ("add_rms_norm", 4096, torch.bfloat16, 2049, "main"),
        ("add_layer_norm", 1024, torch.bfloat16, 1024, "few_rows"),
        ("add_layer_norm", 1024, torch.bfloat16, 5121, "evict_first"),
        ("rms_norm", 4096, torch.bfloat16, 4096, "main"),
    ],
)
def test_each_call_takes_the_build_its_size_chooses_from_the_declared_list(cpu_kernels, kind, n, dtype, rows, build):
    variant = _selected_variant(kind, n, dtype)
    kernel = _norm_kernel(kind, variant, n, dtype)
    chosen = list(kernel.compiled)[kernel._build_for(rows * n)]
    assert chosen == build, (kernel.config, kernel._choices)
    x = torch.zeros(rows, n, dtype=dtype)
    kernel.forward(*([x, torch.zeros_like(x)] if kind.startswith("add_") else [x]), None, *([None] if "layer" in kind else []))
    config, _, _ = cpu_kernels.launched[-1]
    assert config == kernel.build_plan(kernel.default_config()).builds[build]


def test_the_kernel_config_shows_the_variant_and_its_extra_builds(cpu_kernels):
    kernel = _norm_kernel("add_layer_norm", "register", 1024, torch.bfloat16, has_bias=True)
    assert kernel.config["variant"] == "register"
    assert kernel.config["decode_build"]["max_rows"] == 132 and kernel.config["decode_build"]["preload"]
    assert kernel.config["few_row_build"]["max_rows"] == 1056
    assert kernel.config["evict_first_build"] == {"x_bytes": (10 * 2**20, 16 * 2**20)}
    assert list(kernel.compiled) == ["main", "decode", "few_rows", "evict_first"]
    assert sorted(kernel.compiled["main"]) == [2]  # the main build of (m, n) rows compiles with the kernel


def test_a_tune_request_on_a_decode_call_tunes_the_decode_build_under_a_key_of_its_own(cpu_kernels, monkeypatch, tmp_path):
    fastest = {"tpr": 128, "preload": False}
    tuning_timed_by_config(monkeypatch, tmp_path, cpu_kernels.launched, fastest)
    kernel = _norm_kernel("add_rms_norm", "shared", 7168, torch.float16)
    main, decode = kernel.config["tpr"], kernel.build_plan(kernel.default_config()).builds["decode"]
    x = torch.zeros(1, 7168, dtype=torch.float16)
    kernel.request_tune()
    kernel.forward(x, x, None)
    chosen = {**decode, **fastest}
    assert kernel.config["tuned_builds"] == {"decode": chosen} and kernel.config["tpr"] == main
    assert cpu_kernels.launched[-1][0] == chosen  # the call itself ran what tuning chose
    stored = json.loads((tmp_path / "tuning" / "GPU.json").read_text())
    assert stored == {f"{kernel._tuning_key}/decode": chosen}  # the main build's key is not tuned
    again = _norm_kernel("add_rms_norm", "shared", 7168, torch.float16)
    assert again.config["tuned_builds"] == {"decode": chosen}
    again.forward(torch.zeros(132, 7168, dtype=torch.float16), torch.zeros(132, 7168, dtype=torch.float16), None)
    assert cpu_kernels.launched[-1][0] == chosen


def test_one_row_candidates_start_with_the_build_and_keep_to_the_register_budget():
    for n, dtype in [(7168, torch.float16), (14336, torch.float32), (128, torch.bfloat16), (2048, torch.bfloat16)]:
        config = policy.launch_config("rms_norm", _selected_variant("rms_norm", n, dtype), n, dtype)
        build = builds.decode_config("rms_norm", n, dtype, config) or builds.few_row_config("rms_norm", n, dtype, config)
        candidates = builds.one_row_candidates(n, dtype, build)
        vectors = n // build["vec"]
        assert candidates[0] == build and len(candidates) == len({tuple(sorted(c.items())) for c in candidates}) > 2
        for candidate in candidates:
            assert (candidate["mode"], candidate["rows"]) == ("register", 1)
            assert candidate["tpr"] <= max(build["tpr"], pow2_ceil(vectors))
            assert math.ceil(vectors / candidate["tpr"]) <= 8


def test_a_kind_with_computed_outputs_allocates_them_from_its_shape_functions(cpu_kernels):
    # A made-up kind: a scalar sum and a per-row maximum of x, computed outputs of their own shapes.
    from tileops.backend import CallSpec, KernelInterface
    from tileops.kernels.cuda.kernel import BuildPlan, Output, TileLangKernel

    class ReduceInterface(KernelInterface):
        call_spec = CallSpec

        def forward(self, x, scale):
            """(sum of x, max of each row)"""

    class Reduce(TileLangKernel, ReduceInterface):
        family, kind = "test", "reduce"
        outputs = (Output.computed(lambda args, params: (), lambda args, params: torch.float32),
                   Output.computed(lambda args, params: args[0].shape[:-1], lambda args, params: args[0].dtype))
        order = (1, 0)  # the program takes scale first

        def identity(self):
            return ()

        def default_config(self):
            return {"threads": 128}

        def build_plan(self, config):
            return BuildPlan({"main": config, "small": {**config, "threads": 32}}, ((64, "small"),))

        def compile(self, config, rank):
            raise AssertionError("replaced")

    kernel = Reduce(torch.device("cuda", 0), None)
    x, scale = torch.zeros(4, 8), torch.ones(())
    total, row_max = kernel.forward(x, scale)
    config, _, tensors = cpu_kernels.launched[-1]
    assert total.shape == () and total.dtype == torch.float32 and row_max.shape == (4,)
    assert tensors[0] is scale and tensors[1] is x and config["threads"] == 32  # 32 elements: the small build
    kernel.forward(torch.zeros(4, 32), scale)
    assert cpu_kernels.launched[-1][0]["threads"] == 128
    with pytest.raises(ValueError, match="like an argument .* or computed"):
        Output(like=0, shape=lambda args, params: ())


def test_build_choices_whose_bounds_do_not_increase_are_refused(cpu_kernels, monkeypatch):
    from tileops.kernels.cuda.kernel import BuildPlan

    plan = BuildPlan({"main": {}, "a": {}, "b": {}}, ((100, "a"), (100, "b")))
    cls = KERNELS[RMSNormFwdOp.kernel_interfaces[0]]["rms_norm"]
    monkeypatch.setattr(cls, "build_plan", lambda self, config: plan)
    with pytest.raises(ValueError, match="bounds of its build choices must increase"):
        _norm_kernel("rms_norm", "register", 4096, torch.bfloat16)


def test_every_op_takes_its_interfaces_keys_from_the_kernels_table_and_the_order_sets_the_preferences():
    for op_class in OPS.values():
        (interface,) = op_class.kernel_interfaces
        assert op_class.in_tree_classes()[interface] == {**op_class.in_tree_kernels[interface], **KERNELS[interface]}
        keys = list(KERNELS[interface])
        assert [KERNELS[interface][key].preferred_over for key in keys] == [
            frozenset({keys[1]}), frozenset({keys[2]}), frozenset(), frozenset()
        ]
        assert KERNELS[interface][keys[3]].general


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_only_the_fused_kinds_in_registers_have_an_evict_first_build_and_only_from_sm80(dtype):
    # The build serves calls whose four tensors straddle the L2, whatever the row length: on an
    # H200's 60 MiB, x over 10 MiB and at most 16 MiB; on an H100's 50 MiB, five sixths of that.
    h200, h100 = 60 * 2**20, 50 * 2**20
    window = (10 * 2**20 // dtype.itemsize, 16 * 2**20 // dtype.itemsize)
    sm_90, sm_75 = {"kind": "cuda", "arch": "sm_90"}, {"kind": "cuda", "arch": "sm_75"}
    for kind in policy.KINDS:
        for variant in policy.VARIANTS:
            config = policy.launch_config(kind, variant, 1024, dtype)
            expected = window if kind.startswith("add_") and variant == "register" else None
            assert builds.evict_first_elements(kind, dtype, config, sm_90, h200) == expected
            if expected is not None:
                smaller = builds.evict_first_elements(kind, dtype, config, sm_90, h100)
                assert smaller == tuple(size * 5 // 6 for size in expected)
            assert builds.evict_first_elements(kind, dtype, config, sm_75, h200) is None
            assert builds.evict_first_elements(kind, dtype, config, sm_90, None) is None  # L2 size unknown


def test_on_a_small_l2_the_evict_first_window_leaves_the_calls_of_few_rows_their_build(cpu_kernels, monkeypatch):
    from tileops.core import DeviceFacts
    from tileops.kernels.cuda import norm as norm_kernels

    # 10 MiB of L2 (x over 1.67 and at most 2.67 MiB) beside the few-row build of 1056 rows of 1024
    # bf16 elements (2.06 MiB): the window begins at that build's end.
    small = DeviceFacts("cuda", 86, 132, None, "GPU", l2_bytes=10 * 2**20)
    monkeypatch.setattr(norm_kernels, "facts_for", lambda device: small)
    kernel = _norm_kernel("add_layer_norm", "register", 1024, torch.bfloat16)
    names = list(kernel.compiled)
    assert [(bound, names[index]) for bound, index in kernel._choices] == [
        (132 * 1024, "decode"), (1056 * 1024, "few_rows"), (10 * 2**20 * 16 // (15 * 8), "evict_first")
    ]
    assert kernel.config["evict_first_build"]["x_bytes"] == (1056 * 1024 * 2, 10 * 2**20 * 16 // (15 * 8) * 2)
    tiny = DeviceFacts("cuda", 86, 132, None, "GPU", l2_bytes=6 * 2**20)  # the window ends among the few rows
    monkeypatch.setattr(norm_kernels, "facts_for", lambda device: tiny)
    assert "evict_first" not in _norm_kernel("add_layer_norm", "register", 1024, torch.bfloat16).compiled


@pytest.mark.parametrize(
    ("kind", "n", "dtype", "expected"),
    [
        # The measured rows of 1.5 to 4 KiB: one row per block in registers, two or three vectors per thread.
        ("layer_norm", 768, torch.bfloat16, (32, True)),
        ("layer_norm", 1024, torch.float16, (64, True)),
        ("layer_norm", 1536, torch.bfloat16, (64, False)),
        ("layer_norm", 2048, torch.bfloat16, (128, False)),
        ("add_layer_norm", 1024, torch.bfloat16, (64, True)),
        ("add_layer_norm", 2048, torch.bfloat16, (128, False)),
        ("rms_norm", 1024, torch.bfloat16, (64, True)),
        # None: rows of 1 KiB or less, or layer-norm rows over 4 KiB (longer rms rows: the next test);
        # launches already one register row per block; float32 (not measured); the scalar variant.
        ("rms_norm", 512, torch.bfloat16, None),
        ("layer_norm", 4096, torch.bfloat16, None),
        ("rms_norm", 2048, torch.bfloat16, None),
        ("add_rms_norm", 1024, torch.bfloat16, None),
        ("layer_norm", 512, torch.float32, None),
        ("layer_norm", 1001, torch.bfloat16, None),
    ],
)
def test_the_few_row_build_is_for_rows_over_1_and_up_to_4_kib_not_already_one_per_block(kind, n, dtype, expected):
    variant = _selected_variant(kind, n, dtype)
    config = policy.launch_config(kind, variant, n, dtype)
    few_rows = builds.few_row_config(kind, n, dtype, config)
    if expected is None:
        assert few_rows is None
        return
    tpr, preload = expected
    assert few_rows == {**config, "mode": "register", "rows": 1, "tpr": tpr, "unroll": 4, "preload": preload}
    assert builds.few_rows(132) == 1056


@pytest.mark.parametrize(
    ("kind", "n", "dtype", "few_row"),
    [
        # 16-bit rms rows over 4 and up to 16 KiB in registers or shared memory: their launch, the
        # weight loaded early.
        ("rms_norm", 2560, torch.float16, True),
        ("rms_norm", 4096, torch.bfloat16, True),
        ("rms_norm", 8192, torch.bfloat16, True),
        ("add_rms_norm", 7168, torch.float16, True),
        ("add_rms_norm", 8192, torch.bfloat16, True),
        # None: rows over 16 KiB (not measured; streamed from 32 KiB in the single norm), float32,
        # the layer-norm kinds.
        ("add_rms_norm", 14336, torch.bfloat16, False),
        ("rms_norm", 16384, torch.bfloat16, False),
        ("rms_norm", 4096, torch.float32, False),
        ("add_rms_norm", 7168, torch.float32, False),
        ("layer_norm", 8192, torch.bfloat16, False),
        ("add_layer_norm", 4096, torch.bfloat16, False),
    ],
)
def test_longer_16_bit_rms_rows_keep_their_launch_on_few_rows_with_the_weight_loaded_early(kind, n, dtype, few_row):
    variant = _selected_variant(kind, n, dtype)
    config = policy.launch_config(kind, variant, n, dtype)
    built = builds.few_row_config(kind, n, dtype, config)
    if not few_row:
        assert built is None
        return
    assert not config["preload"] and built == {**config, "preload": True}
    assert builds.few_row_config(kind, n, dtype, built) is None  # a tuned launch that loads it early has none
    candidates = builds.one_row_candidates(n, dtype, built)
    assert candidates[0] == built and {c["mode"] for c in candidates} == {config["mode"], "register"}
    assert {c["preload"] for c in candidates} == {True, False}


@pytest.mark.parametrize(
    ("kind", "n", "dtype", "threads"),
    [
        # Four 16-byte vectors a thread, 128 to 512 threads (then up to eight vectors each), no
        # more threads than vectors.
        ("add_rms_norm", 7168, torch.float16, 256),  # 896 vectors: 224 threads' worth, a power of two up
        ("rms_norm", 3072, torch.bfloat16, 128),
        ("rms_norm", 14336, torch.float32, 512),  # 3584 vectors: seven a thread
        ("layer_norm", 8192, torch.bfloat16, 256),
        ("rms_norm", 1024, torch.bfloat16, 128),  # 128 vectors: one a thread
        ("rms_norm", 128, torch.bfloat16, 16),  # a per-head norm: 16 vectors, 16 threads
        ("add_layer_norm", 32768, torch.bfloat16, 512),  # eight vectors a thread
        # None: more than eight vectors a thread; the scalar variant (no 16-byte vectors).
        ("rms_norm", 40960, torch.bfloat16, None),  # 5120 vectors: ten a thread
        ("rms_norm", 65536, torch.bfloat16, None),
        ("layer_norm", 32768, torch.float32, None),
        ("rms_norm", 1001, torch.bfloat16, None),
    ],
)
def test_the_decode_build_spreads_one_row_per_block_over_threads_at_four_vectors_each(kind, n, dtype, threads):
    variant = _selected_variant(kind, n, dtype)
    config = policy.launch_config(kind, variant, n, dtype)
    decode = builds.decode_config(kind, n, dtype, config)
    if threads is None:
        assert decode is None
        return
    assert decode == {**config, "mode": "register", "rows": 1, "tpr": threads, "unroll": 4, "preload": True}


def test_a_decode_build_that_is_the_launch_configuration_itself_is_none():
    config = policy.launch_config("rms_norm", "register", 4096, torch.bfloat16)
    decode = builds.decode_config("rms_norm", 4096, torch.bfloat16, config)
    assert decode is not None and builds.decode_config("rms_norm", 4096, torch.bfloat16, decode) is None


def test_an_evict_first_build_where_there_is_none_is_refused_with_the_reason():
    config = policy.launch_config("rms_norm", "register", 4096, torch.bfloat16)
    with pytest.raises(ValueError, match="fused kinds in registers.*not rms_norm mode=register"):
        programs.make_program("rms_norm", 4096, torch.bfloat16, 1e-5, True, False, evict_first_inputs=True, **config)
    config = policy.launch_config("add_rms_norm", "register", 4096, torch.bfloat16)
    with pytest.raises(ValueError, match="cache_priorities=False"):
        programs.make_program("add_rms_norm", 4096, torch.bfloat16, 1e-5, True, False, evict_first_inputs=True,
                              cache_priorities=False, **config)


# -- saved statistics: the programs with save_stats and forward_saving's twin kernel ------------

SAVING_BUILDS = [
    # (kind, variant, n, dtype, build, leading): each mode, the scalar variant cached and streamed,
    # the few-row and evict-first builds, and 0-2 leading dimensions.
    ("rms_norm", "register", 4096, torch.bfloat16, "main", 1),
    ("layer_norm", "register", 256, torch.float16, "main", 0),
    ("add_layer_norm", "shared", 1000, torch.bfloat16, "main", 2),
    ("layer_norm", "streamed", 16384, torch.bfloat16, "main", 1),
    ("add_rms_norm", "streamed", 100000, torch.bfloat16, "main", 1),
    ("layer_norm", "scalar", 1001, torch.float32, "main", 1),
    ("add_layer_norm", "scalar", 100003, torch.float32, "main", 0),
    ("layer_norm", "streamed", 2048, torch.bfloat16, "few_rows", 2),
    ("add_layer_norm", "register", 1024, torch.bfloat16, "evict_first", 1),
]


def _build_config(kind, variant, n, dtype, build):
    config = policy.launch_config(kind, variant, n, dtype)
    if build == "few_rows":
        return builds.few_row_config(kind, n, dtype, config)
    return {**config, "evict_first_inputs": True} if build == "evict_first" else config


@pytest.mark.parametrize(("kind", "variant", "n", "dtype", "build", "leading"), SAVING_BUILDS,
                         ids=[f"{k}-{v}-{n}-{b}-{lead}" for k, v, n, _, b, lead in SAVING_BUILDS])
def test_save_stats_off_is_the_program_as_before_and_on_adds_only_the_statistics(kind, variant, n, dtype, build, leading):
    # Without the flag the plain builds keep their program text (the C++ launch path and the
    # measured kernels stay as they are). With it, the text differs by the two arguments (one for
    # the rms kinds) and their stores by the row's first thread, once per row.
    import difflib

    layer = kind.endswith("layer_norm")
    config = {**_build_config(kind, variant, n, dtype, build), "leading": leading}
    args = (kind, n, dtype, 1e-5, True, layer)
    plain = programs.make_program(*args, **config).script()
    assert programs.make_program(*args, save_stats=False, **config).script() == plain
    saving = programs.make_program(*args, save_stats=True, **config).script()
    removed, added = [], []
    for line in difflib.unified_diff(plain.splitlines(), saving.splitlines(), lineterm="", n=0):
        if line.startswith(("---", "+++", "@@")):
            continue
        (removed if line.startswith("-") else added).append(line[1:].strip())
    statistics = ["mean_in", "rstd_in"] if layer else ["rstd_in"]
    assert len(removed) == 1 and removed[0].startswith("def main(") and removed[0].endswith("):")
    assert added[0] == removed[0][:-2] + "".join(
        f", {name}: T.Buffer((), \"float32\")" if leading == 0 else f", {name}_handle: T.handle" for name in statistics
    ) + "):"
    body = [line for line in added[1:] if not line.startswith(tuple(f"{name} = T.match_buffer(" for name in statistics))]
    stores = [line for line in body if line.startswith(("rstd_out[", "mean_out["))]
    assert body[0] == "if lane == 0:" and len(stores) == len(statistics), body
    assert all("_out" in line for line in body[1:]), body


def test_forward_saving_launches_the_twin_build_the_call_chooses_and_returns_the_statistics(cpu_kernels):
    kernel = _norm_kernel("add_layer_norm", "register", 1024, torch.bfloat16, has_bias=True)
    x, r, b = torch.zeros(2, 3, 1024, dtype=torch.bfloat16), torch.ones(2, 3, 1024, dtype=torch.bfloat16), torch.ones(1024)
    (y, total), (mean, rstd) = kernel.forward_saving(x, r, None, b)
    config, rank, tensors = cpu_kernels.launched[-1]
    assert rank == 3 and config == kernel.build_plan(kernel.default_config()).builds["decode"]  # 6 rows
    assert tensors[:3] == (x, r, b) and [t.data_ptr() for t in tensors[3:]] == [t.data_ptr() for t in (y, total, mean, rstd)]
    assert y.shape == total.shape == x.shape and y.dtype == total.dtype == x.dtype
    assert mean.shape == rstd.shape == (2, 3) and mean.dtype == rstd.dtype == torch.float32
    twin = kernel._saving_twin
    assert twin.save_stats and not kernel.save_stats and twin.config == kernel.config
    assert list(twin.compiled) == list(kernel.compiled) and sorted(twin.compiled["decode"]) == [3]
    assert not twin.compiled["main"]  # the twin compiles a rank on its first call, not with itself
    kernel.forward_saving(torch.zeros(5121, 1024, dtype=torch.bfloat16), torch.zeros(5121, 1024, dtype=torch.bfloat16), None, b)
    assert cpu_kernels.launched[-1][0] == kernel.build_plan(kernel.default_config()).builds["evict_first"]

    rms = _norm_kernel("rms_norm", "register", 4096, torch.bfloat16)
    one_row, weight = torch.zeros(4096, dtype=torch.bfloat16), torch.ones(4096, dtype=torch.bfloat16)
    y, statistics = rms.forward_saving(one_row, weight)
    assert y.shape == one_row.shape and len(statistics) == 1 and statistics[0].shape == ()  # a 1-D x: one 0-dim rstd
    assert cpu_kernels.launched[-1][1] == 1 and cpu_kernels.launched[-1][2][:2] == (one_row, weight)


def test_plain_calls_keep_the_cpp_launch_path_and_only_the_twin_compiles_with_save_stats(cpu_kernels, monkeypatch):
    from tileops.kernels.cuda import fast_launch
    from tileops.kernels.cuda.kernel import TileLangKernel

    monkeypatch.setattr(fast_launch, "launcher", lambda fallback, *args, **kwargs: ("C++ launcher", fallback))
    kernel = _norm_kernel("rms_norm", "register", 4096, torch.bfloat16)
    assert kernel.forward[0] == "C++ launcher"
    kernel.forward_saving(torch.zeros(8, 4096, dtype=torch.bfloat16), None)
    twin = kernel._saving_twin
    assert twin._fast_forward is None and twin.forward.__func__ is TileLangKernel.forward  # the Python forward
    compiled = []
    monkeypatch.setattr(programs, "compile_config", lambda *args, **config: compiled.append(config))
    config = kernel.default_config()
    kernel.compile(config, 2)
    twin.compile(config, 2)
    assert compiled == [{**config, "leading": 1}, {**config, "leading": 1, "save_stats": True}]


def test_after_tuning_the_next_saving_call_gets_a_twin_of_the_tuned_configuration(cpu_kernels, monkeypatch):
    from tileops.kernels.cuda import tuning

    kernel = _norm_kernel("layer_norm", "shared", 4096, torch.bfloat16, has_bias=True)
    x = torch.zeros(4096, 4096, dtype=torch.bfloat16)
    kernel.forward_saving(x, None, None)
    before = kernel._saving_twin
    tuned = {**kernel.default_config(), "rows": 2}
    monkeypatch.setattr(tuning, "chosen", lambda *args: tuned)  # what tuning remembered
    kernel._use(tuned)  # as tuning does with the configuration it chose
    kernel.forward_saving(x, None, None)
    assert kernel._saving_twin is not before and kernel._saving_twin.config == kernel.config
    assert cpu_kernels.launched[-1][0] == tuned


SAVING_COMPILE = """
import torch
from tileops.kernels.cuda.norm import policy, programs
target = {"kind": "cuda", "arch": "sm_90"}
# One saving build per kind: the stores, the 0-dim statistics of a 1-D x, the streamed layer norm.
for kind, variant, n, dtype, leading in [("rms_norm", "register", 4096, torch.bfloat16, 1),
                                         ("layer_norm", "streamed", 16384, torch.bfloat16, 2),
                                         ("add_rms_norm", "scalar", 1001, torch.float32, 0),
                                         ("add_layer_norm", "shared", 4096, torch.float16, 1)]:
    config = policy.launch_config(kind, variant, n, dtype)
    kernel = programs.compile_config(kind, n, dtype, 1e-5, True, kind.endswith("layer_norm"), target,
                                     leading=leading, save_stats=True, **config)
    source = kernel.get_kernel_source()
    declaration = next(line for line in source.splitlines() if "__global__" in line)
    print(kind, "float* __restrict__ mean_out" in declaration, "float* __restrict__ rstd_out" in declaration,
          source.count("rstd_out["), source.count("mean_out["), "__fmul_rn" in source)
"""


@pytest.mark.compile
def test_one_saving_build_per_kind_compiles_for_sm90(tmp_path):
    result = run_python(SAVING_COMPILE, env={"TILELANG_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [line for line in result.stdout.splitlines() if line.split()[0] in policy.KINDS]
    # The layer norms store a mean of its own product, so that y keeps the plain build's roundings.
    assert lines == ["rms_norm False True 1 0 False", "layer_norm True True 1 1 True", "add_rms_norm False True 1 0 False",
                     "add_layer_norm True True 1 1 True"], result.stdout[-2000:]


@pytest.mark.parametrize(
    ("kind", "row_strides", "leading"),
    [("rms_norm", (4096, 4096), 1), ("add_rms_norm", (8192,), 1), ("rms_norm", (4000,), 1),
     ("rms_norm", (8196,), 1), ("rms_norm", (8192,), 2)],
    ids=["two-pitches-for-one-input", "one-pitch-for-two", "shorter-than-a-row", "off-the-vector-grid", "two-leading-dims"],
)
def test_a_program_refuses_row_strides_it_cannot_read(kind, row_strides, leading):
    config = {**policy.launch_config(kind, "register", 4096, torch.bfloat16), "leading": leading}
    with pytest.raises(ValueError, match="one pitch per row input"):
        programs.make_program(kind, 4096, torch.bfloat16, 1e-6, True, False, row_strides=row_strides, **config)
