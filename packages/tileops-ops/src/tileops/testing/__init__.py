"""Checking ops, targets and added kernel types against the manifest.

Backend authors and TileOPs' own tests use the same helpers: ``workload_inputs`` builds the
inputs of a manifest workload, ``reference_outputs`` evaluates the entry's ``ref_api``, and
``check_workload`` runs an op on a workload and compares every output (shape, dtype, values
within the manifest's tolerance for the dtype) with the reference.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from tileops.core import Op, stand_in
from tileops.core.manifest import SKIP_OUTPUTS, OpEntry, Workload, evaluate

__all__ = [
    "WorkloadCase",
    "check_empty_write",
    "check_workload",
    "resize_batch",
    "reference_outputs",
    "smallest_workload",
    "workload_cases",
    "workload_elements",
    "workload_for_shape",
    "workload_inputs",
]


class WorkloadCase:
    """One (op class, workload, dtype) to check; its ``id`` names it in test reports."""

    def __init__(self, op_class: type[Op], workload: Workload, dtype: torch.dtype) -> None:
        self.op_class, self.workload, self.dtype = op_class, workload, dtype

    @property
    def id(self) -> str:
        return f"{self.op_class.__name__}-{self.workload.name}-{str(self.dtype).removeprefix('torch.')}"

    @property
    def elements(self) -> int:
        return workload_elements(self.workload)

    def __repr__(self) -> str:
        return f"WorkloadCase({self.id})"


def workload_elements(workload: Workload) -> int:
    """How many elements all of ``workload``'s inputs hold together."""
    return sum(math.prod(shape) for shape in workload.shapes.values())


def smallest_workload(op_class) -> Workload:
    """The workload of ``op_class`` whose inputs hold the fewest elements: what a call that checks
    what the op does with any input (or shows it running) needs, at the least cost."""
    return min(op_class.manifest_entry().workloads, key=workload_elements)


def workload_cases(op_classes) -> Iterator[WorkloadCase]:
    """Every (op, workload, dtype) the manifest declares for ``op_classes``."""
    for op_class in op_classes:
        for workload in op_class.manifest_entry().workloads:
            for dtype in workload.dtypes:
                yield WorkloadCase(op_class, workload, dtype)


def workload_inputs(
    entry: OpEntry, workload: Workload, dtype: torch.dtype, device: torch.device | str, *, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random inputs of ``workload`` in ``dtype`` on ``device`` (inputs it omits are absent);
    an input the manifest derives from the others (a forward's saved statistics) is computed
    by its ``derive`` expression instead."""
    generator = torch.Generator().manual_seed(seed)
    inputs = {}
    for decl in entry.inputs:
        if decl.name in workload.shapes and decl.derive_code is None:
            tensor = torch.randn(workload.shapes[decl.name], generator=generator, dtype=torch.float32)
            inputs[decl.name] = tensor.to(device=device, dtype=decl.dtype_in(dtype))
    derived = [decl for decl in entry.inputs if decl.name in workload.shapes and decl.derive_code is not None]
    if derived:
        namespace: dict[str, Any] = {decl.name: None for decl in entry.inputs}
        namespace.update({p.name: p.default for p in entry.params if not p.required}, **workload.params)
        namespace.update(inputs, torch=torch, F=F)
        for decl in derived:  # in declaration order: a derive may use the ones before it
            inputs[decl.name] = namespace[decl.name] = evaluate(decl.derive_code, namespace)
    return {decl.name: inputs[decl.name] for decl in entry.inputs if decl.name in inputs}


def reference_outputs(
    entry: OpEntry, inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]
) -> tuple[tuple, dict[str, torch.Tensor]]:
    """The entry's ``ref_api`` evaluated on clones of ``inputs``: its outputs (None for those
    ``params`` skip), and the clones of the inputs the op writes, as the reference left them."""
    namespace: dict[str, Any] = {decl.name: None for decl in entry.inputs}
    namespace.update({name: tensor.clone() for name, tensor in inputs.items()})
    namespace.update(params)
    namespace.update(torch=torch, F=F)
    result = evaluate(entry.ref_code, namespace)
    written = {d.name: namespace[d.name] for d in entry.inputs if d.written and namespace[d.name] is not None}
    results = result if isinstance(result, tuple) else (result,)
    skipped = params.get(SKIP_OUTPUTS)
    if skipped:
        results = tuple(None if decl.name in skipped else r for decl, r in zip(entry.outputs, results))
    return results, written


def check_workload(
    op: Op,
    workload: Workload,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    seed: int = 0,
    out_buffers: bool = False,
) -> tuple:
    """Run ``op`` on ``workload`` and assert every output matches the reference.

    Checks the number, shapes, dtypes and device of the outputs, their values within the
    manifest's tolerance for ``dtype``, the inputs the op writes, and outputs that alias a
    written input. With ``out_buffers``, passes a buffer for every output that accepts one and
    checks the op returns and fills it. An input declared ``access: shape`` reaches the op as a
    one-element stand-in of its shape (as an autograd node passes it), the reference its values:
    an implementation that reads its values fails here. Returns the op's outputs as a tuple;
    raises AssertionError naming the op, the workload, the dtype and what differs.
    """
    entry = type(op).manifest_entry()
    inputs = workload_inputs(entry, workload, dtype, device, seed=seed)
    expected, expected_written = reference_outputs(entry, inputs, op.params)
    where = f"{entry.name} on workload {workload.name!r} in {dtype} on {device}"
    buffers = {}
    if out_buffers:
        for decl, want in zip(entry.outputs, expected):
            if decl.out:
                buffers[decl.out] = torch.empty_like(want)
    described = {name: stand_in(t) for name, t in inputs.items() if entry.input(name).described_only}
    result = op(**{**inputs, **described}, **buffers)
    outputs = result if isinstance(result, tuple) else (result,)
    assert len(outputs) == len(entry.outputs), f"{where}: {len(outputs)} outputs, the manifest declares {len(entry.outputs)}"
    for decl, got, want in zip(entry.outputs, outputs, expected):
        if want is None:  # absent (an output of an optional input the workload leaves out)
            assert got is None, f"{where}: output {decl.name!r} is {type(got).__name__}; the reference's is None"
            continue
        _assert_tensor_close(f"{where}: output {decl.name!r}", got, want, entry.tolerance[dtype])
        if decl.aliases:
            assert got is inputs[decl.aliases], f"{where}: output {decl.name!r} must be input {decl.aliases!r} itself"
        if decl.out in buffers:
            assert got is buffers[decl.out], f"{where}: output {decl.name!r} is not the {decl.out}= buffer passed"
    for name, want in expected_written.items():
        _assert_tensor_close(f"{where}: written input {name!r}", inputs[name], want, entry.tolerance[dtype])
    return outputs


def _assert_tensor_close(what: str, got: Any, want: torch.Tensor, tolerance: tuple[float, float]) -> None:
    assert isinstance(got, torch.Tensor), f"{what} is {type(got).__name__}, not a tensor"
    assert got.shape == want.shape, f"{what} has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what} has dtype {got.dtype}, expected {want.dtype}"
    assert got.device == want.device, f"{what} is on {got.device}, expected {want.device}"
    atol, rtol = tolerance
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def check_empty_write(op: Op, workload: Workload, dtype: torch.dtype, device: torch.device | str) -> None:
    """A call whose written tensors are all empty returns outputs built from the signature,
    runs no implementation and binds no target."""
    entry = type(op).manifest_entry()
    empty = resize_batch(entry, workload, 0)
    inputs = workload_inputs(entry, empty, dtype, device)
    result = op(**inputs)
    outputs = result if isinstance(result, tuple) else (result,)
    expected, _ = reference_outputs(entry, inputs, op.params)
    for decl, got, want in zip(entry.outputs, outputs, expected):
        if want is None:  # absent (an output of an optional input the workload leaves out)
            assert got is None, f"{entry.name}: an empty call's output {decl.name!r} is {type(got).__name__}, expected None"
            continue
        assert got.shape == want.shape and got.dtype == want.dtype and got.device == want.device, (
            f"{entry.name}: an empty call's output {decl.name!r} is {tuple(got.shape)} {got.dtype} on {got.device}, "
            f"expected {tuple(want.shape)} {want.dtype} on {want.device}"
        )
    assert op.target is None, f"{entry.name}: a call writing only empty tensors bound target {op.target!r}"
    assert op.built_kernels() == [], f"{entry.name}: a call writing only empty tensors built a kernel"


def resize_batch(entry: OpEntry, workload: Workload, rows: int) -> Workload:
    """``workload`` with the leading (batch) dimension set to ``rows`` in every input shaped
    like the first input; inputs of other ranks keep their shapes."""
    first = workload.shapes[entry.inputs[0].name]
    shapes = {
        name: (rows, *shape[1:]) if len(shape) == len(first) else shape for name, shape in workload.shapes.items()
    }
    return Workload(f"{workload.name}-rows{rows}", shapes, workload.dtypes, workload.params)


def workload_for_shape(entry: OpEntry, shape: tuple[int, ...], template: Workload | None = None) -> Workload:
    """A workload of ``entry`` whose first input has ``shape``, for shapes the manifest lacks.

    The first input's shape pattern binds the params it names from ``shape``: a
    ``*name`` group bound by a shape param takes as many trailing dimensions as it has in ``template`` (default:
    the entry's first workload), and ``...`` the leading ones. The template's other inputs
    follow: an input declared the same shape as another copies it; any other is expanded from
    its pattern with the new params, its ``...`` standing for the first input's leading
    dimensions, and a dimension the first input does not name keeps its size in the template
    (a backward op's 0-dim incoming gradient names none). Other params are the template's; the
    dtypes are those the first input accepts, the template's in front. ValueError says why a
    shape does not fit the pattern; the op's own checks judge the rest when it runs.
    """
    template = entry.workloads[0] if template is None else template
    first = entry.inputs[0]
    pattern = first.shape
    params = dict(template.params)
    dims: dict[str, Any] = {}
    shape_params = {p.name for p in entry.params}
    for dim in pattern.entries:
        # A group a shape param binds needs the param's width; a free group ('*batch') is the
        # free part of the shape, as '...' is.
        if dim.group and dim.name in shape_params and template.params.get(dim.name) is None:
            raise ValueError(
                f"{entry.name}: workload {template.name!r} gives no {dim.name!r}, so the dimensions "
                f"{first.name}'s {dim.written} covers are unknown"
            )
    # Every group but '...' is as wide as the template's param says; '...' takes the rest.
    placed = pattern.place(shape, pattern.widths(template.params.get))
    if isinstance(placed, str):
        raise ValueError(
            f"{entry.name}: {first.name} of shape {tuple(shape)} does not fit its pattern {list(pattern)}: {placed}"
        )
    leading: tuple[int, ...] = ()
    for dim, (start, part) in zip(pattern.entries, placed):
        if dim.size is not None:
            if part[0] != dim.size:
                raise ValueError(f"{entry.name}: dimension {start} of {first.name} must be {dim.size}, got {part[0]}")
        elif dim.name is None:
            leading = part
        elif dim.group:
            if dim.name in shape_params:
                params[dim.name] = list(part)
            else:
                dims[dim.name] = part
                leading = part
        else:
            (params if dim.name in params else dims)[dim.name] = part[0]

    # The template's own sizes of every dimension its inputs name, for those the first input does not.
    template_dims: dict[str, Any] = {}
    for decl in entry.inputs:
        if decl.shape is not None and decl.name in template.shapes:
            decl.shape.match(template.shapes[decl.name], template_dims, template.params)

    def size_of(name: str):
        if name in params:
            return params[name]
        return dims[name] if name in dims else template_dims.get(name)

    def expanded(decl) -> tuple[int, ...]:
        try:
            return decl.shape.expand(size_of, leading)
        except KeyError as missing:
            raise ValueError(
                f"{entry.name}: the shape of {decl.name} ({list(decl.shape)}) names {missing.args[0]!r}, "
                f"which neither {first.name}'s shape nor workload {template.name!r} gives"
            ) from None

    shapes = {first.name: tuple(shape)}
    for decl in entry.inputs[1:]:
        if decl.name in template.shapes:
            if decl.shape_same_as and decl.shape_same_as not in shapes:
                raise ValueError(
                    f"{entry.name}: {decl.name} has the shape of {decl.shape_same_as}, "
                    f"which workload {template.name!r} omits"
                )
            shapes[decl.name] = shapes[decl.shape_same_as] if decl.shape_same_as else expanded(decl)
    # Any dtype the first input accepts, the template's first (a default for whoever takes one).
    dtypes = template.dtypes + tuple(d for d in first.dtypes or () if d not in template.dtypes)
    name = "x".join(str(d) for d in shape)
    return Workload(f"shape-{name}", shapes, dtypes, params)


# The kit builds on the helpers above, so it is imported after them.
from .conformance import Check, KernelTypeConformance, TargetConformance  # noqa: E402

__all__ += ["Check", "KernelTypeConformance", "TargetConformance"]
