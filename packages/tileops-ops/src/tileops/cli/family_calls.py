"""The family-specific piece of ``tileops explain``: how a call of a family's ops is described
without tensors.

An op's ``forward`` builds the call spec of each kernel interface from the tensors it is
given. ``explain`` has only a shape, a dtype, a device and which optional inputs are passed,
so each family says here how those become the op's params, each input's shape and each
interface's call spec. A new family adds one ``FamilyCalls`` to ``FAMILY_CALLS``.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from tileops.core.kernel import CallSpec, KernelInterface
from tileops.core.op import Op

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class DescribedCall:
    """A call as the command line describes it."""

    device: torch.device
    dtype: torch.dtype
    shape: Shape  # of the op's first input
    passed: frozenset[str]  # the inputs the call passes (required ones and the optional ones kept)
    aligned: bool  # whether every data pointer is 16-byte aligned


@dataclasses.dataclass(frozen=True)
class FamilyCalls:
    """How ``explain`` builds one family's ops and describes their calls."""

    params: Callable[[Shape, argparse.Namespace], dict[str, Any]]
    input_shapes: Callable[[Op, DescribedCall], dict[str, Shape]]
    call_spec: Callable[[Op, type[KernelInterface], DescribedCall], CallSpec]


def _norm_params(shape: Shape, args: argparse.Namespace) -> dict[str, Any]:
    # As torch's functional API: normalize over the last dimension unless told otherwise.
    params: dict[str, Any] = {
        "normalized_shape": shape[-1:] if args.normalized_shape is None else args.normalized_shape
    }
    if args.eps is not None:  # else the op's own default, as a call without eps= gets
        params["eps"] = args.eps
    return params


def _norm_input_shapes(op: Op, call: DescribedCall) -> dict[str, Shape]:
    normalized_shape = op.params["normalized_shape"]
    shapes = {"x": call.shape, "residual": call.shape, "weight": normalized_shape, "bias": normalized_shape}
    return {name: shape for name, shape in shapes.items() if name in call.passed}


def _norm_call_spec(op: Op, interface: type[KernelInterface], call: DescribedCall) -> CallSpec:
    return interface.call_spec(
        device=call.device,
        n=op.n,
        dtype=call.dtype,
        eps=op.eps_for(call.dtype),
        has_weight="weight" in call.passed,
        has_bias="bias" in call.passed,
        aligned=call.aligned,
    )


#: By the family name of the manifest.
FAMILY_CALLS = {"norm": FamilyCalls(_norm_params, _norm_input_shapes, _norm_call_spec)}
