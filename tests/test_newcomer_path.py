"""What a newcomer meets first: the command's mistakes end in one line and exit status 2, the
template backend changes no in-tree CUDA selection, ``--help`` starts without torch, ops show
their manifest signature, and TileLang's log lines stay quiet."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from helpers import run_python
from tileops.cli import main
from tileops.ops import FusedAddRMSNormFwdOp, RMSNormFwdOp


def _exits_2_with_one_line(capsys, *argv: str) -> str:
    try:
        code = main(list(argv))
    except SystemExit as exit_:  # argparse's errors
        code = exit_.code
    out, err = capsys.readouterr()
    assert code == 2, (code, out, err)
    assert out == "" and len(err.strip().splitlines()) == 1, err
    return err.strip()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_demo_on_cuda_without_a_gpu_says_so_in_one_line(capsys, device):
    line = _exits_2_with_one_line(capsys, "demo", "--device", device)
    assert line == f"tileops demo: error: --device {device}: no CUDA GPU is present on this machine; run on the CPU with --device cpu"


def test_demo_on_meta_says_no_op_runs_there(capsys):
    line = _exits_2_with_one_line(capsys, "demo", "--device", "meta")
    assert line.startswith("tileops demo: error: --device meta: meta tensors hold no data")


@pytest.mark.parametrize("command", [["demo"], ["explain", "RMSNormFwdOp", "--shape", "8,64"]])
def test_a_device_torch_does_not_know_is_one_line(capsys, command):
    line = _exits_2_with_one_line(capsys, *command, "--device", "tpu")
    assert line.startswith(f"tileops {command[0]}: error: argument --device: torch knows no device 'tpu': Expected one of cpu, cuda")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["demoo"], "tileops: error: argument COMMAND: invalid choice: 'demoo'"),
        (["ops", "--bogus"], "tileops ops: error: unrecognized arguments: --bogus"),
        (["ops", "NoSuchOp"], "tileops ops: error: no op is named 'NoSuchOp'"),
        (["demo", "NoSuchOp"], "tileops demo: error: no op is named 'NoSuchOp'"),
        (["explain", "RMSNormFwdOp"], "tileops explain: error: the following arguments are required: --shape"),
        (["demo", "--shape", "8,-4"], "tileops demo: error: argument --shape: sizes cannot be negative"),
    ],
)
def test_every_mistake_is_one_line_and_exit_status_2(capsys, argv, expected):
    assert _exits_2_with_one_line(capsys, *argv).startswith(expected)


def test_demo_json_reports_each_call_and_what_each_target_is(capsys):
    assert main(["demo", "RMSNormFwdOp", "--device", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device"] == "cpu" and report["load_failures"] == []
    assert report["targets"] == [
        {"target": "acme", "distribution": "tileops-acme-template", "module": "tileops_acme.detect", "claims_device": False}
    ]
    (call,) = report["calls"]
    assert call["op"] == "RMSNormFwdOp" and call["target"] == "builtin" and call["served_by"] == ["torch_cpu"]


def test_demo_says_what_the_acme_target_is(capsys):
    assert main(["demo", "RMSNormFwdOp", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert (
        "targets registered: acme (a backend's target, from tileops-acme-template: serves whole ops on its own devices; "
        "it does not claim cpu)"
    ) in out


def test_ops_takes_op_names(capsys):
    assert main(["ops", "LayerNormFwdOp", "--json"]) == 0
    assert [op["op"] for op in json.loads(capsys.readouterr().out)] == ["LayerNormFwdOp"]


# -- the template changes no in-tree CUDA result --------------------------------------------------
def test_with_the_template_installed_short_rows_on_cuda_select_the_in_tree_kernel(capsys):
    code = main(["explain", "RMSNormFwdOp", "--shape", "32768,256", "--device", "cuda", "--arch", "90", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    (interface,) = report["interfaces"]
    assert interface["selected"] == "rms_norm" and interface["selected_registered_by"] is None
    outcomes = {v["key"]: v["outcome"] for v in interface["verdicts"]}
    assert outcomes["acme_short_rows"] == "unavailable"  # installed, and asked: it serves the CPU only
    main(["explain", "RMSNormFwdOp", "--shape", "32768,256", "--device", "cuda", "--arch", "90"])
    assert "result:       served in-tree: RMSNormFwdInterface by rms_norm\n" in capsys.readouterr().out


def test_explain_names_the_distribution_that_registered_the_selected_key(capsys):
    assert main(["explain", "RMSNormFwdOp", "--shape", "8,128", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert (
        "result:       served on the builtin target: RMSNormFwdInterface by acme_short_rows "
        "(registered by tileops-acme-template)"
    ) in out
    assert "served in-tree" not in out


# -- start-up and introspection -------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["--help"], ["--version"], []])
def test_help_and_version_import_no_torch(argv):
    found = run_python(
        "import sys\nfrom tileops.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        "print('torch imported' if 'torch' in sys.modules else 'no torch')"
    )
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip().splitlines()[-1] == "no torch"


def test_bench_help_shows_no_rest_markup(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert "tileops bench: the manifest workloads" in out and "``" not in out


def test_an_op_shows_its_call_signature_from_the_manifest():
    assert str(inspect.signature(RMSNormFwdOp(64))) == (
        "(x: torch.Tensor, weight: torch.Tensor | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor"
    )
    fused = inspect.signature(FusedAddRMSNormFwdOp(64))
    assert list(fused.parameters) == ["x", "residual", "weight", "out", "residual_out"]
    assert fused.return_annotation == tuple[torch.Tensor, torch.Tensor]
    # The class still shows its constructor.
    assert list(inspect.signature(RMSNormFwdOp).parameters) == ["normalized_shape", "eps", "target"]


def test_an_ops_docstring_gives_params_inputs_and_outputs_from_the_manifest():
    doc = RMSNormFwdOp.__doc__
    entry = RMSNormFwdOp.manifest_entry()
    assert doc.startswith("``torch.nn.functional.rms_norm`` as an op")  # its own docstring first
    assert entry.summary in doc
    assert "    normalized_shape: shape. The trailing dimensions" in doc
    assert "    weight: dtype of x, shape [*normalized_shape] (optional). Elementwise scale" in doc
    assert "    y: dtype of x, shape of x (fills out= when given)." in doc
    assert inspect.getdoc(RMSNormFwdOp(64)) == inspect.cleandoc(doc)


# -- TileLang's logging ---------------------------------------------------------------------------
@pytest.mark.compile
@pytest.mark.parametrize(("setting", "level"), [(None, "WARNING"), ("1", "INFO")])
def test_tilelang_logs_at_info_only_when_asked(setting, level):
    found = run_python(
        "import logging\nfrom tileops.kernels.cuda import compile\ncompile._import_tilelang()\n"
        "print(logging.getLevelName(logging.getLogger('tilelang').getEffectiveLevel()))",
        env={"TILEOPS_TILELANG_LOG": setting or ""},
    )
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip().splitlines()[-1] == level
