"""Execution arguments: keyword-only call arguments declared in the manifest (how to run, not
what to compute), checked like params and passed to implementations and target kernels as
keywords, only when the caller passes them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tileops.backend import CallSpec, Kernel, KernelInterface, OpArgumentError, register_kernel_builder
from tileops.core import Op

MANIFEST = """
CopyFwdOp:
  family: demo
  summary: y = x, with a hint for how to copy.
  signature:
    inputs:
      x: {dtype: [float32], shape: ["..."]}
    outputs:
      y: {dtype: {same_as: x}, shape: {same_as: x}, out: out}
    exec_args:
      chunks: {type: int, default: 1, doc: how many pieces to copy in}
      label: {type: str, default: copy, nullable: true, doc: a name for profilers}
  ref_api: x.clone()
  tolerance: {float32: {atol: 0, rtol: 0}}
  workloads:
    - {name: small, shapes: {x: [4]}, dtypes: [float32]}
  roofline: {bytes: 2 * numel(x) * itemsize(x), flops: "0"}
"""


@dataclasses.dataclass(frozen=True)
class CopyCall(CallSpec):
    pass


class CopyInterface(KernelInterface):
    call_spec = CopyCall

    def forward(self, x, chunks):
        """Return a copy of x made in ``chunks`` pieces."""
        raise NotImplementedError


class TorchCopy(Kernel, CopyInterface):
    devices = frozenset({"cpu"})

    @classmethod
    def entry_for(cls, call):
        return None, cls

    def forward(self, x, chunks):
        return torch.cat([piece.clone() for piece in x.chunk(chunks)])


@pytest.fixture
def copy_op(tmp_path):
    manifest = tmp_path / "demo.yaml"
    manifest.write_text(MANIFEST)
    seen = []

    class CopyFwdOp(Op):
        manifest_file = manifest
        kernel_interfaces = (CopyInterface,)
        in_tree_kernels = {CopyInterface: {"torch": TorchCopy}}

        def __init__(self, *, target=None):
            super().__init__(target=target)

        def forward(self, x, *, out=None, chunks=1):
            seen.append(chunks)
            y = self.kernel_for(CopyInterface, x.device).forward(x, chunks)
            return y if out is None else out.copy_(y)

    CopyFwdOp.seen = seen
    return CopyFwdOp


def test_the_in_tree_forward_receives_execution_arguments_as_keywords(copy_op):
    op = copy_op()
    x = torch.arange(6.0)
    assert torch.equal(op(x, chunks=3), x)
    assert torch.equal(op(x), x)
    assert copy_op.seen == [3, 1]


def test_a_target_kernel_receives_only_the_execution_arguments_the_caller_passed(copy_op, scoped_registry):
    received = []

    def kernel(x, **keywords):
        received.append(keywords)
        out = keywords.get("out")
        return x.clone() if out is None else out.copy_(x)

    register_kernel_builder(op="CopyFwdOp", target="recorder", build_kernel=lambda x: kernel)
    op = copy_op(target="recorder")
    x, out = torch.ones(4), torch.empty(4)
    op(x)
    op(x, chunks=2)
    op(x, chunks=2, out=out)
    assert received == [{}, {"chunks": 2}, {"out": out, "chunks": 2}]


def test_execution_arguments_are_checked_like_params(copy_op):
    with pytest.raises(OpArgumentError, match="CopyFwdOp: execution argument 'chunks' expected an int, got '2'"):
        copy_op()(torch.ones(4), chunks="2")
    with pytest.raises(OpArgumentError, match="and execution arguments chunks"):
        copy_op()(torch.ones(4), chunk=2)


def test_execution_arguments_reach_the_implementation_inside_torch_compile(copy_op):
    op = copy_op()
    x = torch.arange(6.0)
    compiled = torch.compile(lambda x: op(x, chunks=3), fullgraph=True, backend="eager")
    assert torch.equal(compiled(x), x)
    assert copy_op.seen[-1] == 3
    default = torch.compile(lambda x: op(x), fullgraph=True, backend="eager")
    assert torch.equal(default(x), x)
    assert copy_op.seen[-1] == 1


def test_a_bad_execution_argument_is_refused_while_tracing(copy_op):
    op = copy_op()
    compiled = torch.compile(lambda x: op(x, chunks="3"), fullgraph=True, backend="eager")
    # Dynamo re-raises what traced code raises inside its own error, with the message kept.
    with pytest.raises(Exception, match="CopyFwdOp: execution argument 'chunks' expected an int, got '3'"):
        compiled(torch.ones(4))


def test_none_for_an_execution_argument_with_another_default_is_refused_inside_torch_compile(copy_op):
    op = copy_op()
    compiled = torch.compile(lambda x: op(x, label=None), fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="execution argument 'label' cannot be passed as None inside torch.compile"):
        compiled(torch.ones(4))
