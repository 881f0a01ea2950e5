"""TileLang implementations of the norm family's kernel interfaces, and their key table.

Four variants per interface, each a key (``kind`` is rms_norm, layer_norm, add_rms_norm or
add_layer_norm): ``<kind>`` keeps the row in registers (short and ordinary rows),
``<kind>_shared`` stages it in shared memory (medium rows), ``<kind>_streamed`` reads it twice
and keeps it in L1/L2 in between by eviction priority (any length; the single norms' long rows
and layer_norm's short ones), and ``<kind>_scalar`` serves every length and alignment without
vector accesses. ``KERNELS`` (interface -> key -> class) is the table the ops name; in it, where
several variants serve a call the earlier beats the later (``preferred_over``), and the scalar
one is ``general``. Their boundaries are ``policy.refusal``: measured on an H200, and for the
shared variant the shared memory a block may have on the call's GPU.

Besides its main build, a kernel may have three more, chosen per call by x's size
(``build_plan``): a decode build for calls of at most one row per SM of its device
(``builds.decode_config``), a few-row build for calls of at most ``builds.few_rows`` rows
(``builds.few_row_config``), and, in the fused kinds' register variant, one for calls whose
tensors straddle the device's L2 (``builds.evict_first_elements``).

A differentiated call goes through ``forward_saving``, which also returns the statistics the
backward reads, written by the same pass: it launches a twin kernel (``_saving_class``) of the
same configuration and builds whose programs also write them (``make_program``'s ``save_stats``),
so that plain calls keep programs that write nothing more and their C++ launch path.

Importing this module does not import tilelang; building a kernel does.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import torch

from tileops.core import facts_for
from tileops.ops.norm import (
    FusedAddLayerNormFwdInterface,
    FusedAddRMSNormFwdInterface,
    LayerNormFwdInterface,
    NormCall,
    RMSNormFwdInterface,
)

from . import builds, policy, programs
from ..device import shared_memory_per_block, sm_count
from ..kernel import BuildPlan, Output, TileLangKernel



class _TileLangNorm(TileLangKernel):
    """One compiled TileLang normalisation for a (kind, variant, n, dtype, eps, flags, device).

    It takes x (and residual) in the caller's shape, (..., n) with any number of leading
    dimensions, so that the op reshapes nothing: a view costs about a microsecond of host
    time per tensor, as much as the rest of the op layer's work on a decode call.
    """

    family = "norm"
    variant: ClassVar[str]
    takes_any_shape = True
    # Row views come as (m, n) views at their pitch, each pitch a build of its own (its
    # kernel's identity): a fused projection's slices keep one pitch for a whole model.
    takes_row_views = True
    ranks_built_eagerly = (2,)  # the usual (m, n) rows are compiled with the kernel, not on a call
    #: True in the twin that ``forward_saving`` launches: its programs also write the statistics.
    save_stats: ClassVar[bool] = False

    def __init__(self, call: NormCall) -> None:
        facts = facts_for(call.device)
        # The decode and few-row builds serve calls of a number of rows per SM, the evict-first
        # build calls whose tensors straddle the L2.
        self.sm_count, self.l2_bytes = sm_count(facts), None if facts is None else facts.l2_bytes
        # Tuning times no launch that the device's shared memory per block cannot hold.
        self.shared_per_block = shared_memory_per_block(call.device)
        super().__init__(call.device, call)

    def identity(self) -> tuple:
        call = self.params
        return (self.variant, call.n, call.dtype, call.eps, call.has_weight, call.has_bias, call.row_strides)

    def default_config(self) -> dict[str, Any]:
        return policy.launch_config(self.kind, self.variant, self.params.n, self.params.dtype)

    def tuning_candidates(self) -> list[dict[str, Any]]:
        call = self.params
        return policy.tuning_candidates(self.kind, self.variant, call.n, call.dtype, self.shared_per_block)

    def build_plan(self, config: dict[str, Any]) -> BuildPlan:
        n, dtype = self.params.n, self.params.dtype
        decode = builds.decode_config(self.kind, n, dtype, config)
        few_row = builds.few_row_config(self.kind, n, dtype, config)
        window = builds.evict_first_elements(self.kind, dtype, config, self.tilelang_target, self.l2_bytes)
        configs = {"main": config}
        choices: list[tuple[int, str]] = []
        tunable = {}
        shown = {"variant": self.variant, **config}
        # The decode and few-row builds run one row per block in registers: a tuning request on
        # a call they serve times their own neighbours (threads per row, weight loaded early).
        if decode is not None:
            configs["decode"] = decode
            choices.append((self.sm_count * n, "decode"))
            tunable["decode"] = builds.one_row_candidates(n, dtype, decode)
            shown["decode_build"] = {"max_rows": self.sm_count, **decode}
        if few_row is not None:
            configs["few_rows"] = few_row
            rows = builds.few_rows(self.sm_count)
            choices.append((rows * n, "few_rows"))
            tunable["few_rows"] = builds.one_row_candidates(n, dtype, few_row)
            shown["few_row_build"] = {"max_rows": rows, **few_row}
        # On a small L2 the window may begin among the calls of few rows, which keep their build.
        fewer = choices[-1][0] if choices else 0
        if window is not None and window[1] > fewer:
            above, up_to = window
            configs["evict_first"] = {**config, "evict_first_inputs": True}
            choices += [(above, "main")] if above > fewer else []
            choices.append((up_to, "evict_first"))
            shown["evict_first_build"] = {"x_bytes": (max(above, fewer) * dtype.itemsize, up_to * dtype.itemsize)}
        return BuildPlan(configs, tuple(choices), tunable=tunable, shown=shown)

    def compile(self, config: dict[str, Any], rank: int) -> Any:
        call = self.params
        # Plain builds of contiguous rows: the programs as before these flags.
        saving = {"save_stats": True} if self.save_stats else {}
        pitched = {} if call.row_strides is None else {"row_strides": call.row_strides}
        return programs.compile_config(
            self.kind, call.n, call.dtype, call.eps, call.has_weight, call.has_bias, self.tilelang_target,
            leading=rank - 1, **config, **saving, **pitched,
        )

    def _use(self, config: dict[str, Any]) -> None:
        super()._use(config)
        # A configuration tuning chose: the twin is made again, with it, on the next saving call.
        self._saving_twin = None

    def forward_saving(self, *args: torch.Tensor | None) -> tuple[Any, tuple[torch.Tensor, ...]]:
        """``(forward(*args), statistics)``: rstd of every row, after its mean for the layer-norm
        kinds, float32 of x's leading shape, as the pass that normalised the row computed them.

        They come from this kernel's twin: the same configuration and builds, chosen per call
        alike, whose programs also write them; it is made (and its builds compiled) on the first
        saving call, so that inference never pays for it. A pending tuning request waits for the
        next plain call: tuning times the plain builds, and the twin then follows.
        """
        twin = self._saving_twin
        if twin is None:
            twin = self._saving_twin = _saving_class(type(self))(self.params)
        results = twin.forward(*args)
        count = len(self.outputs)
        return (results[0] if count == 1 else results[:count]), results[count:]

    def tuning_subject(self, sized: torch.Tensor) -> str:
        n, dtype = self.params.n, self.params.dtype
        return f"{type(self).__name__} n={n} {str(dtype).removeprefix('torch.')} on {sized.numel() // n} rows"

    @classmethod
    def refusal(cls, call: NormCall) -> str | None:
        per_block = shared_memory_per_block(call.device) if cls.variant == "shared" else None
        return policy.refusal(cls.kind, cls.variant, call.n, call.dtype, call.aligned, per_block)

    @classmethod
    def entry_for(cls, call: NormCall):
        identity = (call.device, call.n, call.dtype, call.eps, call.has_weight, call.has_bias, call.row_strides)
        return identity, lambda: cls(call)


def _like_x(arguments: tuple, call: NormCall) -> tuple[int, ...]:
    return arguments[0].shape


def _x_dtype(arguments: tuple, call: NormCall) -> torch.dtype:
    return arguments[0].dtype


def _rows_of_x(arguments: tuple, call: NormCall) -> tuple[int, ...]:
    return arguments[0].shape[:-1]


def _float32(arguments: tuple, call: NormCall) -> torch.dtype:
    return torch.float32


@functools.cache
def _saving_class(cls: type[_TileLangNorm]) -> type[_TileLangNorm]:
    """The twin of ``cls`` that ``forward_saving`` launches: its programs also write the
    statistics, which its outputs add (one per ``saved_count``, in the programs' order).

    The shared runtime allocates either every output like an argument (which the C++ launch
    path does) or every one from shape functions, so y and s are declared from x's shape here
    too: the twin takes the Python forward. It compiles each rank on its first call.
    """
    outputs = (Output.computed(_like_x, _x_dtype),) * len(cls.outputs)
    outputs += (Output.computed(_rows_of_x, _float32),) * cls.saved_count
    return type(f"{cls.__name__}Saving", (cls,), {"save_stats": True, "outputs": outputs, "ranks_built_eagerly": ()})


# Each program takes the interface's arguments in its order (an absent weight or bias left out),
# then y, and for the fused kinds s = x + residual: outputs like x.
class _RMSNorm(_TileLangNorm, RMSNormFwdInterface):
    kind = "rms_norm"
    outputs = (Output.like_argument(0),)


class _LayerNorm(_TileLangNorm, LayerNormFwdInterface):
    kind = "layer_norm"
    outputs = (Output.like_argument(0),)


class _FusedAddRMSNorm(_TileLangNorm, FusedAddRMSNormFwdInterface):
    kind = "add_rms_norm"
    outputs = (Output.like_argument(0), Output.like_argument(0))


class _FusedAddLayerNorm(_TileLangNorm, FusedAddLayerNormFwdInterface):
    kind = "add_layer_norm"
    outputs = (Output.like_argument(0), Output.like_argument(0))


class RMSNormKernel(_RMSNorm):
    variant = "register"


class RMSNormSharedKernel(_RMSNorm):
    variant = "shared"


class RMSNormStreamedKernel(_RMSNorm):
    variant = "streamed"


class RMSNormScalarKernel(_RMSNorm):
    variant = "scalar"
    general = True


class LayerNormKernel(_LayerNorm):
    variant = "register"


class LayerNormSharedKernel(_LayerNorm):
    variant = "shared"


class LayerNormStreamedKernel(_LayerNorm):
    variant = "streamed"


class LayerNormScalarKernel(_LayerNorm):
    variant = "scalar"
    general = True


class FusedAddRMSNormKernel(_FusedAddRMSNorm):
    variant = "register"


class FusedAddRMSNormSharedKernel(_FusedAddRMSNorm):
    variant = "shared"


class FusedAddRMSNormStreamedKernel(_FusedAddRMSNorm):
    variant = "streamed"


class FusedAddRMSNormScalarKernel(_FusedAddRMSNorm):
    variant = "scalar"
    general = True


class FusedAddLayerNormKernel(_FusedAddLayerNorm):
    variant = "register"


class FusedAddLayerNormSharedKernel(_FusedAddLayerNorm):
    variant = "shared"


class FusedAddLayerNormStreamedKernel(_FusedAddLayerNorm):
    variant = "streamed"


class FusedAddLayerNormScalarKernel(_FusedAddLayerNorm):
    variant = "scalar"
    general = True


#: The in-tree keys of each interface and their classes, in preference order: the only place
#: they are named (the ops take this table through ``kernel_tables``).
KERNELS: dict[type, dict[str, type[_TileLangNorm]]] = {
    RMSNormFwdInterface: {
        "rms_norm": RMSNormKernel,
        "rms_norm_shared": RMSNormSharedKernel,
        "rms_norm_streamed": RMSNormStreamedKernel,
        "rms_norm_scalar": RMSNormScalarKernel,
    },
    LayerNormFwdInterface: {
        "layer_norm": LayerNormKernel,
        "layer_norm_shared": LayerNormSharedKernel,
        "layer_norm_streamed": LayerNormStreamedKernel,
        "layer_norm_scalar": LayerNormScalarKernel,
    },
    FusedAddRMSNormFwdInterface: {
        "add_rms_norm": FusedAddRMSNormKernel,
        "add_rms_norm_shared": FusedAddRMSNormSharedKernel,
        "add_rms_norm_streamed": FusedAddRMSNormStreamedKernel,
        "add_rms_norm_scalar": FusedAddRMSNormScalarKernel,
    },
    FusedAddLayerNormFwdInterface: {
        "add_layer_norm": FusedAddLayerNormKernel,
        "add_layer_norm_shared": FusedAddLayerNormSharedKernel,
        "add_layer_norm_streamed": FusedAddLayerNormStreamedKernel,
        "add_layer_norm_scalar": FusedAddLayerNormScalarKernel,
    },
}


def _prefer_in_table_order(table: dict[str, type[_TileLangNorm]]) -> None:
    """Where several variants serve a call, each beats the next in its table (registers over
    shared memory over streamed); the scalar one ranks last as the general one."""
    keys = list(table)
    for key, next_key in zip(keys, keys[1:]):
        if not table[next_key].general:
            table[key].preferred_over = frozenset({next_key})


for _interface_table in KERNELS.values():
    _prefer_in_table_order(_interface_table)

# The backward kernels (``backward``) join the same table, one entry per backward interface, so
# that the backward ops find them through ``kernel_tables`` as the forward ops find theirs.
from .backward import BACKWARD_KERNELS  # noqa: E402

KERNELS.update(BACKWARD_KERNELS)
