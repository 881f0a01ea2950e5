"""GPU tier: ops inside torch.compile(fullgraph=True) and CUDA graphs on a real GPU."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

from tileops.ops import FAMILIES, FusedAddRMSNormFwdOp, LayerNormFwdOp, RMSNormFwdOp
from tileops.testing import workload_inputs

pytestmark = pytest.mark.gpu


class Block(torch.nn.Module):
    """Norms and residual adds, as in a transformer layer without the matmuls."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.add_norm = FusedAddRMSNormFwdOp(hidden)
        self.norm = LayerNormFwdOp(hidden)
        self.final = RMSNormFwdOp(hidden)
        self.weight = torch.nn.Parameter(torch.randn(hidden, device="cuda", dtype=torch.bfloat16), requires_grad=False)

    def forward(self, x, residual):
        y, total = self.add_norm(x, residual, self.weight)
        z = self.norm(torch.nn.functional.silu(y), self.weight)
        return self.final(z + total, self.weight)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_compiled_model_matches_eager_without_graph_breaks_or_retracing():
    model = Block(4096)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=counter)
    batch_sizes = (7, 64, 300, 1000)
    for rows in batch_sizes:
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        r = torch.randn_like(x)
        torch.testing.assert_close(compiled(x, r), model(x, r), atol=1.6e-2, rtol=1.6e-2)
    # Not one trace per batch size: the ops' fakes keep the batch dimension symbolic.
    assert counter.frame_count < len(batch_sizes), counter.frame_count


def test_a_compiled_model_captures_in_a_cuda_graph_and_replays_correctly():
    model = Block(2048)
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(32, 2048, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    compiled(x, r)  # warm-up: compiles, binds and builds
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = compiled(x, r)
    x.copy_(torch.randn_like(x))
    r.copy_(torch.randn_like(r))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, model(x, r), atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize("op_class", FAMILIES["norm"], ids=lambda c: c.__name__)
def test_every_op_compiles_and_captures(op_class):
    entry = op_class.manifest_entry()
    # The 2048 x 4096 workload of each op, forward ('prefill') and backward ('train') alike.
    first = entry.inputs[0].name
    workload = next(w for w in entry.workloads if tuple(w.shapes[first]) == (2048, 4096))
    op = op_class(**workload.params)
    inputs = workload_inputs(entry, workload, torch.bfloat16, "cuda")
    compiled = torch.compile(lambda **kw: op(**kw), fullgraph=True)
    eager = op(**inputs)
    got = compiled(**inputs)
    for g, e in zip(got if isinstance(got, tuple) else (got,), eager if isinstance(eager, tuple) else (eager,)):
        torch.testing.assert_close(g, e, atol=0, rtol=0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = op(**inputs)
    graph.replay()
    torch.cuda.synchronize()
    for g, e in zip(captured if isinstance(captured, tuple) else (captured,), eager if isinstance(eager, tuple) else (eager,)):
        torch.testing.assert_close(g, e, atol=0, rtol=0)
