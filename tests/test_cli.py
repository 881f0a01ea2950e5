"""The ``tileops`` command: ops, backends, explain, check and demo, through ``main`` and once
through the installed console script."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tileops.backend import (
    DeviceFacts,
    Kernel,
    register_detector,
    register_kernel_builder,
    register_kernel_type,
    set_default_target,
)
from tileops.cli import check, list_ops, main
from tileops.core import discovery
from tileops.ops import FAMILIES, RMSNormFwdOp
from tileops.ops.norm import RMSNormCall, RMSNormFwdInterface

NORM_OPS = [
    "RMSNormFwdOp", "LayerNormFwdOp", "FusedAddRMSNormFwdOp", "FusedAddLayerNormFwdOp",
    "RMSNormBwdOp", "LayerNormBwdOp", "FusedAddRMSNormBwdOp", "FusedAddLayerNormBwdOp",
]
#: Every op of every family, in the order ``tileops ops`` lists them.
ALL_OPS = [op_class.__name__ for ops in FAMILIES.values() for op_class in ops]
EXPLAIN_HOPPER = ["explain", "RMSNormFwdOp", "--device", "cuda", "--arch", "90", "--dtype", "bfloat16"]
EXPLAIN_CPU = ["explain", "RMSNormFwdOp", "--shape", "8,4096", "--device", "cpu"]


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out + err


def run_json(capsys, *argv: str):
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("command", ["demo", "ops", "backends", "explain", "check"])
def test_every_subcommand_has_help(capsys, command):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    assert f"usage: tileops {command}" in capsys.readouterr().out


def test_the_help_lists_the_subcommands(capsys):
    code, out = run_cli(capsys)
    assert code == 0
    for command in ("demo", "ops", "backends", "explain", "check"):
        assert command in out


# -- ops ------------------------------------------------------------------------------------------
def test_ops_lists_interfaces_keys_distributions_and_targets(capsys):
    code, out = run_cli(capsys, "ops")
    assert code == 0
    assert "RMSNormFwdOp (family norm)" in out
    assert "targets with a kernel builder: acme" in out
    rms_norm = next(line for line in out.splitlines() if line.strip().startswith("rms_norm "))
    assert "tileops-kernels-cuda" in rms_norm and "in-tree" in rms_norm
    assert "tileops.kernels.cuda.norm.RMSNormKernel" in rms_norm
    short_rows = next(line for line in out.splitlines() if line.strip().startswith("acme_short_rows"))
    assert "tileops-acme-template" in short_rows and "registered by tileops_acme.short_rows" in short_rows


def test_ops_json_gives_each_keys_origin_distribution_and_installation(capsys):
    code, ops = run_json(capsys, "ops")
    assert code == 0
    assert [op["op"] for op in ops] == ALL_OPS
    rms = next(op for op in ops if op["op"] == "RMSNormFwdOp")
    assert rms["family"] == "norm" and rms["targets"] == ["acme"] and rms["error"] is None
    (interface,) = rms["interfaces"]
    assert interface["interface"] == "RMSNormFwdInterface"
    keys = {impl["key"]: impl for impl in interface["implementations"]}
    assert set(keys) == {
        "acme_short_rows", "rms_norm", "rms_norm_scalar", "rms_norm_shared", "rms_norm_streamed", "torch_cpu",
        "torch_float64",
    }
    assert keys["rms_norm"]["distribution"] == "tileops-kernels-cuda" and keys["rms_norm"]["installed"]
    assert keys["torch_cpu"]["distribution"] == "tileops-ops" and keys["torch_cpu"]["devices"] == ["cpu"]
    assert keys["acme_short_rows"]["origin"] == "registered"
    assert keys["acme_short_rows"]["distribution"] == "tileops-acme-template"
    assert keys["rms_norm_scalar"]["general"] is True


def _rms_norm_op_with(**attributes) -> type:
    """A stand-in for RMSNormFwdOp (its manifest entry is found by class name) with other
    declarations; it defines no torch custom op, which the real class already owns."""
    return type("RMSNormFwdOp", (RMSNormFwdOp,), {"_custom_op": None, **attributes})


def test_ops_says_which_in_tree_keys_are_not_installed_and_how_to_install_them(capsys, monkeypatch):
    ghost = _rms_norm_op_with(kernel_tables=(*RMSNormFwdOp.kernel_tables, "tileops.kernels.ghost.norm:KERNELS"))
    monkeypatch.setattr(list_ops, "FAMILIES", {"norm": (ghost,)})
    code, out = run_cli(capsys, "ops")
    assert code == 0
    assert (
        "tileops.kernels.ghost.norm is not installed: tileops.kernels.ghost.norm is not installed; "
        "pip install tileops-kernels-ghost"
    ) in out
    _, ops = run_json(capsys, "ops")
    keys = {impl["key"]: impl for impl in ops[0]["interfaces"][0]["implementations"]}
    ghost_key = keys["tileops.kernels.ghost.norm"]
    assert ghost_key["installed"] is False and ghost_key["distribution"] is None
    assert ghost_key["class"] == "tileops.kernels.ghost.norm.KERNELS"
    assert keys["torch_cpu"]["installed"] is True and keys["rms_norm"]["installed"] is True


# -- backends -------------------------------------------------------------------------------------
def test_backends_lists_the_template_and_what_it_registered(capsys):
    code, out = run_cli(capsys, "backends")
    assert code == 0
    assert "acme = tileops_acme  (distribution tileops-acme-template)" in out
    assert "tileops_acme.detect.claims" in out
    assert "RMSNormFwdOp on target acme" in out and "tileops_acme.builders.build_rms_norm" in out
    assert "RMSNormFwdOp key acme_short_rows" in out and "tileops_acme.short_rows.AcmeShortRowRMSNorm" in out
    assert "load failures: none" in out


def test_backends_json_groups_registrations_by_backend(capsys):
    code, described = run_json(capsys, "backends")
    assert code == 0
    (acme,) = described["backends"]
    assert (acme["name"], acme["value"], acme["distribution"]) == ("acme", "tileops_acme", "tileops-acme-template")
    assert [d["target"] for d in acme["detectors"]] == ["acme"]
    assert {b["op"] for b in acme["kernel_builders"]} == {
        "RMSNormFwdOp", "LayerNormFwdOp", "FusedAddRMSNormFwdOp", "FusedAddLayerNormFwdOp"
    }
    assert [(t["op"], t["key"]) for t in acme["kernel_types"]] == [("RMSNormFwdOp", "acme_short_rows")]
    assert described["load_failures"] == []


def test_backends_lists_registrations_made_outside_any_backend(capsys, scoped_registry):
    register_detector(target="probe", detect=lambda device: False)
    code, out = run_cli(capsys, "backends")
    assert code == 0
    assert "registered by code outside any backend:" in out
    assert "target probe" in out.split("registered by code outside any backend:")[1]


class _FakeEntryPoint:
    name, value, dist = "fake", "fake_backend", None

    @staticmethod
    def load():
        raise ImportError("missing driver")


@pytest.fixture
def failed_backend(monkeypatch):
    """A backend whose import failed, recorded as discovery records it, and forgotten after."""
    monkeypatch.setattr(discovery, "_failures", list(discovery.load_failures()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        discovery._load_one(_FakeEntryPoint())


def test_backends_reports_each_load_failure_and_its_traceback_when_verbose(capsys, failed_backend):
    code, out = run_cli(capsys, "backends")
    assert code == 1
    assert "load failures: 1" in out
    assert "fake = fake_backend: ImportError: missing driver" in out
    assert "Traceback" not in out
    _, out = run_cli(capsys, "backends", "--verbose")
    assert "Traceback (most recent call last)" in out
    _, described = run_json(capsys, "backends")
    (failure,) = described["load_failures"]
    assert failure["error"] == "ImportError: missing driver" and "missing driver" in failure["traceback"]


# -- explain --------------------------------------------------------------------------------------
def test_explain_on_hopper_selects_the_register_kernel_on_the_builtin_target(capsys):
    code, out = run_cli(capsys, *EXPLAIN_HOPPER, "--shape", "8,4096")
    assert code == 0
    assert "device facts: stated by --arch: cuda architecture 90" in out
    assert "target:       builtin (no target's detector claims cuda" in out
    assert "  - rms_norm: selected" in out
    assert "  - rms_norm_shared: beaten (beaten by rms_norm)" in out
    assert "  - torch_cpu: unavailable (runs on cpu, not cuda)" in out
    assert "  - acme_short_rows: unavailable (runs on cpu, not cuda)" in out


def test_explain_of_rows_that_are_not_16_byte_multiples_selects_the_scalar_kernel(capsys):
    code, out = run_cli(capsys, *EXPLAIN_HOPPER, "--shape", "8,4095")
    assert code == 0
    refused = next(line for line in out.splitlines() if line.startswith("  - rms_norm: "))
    assert refused.startswith("  - rms_norm: refused (")
    assert "8190 bytes, not a multiple of 16" in refused
    assert "  - rms_norm_scalar: selected" in out


def test_explain_json_parses_and_gives_every_verdict(capsys):
    code, report = run_json(capsys, *EXPLAIN_HOPPER, "--shape", "8,4095", "--no-weight")
    assert code == 0 and report["served"] is True
    assert report["target"] == {
        "name": "builtin",
        "reason": "no target's detector claims cuda, so the in-tree implementations serve it",
        "builder": None,
        "error": None,
    }
    assert report["call"]["inputs"] == {"x": [8, 4095]}
    (interface,) = report["interfaces"]
    assert interface["selected"] == "rms_norm_scalar"
    assert "has_weight=False" in interface["call_spec"] and "eps=0.0078125" in interface["call_spec"]
    outcomes = {v["key"]: v["outcome"] for v in interface["verdicts"]}
    assert outcomes["rms_norm"] == "refused" and outcomes["torch_cpu"] == "unavailable"


def test_explain_uses_the_same_verdict_text_as_a_failing_call(capsys):
    op = RMSNormFwdOp(4095)
    eps = torch.finfo(torch.bfloat16).eps
    call = RMSNormCall(torch.device("cuda"), 4095, torch.bfloat16, eps, True, False, True)
    implementations = op.implementations()[RMSNormFwdInterface]
    expected = [str(v) for v in implementations.verdicts(call, lambda _call: DeviceFacts("cuda", arch=90))]
    _, out = run_cli(capsys, *EXPLAIN_HOPPER, "--shape", "8,4095")
    for text in expected:
        assert f"  - {text}" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA device")
def test_explain_on_an_absent_cuda_device_says_the_facts_are_unknown_and_suggests_arch(capsys):
    code, out = run_cli(capsys, "explain", "RMSNormFwdOp", "--shape", "8,4096", "--device", "cuda")
    assert code == 0
    assert "device facts: unknown: cuda is not present on this machine" in out
    assert "Pass --arch" in out


class _HopperRMSNorm(Kernel, RMSNormFwdInterface):
    """An added implementation that runs on Hopper only and beats the in-tree kernels there."""

    supported_archs = frozenset({90})
    preferred_over = frozenset({"rms_norm"})

    @classmethod
    def entry_for(cls, call):
        return call.n, cls

    def forward(self, x, weight):
        return F.rms_norm(x, x.shape[-1:], weight)


def test_explain_checks_supported_archs_against_the_stated_facts(capsys, scoped_registry):
    register_kernel_type("RMSNormFwdOp", "hopper_only", _HopperRMSNorm)
    shape = ["--shape", "8,4096", "--device", "cuda"]
    code, out = run_cli(capsys, "explain", "RMSNormFwdOp", *shape, "--arch", "90")
    assert code == 0
    assert "  - hopper_only: selected" in out and "  - rms_norm: beaten (beaten by hopper_only)" in out
    code, out = run_cli(capsys, "explain", "RMSNormFwdOp", *shape, "--arch", "80")
    assert code == 0
    assert "  - hopper_only: unavailable (needs architecture 90, cuda is 80)" in out
    assert "  - rms_norm: selected" in out
    if not torch.cuda.is_available():
        _, out = run_cli(capsys, "explain", "RMSNormFwdOp", *shape)
        assert "  - hopper_only: unavailable (the facts of cuda are unknown)" in out


@pytest.mark.parametrize("arch, shared_serves", [(86, False), (90, True)])
def test_explain_for_a_stated_architecture_applies_its_shared_memory_not_the_present_gpus(capsys, arch, shared_serves):
    # A fused row of 60000 bf16 columns parks 120 KB in shared memory: within the 227 KiB an sm_90
    # block may take, beyond the 99 KiB of an sm_86 one, whichever GPU (if any) this machine has.
    code, out = run_cli(capsys, "explain", "FusedAddRMSNormFwdOp", "--shape", "4x60000", "--arch", str(arch))
    assert code == 0
    limit = {86: 99 * 1024, 90: 227 * 1024}[arch]
    assert f"stated by --arch: cuda architecture {arch}, {limit} bytes of shared memory per block" in out
    if shared_serves:
        assert "  - add_rms_norm_shared: selected" in out
    else:
        assert f"  - add_rms_norm_shared: refused (a row of 120000 bytes takes 123008 bytes of shared memory a block and this GPU gives a block at most {limit}" in out
        assert "  - add_rms_norm_streamed: selected" in out


def test_explain_with_a_named_target_says_its_builder_serves_the_call(capsys):
    code, out = run_cli(capsys, *EXPLAIN_CPU, "--target", "acme")
    assert code == 0
    assert "target:       acme (target='acme' was given when the op was constructed)" in out
    assert "its kernel builder tileops_acme.builders.build_rms_norm serves every call" in out
    assert "result:       served by target acme" in out


def test_explain_prints_target_errors_as_the_verdict(capsys, scoped_registry):
    code, out = run_cli(capsys, *EXPLAIN_CPU, "--target", "nope")
    assert code == 1
    assert "target:       UnknownTargetError: --target: no backend registered target 'nope'" in out
    register_detector(target="everywhere", detect=lambda device: True)
    register_detector(target="anywhere", detect=lambda device: True)
    code, out = run_cli(capsys, *EXPLAIN_CPU)
    assert code == 1
    assert "AmbiguousTargetError: RMSNormFwdOp: targets 'anywhere', 'everywhere' all claim cpu" in out
    code, out = run_cli(capsys, "explain", "LayerNormFwdOp", "--shape", "8,64", "--target", "everywhere")
    assert code == 1
    assert "OpNotAvailableError: LayerNormFwdOp: target 'everywhere' is bound" in out
    assert "registers no kernel builder for LayerNormFwdOp" in out


def test_explain_reports_a_call_the_signature_rejects(capsys):
    code, out = run_cli(capsys, "explain", "RMSNormFwdOp", "--shape", "8,4096", "--normalized-shape", "4095")
    assert code == 1
    assert "the call raises OpArgumentError: RMSNormFwdOp: argument 'x' expected shape" in out
    code, out = run_cli(capsys, "explain", "LayerNormFwdOp", "--shape", "8,4096", "--dtype", "int8")
    assert code == 1
    assert "argument 'x' expected dtype float16 or bfloat16 or float32 or float64, got torch.int8" in out


def test_explain_takes_the_dimensions_a_shape_leaves_from_a_workload_whose_call_it_fits(capsys):
    # Eight sequences: the first decode workload's caches hold 2 rows, a later one's 8. The block
    # table and the key mask, whose widths nothing given names, are left out.
    code, out = run_cli(capsys, "explain", "DecodeAttentionFwdOp", "--shape", "8x1x32x128", "--device", "cpu")
    assert code == 0, out
    call = next(line for line in out.splitlines() if line.startswith("call:"))
    assert call.startswith("call:         q (8, 1, 32, 128), k_cache (8, 16384, 8, 128),") and "block_table" not in call
    assert "served in-tree: DecodeAttentionFwdInterface by torch_cpu" in out
    # Heads-first caches: a heads-first workload gives them.
    _, out = run_cli(capsys, "explain", "DecodeAttentionFwdOp", "--shape", "8x1x32x128", "--device", "cpu",
                     "--param", "cache_layout=bhsd")
    assert "k_cache (8, 8, 4096, 128)" in out and "served in-tree" in out
    # No workload's caches hold 300 rows: the first workload's sizes stand, and the signature says why.
    _, out = run_cli(capsys, "explain", "DecodeAttentionFwdOp", "--shape", "300x1x32x128", "--device", "cpu")
    assert "the call raises OpArgumentError" in out and "rule: N >= B" in out


def test_explain_of_a_backward_op_whose_first_input_is_a_0_dim_gradient(capsys):
    # --shape () is the loss's gradient; the other inputs keep the first workload's sizes.
    code, out = run_cli(capsys, "explain", "CrossEntropyBwdOp", "--shape", "()")
    assert code == 0, out
    assert "call:         dloss (), " in out and "logits (8, 100)" in out and "served in-tree: CrossEntropyGradInterface" in out
    code, out = run_cli(capsys, "explain", "LinearCrossEntropyBwdOp", "--shape", "()")
    assert code == 0, out
    assert "grad_weight (100, 64)" in out
    assert "result:       computed by the op's own torch code (it calls no kernel interface)" in out


def test_explain_of_an_empty_call_says_nothing_runs(capsys):
    code, out = run_cli(capsys, "explain", "FusedAddLayerNormFwdOp", "--shape", "0,4096", "--device", "cpu")
    assert code == 0
    assert "writes only empty tensors" in out


def test_explain_resolves_eps_as_the_op_does_and_passes_bias_flags(capsys):
    code, report = run_json(capsys, "explain", "LayerNormFwdOp", "--shape", "4,2,64", "--normalized-shape", "2,64",
                            "--device", "cpu", "--no-bias", "--eps", "0.001")
    assert code == 0
    assert report["params"] == {"normalized_shape": [2, 64], "eps": 0.001}
    spec = report["interfaces"][0]["call_spec"]
    assert "n=128" in spec and "eps=0.001" in spec and "has_weight=True, has_bias=False" in spec


def test_explain_takes_any_param_as_param_name_value_read_as_the_manifest_declares_it(capsys):
    code, report = run_json(capsys, *EXPLAIN_HOPPER, "--shape", "4,2,64", "--param", "normalized_shape=2x64",
                            "--param", "eps=1e-6")
    assert code == 0 and report["served"], report
    assert report["params"] == {"normalized_shape": [2, 64], "eps": 1e-6}
    assert report["call"]["inputs"] == {"x": [4, 2, 64], "weight": [2, 64]}
    assert "n=128" in report["interfaces"][0]["call_spec"] and "eps=1e-06" in report["interfaces"][0]["call_spec"]
    # None where the manifest lets the param be null: the op's default, torch's eps of the dtype.
    _, report = run_json(capsys, *EXPLAIN_HOPPER, "--shape", "8,64", "--param", "eps=None")
    assert report["params"]["eps"] is None and "eps=0.0078125" in report["interfaces"][0]["call_spec"]


def test_explain_omits_the_optional_inputs_named_and_passes_every_other(capsys):
    _, report = run_json(capsys, "explain", "FusedAddLayerNormFwdOp", "--shape", "8,64", "--device", "cpu",
                         "--omit", "weight")
    assert report["call"]["inputs"] == {"x": [8, 64], "residual": [8, 64], "bias": [64]}
    assert "has_weight=False, has_bias=True" in report["interfaces"][0]["call_spec"]
    _, report = run_json(capsys, "explain", "FusedAddLayerNormFwdOp", "--shape", "8,64", "--device", "cpu",
                         "--omit", "weight", "--omit", "bias")
    assert report["call"]["inputs"] == {"x": [8, 64], "residual": [8, 64]}


def test_explain_of_misaligned_tensors_asks_the_op_and_refuses_the_vectorised_kernels(capsys):
    _, report = run_json(capsys, *EXPLAIN_HOPPER, "--shape", "8,4096", "--misaligned")
    assert report["call"]["aligned"] is False
    (interface,) = report["interfaces"]
    assert "aligned=False" in interface["call_spec"] and interface["selected"] == "rms_norm_scalar"


def test_explain_builds_the_call_spec_through_the_ops_own_call_spec():
    from tileops.core.tensor_description import TensorDescription

    op = RMSNormFwdOp(4096, 1e-6)
    device = torch.device("cuda")
    x = TensorDescription(device, torch.float16, (8, 4096), address=2)
    specs = op.call_specs(device, {"x": x})
    assert specs == {RMSNormFwdInterface: op.call_spec(RMSNormFwdInterface, device, torch.float16, False, False, False)}
    assert specs[RMSNormFwdInterface] == RMSNormCall(device, 4096, torch.float16, 1e-6, False, False, False)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["explain", "NoSuchOp", "--shape", "8"], f"no op is named 'NoSuchOp'; the ops are {ALL_OPS[0]}, "),
        (["explain", "RMSNormFwdOp", "--shape", "8,64", "--no-bias"], "RMSNormFwdOp has no optional input 'bias'"),
        (
            ["explain", "RMSNormFwdOp", "--shape", "8,64", "--omit", "bias"],
            "RMSNormFwdOp: --omit bias: RMSNormFwdOp has no optional input 'bias' (no input 'bias' in RMSNormFwdOp; "
            "its optional inputs: weight)",
        ),
        (
            ["explain", "RMSNormFwdOp", "--shape", "8,64", "--omit", "x"],
            "'x' is a required input of RMSNormFwdOp",
        ),
        (
            ["explain", "RMSNormFwdOp", "--shape", "8,64", "--param", "epsilon=1e-6"],
            "RMSNormFwdOp: --param epsilon=1e-6: RMSNormFwdOp has no param 'epsilon' (its params: normalized_shape, eps)",
        ),
        (
            ["explain", "RMSNormFwdOp", "--shape", "8,64", "--param", "eps=small"],
            "RMSNormFwdOp: --param eps=small: expected a number, such as 1e-6 or 0.5, or None (param eps is "
            "declared float), got 'small'",
        ),
        (
            ["explain", "LayerNormFwdOp", "--shape", "8,64", "--param", "eps=None"],
            "LayerNormFwdOp: --param eps=None: expected a number, such as 1e-6 or 0.5 (param eps is declared float)",
        ),
        (
            ["explain", "RMSNormFwdOp", "--shape", "8,64", "--param", "normalized_shape=8x-64"],
            "RMSNormFwdOp: --param normalized_shape=8x-64: expected sizes separated by 'x' or ',', such as 4096, "
            "8x64 or 8,64 (param normalized_shape is declared shape), got '8x-64'",
        ),
        (
            ["explain", "RMSNormFwdOp", "--shape", "8,64", "--eps", "tiny"],
            "RMSNormFwdOp: --eps tiny: expected a number",
        ),
    ],
)
def test_explain_usage_errors_name_the_op_the_flag_what_was_expected_and_what_came(capsys, argv, message):
    code, out = run_cli(capsys, *argv)
    assert code == 2 and message in out, out


def test_a_param_flag_without_a_value_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as info:
        main(["explain", "RMSNormFwdOp", "--shape", "8,64", "--param", "eps"])
    assert info.value.code == 2
    assert "argument --param: expected NAME=VALUE, got 'eps'" in capsys.readouterr().err


def test_a_family_adapters_shorthand_means_the_param_or_omission_it_stands_for(capsys):
    sugar = run_json(capsys, "explain", "LayerNormFwdOp", "--shape", "4,2,64", "--device", "cpu",
                     "--normalized-shape", "2x64", "--eps", "0.001", "--no-bias")
    generic = run_json(capsys, "explain", "LayerNormFwdOp", "--shape", "4,2,64", "--device", "cpu",
                       "--param", "normalized_shape=2x64", "--param", "eps=0.001", "--omit", "bias")
    assert sugar == generic and sugar[1]["params"] == {"normalized_shape": [2, 64], "eps": 0.001}


def test_a_shorthand_of_another_family_is_refused_for_an_op(capsys, monkeypatch):
    from tileops.cli import call_flags

    adapters = dict(call_flags.family_adapters())
    adapters["pool"] = type(sys)("tileops.ops.pool.command_line")
    adapters["pool"].PARAM_FLAGS = {"--window": "window"}
    monkeypatch.setattr(call_flags, "family_adapters", lambda: adapters)
    code, out = run_cli(capsys, "explain", "RMSNormFwdOp", "--shape", "8,64", "--window", "3")
    assert code == 2
    assert "RMSNormFwdOp: --window is a shorthand of the pool family's ops; RMSNormFwdOp is of family norm" in out


def test_families_are_found_without_a_list_and_every_op_is_importable_from_tileops_ops():
    import tileops.ops
    import tileops.ops.activation
    import tileops.ops.norm

    assert tileops.ops.FAMILIES["norm"] == tileops.ops.norm.OPS
    assert tileops.ops.FAMILIES["activation"] == tileops.ops.activation.OPS
    assert [op.__name__ for op in tileops.ops.norm.OPS] == NORM_OPS
    for op_class in tileops.ops.norm.OPS:
        assert getattr(tileops.ops, op_class.__name__) is op_class and op_class.__name__ in tileops.ops.__all__


def test_the_shared_layers_name_no_family_op_input_or_param():
    """Core, the command line, tileops.testing and the shared CUDA runtime know no family: no
    family's name, op class, or input or param name of three letters or more appears in them
    (a one- or two-letter name such as x is every language's word)."""
    import re

    import tileops.cli
    import tileops.core
    import tileops.kernels.cuda
    import tileops.testing
    from tileops.core.manifest import CONSUME_INPUTS, SKIP_OUTPUTS
    from tileops.ops import FAMILIES

    names = set(FAMILIES)
    for op_classes in FAMILIES.values():
        for op_class in op_classes:
            entry = op_class.manifest_entry()
            names |= {op_class.__name__, *(decl.name for decl in (*entry.inputs, *entry.params))}
    names.discard(CONSUME_INPUTS)  # core's own param, which the loader requires of in-place backwards
    names.discard(SKIP_OUTPUTS)  # core's own param, which the autograd wiring builds backward ops with
    names = sorted(name for name in names if len(name) >= 3)
    words = re.compile(r"(?<![A-Za-z0-9_])(" + "|".join(map(re.escape, names)) + r")(?![A-Za-z0-9])", re.IGNORECASE)
    runtime = Path(tileops.kernels.cuda.__file__).parent
    shared = [
        *Path(tileops.core.__file__).parent.rglob("*.py"),
        *Path(tileops.cli.__file__).parent.glob("*.py"),
        *Path(tileops.testing.__file__).parent.glob("*.py"),
        *runtime.glob("*.py"),
        *runtime.glob("*.cpp"),
    ]
    assert len(shared) > 20
    for path in shared:
        hits = [line.strip() for line in path.read_text().splitlines() if words.search(line)]
        assert hits == [], f"{path}: {hits}"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("8,x", "expected sizes separated by 'x' or ',', such as 8192x7168 or 8,4096 (or () for a 0-dim tensor), got '8,x'"),
        ("8x4096x", "expected sizes separated by 'x' or ',', such as 8192x7168 or 8,4096 (or () for a 0-dim tensor), got '8x4096x'"),
        ("8,-4096", "sizes cannot be negative, got '8,-4096'"),
    ],
)
@pytest.mark.parametrize("command", [["explain", "RMSNormFwdOp"], ["bench"]], ids=["explain", "bench"])
def test_explain_and_bench_read_shapes_alike_and_reject_malformed_ones(capsys, command, text, message):
    with pytest.raises(SystemExit) as info:
        main([*command, "--shape", text])
    assert info.value.code == 2
    assert f"argument --shape: {message}" in capsys.readouterr().err


def test_explain_reads_shapes_with_x_or_commas(capsys):
    _, by_x = run_json(capsys, *EXPLAIN_HOPPER, "--shape", "2x3x4096", "--normalized-shape", "3x4096")
    _, by_comma = run_json(capsys, *EXPLAIN_HOPPER, "--shape", "2,3,4096", "--normalized-shape", "3,4096")
    assert by_x == by_comma and by_x["served"], by_x


# -- check ----------------------------------------------------------------------------------------
def test_check_passes_the_shipped_manifest(capsys):
    code, out = run_cli(capsys, "check")
    assert code == 0
    for op in NORM_OPS:
        assert f"OK    {op} (norm.yaml)" in out
    _, result = run_json(capsys, "check")
    assert result["ok"] is True and {f["error"] for f in result["files"]} == {None}


def _shipped_manifest_text() -> str:
    (shipped,) = [path for path in check.shipped_manifest_files() if path.name == "norm.yaml"]
    return shipped.read_text(encoding="utf-8")


def test_check_of_a_bad_manifest_names_file_op_and_field_and_exits_1(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    x_doc = "        doc: The input; any leading batch dimensions.\n"
    bad.write_text(_shipped_manifest_text().replace(x_doc, x_doc + "        colour: red\n", 1))
    code, out = run_cli(capsys, "check", "--manifest", str(bad))
    assert code == 1
    assert f"FAIL  {bad}, op RMSNormFwdOp, field signature.inputs.x: unknown field(s) 'colour'" in out
    _, result = run_json(capsys, "check", "--manifest", str(bad))
    assert result["ok"] is False and "colour" in result["files"][0]["error"]


def test_check_of_a_given_good_manifest_lists_its_ops(capsys, tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text(_shipped_manifest_text())
    code, out = run_cli(capsys, "check", "--manifest", str(good))
    assert code == 0
    for op in NORM_OPS:
        assert f"OK    {op} (good.yaml)" in out


def test_check_reports_a_constructor_that_disagrees_with_its_entry(capsys, monkeypatch):
    def __init__(self, normalized_shape, eps: float | None = 1e-6, *, target=None):
        RMSNormFwdOp.__init__(self, normalized_shape, eps, target=target)

    monkeypatch.setattr(check, "FAMILIES", {"norm": (_rms_norm_op_with(__init__=__init__),)})
    code, out = run_cli(capsys, "check")
    assert code == 1
    assert "FAIL  RMSNormFwdOp: RMSNormFwdOp.__init__: eps defaults to 1e-06, the manifest says None" in out
    assert "FAIL  LayerNormFwdOp:" in out and "lists no op class of that name" in out


def test_check_reports_an_op_listed_under_another_family(capsys, monkeypatch):
    monkeypatch.setattr(check, "FAMILIES", {"pool": (RMSNormFwdOp,)})
    code, out = run_cli(capsys, "check")
    assert code == 1
    assert (
        "FAIL  RMSNormFwdOp: tileops.ops.FAMILIES lists RMSNormFwdOp under 'pool', its manifest entry says family 'norm'"
    ) in out


# -- demo and the console script -------------------------------------------------------------------
def test_demo_still_runs_every_op_then_a_transformers_model_as_built_and_patched(capsys):
    code, out = run_cli(capsys, "demo", "--device", "cpu")
    assert code == 0, out
    with_interfaces = [op_class for ops in FAMILIES.values() for op_class in ops if op_class.kernel_interfaces]
    assert out.count("served by torch_cpu") == len(with_interfaces)
    assert out.count("served by its own torch code") == len(ALL_OPS) - len(with_interfaces) == 1  # LinearCrossEntropyBwdOp
    model = out[out.index("\nmodel (") :]
    assert "LlamaMLP -> tileops.nn.GatedMLP (2)" in model
    sides = {line.split()[0]: line.split()[1:] for line in model.splitlines() if line.split()[:1] in (["transformers"], ["tileops"])}
    assert set(sides) == {"transformers", "tileops"}
    assert all(float(value) > 0 for times in sides.values() for value in times[:2])
    # float32 on the CPU: the patched model's logits and loss are the unpatched one's.
    assert abs(float(sides["tileops"][2]) - float(sides["transformers"][2])) < 1e-4
    difference = float(re.search(r"largest difference between the sides ([0-9.e+-]+)", model).group(1))
    assert difference < 1e-4


def test_demo_model_part_says_it_is_skipped_without_transformers_and_leaves_with_no_model(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # an import of it raises ImportError
    code, out = run_cli(capsys, "demo", "--device", "cpu", "RMSNormFwdOp")
    assert code == 0 and "model (" not in out  # naming ops runs those ops only
    code, report = run_json(capsys, "demo", "--device", "cpu")
    assert code == 0 and report["model"] == {"skipped": "transformers is not installed (pip install 'tileops[transformers]')"}
    code, report = run_json(capsys, "demo", "--device", "cpu", "--no-model")
    assert code == 0 and "model" not in report and len(report["calls"]) == len(ALL_OPS)


def test_demo_model_part_that_fails_is_reported_and_exits_1(capsys, monkeypatch):
    from tileops.integrations.transformers import side_by_side

    def broken(device, dtype):
        raise AttributeError("module 'transformers' has no attribute 'LlamaConfig'")

    monkeypatch.setattr(side_by_side, "compare", broken)
    code, out = run_cli(capsys, "demo", "--device", "cpu")
    assert code == 1
    assert "  failed: AttributeError: module 'transformers' has no attribute 'LlamaConfig'" in out
    with_interfaces = [op_class for ops in FAMILIES.values() for op_class in ops if op_class.kernel_interfaces]
    assert out.count("served by torch_cpu") == len(with_interfaces)
    assert out.count("served by its own torch code") == len(ALL_OPS) - len(with_interfaces) == 1  # LinearCrossEntropyBwdOp  # the ops ran and were reported first


def test_demo_runs_the_named_ops_with_the_shape_params_and_omissions_given(capsys):
    code, out = run_cli(capsys, "demo", "LayerNormFwdOp", "--device", "cpu", "--shape", "3x2x64",
                        "--param", "normalized_shape=2x64", "--omit", "bias")
    assert code == 0, out
    (line,) = [line for line in out.splitlines() if "served by" in line]
    assert line.split()[:10] == ["LayerNormFwdOp", "shape-3x2x64", "x(3,", "2,", "64)", "float32", "target=builtin",
                                 "served", "by", "torch_cpu"]
    code, out = run_cli(capsys, "demo", "--device", "cpu", "--omit", "bias")
    assert code == 2 and f"{ALL_OPS[0]}: --omit bias: {ALL_OPS[0]} has no optional input 'bias'" in out


def test_demo_prints_each_calls_largest_error_against_the_manifests_reference(capsys):
    code, out = run_cli(capsys, "demo", "--device", "cpu", "RMSNormFwdOp", "FusedAddRMSNormFwdOp")
    assert code == 0, out
    lines = {line.split()[0]: line for line in out.splitlines() if "served by" in line}
    assert "within tolerance (atol 1e-05, rtol 1e-05)" in lines["RMSNormFwdOp"]
    # An op with several outputs says which one is furthest from the reference.
    assert re.search(r"max error [0-9.e+-]+ \((y|residual_sum)\), within tolerance", lines["FusedAddRMSNormFwdOp"])
    _, report = run_json(capsys, "demo", "--device", "cpu", "RMSNormFwdOp")
    (call,) = report["calls"]
    error = call["reference_error"]
    assert error["within_tolerance"] is True and 0 <= error["max_error"] <= 1e-5
    assert (error["atol"], error["rtol"], error["where"]) == (1e-5, 1e-5, "y")


def test_demo_fails_a_call_whose_result_is_outside_the_tolerance_naming_the_op(capsys, scoped_registry):
    def off_by_a_little(x, weight, *, normalized_shape, eps):
        return lambda x, weight, **outs: F.rms_norm(x, normalized_shape, weight, eps) + 1e-3

    register_kernel_builder(op="RMSNormFwdOp", target="skewed", build_kernel=off_by_a_little)
    set_default_target("skewed")
    try:
        code, out = run_cli(capsys, "demo", "--device", "cpu", "RMSNormFwdOp")
    finally:
        set_default_target(None)
    assert code == 1, out
    (line,) = [line for line in out.splitlines() if "served by" in line]
    assert "target=skewed" in line and "max error 0.001, OUTSIDE tolerance" in line
    assert out.rstrip().endswith("1 call(s) outside the manifest's tolerance: RMSNormFwdOp")


def test_the_console_script_explains_a_call():
    script = Path(sys.executable).with_name("tileops")
    result = subprocess.run(
        [str(script), *EXPLAIN_HOPPER, "--shape", "8,4096", "--json"], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["target"]["name"] == "builtin"
    assert report["interfaces"][0]["selected"] == "rms_norm"


def test_overhead_measures_the_op_layer_against_the_kernel_and_leaves_no_registration(capsys):
    code, out = run_cli(capsys, "overhead", "RMSNormFwdOp", "--calls", "200", "--json")
    assert code == 0
    figures = json.loads(out)
    assert set(figures) == {"op", "calls", "torch_calls", "op_us", "kernel_us", "overhead_us", "budget_us", "real_op_us", "torch_us",
                            "over_torch_us", "torch_api"}
    assert figures["op"].startswith("RMSNormFwdOp(normalized_shape=(4096,), eps=None) on decode-1: x (1, 4096) float32")
    assert figures["op_us"] > figures["kernel_us"] > 0
    from tileops.core import registry

    assert "overhead_probe" not in registry.kernel_types("RMSNormFwdOp")


def test_overhead_times_an_op_whose_first_workload_is_large_on_a_small_one(capsys):
    # AttentionFwdOp's first workload is a prefill: timed as it is, the run took hours on a CPU.
    from tileops.cli.overhead import MAX_ELEMENTS
    from tileops.ops import AttentionFwdOp
    from tileops.testing import workload_elements

    entry = AttentionFwdOp.manifest_entry()
    assert workload_elements(entry.workloads[0]) > MAX_ELEMENTS
    code, out = run_cli(capsys, "overhead", "AttentionFwdOp", "--calls", "5", "--json")
    assert code == 0
    figures = json.loads(out)
    (workload,) = [w for w in entry.workloads if f" on {w.name}:" in figures["op"]]
    assert workload_elements(workload) <= MAX_ELEMENTS
    assert figures["op_us"] > figures["kernel_us"] > 0
    assert figures["calls"] == 5 and 1 <= figures["torch_calls"] <= 5  # never more than asked


def test_overhead_of_an_op_without_kernels_says_there_is_nothing_to_separate(capsys):
    code, out = run_cli(capsys, "overhead", "LinearCrossEntropyBwdOp")
    assert code == 2 and "LinearCrossEntropyBwdOp holds no kernels: its forward is its own torch code" in out


def test_check_reports_a_registration_for_an_op_name_no_class_has(capsys, scoped_registry):
    from tileops.backend import Kernel, register_kernel_type
    from tileops.ops.norm import RMSNormFwdInterface

    class Misspelt(Kernel, RMSNormFwdInterface):
        @classmethod
        def entry_for(cls, call):
            return call.n, cls

        def forward(self, x, weight):
            return x

    register_kernel_type("RMSNormFwOp", "misspelt", Misspelt)
    code, out = run_cli(capsys, "check")
    assert code == 1
    assert (
        f"FAIL  {__name__} registered a kernel type 'misspelt' for 'RMSNormFwOp', which no op class is "
        "called; the closest op name is 'RMSNormFwdOp'"
    ) in out
    _, result = run_json(capsys, "check")
    assert result["ok"] is False and len(result["registrations"]) == 1


def test_check_reports_a_workload_its_own_signature_refuses(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    good = "    - {name: decode-1, shapes: {x: [1, 4096], weight: [4096]},"
    assert good in _shipped_manifest_text()
    bad.write_text(_shipped_manifest_text().replace(good, "    - {name: decode-1, shapes: {x: [1, 4096], weight: [4095]},", 1))
    code, out = run_cli(capsys, "check", "--manifest", str(bad))
    assert code == 1
    assert "FAIL  RMSNormFwdOp: workload 'decode-1': RMSNormFwdOp: argument 'weight'" in out, out


def test_bench_summary_gives_geometric_means_and_slower_counts_per_comparison():
    from tileops.cli.bench import Row, geometric_means, summary

    def row(ours, eager, compiled, ours_call=None, eager_call=None):
        return Row(op="RMSNormFwdOp", workload="w", dtype="bfloat16", shape="1x4096", served_by="rms_norm",
                   ours_us=ours, eager_us=eager, compile_us=compiled, bytes=1,
                   ours_call_us=ours_call, eager_call_us=eager_call)

    rows = [row(1.0, 4.0, 2.0, 10.0, 12.0), row(2.0, 2.0, 1.0, 10.0, 8.0), row(4.0, 4.0, None)]
    means = geometric_means(rows)
    assert means["eager"] == {"ratio": pytest.approx(2 ** (2 / 3)), "workloads": 3, "slower": 0}
    assert means["compile"] == {"ratio": pytest.approx(1.0), "workloads": 2, "slower": 1}
    assert means["eager_call"] == {"ratio": pytest.approx((1.2 * 0.8) ** 0.5), "workloads": 2, "slower": 1}
    text = summary(means)
    assert "1.59x torch eager over 3 workloads (TileOPs slower on 0)" in text
    assert "1.00x torch.compile over 2 workloads (TileOPs slower on 1)" in text
    assert "call-time ratios (small shapes, host included): 0.98x torch eager over 2 workloads (TileOPs slower on 1)" in text
    assert "call-time" not in summary(geometric_means(rows[2:]))


def test_bench_shape_derives_every_input_from_the_first_and_the_op_runs_it():
    from tileops.cli.bench import _cases
    from tileops.testing import workload_inputs

    cases = list(_cases(["RMSNormFwdOp", "FusedAddLayerNormFwdOp"], (), ("float32",), [(2, 3, 48)]))
    assert [(op_class.__name__, workload.name, dtype) for op_class, workload, dtype in cases] == [
        ("RMSNormFwdOp", "shape-2x3x48", torch.float32),
        ("FusedAddLayerNormFwdOp", "shape-2x3x48", torch.float32),
    ]
    (_, rms, _), (fused_class, fused, _) = cases
    assert rms.shapes == {"x": (2, 3, 48), "weight": (48,)} and rms.params["normalized_shape"] == [48]
    assert fused.shapes == {"x": (2, 3, 48), "residual": (2, 3, 48), "weight": (48,), "bias": (48,)}
    inputs = workload_inputs(fused_class.manifest_entry(), fused, torch.float32, "cpu")
    y, total = fused_class(**fused.params)(**inputs)
    torch.testing.assert_close(total, inputs["x"] + inputs["residual"])
    expected = F.layer_norm(total, (48,), inputs["weight"], inputs["bias"])
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)


def test_bench_applies_params_and_omissions_to_every_workload_it_times():
    from tileops.cli.bench import _cases
    from tileops.cli.call_flags import CallFlags

    flags = CallFlags.of(main_parser_args("bench", "LayerNormFwdOp", "--param", "eps=0.01", "--omit", "bias"))
    cases = list(_cases(["LayerNormFwdOp"], ["decode-1"], (), (), flags))
    ((_, workload, _),) = cases
    assert workload.shapes == {"x": (1, 4096), "weight": (4096,)} and workload.params["eps"] == 0.01


def test_bench_takes_a_shape_with_a_workload_as_its_template():
    # The first input's shape cannot say how many key/value heads an attention call has, nor
    # its key length: the named workload's stay, with the new batch and head size.
    from tileops.cli.bench import _cases
    from tileops.cli.call_flags import CallFlags

    template = "prefill-b8-s2048-h32x8-d128-causal"
    argv = ("bench", "AttentionFwdOp", "--workload", template, "--shape", "4x2048x32x64")
    ((_, workload, _),) = list(_cases(["AttentionFwdOp"], [template], (), [(4, 2048, 32, 64)], CallFlags.of(main_parser_args(*argv))))
    assert workload.shapes == {"q": (4, 2048, 32, 64), "k": (4, 2048, 8, 64), "v": (4, 2048, 8, 64)}
    assert workload.params["causal"] is True and workload.name == f"{template}-as-4x2048x32x64"
    ((_, longer, _),) = list(_cases(["AttentionFwdOp"], [template], (), [(1, 1024, 32, 64)], CallFlags()))
    assert longer.shapes["k"] == (1, 2048, 8, 64)  # the key length is the workload's
    # Ops without a workload of that name time nothing.
    assert list(_cases(["RMSNormFwdOp"], [template], (), [(4, 64)], CallFlags())) == []


def main_parser_args(*argv: str):
    from tileops.cli.main import build_parser

    return build_parser().parse_args(list(argv))


def test_bench_refuses_unknown_ops_and_bad_flags_before_looking_for_a_gpu(capsys):
    code, out = run_cli(capsys, "bench", "NoSuchOp")
    assert code == 2 and "no op is named 'NoSuchOp'" in out
    code, out = run_cli(capsys, "bench", "RMSNormFwdOp", "--param", "eps=x")
    assert code == 2 and "RMSNormFwdOp: --param eps=x: expected a number" in out
    # A param the workload's shapes contradict: the op's own error, before anything runs.
    code, out = run_cli(capsys, "bench", "RMSNormFwdOp", "--workload", "decode-1", "--param", "normalized_shape=100")
    assert code == 2 and "workload 'decode-1': RMSNormFwdOp: argument 'x' expected shape" in out, out


def test_bench_refuses_shapes_it_cannot_fit_before_looking_for_a_gpu(capsys):
    from tileops.ops import LayerNormFwdOp
    from tileops.testing import workload_for_shape

    with pytest.raises(ValueError, match=r"LayerNormFwdOp: x of shape \(\) does not fit its pattern .* expected at least 1"):
        workload_for_shape(LayerNormFwdOp.manifest_entry(), ())


def test_a_shape_binds_the_named_dimensions_other_inputs_use_and_says_what_it_cannot_give():
    import yaml

    from tileops.core.manifest.loader import parse_manifest
    from tileops.testing import workload_for_shape

    def entry(template_shapes):
        text = yaml.safe_dump({"ScaleRowsOp": {
            "family": "test",
            "summary": "x * scale",
            "signature": {"inputs": {
                "x": {"dtype": ["float32"], "shape": ["M", "N"]},
                "scale": {"dtype": {"same_as": "x"}, "shape": ["N"]},
                "table": {"dtype": ["int64"], "shape": ["K"], "optional": True},
            }, "outputs": {"y": {"dtype": {"same_as": "x"}, "shape": {"same_as": "x"}}}},
            "ref_api": "x * scale",
            "tolerance": {"float32": {"atol": 0, "rtol": 0}},
            "workloads": [{"name": "w", "shapes": template_shapes, "dtypes": ["float32"]}],
            "roofline": {"bytes": "2 * numel(x) * itemsize(x)", "flops": "M * N"},
        }}, sort_keys=False)
        return parse_manifest(text, "t.yaml")["ScaleRowsOp"]

    plain = entry({"x": [2, 3], "scale": [3]})
    assert workload_for_shape(plain, (5, 7)).shapes == {"x": (5, 7), "scale": (7,)}
    with pytest.raises(ValueError, match=r"ScaleRowsOp: x of shape \(5,\) does not fit .* expected 2 dimension\(s\), got 1"):
        workload_for_shape(plain, (5,))
    # A dimension x does not name keeps the template's size: K from the template's table.
    with_table = entry({"x": [2, 3], "scale": [3], "table": [4]})
    assert workload_for_shape(with_table, (5, 7)).shapes == {"x": (5, 7), "scale": (7,), "table": (4,)}


def test_the_command_runs_from_a_source_tree_where_no_distribution_is_installed(capsys, monkeypatch):
    # PYTHONPATH=packages/*/src, as the GPU tier runs it: no installed metadata to read versions from.
    import importlib.metadata

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == "tileops from a source tree (tileops-ops is not installed)"


def test_check_checks_only_the_named_ops_and_the_calls_their_flags_describe(capsys):
    code, out = run_cli(capsys, "check", "RMSNormFwdOp", "--param", "eps=1e-6", "--shape", "8x4096", "--dtype", "float16")
    assert code == 0
    files = len(check.shipped_manifest_files())
    assert out.splitlines() == ["OK    RMSNormFwdOp (norm.yaml)", f"{files} manifest file(s), 1 op(s): all OK"]


def test_check_fails_an_op_that_refuses_the_described_call_with_the_ops_own_message(capsys):
    code, out = run_cli(capsys, "check", "LayerNormFwdOp", "--param", "normalized_shape=4096", "--shape", "8x1024", "--dtype", "bfloat16")
    assert code == 1
    assert (
        "FAIL  LayerNormFwdOp: bfloat16: workload 'shape-8x1024': LayerNormFwdOp: argument 'x' expected shape "
        "[..., *normalized_shape] with normalized_shape=(4096,), got (8, 1024)"
    ) in out


def test_check_with_an_omitted_input_checks_every_workload_without_it(capsys):
    code, result = run_json(capsys, "check", *NORM_OPS, "--omit", "weight")
    assert code == 0 and result["ok"] and len(result["ops"]) == len(NORM_OPS)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["check", "NoSuchOp"], "no op is named 'NoSuchOp'"),
        (["check", "--manifest", "x.yaml", "--param", "eps=1"], "--manifest validates files"),
    ],
)
def test_check_refuses_flags_it_cannot_apply_in_one_line(capsys, argv, message):
    code, out = run_cli(capsys, *argv)
    assert code == 2 and message in out and len(out.strip().splitlines()) == 1
