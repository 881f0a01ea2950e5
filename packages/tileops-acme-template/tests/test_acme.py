"""The acme backend against TileOPs' conformance kit, plus what only this backend promises.

When you fork the template, rename ``acme`` here too; keep the kit calls: they are what
TileOPs' CI runs against every backend.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from tileops.backend import CallSpec, Kernel, KernelInterface, OpNotAvailableError
from tileops.core import Op
from tileops.ops import LayerNormFwdOp, RMSNormFwdOp
from tileops.testing import KernelTypeConformance, TargetConformance

import tileops_acme

TARGET = tileops_acme.TARGET

# The second way of joining: the target serves whole ops, here on CPU tensors by name.
target_kit = TargetConformance(TARGET, device="cpu", backend_module="tileops_acme", max_elements=1 << 22)


@pytest.mark.parametrize("check", target_kit.checks(), ids=str)
def test_target_conforms(check):
    check()


# The first way of joining: an added implementation of RMSNormFwdInterface for short rows.
short_rows_kit = KernelTypeConformance(
    RMSNormFwdOp,
    "acme_short_rows",
    device="cpu",
    inside=[
        {"shapes": {"x": [16, 128], "weight": [128]}, "params": {"normalized_shape": [128]}, "dtype": "float32"},
        {"shapes": {"x": [3, 7, 256]}, "params": {"normalized_shape": [256]}, "dtype": "bfloat16"},
    ],
    outside=[
        {"shapes": {"x": [4, 1024], "weight": [1024]}, "params": {"normalized_shape": [1024]}, "dtype": "float32"},
    ],
)


@pytest.mark.parametrize("check", short_rows_kit.checks(), ids=str)
def test_short_row_kernel_conforms(check):
    check()


def test_the_ops_own_forward_never_runs_on_the_target(monkeypatch):
    op = LayerNormFwdOp(64, target=TARGET)

    def forbidden(*args, **kwargs):
        raise AssertionError("LayerNormFwdOp.forward ran although the acme target serves the op")

    monkeypatch.setattr(op, "forward", forbidden)
    x = torch.randn(4, 64)
    torch.testing.assert_close(op(x), torch.nn.functional.layer_norm(x, (64,)))
    assert op.target == TARGET


def test_the_detector_claims_acme_devices_only():
    # torch.device("acme") exists only once the runtime renames torch's PrivateUse1 backend;
    # the detector reads nothing but the device type.
    assert tileops_acme.detect.claims(SimpleNamespace(type="acme", index=0))
    assert not tileops_acme.detect.claims(torch.device("cpu"))


MANIFEST = """
DoubleFwdOp:
  family: demo
  summary: y = 2 * x, an op the acme target does not serve.
  signature:
    inputs:
      x: {dtype: [float32], shape: ["..."]}
    outputs:
      y: {dtype: {same_as: x}, shape: {same_as: x}}
  ref_api: 2 * x
  tolerance: {float32: {atol: 0, rtol: 0}}
  workloads:
    - {name: small, shapes: {x: [4]}, dtypes: [float32]}
  roofline: {bytes: 2 * numel(x) * itemsize(x), flops: numel(x)}
"""


@dataclasses.dataclass(frozen=True)
class DoubleCall(CallSpec):
    pass


class DoubleFwdInterface(KernelInterface):
    call_spec = DoubleCall

    def forward(self, x):
        """Return 2 * x."""


class TorchDouble(Kernel, DoubleFwdInterface):
    devices = frozenset({"cpu"})

    @classmethod
    def entry_for(cls, call):
        return None, cls

    def forward(self, x):
        return 2 * x


def test_an_op_the_target_does_not_serve_raises_op_not_available(tmp_path):
    manifest = tmp_path / "demo.yaml"
    manifest.write_text(MANIFEST)

    class DoubleFwdOp(Op):
        manifest_file = manifest
        kernel_interfaces = (DoubleFwdInterface,)
        in_tree_kernels = {DoubleFwdInterface: {"torch": TorchDouble}}

        def __init__(self, *, target=None):
            super().__init__(target=target)

        def forward(self, x):
            return self.kernel_for(DoubleFwdInterface, x.device).forward(x)

    x = torch.ones(4)
    assert torch.equal(DoubleFwdOp()(x), 2 * x)  # in-tree, no target named
    with pytest.raises(OpNotAvailableError, match="target 'acme' is bound .* no kernel builder for DoubleFwdOp"):
        DoubleFwdOp(target=TARGET)(x)
