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

from tileops.core import Op
from tileops.core.manifest.expressions import evaluate
from tileops.core.manifest.loader import OpEntry, Workload

__all__ = [
    "WorkloadCase",
    "check_workload",
    "reference_outputs",
    "workload_cases",
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
        return sum(math.prod(shape) for shape in self.workload.shapes.values())

    def __repr__(self) -> str:
        return f"WorkloadCase({self.id})"


def workload_cases(op_classes) -> Iterator[WorkloadCase]:
    """Every (op, workload, dtype) the manifest declares for ``op_classes``."""
    for op_class in op_classes:
        for workload in op_class.manifest_entry().workloads:
            for dtype in workload.dtypes:
                yield WorkloadCase(op_class, workload, dtype)


def workload_inputs(
    entry: OpEntry, workload: Workload, dtype: torch.dtype, device: torch.device | str, *, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random inputs of ``workload`` in ``dtype`` on ``device`` (inputs it omits are absent)."""
    generator = torch.Generator().manual_seed(seed)
    inputs = {}
    for decl in entry.inputs:
        if decl.name in workload.shapes:
            tensor = torch.randn(workload.shapes[decl.name], generator=generator, dtype=torch.float32)
            inputs[decl.name] = tensor.to(device=device, dtype=dtype)
    return inputs


def reference_outputs(entry: OpEntry, inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> tuple:
    """The entry's ``ref_api`` evaluated on ``inputs`` (cloned, so in-place references are safe)."""
    namespace: dict[str, Any] = {decl.name: None for decl in entry.inputs}
    namespace.update({name: tensor.clone() for name, tensor in inputs.items()})
    namespace.update(params)
    namespace.update(torch=torch, F=F)
    result = evaluate(entry.ref_code, namespace)
    return result if isinstance(result, tuple) else (result,)


def check_workload(
    op: Op, workload: Workload, dtype: torch.dtype, device: torch.device | str, *, seed: int = 0
) -> tuple:
    """Run ``op`` on ``workload`` and assert every output matches the reference.

    Returns the op's outputs (as a tuple). Raises AssertionError naming the op, the workload,
    the dtype and the output that differs.
    """
    entry = type(op).manifest_entry()
    inputs = workload_inputs(entry, workload, dtype, device, seed=seed)
    expected = reference_outputs(entry, {k: v.cpu() if v.device.type == "meta" else v for k, v in inputs.items()}, op.params)
    result = op(**inputs)
    outputs = result if isinstance(result, tuple) else (result,)
    where = f"{entry.name} on workload {workload.name!r} in {dtype} on {device}"
    assert len(outputs) == len(entry.outputs), f"{where}: {len(outputs)} outputs, the manifest declares {len(entry.outputs)}"
    atol, rtol = entry.tolerance[dtype]
    for decl, got, want in zip(entry.outputs, outputs, expected):
        assert isinstance(got, torch.Tensor), f"{where}: output {decl.name!r} is {type(got).__name__}"
        assert got.shape == want.shape, f"{where}: output {decl.name!r} has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        assert got.dtype == want.dtype, f"{where}: output {decl.name!r} has dtype {got.dtype}, expected {want.dtype}"
        assert got.device == want.device, f"{where}: output {decl.name!r} is on {got.device}, expected {want.device}"
        torch.testing.assert_close(
            got.float(), want.float(), atol=atol, rtol=rtol, msg=lambda m, d=decl: f"{where}: output {d.name!r}: {m}"
        )
    return outputs
