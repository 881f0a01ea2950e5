"""The manifest loader's strict validation and the signature checks generated from entries."""

from __future__ import annotations

import copy

import pytest
import torch
import yaml

from helpers import ROOT, generated_bind
from tileops.backend import OpArgumentError
from tileops.core.call_path import call_path_factory
from tileops.core.errors import ManifestError
from tileops.core.manifest import Signature
from tileops.core.manifest.loader import parse_manifest
from tileops.core.op import constructor_mismatch
from tileops.ops import FAMILIES, FusedAddLayerNormFwdOp, FusedAddRMSNormFwdOp, LayerNormFwdOp, RMSNormFwdOp

NORM = yaml.safe_load((ROOT / "manifest/norm.yaml").read_text())


def _entry(**changes):
    """The RMSNormFwdOp entry as YAML text, with dotted-path changes applied."""
    entry = copy.deepcopy(NORM["RMSNormFwdOp"])
    del entry["backward"]  # alone in a file, without the backward op it names
    for path, value in changes.items():
        node = entry
        *parents, last = path.split("__")
        for part in parents:
            node = node[part]
        if value is _DELETE:
            del node[last]
        else:
            node[last] = value
    return yaml.safe_dump({"RMSNormFwdOp": entry}, sort_keys=False)


_DELETE = object()


def test_every_shipped_manifest_entry_loads_and_matches_its_op_class():
    for ops in FAMILIES.values():
        for op_class in ops:
            assert op_class.manifest_entry().name == op_class.__name__
            assert constructor_mismatch(op_class) == [], op_class


@pytest.mark.parametrize(
    ("changes", "field", "message"),
    [
        ({"colour": "red"}, None, "unknown field(s) 'colour'"),
        ({"signature__inputs__x__dtpye": ["float32"]}, "signature.inputs.x", "unknown field(s) 'dtpye'"),
        ({"signature__inputs__x__dtype": ["float8"]}, "signature.inputs.x.dtype", "unknown dtype 'float8'"),
        ({"signature__inputs__weight__dtype": {"same_as": "z"}}, "signature.inputs.weight.dtype", "names no tensor declared before it"),
        ({"signature__constraints": [{"expr": "eps > limit", "message": "m"}]}, "signature.constraints[0].expr", "undefined name 'limit'"),
        ({"roofline__bytes": "numel(x) * bogus"}, "roofline.bytes", "undefined name 'bogus'"),
        ({"roofline__flops": "__import__('os')"}, "roofline.flops", "calls something other than abs, is_floating_point, itemsize"),
        ({"signature__outputs__y__aliases": "x"}, "signature.outputs.y.aliases", "is not written"),
        ({"signature__outputs__y__absent_without": "z"}, "signature.outputs.y.absent_without", "names no input (inputs: x, weight)"),
        ({"signature__outputs__y__absent_without": "x"}, "signature.outputs.y.absent_without", "input 'x' is not optional"),
        ({"signature__outputs__y__absent_without": "weight"}, "signature.outputs.y",
         "declares both absent_without and out; a caller's buffer cannot be left unfilled"),
        ({"signature__inputs__x__contiguous": True}, "signature.inputs.x.contiguous", "only written inputs"),
        ({"signature__inputs__x__access": "shape", "signature__inputs__x__contiguous": True}, "signature.inputs.x.contiguous",
         "the layout of one whose shape alone is read (access: shape) does not matter"),
        ({"signature__inputs__x__access": "shape", "signature__inputs__x__row_views": _DELETE, "signature__outputs__y__aliases": "x"},
         "signature.outputs.y.aliases", "input 'x' is not written (access: shape)"),
        ({"signature__inputs__x__access": "readwrite"}, "signature.inputs.x.row_views",
         "is for inputs that are read (access: read), not access: readwrite: a written input is passed as it comes"),
        ({"signature__inputs__x__access": "shape"}, "signature.inputs.x.row_views", "not access: shape"),
        ({"signature__inputs__weight__row_views": True}, "signature.inputs.weight.row_views",
         "needs a shape that begins with the leading dimensions ('...' or a group such as '*batch', not a param's), "
         "got [*normalized_shape]"),
        ({"signature__inputs__x__shape": ["M", "N"]}, "signature.inputs.x.row_views", "needs a shape that begins with the leading"),
        ({"signature__inputs__x__shape": ["M", "*normalized_shape"]}, "signature.inputs.x.row_views",
         "got [M, *normalized_shape]"),
        ({"signature__inputs__x__row_views": "yes"}, "signature.inputs.x.row_views", "expected true or false"),
        ({"signature__inputs__x__access": "sizes"}, "signature.inputs.x.access", "expected one of read, readwrite, write, shape, got 'sizes'"),
        ({"signature__params__eps__nullable": False}, "signature.params.eps.default", "not nullable"),
        ({"signature__inputs__x__shape": ["...", "*normalized_shape", "..."]}, "signature.inputs.x.shape", "variadic"),
        ({"workloads": [{"name": "w", "shapes": {"x": [2, 4]}, "dtypes": ["int32"], "params": {"normalized_shape": [4]}}]}, "workloads[0].dtypes", "accepted by the inputs"),
        ({"workloads": [{"name": "w", "shapes": {"x": [2, 4]}, "dtypes": ["float32"]}]}, "workloads[0].params", "missing required param(s) normalized_shape"),
        ({"signature__inputs__weight__device": "cuda"}, "signature.inputs.weight.device", "only device"),
        ({"summary": _DELETE}, None, "missing required field(s) 'summary'"),
        ({"signature__outputs__y__shape": {"same_as": "weight"}}, "signature.outputs.y.shape", "names an optional input"),
        ({"signature__inputs__x y": {"dtype": ["float32"], "shape": [1]}}, "signature.inputs", "'x y' is not a valid argument name"),
        ({"signature__params__eps__default": "tiny"}, "signature.params.eps.default", "expected a float (the param's type is float), got 'tiny'"),
        ({"signature__params__normalized_shape__default": [4, -1]}, "signature.params.normalized_shape.default", "expected an int or a sequence of non-negative ints"),
        ({"signature__params__skip_outputs": {"type": "outputs", "default": []}}, "signature.params.skip_outputs",
         "the op has no output declared absent_without, which alone may be skipped"),
        ({"signature__params__skip_outputs": {"type": "str", "default": "y"}}, "signature.params.skip_outputs",
         "a param of type outputs is named skip_outputs, and that param has that type"),
        ({"signature__params__unwanted": {"type": "outputs", "default": []}}, "signature.params.unwanted",
         "a param of type outputs is named skip_outputs"),
    ],
)
def test_a_bad_entry_is_refused_naming_file_op_and_field(changes, field, message):
    with pytest.raises(ManifestError) as info:
        parse_manifest(_entry(**changes), "norm.yaml")
    text = str(info.value)
    assert text.startswith("norm.yaml, op RMSNormFwdOp")
    if field:
        assert f"field {field}:" in text
    assert message in text


def test_a_backward_op_may_take_skip_outputs_beside_its_forwards_params_and_skips_nothing_by_default():
    norm = copy.deepcopy(NORM)
    params = norm["RMSNormBwdOp"]["signature"]["params"]
    assert params["skip_outputs"] == {"type": "outputs", "default": [], "keyword_only": True, "doc": params["skip_outputs"]["doc"]}
    params["skip_outputs"]["default"] = ["dweight"]
    with pytest.raises(ManifestError, match=r"op RMSNormBwdOp, field signature.params.skip_outputs.default: must be \[\]"):
        parse_manifest(yaml.safe_dump(norm, sort_keys=False), "norm.yaml")
    params["skip_outputs"]["default"] = []
    params["scale"] = {"type": "float", "default": 1.0}
    with pytest.raises(ManifestError, match=r"RMSNormBwdOp takes params \(normalized_shape, eps, scale\); a backward op takes "
                                            r"its forward's \(normalized_shape, eps\), the same op instance's, and may add skip_outputs"):
        parse_manifest(yaml.safe_dump(norm, sort_keys=False), "norm.yaml")


def test_a_differentiable_ops_output_cannot_be_absent():
    norm = copy.deepcopy(NORM)
    y = norm["RMSNormFwdOp"]["signature"]["outputs"]["y"]
    del y["out"]
    y["absent_without"] = "weight"
    with pytest.raises(ManifestError, match="backward: a differentiable op's outputs are always computed; y declare"):
        parse_manifest(yaml.safe_dump(norm, sort_keys=False), "norm.yaml")


def test_a_key_given_twice_is_refused():
    text = "A:\n  family: x\n  family: y\n"
    with pytest.raises(ManifestError, match="given twice"):
        parse_manifest(text, "dup.yaml")


def test_yaml_tags_that_build_python_objects_are_refused():
    with pytest.raises(ManifestError, match="not valid YAML"):
        parse_manifest("A: !!python/object/apply:os.system ['true']\n", "evil.yaml")


def test_written_tensors_aliases_and_out_buffers_are_understood():
    text = yaml.safe_dump(
        {
            "AddInPlaceOp": {
                "family": "test",
                "summary": "acc += x",
                "signature": {
                    "inputs": {
                        "acc": {"dtype": ["float32"], "shape": ["M", "N"], "access": "readwrite", "contiguous": True},
                        "x": {"dtype": {"same_as": "acc"}, "shape": {"same_as": "acc"}},
                        "table": {"dtype": ["int64"], "shape": ["N"], "device": "cpu", "optional": True},
                    },
                    "outputs": {"acc_out": {"aliases": "acc"}, "norm": {"dtype": ["float32"], "shape": ["M"], "out": "norm_out"}},
                },
                "ref_api": "(acc.add_(x), acc.norm(dim=-1))",
                "tolerance": {"float32": {"atol": 0, "rtol": 0}},
                "workloads": [{"name": "w", "shapes": {"acc": [2, 3], "x": [2, 3]}, "dtypes": ["float32"]}],
                "roofline": {"bytes": "3 * numel(acc) * itemsize(acc)", "flops": "M * N"},
            }
        },
        sort_keys=False,
    )
    entry = parse_manifest(text, "t.yaml")["AddInPlaceOp"]
    signature = Signature(entry)
    assert signature.writes == ("acc", "norm")
    acc, x = torch.zeros(2, 3), torch.ones(2, 3)
    call = signature.bind({}, (acc, x), {})
    assert call.output_shapes == ((2, 3), (2,))
    assert call_path_factory(signature, {}) is not None  # an optional input with its own dtype is checked too
    assert not signature.writes_nothing(call)
    with pytest.raises(OpArgumentError, match="'acc' is written in place and must be contiguous"):
        signature.bind({}, (torch.zeros(3, 2).t(), x), {})
    with pytest.raises(OpArgumentError, match="'table' is declared device: cpu"):
        signature.bind({}, (acc, x, torch.zeros(3, dtype=torch.int64, device="meta")), {})
    empty = torch.zeros(0, 3)
    call = signature.bind({}, (empty, empty), {"norm_out": torch.zeros(0)})
    assert signature.writes_nothing(call)
    acc_out, norm = signature.empty_result(call)
    assert acc_out is empty and norm is call.outs["norm_out"]


@pytest.mark.parametrize(
    ("doc", "shown"),
    [("The input to normalise.", ": the input to normalise"), ("RoPE's queries.", ": RoPE's queries"), ("V rows.", ": V rows"), ("", "")],
)
def test_a_missing_input_is_described_by_its_doc_with_names_kept_as_written(doc, shown):
    entry = parse_manifest(_entry(signature__inputs__x__doc=doc), "t.yaml")["RMSNormFwdOp"]
    with pytest.raises(OpArgumentError) as raised:
        Signature(entry).bind({"normalized_shape": (8,), "eps": 1e-6}, (), {})
    assert str(raised.value) == f"RMSNormFwdOp: missing required input 'x'{shown}"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda op, x, w: op(), "missing required input 'x'"),
        (lambda op, x, w: op(x.numpy()), "argument 'x' expected a torch.Tensor, got ndarray"),
        (lambda op, x, w: op(x.int()), "argument 'x' expected dtype float16 or bfloat16 or float32 or float64, got torch.int32"),
        (lambda op, x, w: op(x, w.half()), "argument 'weight' must have the dtype of 'x' (torch.float32), got torch.float16"),
        (lambda op, x, w: op(x[:, :7], w), "argument 'x' expected shape [..., *normalized_shape] with normalized_shape=(8,), got (3, 7)"),
        (lambda op, x, w: op(x, w[None]), "argument 'weight' expected shape [*normalized_shape]"),
        (lambda op, x, w: op(x, w.to("meta")), "argument 'weight' is on meta, but the call's device (from 'x') is cpu"),
        (lambda op, x, w: op(x, w, w), "takes at most 2 positional tensor(s) (x, weight), got 3"),
        (lambda op, x, w: op(x, w, weight=w), "got input 'weight' both by position and by keyword"),
        (lambda op, x, w: op(x, bias=w), "unexpected argument 'bias'"),
        (lambda op, x, w: op(x, out=torch.empty(3, 9)), "output buffer 'out' expected shape (3, 8) and dtype torch.float32, got (3, 9)"),
        (lambda op, x, w: op(x, out=torch.empty(8, 3).t()), "output buffer 'out' must be contiguous"),
    ],
)
def test_bad_calls_name_the_op_the_argument_what_was_declared_and_what_came(call, message):
    op = RMSNormFwdOp(8)
    x, w = torch.randn(3, 8), torch.randn(8)
    with pytest.raises(OpArgumentError) as info:
        call(op, x, w)
    assert str(info.value).startswith("RMSNormFwdOp: ")
    assert message in str(info.value)
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: RMSNormFwdOp("8"), "param 'normalized_shape' expected an int or a sequence of non-negative ints, got '8'"),
        (lambda: RMSNormFwdOp([]), "normalized_shape must name at least one dimension"),
        (lambda: LayerNormFwdOp(8, eps=-1.0), "eps must be non-negative"),
        (lambda: LayerNormFwdOp(8, eps="small"), "param 'eps' expected a float, got 'small'"),
        # Arguments the constructor does not take: named with what it takes, not as __init__'s.
        (lambda: LayerNormFwdOp(8, epsilon=1e-6),
         "LayerNormFwdOp: got an unexpected keyword argument 'epsilon'; it takes (normalized_shape, eps=1e-05, *, target=None)"),
        (lambda: RMSNormFwdOp(), "RMSNormFwdOp: missing a required argument: 'normalized_shape'; it takes (normalized_shape"),
        (lambda: RMSNormFwdOp(8, None, "cuda"), "RMSNormFwdOp: too many positional arguments; it takes"),
    ],
)
def test_bad_construction_arguments_are_refused(build, message):
    with pytest.raises(OpArgumentError) as info:
        build()
    assert message in str(info.value)


def test_multi_dimensional_normalized_shape_and_any_batch_rank():
    op = LayerNormFwdOp((4, 8))
    x, w, b = torch.randn(2, 3, 4, 8), torch.randn(4, 8), torch.randn(4, 8)
    torch.testing.assert_close(op(x, w, b), torch.nn.functional.layer_norm(x, (4, 8), w, b))
    torch.testing.assert_close(op(x[0, 0]), torch.nn.functional.layer_norm(x[0, 0], (4, 8)))


def test_the_fused_op_fills_both_output_buffers():
    op = FusedAddRMSNormFwdOp(8)
    x, r = torch.randn(3, 8), torch.randn(3, 8)
    out, residual_out = torch.empty(3, 8), torch.empty(3, 8)
    y, total = op(x, r, out=out, residual_out=residual_out)
    assert y is out and total is residual_out
    torch.testing.assert_close(total, x + r)


def test_the_generated_fast_path_agrees_with_the_reference_bind():
    op = FusedAddLayerNormFwdOp((4, 8))
    x, r = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8)
    w = torch.nn.Parameter(torch.randn(4, 8), requires_grad=False)
    out = torch.empty(2, 3, 4, 8)
    for args, kwargs in [((x, r), {}), ((x, r, w), {}), ((x, r, None, w), {"out": out}), ((x,), {"residual": r})]:
        got = generated_bind(op.signature(), op.params, args, kwargs)
        want = op.signature().bind(op.params, args, kwargs)
        assert got is not None
        assert [id(t) for t in got.inputs] == [id(t) for t in want.inputs]
        assert got.output_shapes == want.output_shapes and got.output_dtypes == want.output_dtypes
        assert got.outs == want.outs and got.device == want.device


@pytest.mark.parametrize(
    "call",
    [
        lambda x, r, w: ((x.transpose(0, 1), r), {}),  # not contiguous: the reference copies it
        lambda x, r, w: ((x, r[:1]), {}),
        lambda x, r, w: ((x, r, w[:2]), {}),
        lambda x, r, w: ((x, r.double()), {}),
        lambda x, r, w: ((x, r), {"out": torch.empty(1)}),
        lambda x, r, w: ((x,), {}),
    ],
)
def test_the_fast_path_declines_what_it_does_not_check_exactly(call):
    op = FusedAddLayerNormFwdOp((4, 8))
    x, r, w = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8), torch.randn(4, 8)
    args, kwargs = call(x, r, w)
    assert generated_bind(op.signature(), op.params, args, kwargs) is None


def test_the_fast_path_serves_an_output_aliasing_an_input_whose_dtype_follows_another():
    text = yaml.safe_dump(
        {
            "CopyIntoOp": {
                "family": "test",
                "summary": "dst.copy_(src)",
                "signature": {
                    "inputs": {
                        "src": {"dtype": ["float32", "float16"], "shape": ["..."]},
                        "dst": {"dtype": {"same_as": "src"}, "shape": {"same_as": "src"}, "access": "write"},
                    },
                    "outputs": {"result": {"aliases": "dst"}},
                },
                "ref_api": "dst.copy_(src)",
                "tolerance": {"float32": {"atol": 0, "rtol": 0}},
                "workloads": [{"name": "w", "shapes": {"src": [4], "dst": [4]}, "dtypes": ["float32"]}],
                "roofline": {"bytes": "2 * numel(src) * itemsize(src)", "flops": "0"},
            }
        },
        sort_keys=False,
    )
    signature = Signature(parse_manifest(text, "t.yaml")["CopyIntoOp"])
    src, dst = torch.ones(4, dtype=torch.float16), torch.zeros(4, dtype=torch.float16)
    fast = generated_bind(signature, {}, (src, dst))
    reference = signature.bind({}, (src, dst), {})
    assert fast.output_dtypes == reference.output_dtypes == (torch.float16,)
    assert generated_bind(signature, {}, (src, dst.float())) is None


def test_a_type_error_raised_while_the_call_runs_is_not_taken_for_bad_arguments(scoped_registry):
    from tileops.backend import Kernel, register_kernel_type
    from tileops.ops.norm import RMSNormFwdInterface

    runs = []

    class Broken(Kernel, RMSNormFwdInterface):
        devices = frozenset({"cpu"})

        @classmethod
        def entry_for(cls, call):
            return call.n, cls

        def forward(self, x, weight):
            runs.append(x)
            raise TypeError("a bug inside the kernel")

    register_kernel_type("RMSNormFwdOp", "broken", Broken)
    op = RMSNormFwdOp(512)  # rows the template backend's kernel refuses
    with pytest.raises(TypeError, match="^a bug inside the kernel$"):
        op(torch.randn(2, 512))
    assert len(runs) == 1  # not run a second time through the reference binder


def test_an_input_given_twice_is_an_op_argument_error_on_the_generated_path():
    op = RMSNormFwdOp(8)
    x = torch.randn(2, 8)
    with pytest.raises(OpArgumentError, match="^RMSNormFwdOp: got input 'x' both by position and by keyword$"):
        op(x, x=x)


def _strided(rows: int, n: int) -> torch.Tensor:
    """A non-contiguous (rows, n) tensor: the generated path declines it, the reference copies it."""
    return torch.randn(n, rows).t()


@pytest.mark.parametrize(
    "call",
    [
        lambda x, w: ((x, w), {}),
        lambda x, w: ((), {"x": x, "weight": w}),
        lambda x, w: ((x,), {"weight": w, "out": None}),
    ],
    ids=["positional", "keywords", "keywords-and-an-empty-out"],
)
def test_a_call_the_generated_path_declines_is_bound_once_with_the_callers_own_arguments(monkeypatch, call):
    op = RMSNormFwdOp(8)
    x, weight = _strided(3, 8), torch.randn(8)
    args, kwargs = call(x, weight)
    binds = []
    reference_bind = Signature.bind

    def recording_bind(self, params, args, kwargs):
        binds.append((args, dict(kwargs)))
        return reference_bind(self, params, args, kwargs)

    monkeypatch.setattr(Signature, "bind", recording_bind)
    y = op(*args, **kwargs)
    assert len(binds) == 1
    (bound_args, bound_kwargs), = binds
    assert len(bound_args) == len(args) and all(a is b for a, b in zip(bound_args, args))
    assert bound_kwargs.keys() == kwargs.keys() and all(bound_kwargs[k] is kwargs[k] for k in kwargs)
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x, (8,), weight, op.params["eps"]))



def test_row_views_follow_a_chain_of_same_as_shapes_to_the_pattern_that_names_the_row():
    entry = copy.deepcopy(NORM["FusedAddRMSNormFwdOp"])
    del entry["backward"]
    inputs = entry["signature"]["inputs"]
    # a second residual whose shape follows the first, which follows x
    inputs = {**{k: inputs[k] for k in ("x", "residual")}, "extra": {"dtype": {"same_as": "x"}, "shape": {"same_as": "residual"},
                                                                     "row_views": True}, "weight": inputs["weight"]}
    entry["signature"]["inputs"] = inputs
    entry["workloads"] = [{"name": "w", "shapes": {"x": [2, 8], "residual": [2, 8], "extra": [2, 8]}, "dtypes": ["float32"],
                           "params": {"normalized_shape": [8]}}]
    parsed = parse_manifest(yaml.safe_dump({"FusedAddRMSNormFwdOp": entry}, sort_keys=False), "norm.yaml")["FusedAddRMSNormFwdOp"]
    extra = parsed.input("extra")
    assert extra.row_views and extra.pattern(parsed.input) is parsed.input("x").shape


def test_every_shipped_roofline_counts_the_bytes_of_every_workload():
    # tileops bench reports bandwidth from the roofline: it must hold for every call a workload
    # makes, outputs that are None there (absent, or aliasing an input left out) included. The
    # tensors are meta ones: the expressions read shapes and dtypes alone.
    from tileops.core.manifest.expressions import evaluate

    for ops in FAMILIES.values():
        for op_class in ops:
            entry = op_class.manifest_entry()
            for workload in entry.workloads:
                dtype = workload.dtypes[0]
                inputs = {
                    decl.name: torch.empty(workload.shapes[decl.name], dtype=decl.dtype_in(dtype), device="cpu" if decl.cpu else "meta")
                    for decl in entry.inputs if decl.name in workload.shapes
                }
                params = {**{p.name: p.default for p in entry.params if not p.required}, **workload.params}
                call = op_class(**workload.params).signature().bind(params, (), inputs, check_overlap=False)
                outputs = [None if shape is None else torch.empty(shape, dtype=out_dtype, device="meta")
                           for shape, out_dtype in zip(call.output_shapes, call.output_dtypes)]
                namespace = {decl.name: inputs.get(decl.name) for decl in entry.inputs}
                namespace.update({decl.name: out for decl, out in zip(entry.outputs, outputs)}, **params)
                assert evaluate(entry.roofline["bytes"], namespace) > 0, (entry.name, workload.name)
