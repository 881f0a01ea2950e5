"""Ops under torch.compile(fullgraph=True) on the CPU: no graph break, eager results,
no retrace per batch size, and targets bound as in eager calls."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

from tileops.ops import FAMILIES, FusedAddRMSNormFwdOp, LayerNormFwdOp, RMSNormFwdOp
from tileops.testing import workload_inputs


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("op_class", FAMILIES["norm"], ids=lambda c: c.__name__)
def test_every_op_compiles_fullgraph_and_matches_eager(op_class):
    entry = op_class.manifest_entry()
    workload = next(w for w in entry.workloads if w.name == "decode-64" or w.name == "prefill-2k-4k")
    op = op_class(**workload.params)
    inputs = workload_inputs(entry, workload, torch.float32, "cpu")
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(lambda **kw: op(**kw), fullgraph=True, backend=counter)
    got, want = compiled(**inputs), op(**inputs)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert counter.frame_count == 1


def test_a_small_model_compiles_without_retracing_per_batch_size():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.add_norm = FusedAddRMSNormFwdOp(64)
            self.norm = LayerNormFwdOp(64)
            self.weight = torch.nn.Parameter(torch.randn(64), requires_grad=False)

        def forward(self, x, residual):
            y, total = self.add_norm(x, residual, self.weight)
            return self.norm(y * 2, self.weight) + total

    model = Block()
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=counter)
    for rows in (3, 5, 17, 64):
        x, r = torch.randn(rows, 64), torch.randn(rows, 64)
        torch.testing.assert_close(compiled(x, r), model(x, r), atol=1e-5, rtol=1e-5)
    assert counter.frame_count == 1


def test_out_buffers_are_filled_in_compiled_code():
    op = RMSNormFwdOp(32)
    x, out = torch.randn(4, 32), torch.empty(4, 32)
    compiled = torch.compile(lambda x, out: op(x, out=out), fullgraph=True, backend="eager")
    compiled(x, out)
    torch.testing.assert_close(out, op(x))


def test_a_target_served_op_compiles_and_still_uses_its_target():
    op = RMSNormFwdOp(16, target="acme")
    x = torch.randn(3, 16)
    compiled = torch.compile(lambda x: op(x), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), op(x))
    from tileops.core.tracing import _instances

    assert any(instance.target == "acme" for (cls, _, target), instance in _instances.items() if target == "acme")
