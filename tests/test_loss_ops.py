"""The loss family on the CPU: every small manifest workload against the reference, the ops against
torch.nn.functional.cross_entropy for every option and reduction, gradients (gradcheck in float64,
and against torch's autograd), a compiled training step, and bad calls."""

from __future__ import annotations

import gc
import itertools
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tileops.backend import OpArgumentError, OpNotAvailableError
from tileops.ops import FAMILIES, CrossEntropyBwdOp, CrossEntropyFwdOp, CrossEntropyPerRowFwdOp
from tileops.testing import check_workload, workload_cases

from helpers import ROOT

#: The CPU tier runs workloads up to this many elements in all; larger ones run in the GPU tier.
CPU_ELEMENTS = 1 << 21

CASES = [case for case in workload_cases(FAMILIES["loss"]) if case.elements <= CPU_ELEMENTS]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_small_workload_matches_the_reference_on_cpu(case):
    op = case.op_class(**case.workload.params)
    check_workload(op, case.workload, case.dtype, "cpu")


def _torch_loss(logits, target_ids, *, ignore_index=-100, label_smoothing=0.0, reduction="mean", lse_square_scale=0.0, softcap=None):
    """The loss as a torch user writes it: F.cross_entropy plus PaLM's z-loss, soft-capped first."""
    z = logits if softcap is None else softcap * torch.tanh(logits / softcap)
    loss = F.cross_entropy(z, target_ids, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction)
    keep = target_ids != ignore_index
    z_loss = lse_square_scale * torch.logsumexp(z, -1).square() * keep
    if reduction == "none":
        return loss + z_loss
    return loss + z_loss.sum() / (keep.sum().clamp(min=1) if reduction == "mean" else 1)


def _logits_and_targets(rows=9, vocab=37, dtype=torch.float64, ignore_index=-100, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=generator, dtype=torch.float64) * 3).to(dtype)
    target_ids = torch.randint(0, vocab, (rows,), generator=generator)
    target_ids[::4] = ignore_index
    return logits, target_ids


OPTIONS = [
    dict(zip(("label_smoothing", "lse_square_scale", "softcap"), values))
    for values in itertools.product((0.0, 0.1), (0.0, 1e-2), (None, 5.0))
]
OPTION_IDS = [f"ls{o['label_smoothing']}-z{o['lse_square_scale']}-cap{o['softcap']}" for o in OPTIONS]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
def test_loss_and_gradient_match_torch_for_every_option(options, reduction):
    ignore_index = 5
    logits, target_ids = _logits_and_targets(ignore_index=ignore_index)
    if reduction == "none":
        op = CrossEntropyPerRowFwdOp(ignore_index=ignore_index, **options)
    else:
        op = CrossEntropyFwdOp(ignore_index=ignore_index, reduction=reduction, **options)
    ours = logits.clone().requires_grad_()
    theirs = logits.clone().requires_grad_()
    loss, lse = op(ours, target_ids)
    expected = _torch_loss(theirs, target_ids, ignore_index=ignore_index, reduction=reduction, **options)
    torch.testing.assert_close(loss, expected, atol=1e-12, rtol=1e-12)
    z = theirs if options["softcap"] is None else options["softcap"] * torch.tanh(theirs / options["softcap"])
    torch.testing.assert_close(lse, torch.logsumexp(z, -1).float().detach())
    incoming = torch.randn_like(loss)
    (loss * incoming).sum().backward()
    (expected * incoming).sum().backward()
    torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_gradcheck_in_float64(reduction):
    logits, target_ids = _logits_and_targets(rows=5, vocab=7)
    options = {"label_smoothing": 0.2, "lse_square_scale": 0.05, "softcap": 4.0}
    if reduction == "none":
        op = CrossEntropyPerRowFwdOp(**options)
    else:
        op = CrossEntropyFwdOp(reduction=reduction, **options)
    # The loss output: lse is float32 by its signature, too coarse for finite differences.
    assert torch.autograd.gradcheck(lambda x: op(x, target_ids)[0], (logits.requires_grad_(),))


def test_the_gradient_of_lse_is_the_softmax():
    logits, target_ids = _logits_and_targets(rows=4, vocab=10)
    x = logits.clone().requires_grad_()
    _, lse = CrossEntropyFwdOp()(x, target_ids)
    dlse = torch.randn(4)
    lse.backward(dlse)
    torch.testing.assert_close(x.grad, torch.softmax(logits, -1) * dlse.double()[:, None])


def test_the_backward_of_a_loss_whose_lse_goes_unused_receives_no_lse_gradient(monkeypatch):
    """An output the graph never used reaches the backward op as None where it takes that
    gradient as optional: no zeros are made and summed (two launches of a training step on CUDA);
    where only lse is used, the loss's gradient, which the backward op needs, comes as zeros."""
    received = []
    forward = CrossEntropyBwdOp.forward

    def spy(self, dloss, dlse, *rest):
        received.append((dloss, dlse))
        return forward(self, dloss, dlse, *rest)

    monkeypatch.setattr(CrossEntropyBwdOp, "forward", spy)
    logits, target_ids = _logits_and_targets(rows=4, vocab=10)
    x = logits.clone().requires_grad_()
    loss, _ = CrossEntropyFwdOp()(x, target_ids)
    loss.backward()
    (dloss, dlse), = received
    assert dlse is None and dloss.item() == 1.0
    expected = logits.clone().requires_grad_()
    F.cross_entropy(expected, target_ids).backward()
    torch.testing.assert_close(x.grad, expected.grad)
    received.clear()
    _, lse = CrossEntropyFwdOp()(logits.clone().requires_grad_(), target_ids)
    lse.sum().backward()
    (dloss, dlse), = received
    assert dloss.shape == () and dloss.item() == 0.0 and torch.equal(dlse, torch.ones(4))


def test_a_benchmarked_training_step_starts_from_the_loss_and_leaves_lse_unused():
    from tileops.cli.bench_training import incoming_grads

    loss, lse = torch.tensor(2.0), torch.zeros(3)
    ones, unused = incoming_grads(CrossEntropyFwdOp.manifest_entry(), (loss, lse))
    assert torch.equal(ones, torch.ones(())) and unused is None
    per_row, unused = incoming_grads(CrossEntropyPerRowFwdOp.manifest_entry(), (lse, lse))
    assert per_row.shape == (3,) and unused is None
    # The backward op alone is timed on what that step hands it: dloss 1, no dlse, and the
    # forward's own logits, lse and saved gradient (nothing derived again).
    from tileops.cli.bench_training import backward_inputs, backward_of

    backward, _ = backward_of(CrossEntropyFwdOp)
    logits, target_ids = _logits_and_targets(rows=3, vocab=10, dtype=torch.float32)
    op = CrossEntropyFwdOp()
    loss, lse = op(logits, target_ids)
    made = backward_inputs(op, backward, (logits, target_ids), incoming_grads(op.manifest_entry(), (loss, lse)))
    assert "dlse" not in made and torch.equal(made["dloss"], torch.ones(()))
    assert made["logits"].data_ptr() == logits.data_ptr() and made["target_ids"].data_ptr() == target_ids.data_ptr()
    assert torch.equal(made["lse"], lse)
    expected = logits.clone().requires_grad_()
    F.cross_entropy(expected, target_ids).backward()
    torch.testing.assert_close(made["grad_logits"], expected.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_low_precision_logits_compute_in_float32(dtype):
    logits, target_ids = _logits_and_targets(rows=16, vocab=1001, dtype=dtype)
    x = logits.clone().requires_grad_()
    loss, lse = CrossEntropyFwdOp(label_smoothing=0.1)(x, target_ids)
    assert loss.dtype == dtype and lse.dtype == torch.float32
    reference = logits.double().requires_grad_()
    expected = F.cross_entropy(reference, target_ids, label_smoothing=0.1)
    expected.backward()
    torch.testing.assert_close(loss.double(), expected.detach().to(dtype).double(), atol=0, rtol=0)
    loss.backward()
    assert x.grad.dtype == dtype
    torch.testing.assert_close(x.grad.double(), reference.grad.to(dtype).double(), atol=1e-6, rtol=1e-2)


def test_int32_targets_give_what_int64_targets_give():
    logits, target_ids = _logits_and_targets()
    op = CrossEntropyFwdOp(label_smoothing=0.1)
    torch.testing.assert_close(op(logits, target_ids.int()), op(logits, target_ids))


def test_every_row_ignored_gives_torch_results():
    """The mean over no row is 0 / 0 = nan and the sum is 0, as torch gives; the gradient is 0."""
    logits, _ = _logits_and_targets(rows=3)
    target_ids = torch.full((3,), -100)
    for reduction in ("mean", "sum"):
        x = logits.clone().requires_grad_()
        loss, _ = CrossEntropyFwdOp(reduction=reduction, lse_square_scale=1e-2)(x, target_ids)
        expected = F.cross_entropy(logits, target_ids, reduction=reduction)
        torch.testing.assert_close(loss, expected, equal_nan=True)
        loss.backward()
        assert torch.equal(x.grad, torch.zeros_like(logits))


def test_edge_shapes():
    one_class = torch.randn(4, 1, dtype=torch.float64)
    zeros = torch.zeros(4, dtype=torch.long)
    torch.testing.assert_close(CrossEntropyFwdOp()(one_class, zeros)[0], F.cross_entropy(one_class, zeros))
    one_row, target = torch.randn(1, 33, dtype=torch.float64), torch.tensor([32])
    torch.testing.assert_close(CrossEntropyPerRowFwdOp()(one_row, target)[0], F.cross_entropy(one_row, target, reduction="none"))
    no_rows = torch.empty(0, 33)
    loss, lse = CrossEntropyFwdOp()(no_rows, torch.empty(0, dtype=torch.long))
    assert loss.isnan() and lse.shape == (0,)


def test_the_backward_op_alone_scales_the_saved_gradient_in_place_or_computes_it_again_for_dlse():
    logits, target_ids = _logits_and_targets(rows=6, vocab=20)
    op = CrossEntropyBwdOp(reduction="sum", lse_square_scale=0.1)
    lse = torch.logsumexp(logits, -1).float()
    x = logits.clone().requires_grad_()
    _torch_loss(x, target_ids, reduction="sum", lse_square_scale=0.1).backward()
    unit = x.grad.clone()
    dloss = torch.tensor(2.0, dtype=torch.float64)
    saved = unit.clone()
    dlogits = op(dloss, None, logits, target_ids, lse, saved)
    assert dlogits is saved
    torch.testing.assert_close(dlogits, 2.0 * unit)
    # With lse's gradient the saved one cannot serve: the gradient comes from the logits, over it.
    dlse = torch.randn(6)
    x.grad = None
    loss = _torch_loss(x, target_ids, reduction="sum", lse_square_scale=0.1)
    torch.autograd.backward((loss, torch.logsumexp(x, -1)), (dloss, dlse.double()))
    stale = torch.full_like(unit, float("nan"))
    torch.testing.assert_close(op(dloss, dlse, logits, target_ids, lse, stale), x.grad)


def test_out_of_range_targets_are_refused_by_name():
    logits, target_ids = _logits_and_targets(rows=4, vocab=10, ignore_index=-7)
    for bad, row in ((10, 2), (-1, 1), (-100, 3)):
        given = target_ids.clone()
        given[row] = bad
        op = CrossEntropyFwdOp(ignore_index=-7)
        with pytest.raises(OpArgumentError, match=rf"CrossEntropyFwdOp: argument 'target_ids' holds {bad} at row {row}; expected a class in \[0, 10\) \(V = 10\) or ignore_index \(-7\)"):
            op(logits, given)


def test_every_op_refuses_an_out_of_range_target_even_among_logits_that_are_not_finite():
    from tileops.ops import LinearCrossEntropyFwdOp

    logits, target_ids = _logits_and_targets(rows=6, vocab=10, ignore_index=-100)
    logits[1, 3] = float("inf")  # a loss that is not finite already, whatever the targets
    target_ids[4] = 10
    hidden_states, weight = torch.randn(6, 4), torch.randn(10, 4)
    calls = {
        "CrossEntropyFwdOp": lambda: CrossEntropyFwdOp(reduction="sum")(logits, target_ids),
        "CrossEntropyPerRowFwdOp": lambda: CrossEntropyPerRowFwdOp()(logits, target_ids),
        "LinearCrossEntropyFwdOp": lambda: LinearCrossEntropyFwdOp()(hidden_states, weight, None, target_ids),
    }
    for name, call in calls.items():
        with pytest.raises(OpArgumentError, match=rf"{name}: argument 'target_ids' holds 10 at row 4"):
            call()


def test_logits_that_are_not_finite_give_a_loss_that_is_not_finite_and_no_error():
    logits, target_ids = _logits_and_targets(rows=6, vocab=10, ignore_index=-100)
    logits[1, 3] = float("inf")
    logits[2, 0] = float("nan")
    rows, _ = CrossEntropyPerRowFwdOp()(logits, target_ids)
    want = F.cross_entropy(logits, target_ids, reduction="none")
    assert torch.equal(torch.isfinite(rows), torch.isfinite(want))
    torch.testing.assert_close(rows[torch.isfinite(want)], want[torch.isfinite(want)])
    for reduction in ("mean", "sum"):
        assert not CrossEntropyFwdOp(reduction=reduction)(logits, target_ids)[0].isfinite()


def test_bad_params_and_calls_name_the_op():
    with pytest.raises(OpArgumentError, match="CrossEntropyFwdOp: reduction must be 'mean' or 'sum'.*CrossEntropyPerRowFwdOp"):
        CrossEntropyFwdOp(reduction="none")
    with pytest.raises(OpArgumentError, match="label_smoothing must be in"):
        CrossEntropyFwdOp(label_smoothing=1.5)
    with pytest.raises(OpArgumentError, match="softcap must be positive"):
        CrossEntropyPerRowFwdOp(softcap=0.0)
    with pytest.raises(OpArgumentError, match="argument 'target_ids' expected dtype"):
        CrossEntropyFwdOp()(torch.randn(2, 3), torch.tensor([0.0, 1.0]))
    with pytest.raises(OpArgumentError, match="argument 'target_ids' expected shape"):
        CrossEntropyFwdOp()(torch.randn(2, 3), torch.tensor([0, 1, 2]))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_classifier_trains_as_the_same_classifier_with_torch(compiled):
    torch.manual_seed(0)
    ours_head, theirs_head = torch.nn.Linear(16, 50), torch.nn.Linear(16, 50)
    theirs_head.load_state_dict(ours_head.state_dict())
    loss_op = CrossEntropyFwdOp(label_smoothing=0.1, lse_square_scale=1e-3, softcap=20.0)

    def ours(h, t):
        return loss_op(ours_head(h), t)[0]

    def theirs(h, t):
        return _torch_loss(theirs_head(h), t, label_smoothing=0.1, lse_square_scale=1e-3, softcap=20.0)

    if compiled:
        ours = torch.compile(ours, fullgraph=True)
    hidden_states, target_ids = torch.randn(32, 16), torch.randint(0, 50, (32,))
    target_ids[::5] = -100
    for head, step in ((ours_head, ours), (theirs_head, theirs)):
        optimiser = torch.optim.SGD(head.parameters(), lr=0.1)
        losses = []
        for _ in range(4):
            optimiser.zero_grad()
            loss = step(hidden_states, target_ids)
            loss.backward()
            optimiser.step()
            losses.append(loss.item())
        head.losses = losses
    torch.testing.assert_close(ours_head.losses, theirs_head.losses, atol=1e-5, rtol=1e-5)


# -- the fused linear cross-entropy ------------------------------------------------------------


def test_linear_cross_entropy_chunks_are_gemm_bound_within_the_memory_the_call_holds():
    from tileops.ops.loss.linear import GEMM_BOUND_ROWS, chunk_rows

    # A 1.2B Llama's loss: 384-row chunks (the GEMM's ridge; a quarter of the weight's gradient
    # would allow 512), not the 131 rows whose logits fit the hidden states' memory.
    assert chunk_rows(8192, 2048, 128256) == GEMM_BOUND_ROWS == 384
    assert chunk_rows(8192, 4096, 128256) == 384
    # A narrow model: a quarter of the weight gradient's memory is 224 rows of logits.
    assert chunk_rows(8192, 896, 151936) == 224
    # Many rows: the hidden states' memory allows more (131072 x 4096 hidden, 4186 rows of logits).
    assert chunk_rows(131072, 4096, 128256) == 4186
    assert chunk_rows(3, 8, 1000) == 2 and chunk_rows(10, 100, 50) == 10 and chunk_rows(1, 2, 1000) == 1


@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_linear_cross_entropy_gradcheck_over_several_chunks(with_bias):
    from tileops.ops import LinearCrossEntropyFwdOp
    from tileops.ops.loss.linear import chunk_rows

    generator = torch.Generator().manual_seed(0)
    # 3 chunks of 6 rows (the last of 1): few elements, since gradcheck calls the op twice per element.
    hidden_states = torch.randn(13, 4, generator=generator, dtype=torch.float64).requires_grad_()
    weight = torch.randn(10, 4, generator=generator, dtype=torch.float64).requires_grad_()
    bias = torch.randn(10, generator=generator, dtype=torch.float64).requires_grad_() if with_bias else None
    target_ids = torch.randint(0, 10, (13,), generator=generator)
    target_ids[::5] = -100
    assert chunk_rows(13, 4, 10) == 6
    op = LinearCrossEntropyFwdOp(label_smoothing=0.1, lse_square_scale=0.01, softcap=5.0)
    inputs = (hidden_states, weight, bias) if with_bias else (hidden_states, weight)
    assert torch.autograd.gradcheck(lambda h, w, *b: op(h, w, b[0] if b else None, target_ids), inputs)


def test_linear_cross_entropy_matches_the_logits_path_and_its_backward_op_scales_the_saved_gradients_in_place():
    from tileops.ops import LinearCrossEntropyBwdOp, LinearCrossEntropyFwdOp

    hidden_states, weight = torch.randn(20, 8, dtype=torch.float64), torch.randn(30, 8, dtype=torch.float64)
    target_ids = torch.randint(0, 30, (20,))
    forward = LinearCrossEntropyFwdOp(reduction="sum")
    fused = forward(hidden_states, weight, None, target_ids)
    torch.testing.assert_close(fused, CrossEntropyFwdOp(reduction="sum")(hidden_states @ weight.T, target_ids)[0])
    h, w = hidden_states.clone().requires_grad_(), weight.clone().requires_grad_()
    F.cross_entropy(h @ w.T, target_ids, reduction="sum").backward(torch.tensor(3.0, dtype=torch.float64))
    # Asked for all three (autograd asks only for those its inputs require), with no bias.
    _, saved = forward.forward_saving(hidden_states, weight, None, target_ids, wanted={"hidden_states", "weight", "bias"})
    results = LinearCrossEntropyBwdOp(reduction="sum")(torch.tensor(3.0, dtype=torch.float64), hidden_states, weight, None,
                                                       target_ids, *saved)
    assert all(result is grad for result, grad in zip(results, saved))  # no second weight-sized tensor
    torch.testing.assert_close(results[0], h.grad)
    torch.testing.assert_close(results[1], w.grad)
    zero_bias = torch.zeros(30, dtype=torch.float64, requires_grad=True)  # no bias: that of a zero bias
    F.cross_entropy(hidden_states @ weight.T + zero_bias, target_ids, reduction="sum").backward(torch.tensor(3.0, dtype=torch.float64))
    torch.testing.assert_close(results[2], zero_bias.grad)


class _TensorsOfSize(TorchDispatchMode):
    """Counts the tensors of ``numel`` elements the calls it sees create (not views of their
    arguments)."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        results = [r for r in (result if isinstance(result, (tuple, list)) else (result,)) if isinstance(r, torch.Tensor)]
        held = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        self.count += sum(r.numel() == self.numel and r.untyped_storage().data_ptr() not in held for r in results)
        return result


def test_linear_cross_entropy_training_allocates_one_weight_sized_gradient_and_backward_runs_twice_with_retain_graph():
    from tileops.ops import LinearCrossEntropyFwdOp

    generator = torch.Generator().manual_seed(0)
    hidden_states = torch.randn(24, 8, generator=generator, dtype=torch.float64).requires_grad_()
    weight = torch.randn(50, 8, generator=generator, dtype=torch.float64).requires_grad_()
    target_ids = torch.randint(0, 50, (24,), generator=generator)
    loss = LinearCrossEntropyFwdOp()(hidden_states, weight, None, target_ids)
    counting = _TensorsOfSize(weight.numel())
    with counting:
        loss.backward(torch.tensor(2.0, dtype=torch.float64), retain_graph=True)
    # The weight's gradient is the forward's saved one, scaled where it is: a copy would be a second
    # tensor of the weight's size beside it, at the start of a backward pass, where memory peaks.
    assert counting.count == 0
    h, w = hidden_states.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    (2 * F.cross_entropy(h @ w.T, target_ids)).backward()
    torch.testing.assert_close(weight.grad, w.grad)
    torch.testing.assert_close(hidden_states.grad, h.grad)
    # A second backward through the same call finds the saved gradients used: it computes them again.
    loss.backward(torch.tensor(1.0, dtype=torch.float64))
    torch.testing.assert_close(weight.grad, 1.5 * w.grad)
    torch.testing.assert_close(hidden_states.grad, 1.5 * h.grad)


def test_linear_cross_entropy_does_not_keep_its_hidden_states_alive_until_the_backward():
    from tileops.ops import LinearCrossEntropyFwdOp

    generator = torch.Generator().manual_seed(1)
    before = torch.randn(24, 8, generator=generator, dtype=torch.float64).requires_grad_()
    weight = torch.randn(50, 8, generator=generator, dtype=torch.float64).requires_grad_()
    target_ids = torch.randint(0, 50, (24,), generator=generator)
    hidden_states = before.clone()  # a model's temporary, as a final norm's output: nothing else holds it
    held = weakref.ref(hidden_states)
    loss = LinearCrossEntropyFwdOp()(hidden_states, weight, None, target_ids)
    del hidden_states
    gc.collect()
    # The backward op reads only its shape (access: shape): the node keeps a stand-in, and a
    # training step's memory peak (where the backward starts) does not hold the hidden states.
    assert held() is None
    loss.backward(retain_graph=True)
    h, w = before.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    F.cross_entropy(h @ w.T, target_ids).backward()
    torch.testing.assert_close(before.grad, h.grad)
    torch.testing.assert_close(weight.grad, w.grad)
    # A second backward would compute the consumed gradients again from the hidden states: gone.
    with pytest.raises(OpNotAvailableError, match=r"LinearCrossEntropyFwdOp: a second backward .* hidden_states was freed"):
        loss.backward()


@pytest.mark.parametrize("frozen", ["weight", "bias", "none"])
def test_linear_cross_entropy_computes_in_its_forward_only_the_gradients_its_inputs_require(frozen):
    from tileops.ops import LinearCrossEntropyFwdOp

    generator = torch.Generator().manual_seed(3)
    hidden_states = torch.randn(24, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(56, 8, generator=generator, dtype=torch.float64, requires_grad=frozen != "weight")
    bias = None if frozen == "bias" else torch.randn(56, generator=generator, dtype=torch.float64, requires_grad=True)
    target_ids = torch.randint(0, 56, (24,), generator=generator)
    # The forward pass computes the gradients: a frozen lm-head (LoRA) costs no weight-sized tensor
    # and no weight-gradient GEMM, a missing bias no column sums of the logits' gradient.
    weight_sized, bias_sized = _TensorsOfSize(weight.numel()), _TensorsOfSize(56)
    with weight_sized, bias_sized:
        loss = LinearCrossEntropyFwdOp()(hidden_states, weight, bias, target_ids)
    assert (weight_sized.count == 0) == (frozen == "weight")
    assert (bias_sized.count == 0) == (frozen == "bias")
    loss.backward()
    h, w = hidden_states.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_(weight.requires_grad)
    b = None if bias is None else bias.detach().clone().requires_grad_()
    F.cross_entropy(F.linear(h, w, b), target_ids).backward()
    torch.testing.assert_close(hidden_states.grad, h.grad)
    assert (weight.grad is None) == (frozen == "weight")
    if weight.grad is not None:
        torch.testing.assert_close(weight.grad, w.grad)
    if bias is not None:
        torch.testing.assert_close(bias.grad, b.grad)


def test_linear_cross_entropy_holds_one_chunk_of_logits_at_a_time():
    import weakref

    from tileops.ops import LinearCrossEntropyFwdOp
    from tileops.ops.loss.linear import chunk_rows

    hidden_states = torch.randn(24, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(1000, 8, dtype=torch.float64, requires_grad=True)
    target_ids = torch.randint(0, 1000, (24,))
    chunk = chunk_rows(24, 8, 1000) * 1000
    assert chunk < 24 * 1000  # several chunks

    class LiveChunks(TorchDispatchMode):
        """The most chunks' logits alive at once."""

        def __init__(self):
            super().__init__()
            self.alive = self.most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) and result.numel() == chunk:
                self.alive += 1  # a chunk's logits, from its GEMM
                self.most = max(self.most, self.alive)
                weakref.finalize(result, self.freed)
            return result

        def freed(self):
            self.alive -= 1

    live = LiveChunks()
    with live:
        LinearCrossEntropyFwdOp()(hidden_states, weight, None, target_ids)
    # The extra memory of the loss is one chunk's logits (their gradient is written over them).
    assert live.most == 1


@pytest.mark.parametrize(
    ("declared", "message"),
    [
        ("{grad_weight: target_ids}", "field backward.saved_for.grad_weight: names 'target_ids', which gets no gradient"),
        ("{dloss: weight}", "field backward.saved_for: unknown field(s) 'dloss'"),
        ("{grad_weight: weight}\n    # required", "LinearCrossEntropyBwdOp's input 'grad_weight' must be optional"),
    ],
)
def test_a_statistic_saved_for_an_input_must_serve_a_gradient_and_be_optional_in_the_backward(declared, message):
    from tileops.core.errors import ManifestError
    from tileops.core.manifest.loader import parse_manifest

    text = (ROOT / "manifest/loss.yaml").read_text()
    shipped = "saved_for: {grad_hidden: hidden_states, grad_weight: weight, grad_bias: bias}"
    assert shipped in text
    text = text.replace(shipped, f"saved_for: {declared}")
    if "required" in declared:
        grad_weight = "      grad_weight:\n        dtype: {same_as: dloss}\n        shape: [V, H]\n        access: readwrite\n        optional: true\n"
        assert grad_weight in text
        text = text.replace(grad_weight, grad_weight.replace("        optional: true\n", ""))
    with pytest.raises(ManifestError, match="op LinearCrossEntropyFwdOp") as raised:
        parse_manifest(text, "loss.yaml")
    assert message in str(raised.value)


def test_a_compiled_step_with_a_frozen_lm_head_trains_the_hidden_states_alone():
    from tileops.ops import LinearCrossEntropyFwdOp

    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(40, 8, generator=generator)  # frozen
    target_ids = torch.randint(0, 40, (12,), generator=generator)
    op = LinearCrossEntropyFwdOp()
    step = torch.compile(lambda h, w, t: op(h, w, None, t) * 2, fullgraph=True)
    for trainable_weight in (False, True):  # the second call traces the other gradients anew
        w = weight.clone().requires_grad_(trainable_weight)
        h = torch.randn(12, 8, generator=generator, requires_grad=True)
        step(h, w, target_ids).backward()
        h_ref, w_ref = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_(trainable_weight)
        (2 * F.cross_entropy(h_ref @ w_ref.T, target_ids)).backward()
        torch.testing.assert_close(h.grad, h_ref.grad)
        assert (w.grad is None) != trainable_weight
        if trainable_weight:
            torch.testing.assert_close(w.grad, w_ref.grad)


def test_the_peer_table_names_family_ops_and_builds_liger_losses_with_the_ops_options():
    from tileops.ops.loss import OPS, command_line

    assert set(command_line.PEERS) <= {op_class.__name__ for op_class in OPS}
    built = []

    class FakeLoss:
        """Stands for a Liger loss module: records its options and how it is called."""

        def __init__(self, **options):
            built.append(options)

        def __call__(self, *args):
            built.append(args)
            return args

    logits, target_ids = torch.randn(3, 5), torch.tensor([0, 1, 2], dtype=torch.int32)
    params = {"ignore_index": 1, "label_smoothing": 0.1, "reduction": "sum", "lse_square_scale": 0.0, "softcap": 3.0}
    _, adapter = command_line.PEERS["CrossEntropyFwdOp"]["Liger"]
    called = adapter(FakeLoss, {"logits": logits, "target_ids": target_ids}, params)()
    assert built[0] == params and called[0] is logits and called[1].dtype == torch.int64
    _, adapter = command_line.PEERS["CrossEntropyPerRowFwdOp"]["Liger"]
    adapter(FakeLoss, {"logits": logits, "target_ids": target_ids}, {"softcap": None})()
    assert built[2]["reduction"] == "none"
    hidden_states, weight = torch.randn(3, 4), torch.randn(5, 4)
    calls = []

    def quack_cross_entropy(logits, target_ids, *, ignore_index, reduction):  # quack's keywords
        calls.append((target_ids.dtype, ignore_index, reduction))
        return F.cross_entropy(logits, target_ids, ignore_index=ignore_index, reduction=reduction)

    _, adapter = command_line.PEERS["CrossEntropyFwdOp"]["quack"]
    plain = {"ignore_index": 1, "reduction": "sum"}
    torch.testing.assert_close(adapter(quack_cross_entropy, {"logits": logits, "target_ids": target_ids}, plain)(),
                               F.cross_entropy(logits, target_ids.long(), ignore_index=1, reduction="sum"))
    assert calls[-1] == (torch.int64, 1, "sum")
    assert adapter(quack_cross_entropy, {"logits": logits, "target_ids": target_ids}, params) == (
        "has no label_smoothing, softcap"
    )
    _, adapter = command_line.PEERS["CrossEntropyPerRowFwdOp"]["quack"]
    assert adapter(quack_cross_entropy, {"logits": logits, "target_ids": target_ids}, {})().shape == (3,)
    assert calls[-1] == (torch.int64, -100, "none")
    _, adapter = command_line.PEERS["LinearCrossEntropyFwdOp"]["Liger"]
    called = adapter(FakeLoss, {"hidden_states": hidden_states, "weight": weight, "target_ids": target_ids}, params)()
    assert called[0] is weight and called[1] is hidden_states and called[3] is None  # Liger takes the weight first
