"""GPU tier: the loss family's TileLang kernels on CUDA, against the float64 reference and torch.

They need a CUDA GPU (``pytest -m gpu``); elsewhere they skip.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tileops.backend import OpArgumentError
from tileops.ops import (
    FAMILIES,
    CrossEntropyBwdOp,
    CrossEntropyFwdOp,
    CrossEntropyPerRowFwdOp,
    LinearCrossEntropyFwdOp,
)
from tileops.ops.loss.linear import chunk_rows
from helpers import workload_params
from test_loss_ops import _torch_loss
from tileops.testing import check_workload, workload_cases

pytestmark = pytest.mark.gpu

CASES = list(workload_cases(FAMILIES["loss"]))


def _reference_bytes(case) -> int:
    """GPU memory the float64 reference of a workload takes at its peak: (rows, V) float64 tensors,
    three in a forward and five in a backward (autograd's saved tensors and the gradient), two more
    for the cross-entropy backward's grad_logits, derived by float64 autograd. H100, 80 GiB: the
    forward of 16k rows x 151936 fitted; its backward asked 18.55 GiB more beside 72."""
    shapes = case.workload.shapes
    if "logits" in shapes:
        rows, vocab = math.prod(shapes["logits"][:-1]), shapes["logits"][-1]
    else:  # the fused linear loss: hidden_states (rows, H) x weight (V, H)
        rows, vocab = shapes["hidden_states"][0], shapes["weight"][0]
    copies = {"CrossEntropyBwdOp": 7}.get(case.op_class.__name__, 5 if case.op_class.__name__.endswith("BwdOp") else 3)
    return copies * rows * vocab * 8


@pytest.mark.parametrize("case", workload_params(CASES))
def test_every_workload_matches_the_reference_on_cuda(case):
    need, has = _reference_bytes(case), torch.cuda.get_device_properties(0).total_memory
    if need > has:
        pytest.skip(f"the float64 reference needs about {need / 2**30:.0f} GiB of GPU memory; this GPU has {has / 2**30:.0f} GiB")
    op = case.op_class(**case.workload.params)
    check_workload(op, case.workload, case.dtype, "cuda")
    assert op.target == "builtin"
    keys = {key for key, _ in op.built_kernels()}
    if not case.op_class.kernel_interfaces:  # LinearCrossEntropyBwdOp scales the gradients with torch
        assert keys == set(), keys
    elif case.dtype == torch.float64:
        assert keys <= {"torch_float64", "torch_float64_grad", "torch_float64_scale"}, keys
    else:
        assert keys and keys <= {"tilelang", "tilelang_grad", "tilelang_scale"}, keys


def _case(rows, vocab, dtype, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=generator, device="cuda") * 4).to(dtype)
    target_ids = torch.randint(0, vocab, (rows,), generator=generator, device="cuda")
    target_ids[3::7] = -100
    return logits, target_ids


SHAPES = [(1, 32000), (3, 256000), (64, 151936), (300, 128256), (517, 1001), (9, 1), (2048, 32768), (5, 50257), (300, 50257)]
OPTIONS = [
    {},
    {"label_smoothing": 0.1},
    {"lse_square_scale": 1e-4, "softcap": 30.0},
    {"label_smoothing": 0.05, "lse_square_scale": 1e-3, "softcap": 15.0},
]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "plain")
@pytest.mark.parametrize(("rows", "vocab"), SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_loss_and_gradient_match_torch_in_float64(rows, vocab, dtype, options):
    """Every row length (V = 1, not a multiple of 8, 256k), split and unsplit rows, every option."""
    logits, target_ids = _case(rows, vocab, dtype)
    for reduction in ("mean", "sum", "none"):
        op = CrossEntropyPerRowFwdOp(**options) if reduction == "none" else CrossEntropyFwdOp(reduction=reduction, **options)
        x = logits.clone().requires_grad_()
        loss, lse = op(x, target_ids)
        reference = logits.double().requires_grad_()
        expected = _torch_loss(reference, target_ids, reduction=reduction, **options)
        z = reference if options.get("softcap") is None else options["softcap"] * torch.tanh(reference / options["softcap"])
        torch.testing.assert_close(lse, torch.logsumexp(z, -1).float().detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(loss.double(), expected.detach(), atol=1e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5)
        incoming = torch.randn_like(expected)
        (loss.double() * incoming).sum().backward()
        (expected * incoming).sum().backward()
        # A row's gradient is its weight in the loss times p - y (entries within [-1, 1], scaled by at most
        # 1 + 2 * lse_square_scale * lse): within a few roundings of that weight. Not relative to the largest
        # entry, which is 0 where p - y is (V = 1) and would turn the float32 exp's last bit into a failure.
        weight = incoming.abs().max() / ((target_ids != -100).sum() if reduction == "mean" else 1)
        torch.testing.assert_close(
            x.grad.double() / weight, reference.grad / weight, atol=1e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0
        )


@pytest.mark.parametrize("vocab", [1001, 50257])
def test_an_odd_vocabulary_takes_16_byte_accesses_over_each_row_s_middle_in_both_steps(vocab):
    logits, target_ids = _case(300, vocab, torch.bfloat16)
    # The first and last logits of some rows hold their targets: the edges' columns count.
    target_ids[0], target_ids[1] = 0, vocab - 1
    x = logits.clone().requires_grad_()
    op = CrossEntropyFwdOp(label_smoothing=0.1)
    op(x, target_ids)[0].backward()
    reference = logits.double().requires_grad_()
    F.cross_entropy(reference, target_ids, label_smoothing=0.1).backward()
    torch.testing.assert_close(x.grad.double(), reference.grad, atol=2e-3, rtol=0)
    # The training step: the fused step forward, the scale backward (skipping its pass: dloss is 1).
    assert {key for key, _ in op.built_kernels()} == {"tilelang_fused"}
    assert {key for key, _ in op.backward_op.built_kernels()} == {"tilelang_scale"}
    (_, fused), = op.built_kernels()
    assert fused.config["shifted"] is True and fused.config["vec"] == 8
    with torch.no_grad():
        op(logits, target_ids)
    (_, rows), = [(key, kernel) for key, kernel in op.built_kernels() if key == "tilelang"]
    assert rows.config["shifted"] is True and rows.config["vec"] == 8


@pytest.mark.parametrize("rows", [5, 300], ids=["split-rows-step", "fused-step"])
def test_a_training_step_from_the_loss_and_one_that_also_differentiates_lse(rows):
    """loss.backward() leaves the forward's gradient as it is (the scale skips dloss = 1); an lse
    that is differentiated too has the backward compute the gradient again from the logits."""
    logits, target_ids = _case(rows, 32000, torch.bfloat16)
    op = CrossEntropyFwdOp(lse_square_scale=1e-4)
    reference = logits.double().requires_grad_()
    expected = _torch_loss(reference, target_ids, lse_square_scale=1e-4)
    x = logits.clone().requires_grad_()
    loss, lse = op(x, target_ids)
    loss.backward()
    expected.backward(retain_graph=True)
    torch.testing.assert_close(x.grad.double(), reference.grad, atol=2e-3, rtol=0)
    x.grad, reference.grad = None, None
    dlse = torch.randn(rows, device="cuda")
    loss, lse = op(x, target_ids)
    torch.autograd.backward((loss, lse), (torch.tensor(3.0, device="cuda", dtype=torch.bfloat16), dlse))
    torch.autograd.backward((expected, torch.logsumexp(reference, -1)), (torch.tensor(3.0, device="cuda", dtype=torch.float64), dlse.double()))
    torch.testing.assert_close(x.grad.double(), reference.grad, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("vocab", [1000, 1001])
def test_the_scale_step_multiplies_in_place_and_a_factor_of_one_leaves_the_gradient_as_it_is(vocab):
    op = CrossEntropyBwdOp()
    grad = torch.randn(7, vocab, device="cuda").to(torch.bfloat16)
    before = grad.clone()
    assert op.scaled(grad, torch.tensor(1.0, device="cuda", dtype=torch.bfloat16)) is grad
    assert torch.equal(grad, before)
    op.scaled(grad, torch.tensor(-2.0, device="cuda", dtype=torch.bfloat16))
    assert torch.equal(grad, before * -2.0)


def test_every_row_ignored_gives_nan_for_the_mean_and_zero_gradients():
    logits = torch.randn(5, 1000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target_ids = torch.full((5,), -100, device="cuda")
    loss, _ = CrossEntropyFwdOp()(logits, target_ids)
    assert loss.isnan()
    loss.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))
    assert CrossEntropyFwdOp(reduction="sum")(logits.detach(), target_ids)[0].item() == 0.0


def test_int32_targets_and_an_unaligned_slice():
    logits, target_ids = _case(40, 32001, torch.bfloat16)
    op = CrossEntropyFwdOp(label_smoothing=0.1)
    torch.testing.assert_close(op(logits, target_ids.int()), op(logits, target_ids))
    wide = torch.randn(40, 32008, device="cuda", dtype=torch.bfloat16)
    part = wide[:, 1:32001]  # not contiguous: copied by the call path, then served
    torch.testing.assert_close(op(part, target_ids), op(part.contiguous(), target_ids))


def test_a_target_out_of_range_is_refused_by_name_not_by_a_device_assert():
    logits, target_ids = _case(8, 1000, torch.bfloat16)
    target_ids[5] = 1000
    with pytest.raises(OpArgumentError, match=r"CrossEntropyFwdOp: argument 'target_ids' holds 1000 at row 5; expected a class in \[0, 1000\)"):
        CrossEntropyFwdOp()(logits, target_ids)
    torch.cuda.synchronize()  # the context is healthy: no kernel read out of bounds


def test_under_graph_capture_an_out_of_range_target_gives_nan_and_reads_nothing_out_of_bounds():
    logits, target_ids = _case(8, 1000, torch.bfloat16)
    op = CrossEntropyPerRowFwdOp()
    op(logits, target_ids)  # build outside the capture
    bad = target_ids.clone()
    bad[2] = 5000
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss, _ = op(logits, bad)
    graph.replay()
    torch.cuda.synchronize()
    assert loss[2].isnan() and not loss[torch.arange(8, device="cuda") != 2].isnan().any()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_training_through_the_loss_matches_torch(compiled):
    torch.manual_seed(0)
    ours_head = torch.nn.Linear(256, 32000, device="cuda", dtype=torch.bfloat16)
    theirs_head = torch.nn.Linear(256, 32000, device="cuda", dtype=torch.bfloat16)
    theirs_head.load_state_dict(ours_head.state_dict())
    options = {"label_smoothing": 0.1, "lse_square_scale": 1e-4, "softcap": 30.0}
    loss_op = CrossEntropyFwdOp(**options)

    def ours(h, t):
        return loss_op(ours_head(h), t)[0]

    def theirs(h, t):
        return _torch_loss(theirs_head(h).float(), t, **options)

    if compiled:
        ours = torch.compile(ours, fullgraph=True)
    hidden_states = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    target_ids = torch.randint(0, 32000, (512,), device="cuda")
    target_ids[::9] = -100
    results = []
    for head, step in ((ours_head, ours), (theirs_head, theirs)):
        optimiser = torch.optim.SGD(head.parameters(), lr=0.5)
        losses = []
        for _ in range(3):
            optimiser.zero_grad()
            loss = step(hidden_states, target_ids)
            loss.backward()
            optimiser.step()
            losses.append(loss.float().item())
        results.append(losses)
    torch.testing.assert_close(results[0], results[1], atol=2e-2, rtol=1e-2)


@pytest.mark.large_memory  # its float64 reference: (4096, 128256) logits, 3.9 GiB a copy
def test_linear_cross_entropy_matches_torch_and_needs_less_memory_than_the_logits():
    torch.manual_seed(0)
    rows, hidden_size, vocab = 4096, 2048, 128256
    hidden_states = (torch.randn(rows, hidden_size, device="cuda") / 8).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, device="cuda") / 32).to(torch.bfloat16).requires_grad_()
    target_ids = torch.randint(0, vocab, (rows,), device="cuda")
    target_ids[::11] = -100
    op = LinearCrossEntropyFwdOp(label_smoothing=0.1, softcap=30.0)
    op(hidden_states.detach(), weight.detach(), None, target_ids)  # build the kernels first
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss = op(hidden_states, weight, None, target_ids)
    dhidden, dweight = torch.autograd.grad(loss, (hidden_states, weight))
    peak = torch.cuda.max_memory_allocated() - before
    # What the call keeps: the forward's gradients for a unit loss (weight- and hidden-sized), which
    # the backward scales in place (a scaled copy would be a second weight-sized tensor), plus one
    # chunk's logits, their gradient written over them; nothing grows with rows x vocab.
    weight_bytes, hidden_bytes = weight.numel() * 2, hidden_states.numel() * 2
    chunk_bytes = chunk_rows(rows, hidden_size, vocab) * vocab * 2
    assert chunk_bytes <= rows * vocab * 2 / 8
    assert peak < weight_bytes + 4 * hidden_bytes + chunk_bytes, (peak, weight_bytes, chunk_bytes)
    h = hidden_states.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    expected = _torch_loss(h @ w.T, target_ids, label_smoothing=0.1, softcap=30.0)
    expected.backward()
    torch.testing.assert_close(loss.double(), expected.detach(), atol=2e-2, rtol=1e-2)
    for got, want in ((dhidden, h.grad), (dweight, w.grad)):
        scale = want.abs().max().item()
        torch.testing.assert_close(got.double() / scale, want / scale, atol=2e-2, rtol=0)


@pytest.mark.parametrize("vocab", [128256, 256000])
def test_every_split_build_tuning_candidate_gives_torchs_loss_and_lse(vocab):
    # request_tune on a call of few rows may choose any of them (other split and thread counts).
    from tileops.kernels.cuda.loss import KERNELS, policy
    from tileops.ops.loss import CrossEntropyRowsInterface

    device = torch.device("cuda", torch.cuda.current_device())
    logits = torch.randn(3, vocab, device="cuda", dtype=torch.bfloat16) * 3
    target_ids = torch.tensor([0, vocab - 1, 12345], device="cuda")
    spec = CrossEntropyFwdOp().call_spec(CrossEntropyRowsInterface, device, torch.bfloat16, vocab, torch.int64, True, True)
    kernel = KERNELS[CrossEntropyRowsInterface]["tilelang"](spec)
    expected_loss = torch.nn.functional.cross_entropy(logits.double(), target_ids, reduction="none")
    expected_lse = torch.logsumexp(logits.double(), -1)
    tiers = policy.row_tiers(kernel.default_config(), vocab, kernel.sm_count)
    assert tiers
    for _, tier in tiers:
        for config in policy.tier_candidates(tier, vocab):
            loss, lse = torch.empty(3, device="cuda"), torch.empty(3, device="cuda")
            kernel._launch_function(config, 2)(logits, target_ids, loss, lse)
            torch.testing.assert_close(loss.double(), expected_loss, atol=1e-3, rtol=1e-4, msg=lambda m, config=config: f"{config}: {m}")
            torch.testing.assert_close(lse.double(), expected_lse, atol=1e-3, rtol=1e-4, msg=lambda m, config=config: f"{config}: {m}")
