"""``tileops bench --backward``: training, for every op whose manifest declares a backward.

Each forward workload gives two rows. **forward+backward** is one training step of the op:
``outputs = op(...)``, then ``torch.autograd.grad(outputs, inputs, grads)`` for the inputs the
declaration gives gradients (the gradients are returned, not accumulated into ``.grad``, as for
a layer inside a network). ``grads`` are random, as the layers after the op would hand them,
except where the declaration's ``incoming`` says otherwise: the objective a step starts its
backward from gets 1 (``.backward()``), an output a training step does not use none.
**backward** is the backward op alone, called on the inputs that step hands it: the incoming
gradients, the forward's inputs and outputs it names, and the saved statistics as the op's own
forward computed them (``Op.backward_inputs``: the autograd node's arguments, nothing derived
again).

The same run times torch eager autograd of the forward's ``torch_api``, ``torch.compile`` of the
same code and each peer's autograd function (``tileops.cli.peers``): forward+backward as above,
backward alone as ``torch.autograd.grad(..., retain_graph=True)`` replayed on the graph of one
forward (run on a stream of its own, which the capture forks to and joins, so that the backward
kernels run where autograd puts them, on the forward's stream). Every side is timed by CUDA-graph
replay. Bandwidth counts the bytes the backward must move (the backward op's roofline), plus the
forward's roofline for forward+backward. A forward+backward row also gives each side's peak
memory: what one eager training step allocates above what was allocated before it (a fused op
such as the linear cross-entropy is used for the memory it saves as much as for its time).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tileops.core.manifest import load_manifest
from tileops.core.manifest import OpEntry, Workload
from tileops.testing import reference_outputs, workload_inputs

from . import bench, call_flags
from .peers import Peers, describe, time_cells

FORWARD_BACKWARD = "forward+backward"
BACKWARD = "backward"
DEVICE = "cuda"


def backward_of(op_class) -> tuple[OpEntry, type | None]:
    """The backward op's manifest entry, and its class where ``tileops.ops`` has one."""
    name = op_class.manifest_entry().backward.op
    return load_manifest(op_class.manifest_file)[name], call_flags.op_classes().get(name)


def outputs_of(result: Any) -> tuple:
    return result if isinstance(result, tuple) else (result,)


def incoming_grads(entry: OpEntry, outputs: Sequence[Any]) -> list[torch.Tensor | None]:
    """The gradient a training step hands each output (``backward.incoming``): 1 for the
    objective, None for an output it does not use, else a random one."""
    made = {"one": torch.ones_like, "none": lambda out: None}
    return [made.get(entry.backward.incoming.get(decl.name), torch.randn_like)(out) for decl, out in zip(entry.outputs, outputs)]


def _differentiable_outputs(result: Any, grads: Sequence[torch.Tensor | None]) -> tuple[list, list]:
    pairs = [
        (out, grad) for out, grad in zip(outputs_of(result), grads)
        if isinstance(out, torch.Tensor) and out.requires_grad and grad is not None
    ]
    if not pairs:
        raise RuntimeError("no output requires grad: the call recorded no autograd history")
    return [out for out, _ in pairs], [grad for _, grad in pairs]


def differentiable_leaves(entry: OpEntry, inputs: dict) -> list[torch.Tensor]:
    """The inputs a training step differentiates (those the manifest's ``backward.grads`` name
    that the call has), set to require grad."""
    leaves = [inputs[name] for name in entry.backward.grads if name in inputs]
    for leaf in leaves:
        leaf.requires_grad_(True)
    return leaves


def training_step(forward: Callable[[], Any], leaves: list[torch.Tensor], grads: list[torch.Tensor]) -> Callable[[], Any]:
    """One forward and its backward: the gradients of ``leaves`` given ``grads`` of the outputs."""

    def step():
        outputs, incoming = _differentiable_outputs(forward(), grads)
        return torch.autograd.grad(outputs, leaves, incoming)

    return step


def retained_backward(forward: Callable[[], Any], leaves: list[torch.Tensor], grads: list[torch.Tensor]) -> Callable[[], Any]:
    """The backward of one forward, to be called again and again: the forward runs once here on a
    stream of its own, and each call forks to that stream, runs the backward there (where autograd
    runs it: on the forward's stream) with the graph retained, and joins the caller's stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        outputs, incoming = _differentiable_outputs(forward(), grads)

    def backward():
        caller = torch.cuda.current_stream()
        stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            result = torch.autograd.grad(outputs, leaves, incoming, retain_graph=True)
        caller.wait_stream(stream)
        return result

    return backward


def peak_mib(call: Callable[[], Any]) -> float:
    """MiB ``call`` allocates at its peak above what is allocated before it (what it returns
    included), one eager call."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del result
    return peak / 2**20


def _time(
    make: Callable[[], Callable[[], Any]], *, peaks: dict[str, float] | None = None, side: str = ""
) -> tuple[float | None, str | None]:
    """The GPU time of the call ``make`` builds, or None and why it could not be had; with
    ``peaks``, its peak memory (after a first call, which may compile) goes in ``peaks[side]``."""
    try:
        call = make()
        call()
        if peaks is not None:
            peaks[side] = peak_mib(call)
        return bench.gpu_time_us(call), None
    except Exception as error:  # noqa: BLE001 - a side that cannot run is shown so, not dropped
        return None, describe(error)


def _no_donated_buffers():
    """torch.compile's backward may reuse the buffers of saved tensors, which a retained graph
    forbids: off while the backward alone is compiled and timed."""
    config = getattr(torch, "_functorch", None) and getattr(torch._functorch, "config", None)
    if config is None or not hasattr(config, "donated_buffer"):
        return contextlib.nullcontext()
    return config.patch(donated_buffer=False)


def backward_inputs(op, backward: OpEntry, arguments: Sequence[Any], grads: Sequence[Any]) -> dict:
    """The backward op's inputs, by name, for one training step of ``op`` on ``arguments`` whose
    outputs get ``grads`` (``incoming_grads``): what the call's autograd node hands it
    (``Op.backward_inputs``), the forward's own inputs, outputs and statistics, detached (the
    backward op alone records no history); an optional input the step does not give is left out."""
    _, made = op.backward_inputs(*arguments, grads=grads)
    return {
        decl.name: value.detach() if isinstance(value, torch.Tensor) else value
        for decl, value in zip(backward.inputs, made) if value is not None
    }


def bench_training(
    op_class, workload: Workload, dtype: torch.dtype, *, with_compile: bool, tune: bool = False, others: Peers | None = None
) -> tuple[bench.Row, bench.Row]:
    """The forward+backward row and the backward row of one forward workload."""
    entry = op_class.manifest_entry()
    backward, backward_class = backward_of(op_class)
    op = op_class(**workload.params)
    params = dict(op.params)
    inputs = workload_inputs(entry, workload, dtype, DEVICE)
    leaves = differentiable_leaves(entry, inputs)
    arguments = [inputs.get(d.name) for d in entry.inputs]
    with torch.no_grad():
        outputs = outputs_of(op(*arguments))
    grads = incoming_grads(entry, outputs)
    shape = "x".join(str(d) for d in inputs[entry.inputs[0].name].shape)
    rows = {
        mode: bench.Row(op=op_class.__name__, workload=workload.name, dtype=str(dtype).removeprefix("torch."), shape=shape,
                        served_by="", ours_us=None, eager_us=None, compile_us=None, bytes=0, mode=mode)
        for mode in (FORWARD_BACKWARD, BACKWARD)
    }
    full, alone = rows[FORWARD_BACKWARD], rows[BACKWARD]

    # TileOPs: the op's own autograd node, and the backward op on its own.
    if tune:
        op.request_tune()
    full.ours_us, full.ours_error = _time(
        lambda: training_step(lambda: op(*arguments), leaves, grads), peaks=full.peak_mib, side="ours"
    )
    backward_outputs = bench_backward_inputs = None
    try:
        bench_backward_inputs = backward_inputs(op, backward, arguments, grads)
    except torch.OutOfMemoryError as error:
        # The forward runs once more for them, beside the step's tensors: where the GPU cannot
        # hold both, the step is still timed.
        alone.ours_error = f"the backward op's inputs did not fit: {describe(error)}"
        torch.cuda.empty_cache()
    if bench_backward_inputs is not None and backward_class is None:
        alone.ours_error = f"{backward.name} is not an op of tileops.ops"
    elif bench_backward_inputs is not None:
        backward_arguments = [bench_backward_inputs.get(d.name) for d in backward.inputs]
        backward_op = backward_class(**workload.params)
        try:
            backward_outputs = outputs_of(backward_op(*backward_arguments))
            if tune:
                backward_op.request_tune()
        except Exception as error:  # noqa: BLE001 - shown in the table
            alone.ours_error = describe(error)
        else:
            alone.ours_us, alone.ours_error = _time(lambda: lambda: backward_op(*backward_arguments))
            del backward_arguments
            alone.served_by = ",".join(sorted({key for key, _ in backward_op.built_kernels()}))
    full.served_by = ",".join(sorted({key for key, _ in op.built_kernels()})) + (f" + {alone.served_by}" if alone.served_by else "")
    if bench_backward_inputs is not None:  # else no bandwidth: the backward's bytes are not known
        if backward_outputs is None:  # the roofline counts the outputs the reference gives
            backward_outputs, _ = reference_outputs(backward, bench_backward_inputs, params)
        backward_bytes = bench._roofline_bytes(backward, bench_backward_inputs, backward_outputs, params)
        full.bytes = bench._roofline_bytes(entry, inputs, outputs, params) + backward_bytes
        alone.bytes = backward_bytes
        del bench_backward_inputs, backward_outputs  # the GiBs of a large workload's, before the peers run

    # torch eager autograd and torch.compile of the forward's torch_api.
    baseline = bench.torch_baseline(entry, params)
    if baseline is not None:
        full.eager_us, _ = _time(
            lambda: training_step(lambda: baseline(*arguments), leaves, grads), peaks=full.peak_mib, side="eager"
        )
        alone.eager_us, _ = _time(lambda: retained_backward(lambda: baseline(*arguments), leaves, grads))
        if with_compile:
            torch._dynamo.reset()
            compiled = torch.compile(baseline, dynamic=False)
            full.compile_us, _ = _time(
                lambda: training_step(lambda: compiled(*arguments), leaves, grads), peaks=full.peak_mib, side="compile"
            )
            torch._dynamo.reset()
            with _no_donated_buffers():
                compiled = torch.compile(baseline, dynamic=False)
                alone.compile_us, _ = _time(lambda: retained_backward(lambda: compiled(*arguments), leaves, grads))

    # Peers: each one's autograd function, both ways.
    if others is not None:
        prepared = others.prepare(op_class.__name__, inputs, params)
        steps = {c: training_step(p, leaves, grads) if callable(p) else p for c, p in prepared.items()}
        full.peers = time_cells(steps, bench.peer_time_us)
        for column, step in steps.items():
            if callable(step) and isinstance(full.peers[column], float):
                full.peak_mib[column] = peak_mib(step)
        alone.peers = {}
        for column, call in prepared.items():
            if not callable(call) or not isinstance(full.peers[column], float):
                alone.peers[column] = full.peers[column]  # the same refusal, or the same failure
                continue
            try:
                backward_call = retained_backward(call, leaves, grads)
            except Exception as error:  # noqa: BLE001 - shown in the table
                alone.peers[column] = "failed: " + describe(error)
                continue
            alone.peers.update(time_cells({column: backward_call}, bench.peer_time_us))
    return full, alone
