"""Selection rules on a small op and interfaces of this test's own (no norm family involved)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from tileops.backend import BackendError, CallSpec, DeviceFacts, Kernel, KernelInterface, KernelSelectionError
from tileops.core import Op

MANIFEST = """
ScaleFwdOp:
  family: demo
  summary: y = factor * x, with a first stage (scale) and a second (shift by zero).
  signature:
    inputs:
      x: {dtype: [float32], shape: ["...", N]}
    outputs:
      y: {dtype: {same_as: x}, shape: {same_as: x}}
    params:
      factor: {type: float, default: 2.0}
  ref_api: factor * x
  tolerance: {float32: {atol: 0, rtol: 0}}
  workloads:
    - {name: small, shapes: {x: [2, 8]}, dtypes: [float32]}
  roofline: {bytes: 2 * numel(x) * itemsize(x), flops: numel(x)}
"""


@dataclasses.dataclass(frozen=True)
class ScaleCall(CallSpec):
    n: int


class ScaleInterface(KernelInterface):
    call_spec = ScaleCall

    def forward(self, x, factor):
        """Return factor * x."""
        raise NotImplementedError


class ShiftInterface(KernelInterface):
    call_spec = ScaleCall

    def forward(self, x):
        """Return x unchanged (a second call site of the op)."""
        raise NotImplementedError


def _kernel(name: str, interface=ScaleInterface, **declarations):
    """A kernel class of ``interface`` whose result says which class ran."""

    def forward(self, x, factor=None):
        self.ran.append(name)
        return x * factor if factor is not None else x

    namespace = {
        "entry_for": classmethod(lambda cls, call: (call.n, cls)),
        "forward": forward if interface is ScaleInterface else (lambda self, x: forward(self, x)),
        "ran": [],
        "devices": frozenset({"cpu"}),
        **declarations,
    }
    if "refusal" in declarations:
        namespace["refusal"] = classmethod(declarations["refusal"])
    return type(name, (Kernel, interface), namespace)


@pytest.fixture
def scale_op(tmp_path):
    manifest = tmp_path / "demo.yaml"
    manifest.write_text(MANIFEST)

    def make(scale_kernels: dict, shift_kernels: dict | None = None):
        class ScaleFwdOp(Op):
            manifest_file = manifest
            kernel_interfaces = (ScaleInterface, ShiftInterface)
            in_tree_kernels = {ScaleInterface: scale_kernels, ShiftInterface: shift_kernels or {"shift": _kernel("shift", ShiftInterface)}}

            def __init__(self, factor: float = 2.0, *, target=None):
                super().__init__(factor=factor, target=target)

            def forward(self, x):
                call = (x.device, x.shape[-1])
                scaled = self.kernel_for(ScaleInterface, *call).forward(x, self.params["factor"])
                return self.kernel_for(ShiftInterface, *call).forward(scaled)

        return ScaleFwdOp()

    return make


def _selected(op, n=8, facts=None):
    verdicts = op.verdicts(ScaleInterface, ScaleCall(torch.device("cpu"), n), facts)
    return [v.key for v in verdicts if v.outcome == "selected"], {v.key: v for v in verdicts}


def test_general_ranks_below_every_other_survivor(scale_op):
    op = scale_op({"catch_all": _kernel("catch_all", general=True), "special": _kernel("special")})
    selected, verdicts = _selected(op)
    assert selected == ["special"]
    assert verdicts["catch_all"].reason == "beaten by special"


def test_preferred_over_is_transitive_and_declaration_order_decides_nothing(scale_op):
    a = _kernel("a", preferred_over=frozenset({"b"}))
    b = _kernel("b", preferred_over=frozenset({"c"}))
    c = _kernel("c")
    for order in itertools.permutations([("a", a), ("b", b), ("c", c)]):
        op = scale_op(dict(order))
        selected, verdicts = _selected(op)
        assert selected == ["a"]
        assert verdicts["c"].reason == "beaten by a, b"


def test_a_refusal_removes_a_key_with_its_reason_and_the_next_one_serves(scale_op):
    short = _kernel("short", refusal=lambda cls, call: None if call.n <= 4 else f"rows of {call.n} > 4",
                    preferred_over=frozenset({"any"}))
    op = scale_op({"short": short, "any": _kernel("any")})
    assert _selected(op, n=4)[0] == ["short"]
    selected, verdicts = _selected(op, n=8)
    assert selected == ["any"] and verdicts["short"].reason == "rows of 8 > 4"


def test_supported_archs_against_stated_facts(scale_op):
    op = scale_op({"new": _kernel("new", supported_archs=frozenset({7}), preferred_over=frozenset({"old"})),
                   "old": _kernel("old")})
    assert _selected(op, facts=DeviceFacts("cpu", arch=7))[0] == ["new"]
    selected, verdicts = _selected(op, facts=DeviceFacts("cpu", arch=6))
    assert selected == ["old"] and verdicts["new"].outcome == "unavailable"


def test_no_survivor_and_ambiguity_are_errors_that_say_what_to_do(scale_op):
    op = scale_op({"only": _kernel("only", refusal=lambda cls, call: "never")})
    with pytest.raises(KernelSelectionError, match=r"no implementation serves .*\n  - only: refused \(never\)"):
        op(torch.ones(2, 8))
    op = scale_op({"one": _kernel("one"), "two": _kernel("two")})
    with pytest.raises(KernelSelectionError, match=r"(?s)one, two.*preferred_over = frozenset\(\{'two'\}\) on the class under 'one'"):
        op(torch.ones(2, 8))


def test_each_interface_selects_on_its_own_and_the_call_runs_both(scale_op):
    op = scale_op({"scale": _kernel("scale")})
    assert torch.equal(op(torch.ones(2, 8)), torch.full((2, 8), 2.0))
    assert {key for key, _ in op.built_kernels()} == {"scale", "shift"}


def test_an_implementation_inheriting_two_of_the_ops_interfaces_is_refused(scale_op):
    both = type("Both", (Kernel, ScaleInterface, ShiftInterface), {
        "entry_for": classmethod(lambda cls, call: (0, cls)), "forward": lambda self, x, factor: x})
    with pytest.raises(BackendError, match="inherits several of the op's interfaces"):
        scale_op({"both": both})


def test_two_general_implementations_on_one_device_type_are_refused(scale_op):
    with pytest.raises(BackendError, match="'g1' and 'g2' both declare general = True on cpu"):
        scale_op({"g1": _kernel("g1", general=True), "g2": _kernel("g2", general=True)})
