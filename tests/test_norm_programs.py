"""The norm kernels' launch configurations, tuning candidates and the store of tuned
configurations (pure Python: no tilelang, no GPU)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from helpers import run_python
from tileops.kernels.cuda.norm import programs

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
    assert programs.choose_variant(kind, n, torch.bfloat16, True) == variant


def test_the_layer_norm_register_refusal_names_the_kind_and_its_limit():
    reason = programs.refusal("add_layer_norm", "register", 2048, torch.bfloat16, True)
    assert reason == "add_layer_norm rows over 2048 bytes run faster in the 'shared' variant (this row is 4096 bytes)"


def test_the_shared_refusals_of_the_single_norms_name_the_streamed_variant_and_the_row_size():
    long_row = programs.refusal("rms_norm", "shared", 16384, torch.bfloat16, True)
    assert long_row == "rms_norm rows of 32768 bytes or more run faster in the 'streamed' variant (this row is 32768 bytes)"
    short_row = programs.refusal("layer_norm", "shared", 1000, torch.float32, True)
    assert short_row == "layer_norm rows of at most 4096 bytes run faster in the 'streamed' variant (this row is 4000 bytes)"
    assert programs.refusal("layer_norm", "shared", 4096, torch.bfloat16, True) is None


@pytest.mark.parametrize(("kind", "variant", "n", "dtype"), SHAPES)
def test_tuning_candidates_start_with_the_default_and_fit_the_block(kind, variant, n, dtype):
    candidates = programs.tuning_candidates(kind, variant, n, dtype)
    assert candidates[0] == programs.launch_config(kind, variant, n, dtype)
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
    for config in programs.tuning_candidates("rms_norm", "shared", 65536, torch.bfloat16):
        assert config["rows"] == 1, config



@pytest.mark.parametrize(
    ("n", "dtype", "threads_per_row"),
    [(1024, torch.bfloat16, 64), (512, torch.float16, 32), (512, torch.float32, 64), (1000, torch.bfloat16, 32)],
)
def test_fused_add_layer_norm_rows_of_a_power_of_two_of_vectors_spread_over_more_threads(n, dtype, threads_per_row):
    # Two vectors per thread where the row is a power of two of 16-byte vectors, four otherwise
    # (docs/perf/h200-add-layer-norm-threads-2026-11-29.txt); never below 16 threads per row.
    config = programs.launch_config("add_layer_norm", "register", n, dtype)
    assert (config["tpr"], config["rows"]) == (threads_per_row, 128 // threads_per_row)
    assert programs.launch_config("add_layer_norm", "register", 256, torch.bfloat16)["tpr"] == 16

# -- tuned configurations persist per machine -------------------------------------------------

KEY = ("NVIDIA H200", "sm_90", "rms_norm", "register", 1000, "torch.bfloat16", 1e-6, True, False)


def _python(code: str, cache: Path):
    return run_python(code, env={"TILEOPS_CACHE_DIR": str(cache)})


def test_a_tuned_configuration_is_found_by_a_later_process(tmp_path):
    config = {"vec": 8, "tpr": 32, "rows": 16, "mode": "register", "unroll": 4, "preload": True}
    stored = _python(
        f"from tileops.kernels.cuda.norm import tuning\ntuning.remember({KEY!r}, {config!r})\nprint(tuning.store_path())",
        tmp_path,
    )
    assert stored.returncode == 0, stored.stderr
    assert Path(stored.stdout.strip()).parent == tmp_path
    found = _python(f"from tileops.kernels.cuda.norm import tuning\nprint(tuning.chosen({KEY!r}))", tmp_path)
    assert found.returncode == 0, found.stderr
    assert ast.literal_eval(found.stdout.strip()) == config
    other_gpu = ("NVIDIA H100",) + KEY[1:]
    found = _python(f"from tileops.kernels.cuda.norm import tuning\nprint(tuning.chosen({other_gpu!r}))", tmp_path)
    assert found.stdout.strip() == "None"


def test_an_unreadable_store_warns_and_is_replaced_by_the_next_tuning(tmp_path):
    (tmp_path / "norm-tuning.json").write_text("{not json")
    found = _python(
        "import warnings\nwarnings.simplefilter('always')\n"
        f"from tileops.kernels.cuda.norm import tuning\nprint(tuning.chosen({KEY!r}))",
        tmp_path,
    )
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == "None"
    assert "were not read" in found.stderr and "norm-tuning.json" in found.stderr
    config = {"tpr": 64}
    replaced = _python(f"from tileops.kernels.cuda.norm import tuning\ntuning.remember({KEY!r}, {config!r})", tmp_path)
    assert replaced.returncode == 0, replaced.stderr
    found = _python(f"from tileops.kernels.cuda.norm import tuning\nprint(tuning.chosen({KEY!r}))", tmp_path)
    assert found.stdout.strip() == repr(config), found.stderr  # tuning replaced the unreadable file


def test_a_store_that_is_not_a_json_object_is_treated_as_unreadable(tmp_path):
    (tmp_path / "norm-tuning.json").write_text("[1, 2]")
    found = _python(f"from tileops.kernels.cuda.norm import tuning\nprint(tuning.chosen({KEY!r}))", tmp_path)
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == "None" and "expected a JSON object, found list" in found.stderr


def test_an_unwritable_store_keeps_the_configuration_for_the_process_and_says_so(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    code = (
        "import warnings\nwarnings.simplefilter('always')\nfrom tileops.kernels.cuda.norm import tuning\n"
        f"tuning.remember({KEY!r}, {{'tpr': 64}})\nprint(tuning.chosen({KEY!r}))"
    )
    result = _python(code, blocker / "cache")  # a folder below a file cannot be created
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "{'tpr': 64}"
    assert "holds for this process only" in result.stderr


# -- the tuning loop, with the GPU timing replaced by given figures -----------------------------


def _tune_with(monkeypatch, tmp_path, figures, key_suffix, broken=()):
    """Run ``tuning.tune`` over candidates timed at ``figures`` µs (the first is the default);
    candidates whose index is in ``broken`` fail to compile."""
    from tileops.kernels.cuda.norm import tuning

    monkeypatch.setenv("TILEOPS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_chosen", {})
    monkeypatch.setattr(tuning, "_loaded", False)
    candidates = [{"tpr": 32 * (i + 1)} for i in range(len(figures))]

    def compile_candidate(config):
        index = candidates.index(config)
        if index in broken:
            raise ValueError(f"candidate {index} does not compile")
        return lambda *tensors: index

    def timed(fn, **_):
        return figures[fn()]

    monkeypatch.setattr(tuning, "gpu_time_us", timed)
    key = ("GPU", "sm_90", "rms_norm", "register", key_suffix)
    return tuning, key, candidates, tuning.tune(key, candidates, compile_candidate, (), "RMSNormKernel test")


def test_tuning_keeps_the_fastest_candidate_and_stores_it(monkeypatch, tmp_path, capfd):
    tuning, key, candidates, config = _tune_with(monkeypatch, tmp_path, [10.0, 8.0, 9.0], 1)
    assert config == candidates[1]
    assert tuning.chosen(key) == candidates[1]
    assert "tuning RMSNormKernel test: chose {'tpr': 64} at 8.00 us (default 10.00 us)" in capfd.readouterr().err
    assert (tmp_path / "norm-tuning.json").exists()


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_only_the_fused_kinds_in_registers_have_an_evict_first_build_and_only_from_sm80(dtype):
    # The build serves calls whose x is over 10 MiB and at most 16 MiB, whatever the row length.
    window = (10 * 2**20 // dtype.itemsize, 16 * 2**20 // dtype.itemsize)
    for kind in programs.KINDS:
        for variant in programs.VARIANTS:
            config = programs.launch_config(kind, variant, 1024, dtype)
            expected = window if kind.startswith("add_") and variant == "register" else None
            assert programs.evict_first_elements(kind, dtype, config, {"kind": "cuda", "arch": "sm_90"}) == expected
            assert programs.evict_first_elements(kind, dtype, config, {"kind": "cuda", "arch": "sm_75"}) is None


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
        # None: rows of 1 KiB or less, or over 4 KiB; launches already one register row per block;
        # float32 (not measured); the scalar variant (no 16-byte vectors).
        ("rms_norm", 512, torch.bfloat16, None),
        ("layer_norm", 4096, torch.bfloat16, None),
        ("rms_norm", 2048, torch.bfloat16, None),
        ("add_rms_norm", 1024, torch.bfloat16, None),
        ("layer_norm", 512, torch.float32, None),
        ("layer_norm", 1001, torch.bfloat16, None),
    ],
)
def test_the_few_row_build_is_for_rows_over_1_and_up_to_4_kib_not_already_one_per_block(kind, n, dtype, expected):
    variant = programs.choose_variant(kind, n, dtype, True)
    config = programs.launch_config(kind, variant, n, dtype)
    few_rows = programs.few_row_config(kind, n, dtype, config)
    if expected is None:
        assert few_rows is None
        return
    tpr, preload = expected
    assert few_rows == {**config, "mode": "register", "rows": 1, "tpr": tpr, "unroll": 4, "preload": preload}
    assert programs.FEW_ROWS == 1024


def test_an_evict_first_build_where_there_is_none_is_refused_with_the_reason():
    config = programs.launch_config("rms_norm", "register", 4096, torch.bfloat16)
    with pytest.raises(ValueError, match="fused kinds in registers.*not rms_norm mode=register"):
        programs.make_program("rms_norm", 4096, torch.bfloat16, 1e-5, True, False, evict_first_inputs=True, **config)
    config = programs.launch_config("add_rms_norm", "register", 4096, torch.bfloat16)
    with pytest.raises(ValueError, match="cache_priorities=False"):
        programs.make_program("add_rms_norm", 4096, torch.bfloat16, 1e-5, True, False, evict_first_inputs=True,
                              cache_priorities=False, **config)
