"""Fault injection: corrupt manifests and corrupt or contended tuning stores.

Each case breaks one file the way a careless author, a bad disk or an attacker would, and
asserts three things: the error type (``ManifestError`` for manifests, a warning and an
ignored entry for the tuning store), that the message names the culprit (the file, the op and
the field), and that everything else still works afterwards (the shipped ops compute, the
other entries of the store are kept).

To add a case: append a row to ``CORRUPT_MANIFESTS`` (a change to the shipped RMSNormFwdOp
entry, the field the error must name and a phrase it must contain), or a row to
``CORRUPT_STORE_ENTRIES``; the tests below run every row through the loader, through
``tileops check --manifest`` and through the store.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from helpers import ROOT, fresh_tuning_store
from tileops.cli import main as tileops
from tileops.core.errors import ManifestError, OpArgumentError
from tileops.core.manifest import Signature
from tileops.core.manifest.loader import parse_manifest
from tileops.ops import LayerNormFwdOp, RMSNormFwdOp

SOURCE = "corrupt.yaml"
SHIPPED = (ROOT / "manifest/norm.yaml").read_text(encoding="utf-8")
ENTRY_START = "RMSNormFwdOp:\n"
# Alone in a file, without the backward op its backward: section names.
RMS_ENTRY = re.sub(r"  backward:\n(    .*\n)+", "", SHIPPED[SHIPPED.index(ENTRY_START):SHIPPED.index("\nLayerNormFwdOp:")])


def _changed(old: str, new: str) -> str:
    """The shipped RMSNormFwdOp entry with ``old`` (which it must hold) replaced by ``new``."""
    assert old in RMS_ENTRY, old
    return RMS_ENTRY.replace(old, new, 1)


def _assert_other_ops_still_work() -> None:
    x = torch.randn(3, 8)
    torch.testing.assert_close(RMSNormFwdOp(8)(x), F.rms_norm(x, (8,), eps=torch.finfo(x.dtype).eps))
    torch.testing.assert_close(LayerNormFwdOp(8)(x), F.layer_norm(x, (8,)))
    assert set(parse_manifest(SHIPPED, "norm.yaml")) >= {"RMSNormFwdOp", "LayerNormFwdOp"}


WORKLOAD = "    - {name: decode-1, shapes: {x: [1, 4096], weight: [4096]}, dtypes: [bfloat16, float16, float32], params: {normalized_shape: [4096]}}"
ESCAPE = "F.__builtins__['__import__']('os').system('touch {marker}')"

#: (id, the corrupt file's text, the field the error names or None, a phrase of the message).
CORRUPT_MANIFESTS = [
    ("dtype-a-nested-list", _changed("dtype: [float16, bfloat16, float32, float64]", "dtype: [[float16]]"),
     "signature.inputs.x.dtype", "expected a dtype name"),
    ("dtype-a-mapping-in-a-list", _changed("dtype: [float16, bfloat16, float32, float64]", "dtype: [{a: 1}]"),
     "signature.inputs.x.dtype", "got {'a': 1}"),
    ("dtype-param-default-a-list",
     _changed("    params:\n", "    params:\n      out_dtype:\n        type: dtype\n        default: [1]\n"),
     "signature.params.out_dtype.default", "expected a dtype name"),
    ("param-type-a-list", _changed("        type: float\n", "        type: [float]\n"),
     "signature.params.eps.type", "expected one of int"),
    ("constraints-not-a-list",
     _changed("    constraints:\n      - expr: len(normalized_shape) >= 1\n        message: normalized_shape must name at least one dimension\n"
              "      - expr: eps is None or eps >= 0\n        message: eps must be non-negative\n", "    constraints: 5\n"),
     "signature.constraints", "expected a list"),
    ("constraint-comparing-a-shape-with-an-int",
     _changed("expr: len(normalized_shape) >= 1", "expr: normalized_shape >= 1"),
     "workloads[0]", "the constraint 'normalized_shape >= 1' cannot be evaluated"),
    ("constraint-with-a-runaway-power", _changed("expr: len(normalized_shape) >= 1", "expr: 9 ** 9 ** 9 > 0"),
     "signature.constraints[0].expr", "the exponent of ** must be"),
    ("tensor-spec-an-int", _changed("      weight:\n        optional: true\n        dtype: {same_as: x}\n"
                                    "        shape: [\"*normalized_shape\"]\n        doc: Elementwise scale; omitted means no scale.\n",
                                    "      weight: 5\n"),
     "signature.inputs.weight", "expected a mapping, got int"),
    ("unknown-keys-of-mixed-types", _changed("  family: norm\n", "  family: norm\n  1: one\n  colour: red\n"),
     None, "unknown field(s) 'colour', 1"),
    ("a-nan-tolerance", _changed("float32: {atol: 1.0e-5, rtol: 1.0e-5}", "float32: {atol: .nan, rtol: 1.0e-5}"),
     "tolerance.float32.atol", "expected a finite non-negative number, got nan"),
    ("an-infinite-tolerance", _changed("float32: {atol: 1.0e-5, rtol: 1.0e-5}", "float32: {atol: .inf, rtol: 1.0e-5}"),
     "tolerance.float32.atol", "expected a finite non-negative number"),
    ("true-as-a-workload-dimension", _changed("shapes: {x: [1, 4096]", "shapes: {x: [true, 4096]"),
     "workloads[0].shapes.x", "expected a list of non-negative ints, got [True, 4096]"),
    ("a-workload-too-large-for-any-tensor", _changed("shapes: {x: [1, 4096]", "shapes: {x: [1099511627776, 1099511627776]"),
     "workloads[0].shapes.x", "more elements than a tensor can hold"),
    ("workload-dtypes-a-string", _changed("dtypes: [bfloat16, float16, float32], params: {normalized_shape: [4096]}}",
                                          "dtypes: bfloat16, params: {normalized_shape: [4096]}}"),
     "workloads[0].dtypes", "expected a list of dtype names"),
    ("a-workload-param-of-the-wrong-type", _changed("params: {normalized_shape: [4096]}}", "params: {normalized_shape: [four]}}"),
     "workloads[0].params.normalized_shape", "expected an int or a sequence of non-negative ints"),
    ("a-nan-default", _changed("        default: null\n        nullable: true\n", "        default: .nan\n        nullable: true\n"),
     "signature.params.eps.default", "expected a finite float"),
    # Expressions are code: the loader refuses what reaches past torch's computations.
    ("ref-api-reaching-builtins", _changed("ref_api: F.rms_norm(", "ref_api: " + ESCAPE.format(marker="pwned") + " or F.rms_norm("),
     "ref_api", "'__builtins__'; names starting with '_' are not allowed"),
    ("ref-api-reaching-os-through-torch", _changed("ref_api: F.rms_norm(", "ref_api: torch.os.getpid() or F.rms_norm("),
     "ref_api", "reaches the module os (torch.os)"),
    ("torch-api-reaching-sys-through-f", _changed("torch_api: F.rms_norm(", "torch_api: F.torch.sys.modules or F.rms_norm("),
     "torch_api", "reaches the module sys (F.torch.sys)"),
    ("ref-api-reaching-a-class", _changed("ref_api: F.rms_norm(", "ref_api: x.__class__ or F.rms_norm("), "ref_api", "'__class__'"),
    ("ref-api-loading-a-file", _changed("ref_api: F.rms_norm(", "ref_api: torch.load('model.pt') or F.rms_norm("),
     "ref_api", "'load', which reads or writes files"),
    ("ref-api-compiling-code", _changed("ref_api: F.rms_norm(", "ref_api: torch.utils.cpp_extension or F.rms_norm("),
     "ref_api", "reaches the module torch.utils"),
    ("ref-api-formatting-internals", _changed("ref_api: F.rms_norm(", "ref_api: (x.dtype and '{0.__class__}').format(x) or F.rms_norm("),
     "ref_api", "'format'"),
    ("ref-api-nested-past-the-parser", _changed("ref_api: F.rms_norm(", "ref_api: " + "-" * 100_000 + "1 or F.rms_norm("),
     "ref_api", "is longer than 2000 characters"),
]

#: Corrupt files the YAML layer refuses before any op is read: (id, text, phrase).
CORRUPT_YAML = [
    ("an-alias-bomb", "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n"
        for i in range(9)), "manifests do not use anchors and aliases"),
    ("an-anchor", RMS_ENTRY.replace("  family: norm", "  family: &f norm", 1), "manifests do not use anchors and aliases"),
    ("a-merge-key", RMS_ENTRY.replace("  family: norm\n", "  <<: {family: norm}\n", 1), "uses a merge key ('<<')"),
    ("a-complex-mapping-key", RMS_ENTRY + "\n? [a, b]\n: 1\n", "has a sequence as a mapping key"),
    ("a-complex-key-in-an-entry", RMS_ENTRY.replace("  family: norm\n", "  ? {a: 1}\n  : norm\n", 1), "has a mapping as a mapping key"),
    ("nesting-5000-deep", "RMSNormFwdOp: " + "[" * 5000 + "]" * 5000 + "\n", "more than 32 levels deep"),
    ("a-key-given-twice", RMS_ENTRY.replace("  family: norm\n", "  family: norm\n  family: norm\n", 1), "is given twice"),
]

#: Top-level keys that are not op names: (id, text, phrase).
NOT_OP_NAMES = [
    ("an-int-op-name", "1:\n  family: norm\n", "op name 1 is not a class name"),
    ("a-null-op-name", "null:\n  family: norm\n", "op name None is not a class name"),
    ("a-list-at-the-top", "- RMSNormFwdOp\n", "the top level must map op class names to entries"),
]


@pytest.mark.parametrize(("text", "field", "phrase"), [case[1:] for case in CORRUPT_MANIFESTS], ids=[c[0] for c in CORRUPT_MANIFESTS])
def test_a_corrupt_entry_is_a_manifest_error_naming_file_op_and_field(text, field, phrase):
    with pytest.raises(ManifestError) as info:
        parse_manifest(text, SOURCE)
    message = str(info.value)
    assert message.startswith(f"{SOURCE}, op RMSNormFwdOp"), message
    if field:
        assert f"field {field}" in message, message
    assert phrase in message, message
    assert len(message) < 1500, "a message quotes values cut short"
    _assert_other_ops_still_work()


@pytest.mark.parametrize(("text", "phrase"), [case[1:] for case in CORRUPT_YAML + NOT_OP_NAMES],
                         ids=[c[0] for c in CORRUPT_YAML + NOT_OP_NAMES])
def test_a_corrupt_yaml_file_is_a_manifest_error_naming_the_file(text, phrase):
    with pytest.raises(ManifestError) as info:
        parse_manifest(text, SOURCE)
    message = str(info.value)
    assert message.startswith(SOURCE) and phrase in message, message
    assert len(message) < 1500
    _assert_other_ops_still_work()


def test_a_huge_value_is_quoted_cut_short():
    text = _changed("  family: norm\n", "  family: [" + ", ".join(["123456789"] * 100_000) + "]\n")
    with pytest.raises(ManifestError) as info:
        parse_manifest(text, SOURCE)
    message = str(info.value)
    assert "field family: expected a string, got [123456789, " in message and "characters)" in message
    assert len(message) < 300


@pytest.mark.parametrize(
    "text",
    [case[1] for case in CORRUPT_MANIFESTS + CORRUPT_YAML + NOT_OP_NAMES] + [RMS_ENTRY.replace("\n", "\n\udcff", 1)],
    ids=[case[0] for case in CORRUPT_MANIFESTS + CORRUPT_YAML + NOT_OP_NAMES] + ["not-utf-8"],
)
def test_check_of_a_corrupt_manifest_fails_it_naming_the_file_without_a_traceback(capsys, tmp_path, text):
    path = tmp_path / SOURCE
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    code = tileops(["check", "--manifest", str(path)])
    out, err = capsys.readouterr()
    assert code == 1
    assert f"FAIL  {path}" in out, out
    assert "Traceback" not in out + err
    _assert_other_ops_still_work()


def test_check_of_a_manifest_whose_reference_runs_a_shell_command_refuses_it_and_runs_nothing(capsys, tmp_path, monkeypatch):
    marker = tmp_path / "marker"
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "evil.yaml"
    path.write_text(_changed("ref_api: F.rms_norm(", "ref_api: " + ESCAPE.format(marker=marker) + " or F.rms_norm("))
    code = tileops(["check", "--manifest", str(path)])
    out, _ = capsys.readouterr()
    assert code == 1
    assert f"FAIL  {path}, op RMSNormFwdOp, field ref_api:" in out and "'__builtins__'" in out
    assert not marker.exists()


def test_a_constraint_that_cannot_be_evaluated_at_construction_is_a_manifest_error_naming_it():
    # Every workload passes the constraint; a construction with other values makes it raise.
    text = _changed("expr: len(normalized_shape) >= 1", "expr: normalized_shape[0] >= 1")
    entry = parse_manifest(text, SOURCE)["RMSNormFwdOp"]
    with pytest.raises(ManifestError) as info:
        Signature(entry).bind_params({"normalized_shape": ()})
    message = str(info.value)
    assert message.startswith(f"{SOURCE}, op RMSNormFwdOp, field signature.constraints[0]")
    assert "'normalized_shape[0] >= 1' cannot be evaluated" in message and "IndexError" in message
    _assert_other_ops_still_work()


def test_a_saved_statistic_the_backward_can_neither_omit_nor_derive_is_a_manifest_error_naming_it():
    # RMSNormBwdOp's rstd, required and without its derive expression: a target's forward, which
    # saves nothing, would leave the backward without it.
    declaration = re.search(r"^RMSNormBwdOp:\n(?:  .*\n|\n)*?      rstd:\n(?:        .*\n)+", SHIPPED, re.M).group(0)
    broken = re.sub(r"        (optional: true|derive: .*)\n", "", declaration.split("      rstd:\n")[1])
    text = SHIPPED.replace(declaration, declaration.split("      rstd:\n")[0] + "      rstd:\n" + broken)
    assert text != SHIPPED
    with pytest.raises(ManifestError) as info:
        parse_manifest(text, SOURCE)
    message = str(info.value)
    assert message.startswith(f"{SOURCE}, op RMSNormFwdOp, field backward.saves")
    assert "RMSNormBwdOp's input 'rstd' must be optional (the backward op computes it) or declare a derive" in message
    _assert_other_ops_still_work()


ACTIVATIONS = (ROOT / "manifest/activation.yaml").read_text(encoding="utf-8")


@pytest.mark.parametrize(
    ("old", "new", "field", "phrase"),
    [
        # The forward without the param that chooses the in-place backward.
        ("      consume_inputs:\n        type: bool\n        default: false\n", "      consume_inputs:\n        type: int\n        default: 0\n",
         "backward.in_place", "needs the forward to declare the param consume_inputs: {type: bool, default: false}"),
        ("    in_place: SwiGLUInplaceBwdOp\n", "    in_place: SwiGLUMissingBwdOp\n", "backward.in_place", "names an op that has no entry"),
        # An in-place output that is a new tensor, not the input it should be written over.
        ("      dgate:\n        aliases: gate\n        doc: \"Gradient of gate: gate itself.\"\n",
         "      dgate:\n        dtype: {same_as: dy}\n        shape: {same_as: dy}\n        doc: \"Gradient of gate.\"\n",
         "backward.in_place", "SwiGLUInplaceBwdOp's output 'dgate' must alias (aliases:) one of the forward inputs"),
        # The param without an in-place backward to run with it.
        ("    in_place: SwiGLUInplaceBwdOp\n", "", "backward", "declares the param 'consume_inputs' but no in_place backward op"),
    ],
    ids=["param-not-bool", "op-missing", "output-not-an-alias", "param-without-op"],
)
def test_an_in_place_backward_that_does_not_fit_its_forward_is_a_manifest_error_naming_it(old, new, field, phrase):
    assert old in ACTIVATIONS
    text = ACTIVATIONS.replace(old, new, 1)
    with pytest.raises(ManifestError) as info:
        parse_manifest(text, SOURCE)
    message = str(info.value)
    assert message.startswith(f"{SOURCE}, op SwiGLUFwdOp, field {field}"), message
    assert phrase in message, message
    _assert_other_ops_still_work()


LOSSES = (ROOT / "manifest/loss.yaml").read_text(encoding="utf-8")


@pytest.mark.parametrize(
    ("new", "phrase"),
    [
        ("    incoming: {loss: one, lse: zero}\n", "expected one of one, none, got 'zero'"),
        ("    incoming: {loss: one, logits: none}\n", "unknown field(s) 'logits'"),
        ("    incoming: {loss: none, lse: none}\n", "leaves every output unused"),
    ],
    ids=["unknown-kind", "not-an-output", "nothing-differentiated"],
)
def test_what_a_training_step_hands_the_outputs_is_checked_by_name(new, phrase):
    old = "    incoming: {loss: one, lse: none}\n"
    assert old in LOSSES
    with pytest.raises(ManifestError) as info:
        parse_manifest(LOSSES.replace(old, new, 1), SOURCE)
    message = str(info.value)
    assert message.startswith(f"{SOURCE}, op CrossEntropyFwdOp, field backward.incoming"), message
    assert phrase in message, message
    _assert_other_ops_still_work()


def test_a_workload_of_the_wrong_shapes_is_left_to_check_and_reported_there(capsys, tmp_path):
    # The loader evaluates constraints only where the workload's shapes fit the signature.
    path = tmp_path / SOURCE
    path.write_text(RMS_ENTRY.replace(WORKLOAD, WORKLOAD.replace("weight: [4096]", "weight: [4095]"), 1))
    assert tileops(["check", "--manifest", str(path)]) == 1
    out, _ = capsys.readouterr()
    assert "FAIL  RMSNormFwdOp: workload 'decode-1': RMSNormFwdOp: argument 'weight'" in out


# -- params as callers pass them ----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["float16", "float32", "float64", "longdouble"])
def test_a_numpy_float_of_any_width_is_accepted_as_a_float_param(kind):
    np = pytest.importorskip("numpy")
    op = LayerNormFwdOp(np.int64(8), eps=getattr(np, kind)(1e-5))
    assert type(op.params["eps"]) is float and op.params["eps"] == pytest.approx(1e-5, rel=2e-3)
    assert op.params["normalized_shape"] == (8,) and type(op.params["normalized_shape"][0]) is int
    x = torch.randn(2, 8)
    torch.testing.assert_close(op(x), F.layer_norm(x, (8,), eps=op.params["eps"]))


@pytest.mark.parametrize(
    ("params", "phrase"),
    [
        ({"normalized_shape": 8, "eps": True}, "param 'eps' expected a float, got True (bool)"),
        ({"normalized_shape": 8, "eps": 10**400}, "param 'eps' expected a float (a real number that fits one)"),
        ({"normalized_shape": 8, "eps": float("nan")}, "eps must be non-negative"),
        ({"normalized_shape": True}, "param 'normalized_shape' expected an int or a sequence"),
        ({"normalized_shape": [2**62]}, "param 'normalized_shape' expected an int or a sequence"),
        ({"normalized_shape": ["eight"] * 100_000}, "... ("),
    ],
    ids=["bool-eps", "overflowing-eps", "nan-eps", "bool-shape", "shape-beyond-int64-bytes", "huge-shape-quoted-short"],
)
def test_a_param_of_the_wrong_kind_is_an_op_argument_error_naming_it(params, phrase):
    with pytest.raises(OpArgumentError) as info:
        LayerNormFwdOp(**params)
    assert str(info.value).startswith("LayerNormFwdOp: ") and phrase in str(info.value)
    assert len(str(info.value)) < 600
    _assert_other_ops_still_work()


# -- the tuning store -----------------------------------------------------------------------------

MODEL = "NVIDIA H200"
KEY = "norm/rms_norm/register/1000/bfloat16/1e-06/True/False"
OTHER = "norm/layer_norm/shared/1000/bfloat16/1e-05/True/True"
CONFIG = {"vec": 8, "tpr": 32, "scale": 1.5, "preload": True, "mode": "register"}

#: (id, the stored entry as JSON, a phrase of the warning).
CORRUPT_STORE_ENTRIES = [
    ("a-string", '"garbage"', "a str, not an object"),
    ("a-mistyped-value", '{"vec": "eight", "tpr": 32, "scale": 1.5, "preload": true, "mode": "register"}', "'vec' is a str"),
    ("a-bool-for-an-int", '{"vec": true, "tpr": 32, "scale": 1.5, "preload": true, "mode": "register"}', "'vec' is a bool"),
    ("other-keys", '{"vec": "eight"}', "are not the kernel's"),
    ("a-nested-value", '{"vec": {"vec": 8}, "tpr": 32, "scale": 1.5, "preload": true, "mode": "register"}', "'vec' holds a dict"),
    ("a-nan", '{"vec": 8, "tpr": 32, "scale": NaN, "preload": true, "mode": "register"}', "'scale' holds nan"),
    ("null", "null", "a NoneType, not an object"),
]


@pytest.fixture
def store(tmp_path, monkeypatch):
    """The tuning module, with an empty cache folder and nothing read yet."""
    tuning = fresh_tuning_store(monkeypatch, tmp_path)
    (tmp_path / "tuning").mkdir()
    return tuning


@pytest.mark.parametrize(("entry", "phrase"), [c[1:] for c in CORRUPT_STORE_ENTRIES], ids=[c[0] for c in CORRUPT_STORE_ENTRIES])
def test_a_stored_entry_of_the_wrong_shape_is_ignored_with_a_warning_and_the_others_are_kept(store, entry, phrase):
    path = store.store_path(MODEL)
    path.write_text(f'{{"{KEY}": {entry}, "{OTHER}": {json.dumps(CONFIG)}}}')
    with pytest.warns(RuntimeWarning) as caught:
        assert store.chosen(MODEL, KEY, CONFIG) is None
    assert any(KEY in str(w.message) and phrase in str(w.message) and str(path) in str(w.message) for w in caught), \
        [str(w.message) for w in caught]
    assert store.chosen(MODEL, OTHER, CONFIG) == CONFIG
    store.remember(MODEL, KEY, CONFIG)  # tuning replaces the bad entry
    assert json.loads(path.read_text()) == {KEY: CONFIG, OTHER: CONFIG}


def test_a_stored_int_for_a_float_field_is_read_as_a_float(store):
    store.store_path(MODEL).write_text(json.dumps({KEY: {**CONFIG, "scale": 2}}))
    chosen = store.chosen(MODEL, KEY, CONFIG)
    assert chosen == {**CONFIG, "scale": 2.0} and type(chosen["scale"]) is float


def test_a_store_nested_deeper_than_the_parser_goes_is_unreadable_with_a_warning(store):
    path = store.store_path(MODEL)
    path.write_text('{"k": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.warns(RuntimeWarning, match="were not read .nested too deeply"):
        assert store.chosen(MODEL, KEY, CONFIG) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        store.remember(MODEL, KEY, CONFIG)
    assert json.loads(path.read_text()) == {KEY: CONFIG}


def _remember_many(cache_dir: str, writer: int, entries: int) -> None:
    import os

    os.environ["TILEOPS_CACHE_DIR"] = cache_dir
    from tileops.kernels.cuda import tuning

    tuning._chosen.clear()
    tuning._loaded.clear()
    for index in range(entries):
        tuning.remember(MODEL, f"family{writer % 2}/kind/{writer}/{index}", {"vec": index})


def test_eight_processes_writing_the_store_at_once_keep_every_entry(store, tmp_path):
    context = multiprocessing.get_context("fork")  # the children share this interpreter's imports
    writers = [context.Process(target=_remember_many, args=(str(tmp_path), writer, 40)) for writer in range(8)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=300)
    assert [writer.exitcode for writer in writers] == [0] * 8
    stored = json.loads(store.store_path(MODEL).read_text())
    assert len(stored) == 320
    assert stored == {f"family{w % 2}/kind/{w}/{i}": {"vec": i} for w in range(8) for i in range(40)}
    assert store.chosen(MODEL, "family1/kind/7/39", {"vec": 1}) == {"vec": 39}


# -- the warning of a backend whose import fails --------------------------------------------------

USER_SCRIPT = """
import warnings
import tileops.ops
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    tileops.ops.RMSNormFwdOp(8)  # line 6: the line the warning must name
(warning,) = [w for w in caught if issubclass(w.category, RuntimeWarning)]
print(warning.filename, warning.lineno, sep="\\n")
"""


def test_the_warning_of_a_failing_backend_import_names_the_line_that_built_the_op(tmp_path):
    site = tmp_path / "site"
    info = site / "broken_backend-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken_backend\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[tileops.backends]\nbroken_backend = broken_backend\n")
    (site / "broken_backend.py").write_text("raise ImportError('no driver')\n")
    script = tmp_path / "user.py"
    script.write_text(USER_SCRIPT)
    result = subprocess.run(
        [sys.executable, "-P", str(script)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(script), "6"]
    _assert_other_ops_still_work()
