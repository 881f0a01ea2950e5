"""TileLang implementations of the activation family's kernel interfaces, and their key table.

One kernel class per interface, each a key ``tilelang`` in ``KERNELS`` (interface -> key ->
class), the table the activation ops name. A kernel is built per (device, dtype, activation,
alignment; and d for the packed kinds): an aligned call (16-byte aligned pointers, lengths of
whole 16-byte accesses) gets the vectorised programs, any other the scalar ones, so the kernel
serves every call of its dtypes, with one build whatever the call's size (``policy``). A call
on row views (``ActivationCall.row_strides``) gets a kernel of its own width and pitches, which
reads the views where they lie (``programs``: the kinds' row-view builds). float64 calls are
refused (plain torch serves them).
Importing this module does not import tilelang; building a kernel does.
"""

from __future__ import annotations

from typing import Any, ClassVar

from tileops.ops.activation import (
    ActivationBwdInterface,
    ActivationFwdInterface,
    GatedBwdInterface,
    GatedFwdInterface,
    GatedInplaceBwdInterface,
    PackedGatedBwdInterface,
    PackedGatedFwdInterface,
    PackedGatedInplaceBwdInterface,
)

from ..kernel import BuildPlan, Output, TileLangKernel
from . import policy, programs

class _TileLangActivation(TileLangKernel):
    """One compiled activation kernel of one kind (``programs.KINDS``) for a call spec."""

    family = "activation"
    kind: ClassVar[str]
    general = True  # serves every call of its dtypes (scalar programs where not aligned)
    ranks_built_eagerly = (1,)  # the 1-D kinds take 1-D tensors: compiled with the kernel

    def __init__(self, call) -> None:
        if getattr(call, "row_strides", None) is not None:
            self.ranks_built_eagerly = (2,)  # (m, width) rows
        super().__init__(call.device, call)

    @classmethod
    def entry_for(cls, call):
        return call, lambda: cls(call)

    @classmethod
    def refusal(cls, call) -> str | None:
        return policy.refusal(call.dtype)

    def identity(self) -> tuple:
        call = self.params
        rows = (call.width, call.row_strides) if getattr(call, "row_strides", None) is not None else ()
        return (self.kind, call.activation, call.dtype, call.aligned, getattr(call, "d", 0), *rows)

    def default_config(self) -> dict[str, Any]:
        return policy.launch_config(self.params.dtype, self.params.aligned)

    def tuning_candidates(self) -> list[dict[str, Any]]:
        return policy.tuning_candidates(self.params.dtype, self.params.aligned)

    def build_plan(self, config: dict[str, Any]) -> BuildPlan:
        return BuildPlan({"main": config}, shown=dict(config))

    def compile(self, config: dict[str, Any], rank: int) -> Any:
        # The interfaces fix each kind's ranks (1-D, or (m, n) rows for the packed kinds and
        # the row views).
        call = self.params
        pitches = getattr(call, "row_strides", None)
        shape = {"d": getattr(call, "d", 0)} if pitches is None else {"d": call.width, "pitches": pitches}
        return programs.compile_program(self.kind, call.activation, call.dtype, self.tilelang_target, **shape, **config)

    def tuning_subject(self, sized) -> str:
        call = self.params
        return f"{type(self).__name__} {call.activation} {str(call.dtype).removeprefix('torch.')} on {sized.numel()} elements"


class ActivationKernel(_TileLangActivation, ActivationFwdInterface):
    kind = "act"
    takes_row_views = True
    outputs = (Output.like_argument(0),)


class ActivationBwdKernel(_TileLangActivation, ActivationBwdInterface):
    kind = "act_bwd"
    takes_row_views = True
    outputs = (Output.like_argument(0),)


class GatedKernel(_TileLangActivation, GatedFwdInterface):
    kind = "gated"
    takes_row_views = True
    outputs = (Output.like_argument(0),)


class GatedBwdKernel(_TileLangActivation, GatedBwdInterface):
    kind = "gated_bwd"
    takes_row_views = True
    outputs = (Output.like_argument(0), Output.like_argument(0))


class GatedInplaceBwdKernel(_TileLangActivation, GatedInplaceBwdInterface):
    kind = "gated_bwd_inplace"
    outputs = ()  # the gradients are written over gate and up


def _half_rows(arguments: tuple, call) -> tuple[int, ...]:
    return (arguments[0].shape[0], call.d)


class PackedGatedKernel(_TileLangActivation, PackedGatedFwdInterface):
    kind = "packed"
    outputs = (Output.computed(_half_rows, lambda arguments, call: call.dtype),)
    ranks_built_eagerly = (2,)


class PackedGatedBwdKernel(_TileLangActivation, PackedGatedBwdInterface):
    kind = "packed_bwd"
    outputs = (Output.like_argument(1),)
    size_of = 1  # x: the call's largest tensor
    ranks_built_eagerly = (2,)


class PackedGatedInplaceBwdKernel(_TileLangActivation, PackedGatedInplaceBwdInterface):
    kind = "packed_bwd_inplace"
    outputs = ()  # the gradient is written over x
    size_of = 1  # x: the call's largest tensor
    ranks_built_eagerly = (2,)


KERNELS = {
    ActivationFwdInterface: {"tilelang": ActivationKernel},
    ActivationBwdInterface: {"tilelang": ActivationBwdKernel},
    GatedFwdInterface: {"tilelang": GatedKernel},
    GatedBwdInterface: {"tilelang": GatedBwdKernel},
    GatedInplaceBwdInterface: {"tilelang": GatedInplaceBwdKernel},
    PackedGatedFwdInterface: {"tilelang": PackedGatedKernel},
    PackedGatedBwdInterface: {"tilelang": PackedGatedBwdKernel},
    PackedGatedInplaceBwdInterface: {"tilelang": PackedGatedInplaceBwdKernel},
}
