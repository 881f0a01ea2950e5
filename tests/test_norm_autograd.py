"""Training with the norm ops on the CPU: gradients, the autograd wiring and its refusals.

The forward ops are differentiable through their backward ops (declared in the manifest): a
call whose inputs require grad records one autograd node, ``backward`` runs the backward op,
and ``torch.compile`` differentiates the same formula. ``gradcheck`` runs in float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import train_side_by_side
from tileops.backend import Kernel, OpArgumentError, OpNotAvailableError, register_kernel_builder, register_kernel_type
from tileops.ops.norm import RMSNormBwdInterface
from tileops.ops.norm.cpu import TorchCpuRMSNormBwd
from tileops.ops import (
    FusedAddLayerNormFwdOp,
    FusedAddRMSNormFwdOp,
    LayerNormBwdOp,
    LayerNormFwdOp,
    RMSNormBwdOp,
    RMSNormFwdOp,
)

FORWARD_OPS = [RMSNormFwdOp, LayerNormFwdOp, FusedAddRMSNormFwdOp, FusedAddLayerNormFwdOp]


def _torch_function(op_class, normalized_shape, eps):
    """The torch computation ``op_class`` stands for, as a function of the op's inputs."""
    rms = "RMS" in op_class.__name__
    fused = op_class.__name__.startswith("FusedAdd")

    def norm(x, weight=None, bias=None):
        if rms:
            return F.rms_norm(x, normalized_shape, weight, eps)
        return F.layer_norm(x, normalized_shape, weight, bias, 1e-5 if eps is None else eps)

    if not fused:
        return norm

    def fused_norm(x, residual, weight=None, bias=None):
        total = x + residual
        return norm(total, weight, bias), total

    return fused_norm


def _inputs(op_class, leading, normalized_shape, dtype, *, weight=True, bias=True):
    """Inputs of one call that require grad (bias only for the LayerNorm ops)."""
    generator = torch.Generator().manual_seed(0)
    shape = (*leading, *normalized_shape)

    def tensor(*size):
        return torch.randn(size, generator=generator, dtype=torch.float64).to(dtype).requires_grad_()

    inputs = [tensor(*shape)]
    if op_class.__name__.startswith("FusedAdd"):
        inputs.append(tensor(*shape))
    inputs.append(tensor(*normalized_shape) if weight else None)
    if "LayerNorm" in op_class.__name__:
        inputs.append(tensor(*normalized_shape) if bias else None)
    return inputs


def _outputs(result):
    return result if isinstance(result, tuple) else (result,)


# normalized_shape, leading dimensions, weight, bias: every option the ops take.
OPTIONS = [
    ((6,), (4,), True, True),
    ((6,), (2, 3), True, False),
    ((6,), (5,), False, False),
    ((2, 3), (3,), True, True),
    ((2, 3), (2, 2), False, True),
    ((7,), (), True, True),
]


@pytest.mark.parametrize("op_class", FORWARD_OPS)
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: f"shape{o[0]}-lead{o[1]}-w{int(o[2])}-b{int(o[3])}")
def test_gradcheck_in_float64_for_every_op_and_option(op_class, options):
    normalized_shape, leading, weight, bias = options
    op = op_class(normalized_shape)
    inputs = _inputs(op_class, leading, normalized_shape, torch.float64, weight=weight, bias=bias)
    tensors = [t for t in inputs if t is not None]

    def call(*given):
        it = iter(given)
        return op(*[None if t is None else next(it) for t in inputs])

    assert torch.autograd.gradcheck(call, tensors, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("op_class", FORWARD_OPS)
def test_gradcheck_where_the_in_tree_cpu_kernel_saves_the_statistics(op_class):
    # Rows of 300 elements: the template backend (rows of at most 256) leaves them to torch_cpu,
    # whose forward saves rstd (and mean) itself rather than leaving them to be derived.
    op = op_class(300)
    inputs = [t for t in _inputs(op_class, (2,), (300,), torch.float64) if t is not None]
    assert torch.autograd.gradcheck(op, inputs, eps=1e-6, atol=1e-7, fast_mode=True)
    assert {key for key, _ in op.built_kernels()} == {"torch_cpu"}


@pytest.mark.parametrize("op_class", FORWARD_OPS)
@pytest.mark.parametrize(
    ("dtype", "tolerance"),
    [(torch.float32, 1e-4), (torch.bfloat16, 3e-2), (torch.float16, 4e-3)],
    ids=["float32", "bfloat16", "float16"],
)
def test_gradients_match_torch_autograd_in_every_dtype(op_class, dtype, tolerance):
    normalized_shape = (512,)
    inputs = _inputs(op_class, (3, 5), normalized_shape, dtype)
    reference = [t.detach().double().requires_grad_() for t in inputs]
    outputs = _outputs(op_class(normalized_shape)(*inputs))
    expected = _outputs(_torch_function(op_class, normalized_shape, None)(*reference))
    # Drawn from a generator of their own: the global one's state depends on the tests run before.
    generator = torch.Generator().manual_seed(1)
    grads = [torch.randn(o.shape, generator=generator).to(o.dtype) for o in outputs]
    torch.autograd.backward(outputs, grads)
    torch.autograd.backward(expected, [g.double() for g in grads])
    for got, want in zip(inputs, reference):
        torch.testing.assert_close(got.grad.double(), want.grad, atol=tolerance, rtol=tolerance)


def test_the_fused_ops_residual_sum_carries_gradient_as_in_a_pre_norm_block():
    x, residual = torch.randn(4, 32, requires_grad=True), torch.randn(4, 32, requires_grad=True)
    weight = torch.randn(32, requires_grad=True)
    y, total = FusedAddRMSNormFwdOp(32)(x, residual, weight)
    (y.square().sum() + (total * 3).sum()).backward()
    x2, r2, w2 = (t.detach().clone().requires_grad_() for t in (x, residual, weight))
    total2 = x2 + r2
    (F.rms_norm(total2, (32,), w2, torch.finfo(torch.float32).eps).square().sum() + (total2 * 3).sum()).backward()
    for got, want in [(x, x2), (residual, r2), (weight, w2)]:
        torch.testing.assert_close(got.grad, want.grad)


def test_a_call_records_one_node_named_after_the_op_and_only_where_grad_is_needed():
    x, weight = torch.randn(3, 16, requires_grad=True), torch.nn.Parameter(torch.ones(16))
    op = RMSNormFwdOp(16)
    assert type(op(x, weight).grad_fn).__name__ == "RMSNormFwdOpBackward"
    assert op(x.detach(), weight.detach()).grad_fn is None
    with torch.no_grad():
        assert op(x, weight).grad_fn is None
    with torch.inference_mode():
        assert not op(x, weight).requires_grad
    # Only weight requires grad: a node too, and x gets no gradient.
    y = op(x.detach(), weight)
    y.sum().backward()
    assert weight.grad is not None and x.grad is None


@pytest.mark.parametrize("op_class", FORWARD_OPS)
def test_calls_without_grad_save_nothing_and_take_the_inference_path(op_class, monkeypatch):
    op = op_class(300)
    inputs = _inputs(op_class, (2,), (300,), torch.float32)
    monkeypatch.setattr(op, "forward_saving", lambda *a, **k: pytest.fail("a call without grad ran forward_saving"))
    with torch.no_grad():
        op(*inputs)
    op(*[None if t is None else t.detach() for t in inputs])


def test_a_node_keeps_only_what_the_backward_op_reads():
    x, residual = torch.randn(4, 32, requires_grad=True), torch.randn(4, 32, requires_grad=True)
    weight = torch.randn(32, requires_grad=True)
    y, total = FusedAddRMSNormFwdOp(32)(x, residual, weight)
    kept = y.grad_fn.saved_tensors
    # weight, residual_sum and rstd: not x nor residual, which the backward does not read.
    assert [tuple(t.shape) for t in kept] == [(32,), (4, 32), (4,)]
    assert torch.equal(kept[1], total) and not any(t.data_ptr() in (x.data_ptr(), residual.data_ptr()) for t in kept)


def test_backward_inputs_are_what_the_node_hands_the_backward_op_with_the_forwards_own_statistics():
    # What ``tileops bench --backward`` times the backward op alone on: the incoming gradients,
    # the forward's inputs and its saved rstd, none of them computed again.
    x, residual, weight = torch.randn(6, 32), torch.randn(6, 32), torch.randn(32)
    op = FusedAddRMSNormFwdOp(32)
    dy, dsum = torch.randn(6, 32), torch.randn(6, 32)
    (y, total), arguments = op.backward_inputs(x, residual, weight, grads=(dy, dsum))
    torch.testing.assert_close((y, total), op(x, residual, weight))
    backward = type(op).backward_class()
    names = [decl.name for decl in backward.manifest_entry().inputs]
    given = dict(zip(names, arguments))
    assert given["dy"] is dy and given["weight"] is weight
    rstd = torch.rsqrt((x + residual).square().mean(-1) + torch.finfo(torch.float32).eps)
    torch.testing.assert_close(given["rstd"].reshape(-1), rstd)
    leaves = [t.clone().requires_grad_() for t in (x, residual, weight)]
    torch.autograd.backward(op(*leaves), (dy, dsum))
    gradients = backward(**op.params)(*arguments)
    for got, leaf in zip((gradients[0], gradients[0], gradients[1]), leaves):
        torch.testing.assert_close(got, leaf.grad)
    with pytest.raises(TypeError, match="declares no backward op"):
        from tileops.ops import DecodeAttentionFwdOp

        DecodeAttentionFwdOp().backward_inputs(torch.zeros(1), grads=())


def test_double_backward_is_refused_naming_both_ops():
    x, weight = torch.randn(3, 16, requires_grad=True), torch.randn(16, requires_grad=True)
    y = LayerNormFwdOp(16)(x, weight)
    with pytest.raises(OpNotAvailableError, match=r"LayerNormFwdOp: double backward is not supported: LayerNormBwdOp"):
        torch.autograd.grad(y.sum(), x, create_graph=True)


def test_an_output_buffer_with_grad_is_refused_by_name():
    x = torch.randn(3, 16, requires_grad=True)
    with pytest.raises(OpArgumentError, match=r"RMSNormFwdOp: output buffer\(s\) out cannot be filled"):
        RMSNormFwdOp(16)(x, out=torch.empty(3, 16))
    with torch.no_grad():
        out = torch.empty(3, 16)
        assert RMSNormFwdOp(16)(x, out=out) is out


def test_the_gradient_of_a_parameter_the_forward_lacked_is_none_eager_and_compiled():
    dy, x, bias = torch.randn(5, 64), torch.randn(5, 64), torch.randn(64)
    rms, layer = RMSNormBwdOp(64), LayerNormBwdOp(64)
    calls = [(rms, (dy, x)), (layer, (dy, x)), (layer, (dy, x, None, bias))]
    for op, arguments in calls:
        eager = op(*arguments)
        compiled = torch.compile(lambda *given, op=op: op(*given), fullgraph=True)(*arguments)
        for got in (eager, compiled):
            torch.testing.assert_close(got[0], eager[0])
            assert got[1] is None  # dweight: no weight
            if op is layer:  # dbias: the row sum of dy where the forward had a bias, else None
                assert got[2] is None if len(arguments) == 2 else torch.allclose(got[2], dy.sum(0), atol=1e-5)
    # A compiled training step through a weightless norm differentiates x alone.
    norm = RMSNormFwdOp(64)
    xs = x.clone().requires_grad_()
    torch.compile(lambda t: norm(t).square().sum(), fullgraph=True)(xs).backward()
    expected = x.clone().requires_grad_()
    torch.nn.functional.rms_norm(expected, (64,)).square().sum().backward()
    torch.testing.assert_close(xs.grad, expected.grad, atol=1e-4, rtol=1e-4)


# op, trainable (weight, bias) -> the gradients the backward pass skips.
FROZEN = [
    (RMSNormFwdOp, (False, None), ("dweight",)),
    (FusedAddRMSNormFwdOp, (False, None), ("dweight",)),
    (LayerNormFwdOp, (False, True), ("dweight",)),  # BitFit: the biases alone train
    (LayerNormFwdOp, (True, False), ("dbias",)),
    (FusedAddLayerNormFwdOp, (False, False), ("dbias", "dweight")),
]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize(("op_class", "trainable", "skipped"), FROZEN, ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_frozen_parameter_gets_no_gradient_and_the_backward_skips_its_sum(op_class, trainable, skipped, compiled):
    # A LoRA fine-tune freezes the norms' weights: their sums over the rows are work for nothing.
    inputs = _inputs(op_class, (6,), (32,), torch.float32)
    parameters = inputs[-2:] if "LayerNorm" in op_class.__name__ else inputs[-1:]
    for parameter, train in zip(parameters, trainable):
        parameter.requires_grad_(train)
    op = op_class(32)
    step = torch.compile(lambda *given: _outputs(op(*given))[0].square().sum(), fullgraph=True) if compiled else (
        lambda *given: _outputs(op(*given))[0].square().sum()
    )
    step(*inputs).backward()
    expected = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    _outputs(_torch_function(op_class, (32,), None)(*expected))[0].square().sum().backward()
    for got, want in zip(inputs, expected):
        assert (got.grad is None) == (want.grad is None)
        if want.grad is not None:
            torch.testing.assert_close(got.grad, want.grad, atol=1e-4, rtol=1e-4)
    # The backward pass ran the backward op built to skip them, and only that one.
    skipping = op.backward_op_for([t.requires_grad for t in inputs], [True] * len(inputs))
    assert skipping.params["skip_outputs"] == skipped and not op.backward_op.built_kernels()
    ((_, kernel),) = skipping.built_kernels()
    # Its kernel sums the parameter gradients only where one of them is wanted.
    assert kernel.parameter_gradients == any(trainable)


def test_a_backward_op_skips_the_outputs_it_is_built_to_skip_and_refuses_others():
    dy, x, weight, bias = torch.randn(5, 64), torch.randn(5, 64), torch.randn(64), torch.randn(64)
    dx, dweight, dbias = LayerNormBwdOp(64)(dy, x, weight, bias)
    for skip, kept in (("dweight", "dbias"), (["dbias"], "dweight"), (("dweight", "dbias"), None)):
        op = LayerNormBwdOp(64, skip_outputs=skip)
        for result in (op(dy, x, weight, bias), torch.compile(lambda *given, op=op: op(*given), fullgraph=True)(dy, x, weight, bias)):
            torch.testing.assert_close(result[0], dx)
            named = dict(zip(("dweight", "dbias"), result[1:]))
            assert all((value is not None) == (name == kept) for name, value in named.items())
            if kept:
                torch.testing.assert_close(named[kept], {"dweight": dweight, "dbias": dbias}[kept])
    with pytest.raises(OpArgumentError, match=r"LayerNormBwdOp: param 'skip_outputs' expected outputs that may be absent \(dweight, dbias\), got 'dx'"):
        LayerNormBwdOp(64, skip_outputs=["dweight", "dx"])
    with pytest.raises(OpArgumentError, match=r"RMSNormBwdOp: param 'skip_outputs' expected an output name or a sequence of them, got 3"):
        RMSNormBwdOp(64, skip_outputs=3)


def test_a_backward_op_computes_statistics_it_is_not_given():
    dy, x, weight = torch.randn(5, 64), torch.randn(5, 64), torch.randn(64)
    op = LayerNormBwdOp(64)
    mean, var = x.mean(-1), x.var(-1, unbiased=False)
    given = op(dy, x, weight, None, mean, torch.rsqrt(var + 1e-5))
    derived = op(dy, x, weight)
    for a, b in zip(given, derived):
        torch.testing.assert_close(a, b)
    dx, dweight = RMSNormBwdOp((4, 16))(dy.view(5, 4, 16), x.view(5, 4, 16), weight.view(4, 16))
    assert dx.shape == (5, 4, 16) and dweight.shape == (4, 16)


def test_a_target_without_a_backward_builder_fails_at_the_backward_call_naming_the_backward_op(scoped_registry):
    def build(x, weight, *, normalized_shape, eps):
        return lambda x, weight: F.rms_norm(x, normalized_shape, weight, eps).detach()

    register_kernel_builder(op="RMSNormFwdOp", target="forwardonly", build_kernel=build)
    op = RMSNormFwdOp(8, target="forwardonly")
    x = torch.randn(2, 8, requires_grad=True)
    y = op(x)  # the forward is served by the target
    assert op.target == "forwardonly"
    with pytest.raises(OpNotAvailableError, match=r"RMSNormBwdOp: target 'forwardonly' is bound .* no kernel builder for RMSNormBwdOp"):
        y.sum().backward()


def test_a_target_that_serves_the_backward_op_runs_it_with_the_statistics_derived(scoped_registry):
    seen = []

    def build_forward(x, weight, *, normalized_shape, eps):
        return lambda x, weight: F.rms_norm(x, normalized_shape, weight, eps).detach()

    def build_backward(dy, x, weight, rstd, *, normalized_shape, eps):
        def kernel(dy, x, weight, rstd):
            seen.append(rstd)
            return RMSNormBwdOp(normalized_shape, eps, target="builtin")(dy, x, weight, rstd)

        return kernel

    register_kernel_builder(op="RMSNormFwdOp", target="both", build_kernel=build_forward)
    register_kernel_builder(op="RMSNormBwdOp", target="both", build_kernel=build_backward)
    x, weight = torch.randn(2, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    RMSNormFwdOp(8, eps=1e-6, target="both")(x, weight).sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    F.rms_norm(x2, (8,), w2, 1e-6).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(weight.grad, w2.grad)
    # The target's forward saved nothing: the wiring derived rstd from x for its backward.
    torch.testing.assert_close(seen[0], torch.rsqrt(x.detach().square().mean(-1) + 1e-6))


def test_a_target_serves_a_backward_pass_with_a_frozen_weight_as_it_is_and_its_gradient_is_dropped(scoped_registry):
    # A target's builder takes the forward's params (skip_outputs is the in-tree kernels'); what
    # its kernel returns for a skipped gradient is not the caller's to see.
    built = []

    def build_forward(x, weight, *, normalized_shape, eps):
        return lambda x, weight: F.rms_norm(x, normalized_shape, weight, eps).detach()

    def build_backward(dy, x, weight, rstd, *, normalized_shape, eps):
        built.append((normalized_shape, eps))
        return lambda dy, x, weight, rstd: RMSNormBwdOp(normalized_shape, eps, target="builtin")(dy, x, weight, rstd)

    register_kernel_builder(op="RMSNormFwdOp", target="both", build_kernel=build_forward)
    register_kernel_builder(op="RMSNormBwdOp", target="both", build_kernel=build_backward)
    x, weight = torch.randn(2, 8, requires_grad=True), torch.randn(8)
    op = RMSNormFwdOp(8, eps=1e-6, target="both")
    op(x, weight).sum().backward()
    x2 = x.detach().clone().requires_grad_()
    F.rms_norm(x2, (8,), weight, 1e-6).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    assert weight.grad is None and built == [((8,), 1e-6)]
    skipping = op.backward_op_for([True, False], [True, True])
    assert skipping.target == "both" and skipping(torch.ones(2, 8), x.detach(), weight)[1] is None


class _PreNormBlock(torch.nn.Module):
    """Two pre-norm residual layers (norm, linear, residual add), as in a transformer."""

    def __init__(self, n: int, tileops: bool) -> None:
        super().__init__()
        self.norm_weights = torch.nn.ParameterList([torch.nn.Parameter(1 + 0.1 * torch.randn(n)) for _ in range(2)])
        self.bias = torch.nn.Parameter(0.1 * torch.randn(n))
        self.linears = torch.nn.ModuleList([torch.nn.Linear(n, n) for _ in range(2)])
        self.tileops = tileops
        if tileops:
            self.first = RMSNormFwdOp(n, eps=1e-6)
            self.fused = FusedAddLayerNormFwdOp(n)

    def forward(self, x):
        w1, w2 = self.norm_weights
        if self.tileops:
            h = self.linears[0](self.first(x, w1))
            y, residual = self.fused(h, x, w2, self.bias)
        else:
            h = self.linears[0](F.rms_norm(x, (x.shape[-1],), w1, 1e-6))
            residual = h + x
            y = F.layer_norm(residual, (x.shape[-1],), w2, self.bias)
        return self.linears[1](y) + residual


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_pre_norm_block_trains_as_the_same_block_with_torch_ops(compiled):
    torch.manual_seed(0)
    ours = _PreNormBlock(64, tileops=True)
    theirs = _PreNormBlock(64, tileops=False)
    theirs.load_state_dict(ours.state_dict())
    losses = train_side_by_side([ours, theirs], torch.randn(6, 8, 64), torch.randn(6, 8, 64), compiled=compiled)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-5)
    assert losses[0][-1] < losses[0][0]
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_backend_kernel_type_for_the_backward_interface_serves_the_backward_call(scoped_registry):
    served = []

    class CountingBackward(Kernel, RMSNormBwdInterface):
        devices = frozenset({"cpu"})

        @classmethod
        def entry_for(cls, call):
            return (call.n, call.eps), lambda: cls(call.eps)

        def __init__(self, eps):
            super().__init__()
            self.eps = eps

        def forward(self, dy, x, weight, rstd):
            served.append(rstd)
            return TorchCpuRMSNormBwd(x.shape[-1], self.eps).forward(dy, x, weight, rstd)

    register_kernel_type("RMSNormBwdOp", "counting_backward", CountingBackward)
    x, weight = torch.randn(3, 300, requires_grad=True), torch.randn(300, requires_grad=True)
    op = RMSNormFwdOp(300)
    op(x, weight).sum().backward()
    assert [key for key, _ in op.backward_op.built_kernels()] == ["counting_backward"]
    # The in-tree CPU forward saved rstd; the backend's backward received it.
    torch.testing.assert_close(served[0], torch.rsqrt(x.detach().square().mean(-1) + torch.finfo(torch.float32).eps))
    x2, w2 = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    F.rms_norm(x2, (300,), w2, torch.finfo(torch.float32).eps).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_backend_kernel_that_sums_a_frozen_weight_anyway_leaves_it_without_a_gradient(scoped_registry, compiled):
    # A backend's kernel may ignore the call spec's parameter_gradients and sum dweight all the
    # same: the op's result is None there, as it declares, and the weight gets no .grad.
    specs = []

    class AlwaysSums(Kernel, RMSNormBwdInterface):
        devices = frozenset({"cpu"})

        @classmethod
        def entry_for(cls, call):
            specs.append(call)
            return (call.n, call.eps), lambda: cls(call.n, call.eps)

        def __init__(self, n, eps):
            super().__init__()
            self.reference = TorchCpuRMSNormBwd(n, eps)  # sums the weight's gradient: built without the flag

        def forward(self, dy, x, weight, rstd):
            dx, dweight = self.reference.forward(dy, x, weight, rstd)
            assert dweight is not None
            return dx, dweight

    register_kernel_type("RMSNormBwdOp", "always_sums", AlwaysSums)
    op = RMSNormFwdOp(64)
    x, weight = torch.randn(4, 64, requires_grad=True), torch.randn(64)
    step = torch.compile(lambda x, weight: op(x, weight).sum(), fullgraph=True) if compiled else lambda x, weight: op(x, weight).sum()
    step(x, weight).backward()
    x2 = x.detach().clone().requires_grad_()
    F.rms_norm(x2, (64,), weight, torch.finfo(torch.float32).eps).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    assert weight.grad is None
    assert [spec.parameter_gradients for spec in specs] == [False]
    assert op.backward_op_for([True, False], [True, True])(torch.ones(4, 64), x.detach(), weight)[1] is None
