"""TileLang implementations of the norm family's backward kernel interfaces, and their key table.

Three variants per interface (``kind`` is rms_norm, layer_norm, add_rms_norm or add_layer_norm):
``<kind>_bwd`` keeps each thread's slice of the row in registers (rows of up to 64 KiB in
16-byte vectors), ``<kind>_bwd_streamed`` reads it again for dx (any length, 16-byte vectors),
and ``<kind>_bwd_scalar`` serves every length and alignment element-wise (``general``). Each
call runs two kernels (``backward_programs``, configured by ``backward_policy``): the row
kernel writes dx and per-slot float32 partial sums of dweight (and dbias), the reduce kernel sums
those and casts them. The partials are a declared output of the kernel, dropped from what
``forward`` returns. A call of one row runs the row kernel's ``direct`` build alone, which
writes dweight (and dbias) itself: a second launch would cost as much as the row (built at the
first such call). A call with neither weight nor bias, or that wants no parameter gradient (the
parameters are frozen: ``NormBwdCall.parameter_gradients``), runs the row kernel alone, built
without column sums: it returns None for them, as the op does.

The kernels take dy, x (or the residual sum) and dresidual_sum in the caller's shape, (..., n),
and the statistics in x's leading shape: ``forward`` views them as rows. x may be a row view
(``NormCall.row_strides``: its pitch), read where it lies by a build for that pitch. They are
not tuned: the partials' shape follows the launch configuration, which is the rules'.

Importing this module does not import tilelang; building a kernel does.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from tileops.core import facts_for
from tileops.ops.norm import (
    FusedAddLayerNormBwdInterface,
    FusedAddRMSNormBwdInterface,
    LayerNormBwdInterface,
    NormBwdCall,
    RMSNormBwdInterface,
)

from . import backward_policy as policy
from . import backward_programs as programs
from ..compile import entry_function
from ..device import shared_memory_per_block, sm_count
from ..kernel import BuildPlan, Output, TileLangKernel

_STATISTICS = ("mean", "rstd")


@dataclasses.dataclass(frozen=True, eq=False)
class _Params:
    """What a backward kernel's outputs are sized from: the call, its launch configuration and
    the SM count of its device."""

    call: NormBwdCall
    kind: str
    config: dict
    sm_count: int

    def partial_shape(self, arguments: tuple) -> tuple[int, int, int]:
        m = arguments[0].shape[0]
        rows = policy.partial_rows(self.kind, m, self.call.n, self.call.dtype, self.config, self.sm_count)
        return (policy.parts_of(self.kind), rows, self.call.n)


def _column_sums() -> Output:
    """dweight or dbias: (n,) in dy's dtype."""
    return Output.computed(lambda arguments, p: (p.call.n,), lambda arguments, p: arguments[0].dtype)


_PARTIALS = Output.computed(lambda arguments, p: p.partial_shape(arguments), lambda arguments, p: torch.float32)


class _TileLangNormBwd(TileLangKernel):
    """One compiled TileLang norm backward for a (kind, variant, n, dtype, weight flag, device)."""

    family = "norm"
    variant: ClassVar[str]
    takes_any_shape = True
    # x (the forward's input, a row view where the forward read one) comes as (m, n) rows at its
    # pitch, each pitch a build of its own, as in the forward kernels.
    takes_row_views = True
    ranks_built_eagerly = (2,)  # forward views every call as rows: rank 2 is the only one

    def __init__(self, call: NormBwdCall) -> None:
        per_block = shared_memory_per_block(call.device)
        config = policy.launch_config(self.kind, self.variant, call.n, call.dtype, shared_per_block=per_block)
        #: Whether the call has a parameter to differentiate: without (or with frozen ones), the
        #: row kernel writes dx alone (no partials, no reduce kernel) and the op's parameter
        #: gradients are None.
        self.column_sums = (call.has_weight or call.has_bias) and call.parameter_gradients
        if not self.column_sums:
            self.outputs = (_DX,)
        super().__init__(call.device, _Params(call, self.kind, config, sm_count(facts_for(call.device))))

    def identity(self) -> tuple:
        call = self.params.call
        return (self.variant, call.n, call.dtype, call.has_weight, call.has_bias, call.row_strides, call.parameter_gradients)

    def default_config(self) -> dict[str, Any]:
        return dict(self.params.config)

    def tuning_candidates(self) -> list[dict[str, Any]]:
        return [self.default_config()]

    def build_plan(self, config: dict[str, Any]) -> BuildPlan:
        why = "the backward kernels run their rules' configuration (the partials are sized by it)"
        return BuildPlan({"main": config}, untuned={"main": why}, shown={"variant": self.variant, **config})

    def compile(self, config: dict[str, Any], rank: int, direct: bool = False) -> Any:
        call = self.params.call
        options = {**config, "direct": True} if direct else dict(config)
        if not self.column_sums:
            options["column_sums"] = False
        if call.row_strides is not None:
            (options["x_pitch"],) = call.row_strides
        return programs.compile_row_kernel(self.kind, call.n, call.dtype, call.has_weight, self.tilelang_target,
                                           **options)

    def _launch_function(self, config: dict[str, Any], rank: int):
        if rank != 2:
            raise ValueError(f"{type(self).__name__} launches on rows (rank 2), not rank {rank}")
        call = self.params.call
        rows = entry_function(self.compile(config, rank))
        if not self.column_sums:
            return rows  # (inputs..., dx): one kernel
        reduce = entry_function(
            programs.compile_reduce_kernel(call.n, call.dtype, policy.parts_of(self.kind), self.tilelang_target)
        )
        sums = len(self.outputs) - 2  # dweight (and dbias)
        direct = []  # the direct build, once a call of one row came (the sums on chip only)
        has_direct = config["acc"] != "global"

        def launch(*tensors: torch.Tensor) -> None:
            # (inputs..., dx, dweight, [dbias], partials): the row kernel, then the reduction.
            if has_direct and tensors[0].shape[0] == 1:
                if not direct:
                    direct.append(entry_function(self.compile(config, rank, direct=True)))
                direct[0](*tensors[:-1])
                return
            partials = tensors[-1]
            rows(*tensors[: -1 - sums - 1], tensors[-2 - sums], partials)
            reduce(partials, *tensors[-1 - sums : -1])

        return launch

    def forward(self, *args: Any, **named: Any) -> Any:
        if named or len(args) != len(self.argument_names):
            args = self._bind(args, named)
        n = self.params.call.n
        shape = args[0].shape
        rows = tuple(
            None if value is None
            else value if name == "weight"
            else value.reshape(-1) if name in _STATISTICS
            else value.reshape(-1, n)
            for name, value in zip(self.argument_names, args)
        )
        if not self.column_sums:
            sums = len(type(self).outputs) - 2  # the class's: dweight (and dbias), then the partials
            return (super().forward(*rows).view(shape), *[None] * sums)
        dx, *sums, _partials = super().forward(*rows)
        return (dx.view(shape), *sums)

    @classmethod
    def refusal(cls, call: NormBwdCall) -> str | None:
        return policy.refusal(cls.kind, cls.variant, call.n, call.dtype, call.aligned, shared_memory_per_block(call.device))

    @classmethod
    def entry_for(cls, call: NormBwdCall):
        identity = (call.device, call.n, call.dtype, call.has_weight, call.has_bias, call.row_strides, call.parameter_gradients)
        return identity, lambda: cls(call)


# dx is like dy; it is declared computed, as the others are: a kernel's outputs are all like an
# argument (allocated by ``empty_like``) or all computed.
_DX = Output.computed(lambda arguments, p: tuple(arguments[0].shape), lambda arguments, p: arguments[0].dtype)
_RMS_OUTPUTS = (_DX, _column_sums(), _PARTIALS)
_LAYER_OUTPUTS = (_DX, _column_sums(), _column_sums(), _PARTIALS)


# The row kernel takes the interface's arguments in its order (an absent weight left out), then
# dx and the partials; dweight (and dbias) are the reduce kernel's.
class _RMSNormBwd(_TileLangNormBwd, RMSNormBwdInterface):
    kind = "rms_norm"
    outputs = _RMS_OUTPUTS


class _LayerNormBwd(_TileLangNormBwd, LayerNormBwdInterface):
    kind = "layer_norm"
    outputs = _LAYER_OUTPUTS


class _FusedAddRMSNormBwd(_TileLangNormBwd, FusedAddRMSNormBwdInterface):
    kind = "add_rms_norm"
    outputs = _RMS_OUTPUTS


class _FusedAddLayerNormBwd(_TileLangNormBwd, FusedAddLayerNormBwdInterface):
    kind = "add_layer_norm"
    outputs = _LAYER_OUTPUTS


class RMSNormBwdKernel(_RMSNormBwd):
    variant = "register"


class RMSNormBwdStreamedKernel(_RMSNormBwd):
    variant = "streamed"


class RMSNormBwdScalarKernel(_RMSNormBwd):
    variant = "scalar"
    general = True


class LayerNormBwdKernel(_LayerNormBwd):
    variant = "register"


class LayerNormBwdStreamedKernel(_LayerNormBwd):
    variant = "streamed"


class LayerNormBwdScalarKernel(_LayerNormBwd):
    variant = "scalar"
    general = True


class FusedAddRMSNormBwdKernel(_FusedAddRMSNormBwd):
    variant = "register"


class FusedAddRMSNormBwdStreamedKernel(_FusedAddRMSNormBwd):
    variant = "streamed"


class FusedAddRMSNormBwdScalarKernel(_FusedAddRMSNormBwd):
    variant = "scalar"
    general = True


class FusedAddLayerNormBwdKernel(_FusedAddLayerNormBwd):
    variant = "register"


class FusedAddLayerNormBwdStreamedKernel(_FusedAddLayerNormBwd):
    variant = "streamed"


class FusedAddLayerNormBwdScalarKernel(_FusedAddLayerNormBwd):
    variant = "scalar"
    general = True


#: The in-tree backward keys of each interface and their classes, in preference order (merged
#: into ``KERNELS``, the table the ops name): the register variant beats the streamed one where
#: both serve; the scalar one is general.
BACKWARD_KERNELS: dict[type, dict[str, type[_TileLangNormBwd]]] = {
    RMSNormBwdInterface: {
        "rms_norm_bwd": RMSNormBwdKernel,
        "rms_norm_bwd_streamed": RMSNormBwdStreamedKernel,
        "rms_norm_bwd_scalar": RMSNormBwdScalarKernel,
    },
    LayerNormBwdInterface: {
        "layer_norm_bwd": LayerNormBwdKernel,
        "layer_norm_bwd_streamed": LayerNormBwdStreamedKernel,
        "layer_norm_bwd_scalar": LayerNormBwdScalarKernel,
    },
    FusedAddRMSNormBwdInterface: {
        "add_rms_norm_bwd": FusedAddRMSNormBwdKernel,
        "add_rms_norm_bwd_streamed": FusedAddRMSNormBwdStreamedKernel,
        "add_rms_norm_bwd_scalar": FusedAddRMSNormBwdScalarKernel,
    },
    FusedAddLayerNormBwdInterface: {
        "add_layer_norm_bwd": FusedAddLayerNormBwdKernel,
        "add_layer_norm_bwd_streamed": FusedAddLayerNormBwdStreamedKernel,
        "add_layer_norm_bwd_scalar": FusedAddLayerNormBwdScalarKernel,
    },
}

for _table in BACKWARD_KERNELS.values():
    _register, _streamed, _scalar = _table
    _table[_register].preferred_over = frozenset({_streamed})
