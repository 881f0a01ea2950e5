"""Ops under torch.compile(fullgraph=True) on the CPU: no graph break, eager results,
no retrace per batch size, targets bound as in eager calls, and a random call (good and bad
shapes, dtypes, optional inputs and buffers) doing the same eagerly and compiled."""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
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
    workload = next(w for w in entry.workloads if w.name in {"decode-64", "prefill-2k-4k", "batched-3d"})
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


def test_an_op_after_a_dict_mutation_stays_in_the_graph_forward_and_backward():
    # Models mutate dicts in their forward (a KV cache's bookkeeping, a kwargs dict); Dynamo
    # then refuses to read any class's __dict__ in the same frame, which the op's traced call
    # once did (a graph break, an error under fullgraph=True).
    norm = RMSNormFwdOp(64)

    def step(x, weight, state):
        state["seen"] = x.shape[0]
        return norm(x, weight).sum()

    x, weight = torch.randn(5, 64, requires_grad=True), torch.randn(64, requires_grad=True)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    loss = torch.compile(step, fullgraph=True, backend=counter)(x, weight, {})
    loss.backward()
    expected = torch.nn.functional.rms_norm(x, (64,), weight, 1e-6).sum()
    torch.testing.assert_close(loss, expected)
    x_grad, weight_grad = torch.autograd.grad(expected, (x, weight))
    torch.testing.assert_close(x.grad, x_grad)
    torch.testing.assert_close(weight.grad, weight_grad)
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
    assert op.target == "acme"  # the compiled call ran this very instance


# -- the same random call, eager and compiled -------------------------------------------------------

N = 16
_BUFFERS = ["none", "good", "shape", "dtype", "strided", "meta", "input"]


def _tensor_call(op_class, rows, last, dtype, weight, out, residual_out, seed):
    """Positional inputs and keywords of one call, made afresh (equal values) on every call."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, last, generator=generator).to(dtype)
    inputs = [x]
    if op_class is FusedAddRMSNormFwdOp:
        inputs.append(torch.randn(rows, last, generator=generator).to(dtype))
    weights = {
        "none": None,
        "good": torch.randn(N, generator=generator).to(dtype),
        "shape": torch.randn(N + 1).to(dtype),
        "dtype": torch.randn(N, dtype=torch.float64 if dtype != torch.float64 else torch.float32),
    }
    inputs.append(weights[weight])

    def buffer(kind):
        return {
            "none": None,
            "good": torch.empty(rows, last, dtype=dtype),
            "shape": torch.empty(rows + 1, last, dtype=dtype),
            "dtype": torch.empty(rows, last, dtype=torch.float64 if dtype != torch.float64 else torch.float32),
            "strided": torch.empty(last, rows, dtype=dtype).t(),
            "meta": torch.empty(rows, last, dtype=dtype, device="meta"),
            "input": x,
        }[kind]

    kwargs = {"out": buffer(out)}
    if op_class is FusedAddRMSNormFwdOp:
        kwargs["residual_out"] = kwargs["out"] if residual_out == "same" else buffer(residual_out)
    return inputs, kwargs


def _outcome(function, inputs, kwargs):
    try:
        result = function(*inputs, **kwargs)
    except Exception as error:  # noqa: BLE001 - any error: the two runs are compared by its type and message
        return "error", type(error), str(error)
    results = result if isinstance(result, tuple) else (result,)
    buffers = [kwargs.get("out"), kwargs.get("residual_out")]
    same = tuple(r is b for r, b in zip(results, buffers))
    return "result", [r.clone() for r in results], same


_compiled: dict[type, tuple] = {}


def _op_and_compiled(op_class):
    """One op and one compiled function per op class, reused by every example."""
    if op_class not in _compiled:
        op = op_class(N)
        _compiled[op_class] = op, torch.compile(lambda *a, **k: op(*a, **k), fullgraph=True, backend="eager")
    return _compiled[op_class]


@hypothesis.settings(max_examples=25, deadline=None, suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(
    op_class=st.sampled_from([RMSNormFwdOp, LayerNormFwdOp, FusedAddRMSNormFwdOp]),
    rows=st.integers(1, 3),
    last=st.sampled_from([N, N, N + 1]),
    dtype=st.sampled_from([torch.float32, torch.float32, torch.bfloat16, torch.float64]),
    weight=st.sampled_from(["none", "good", "shape", "dtype"]),
    out=st.sampled_from(_BUFFERS),
    residual_out=st.sampled_from([*_BUFFERS, "same"]),
    seed=st.integers(0, 2**16),
)
def test_a_random_call_does_the_same_eagerly_and_compiled(op_class, rows, last, dtype, weight, out, residual_out, seed):
    op, compiled = _op_and_compiled(op_class)
    with torch._dynamo.config.patch(recompile_limit=10_000, accumulated_recompile_limit=10_000):
        eager = _outcome(op, *_tensor_call(op_class, rows, last, dtype, weight, out, residual_out, seed))
        traced = _outcome(compiled, *_tensor_call(op_class, rows, last, dtype, weight, out, residual_out, seed))
    if eager[0] == "error":
        assert traced[0] == "error", f"eager raised {eager[1].__name__}: {eager[2]}; compiled returned"
        assert traced[1:] == eager[1:]
        return
    assert traced[0] == "result", f"compiled raised {traced[1].__name__}: {traced[2]}"
    assert traced[2] == eager[2]  # the caller's buffers are returned in both
    for got, want in zip(traced[1], eager[1]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
