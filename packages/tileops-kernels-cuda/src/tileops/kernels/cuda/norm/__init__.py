"""TileLang implementations of the norm family's kernel interfaces.

Four variants per interface, each a key (``kind`` is rms_norm, layer_norm, add_rms_norm or
add_layer_norm): ``<kind>`` keeps the row in registers (short and
ordinary rows), ``<kind>_shared`` stages it in shared memory (medium rows), ``<kind>_streamed``
reads it twice and keeps it in L1/L2 in between by eviction priority (any length; the single
norms' long rows and layer_norm's short ones), and ``<kind>_scalar`` serves every length and
alignment without vector accesses. Their boundaries are ``programs.refusal`` (measured on an
H200); where several serve a call the order above decides (``preferred_over``), and the scalar
one is ``general``. Besides its main build, a kernel may have two more, chosen per call by x's
size: a few-row build for calls of at most ``programs.FEW_ROWS`` rows
(``programs.few_row_config``), and, in the fused kinds' register variant, one for calls whose
x straddles the L2 (``programs.evict_first_elements``).

Each kernel's forward is the C++ ``fast_launch.Launcher`` where that could be built, and the
Python forward below otherwise; the C++ one hands the Python one every call it does not handle.

Importing this module does not import tilelang; building a kernel does.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from tileops.backend import Kernel
from tileops.core.device_facts import facts_for
from tileops.ops.norm import (
    FusedAddLayerNormFwdInterface,
    FusedAddRMSNormFwdInterface,
    LayerNormFwdInterface,
    NormCall,
    RMSNormFwdInterface,
)

from . import programs, tuning
from .. import fast_launch
from ..device import compile_target, current_device_index, launcher


class _CompiledByRank(dict):
    """A kernel's launch functions by the rank of the tensors it is called with; a rank's is
    compiled on its first call (the same program, taking one size per leading dimension)."""

    def __init__(self, compile_rank: Callable[[int], Callable[..., None]]) -> None:
        super().__init__()
        self._compile_rank = compile_rank

    def __missing__(self, rank: int) -> Callable[..., None]:
        launch = self[rank] = self._compile_rank(rank)
        return launch


class _TileLangNorm(Kernel):
    """One compiled TileLang normalisation for a (kind, variant, n, dtype, eps, flags, device).

    It takes x (and residual) in the caller's shape, (..., n) with any number of leading
    dimensions, so that the op reshapes nothing: a view costs about a microsecond of host
    time per tensor, as much as the rest of the op layer's work on a decode call.
    """

    kind: ClassVar[str]
    variant: ClassVar[str]
    outputs: ClassVar[int]  # tensors like x that forward allocates and returns
    takes_leading_dims = True

    def __init__(self, call: NormCall) -> None:
        super().__init__()
        self._fast_forward = None
        self.device = call.device
        self._device_index = call.device.index
        self._target = compile_target(call.device)
        self._shape = (call.n, call.dtype, call.eps, call.has_weight, call.has_bias)
        self._tuning_key = (facts_for(call.device).name, self._target["arch"], self.kind, self.variant, *self._shape)
        self._tune_pending = False
        tuned = tuning.chosen(self._tuning_key)
        self._use(programs.launch_config(self.kind, self.variant, call.n, call.dtype) if tuned is None else tuned)

    def _use(self, config: dict[str, Any]) -> None:
        n, dtype = self._shape[:2]
        few_rows = programs.few_row_config(self.kind, n, dtype, config)
        window = programs.evict_first_elements(self.kind, dtype, config, self._target)
        # Sizes of x (elements) that take the few-row build (up to the first) or the evict-first
        # one (over the second and up to the third); -1 where a build is absent.
        self._build_sizes = (
            -1 if few_rows is None else programs.FEW_ROWS * n,
            *((0, -1) if window is None else window),
        )
        self._launches = _CompiledByRank(lambda rank: self._compile(config, rank))
        self._launches[2]  # the usual (m, n) rows are compiled with the kernel, not on a call
        # The other builds, where there are any, compile on the first call that needs them.
        self._evict_first_launches = _CompiledByRank(
            lambda rank: self._compile({**config, "evict_first_inputs": True}, rank)
        )
        self._few_row_launches = _CompiledByRank(lambda rank: self._compile(few_rows, rank))
        self._builds = (self._launches, self._evict_first_launches, self._few_row_launches)
        self.config = {"variant": self.variant, **config}
        if few_rows is not None:
            self.config["few_row_build"] = {"max_rows": programs.FEW_ROWS, **few_rows}
        if window is not None:
            self.config["evict_first_build"] = {"x_bytes": tuple(size * dtype.itemsize for size in window)}
        self._fast_forward = fast_launch.launcher(
            type(self).forward.__get__(self), self._entry, self._launch_device, self.outputs, self._build_sizes
        )
        if self._fast_forward is not None:
            # An instance attribute: the op's kernel.forward(...) calls the C++ launcher directly.
            self.forward = self._fast_forward

    def _build_for(self, elements: int) -> int:
        """Which build serves x of ``elements``: 0 the main one, 1 evict-first, 2 few-row."""
        few_rows, evict_first_above, evict_first_up_to = self._build_sizes
        if elements <= few_rows:
            return 2
        return 1 if evict_first_above < elements <= evict_first_up_to else 0

    def _entry(self, rank: int, build: int):
        """The launch function of ``build`` (see ``_build_for``) for tensors of ``rank``."""
        return self._builds[build][rank]

    def _compile(self, config: dict[str, Any], rank: int = 2):
        return launcher(programs.compile_config(self.kind, *self._shape, self._target, leading=rank - 1, **config))

    @classmethod
    def refusal(cls, call: NormCall) -> str | None:
        return programs.refusal(cls.kind, cls.variant, call.n, call.dtype, call.aligned)

    @classmethod
    def entry_for(cls, call: NormCall):
        identity = (call.device, call.n, call.dtype, call.eps, call.has_weight, call.has_bias)
        return identity, lambda: cls(call)

    def request_tune(self) -> None:
        """Time the neighbouring launch configurations on the next call, keep the fastest.

        Tuning happens once per build identity and GPU model on a machine (see ``tuning``): a
        kernel built later for the same identity, in this process or another, starts with the
        chosen configuration, and a request on an identity already tuned changes nothing.
        """
        self._tune_pending = tuning.chosen(self._tuning_key) is None

    def _launch_elsewhere(self, tensors: tuple[torch.Tensor, ...], build: int) -> None:
        """The launch when the fast check in ``forward`` fails: a tuning request is pending, or
        the call's GPU is not the current one (TileLang launches in the current device's
        context, so it is made current for the launch, and restored)."""
        with torch.cuda.device(self._device_index):
            if self._tune_pending:
                build = self._tune(tensors, build)
            self._builds[build][tensors[0].dim()](*tensors)

    @property
    def _tune_pending(self) -> bool:
        return self._launch_device != self._device_index

    @_tune_pending.setter
    def _tune_pending(self, pending: bool) -> None:
        # ``forward`` compares the current device with ``_launch_device`` and nothing else, so
        # a pending request is kept as a device index no GPU has.
        self._launch_device = -1 if pending else self._device_index
        if self._fast_forward is not None:
            self._fast_forward.device = self._launch_device

    def _tune(self, tensors: tuple[torch.Tensor, ...], build: int) -> int:
        """Tune the main build on this call's tensors; the build that serves the call after."""
        if torch.cuda.is_current_stream_capturing():
            return build  # a graph being captured must not see the trial launches; tune after
        n, dtype = self._shape[:2]
        what = f"{type(self).__name__} n={n} {str(dtype).removeprefix('torch.')} on {tensors[0].numel() // n} rows"
        if build == 2:
            print(f"tuning {what}: not tuned, calls of at most {programs.FEW_ROWS} rows run the few-row build, "
                  "whose configuration is fixed", file=sys.stderr)
            self._tune_pending = False
            return build
        rank = tensors[0].dim()
        config = tuning.tune(
            self._tuning_key,
            programs.tuning_candidates(self.kind, self.variant, n, dtype),
            lambda candidate: self._compile(candidate, rank),
            tensors,
            what,
        )
        self._use(config)
        self._tune_pending = False
        return self._build_for(tensors[0].numel())


# The forwards below serve the calls the C++ launcher hands over (and every call where it could
# not be built): each builds its argument tuple (the compiled kernel takes only the tensors
# that exist), picks the build and launches inline, with one device check.


class _RMSNorm(_TileLangNorm, RMSNormFwdInterface):
    kind = "rms_norm"
    outputs = 1

    def forward(self, x, weight):
        y = torch.empty_like(x)
        tensors = (x, y) if weight is None else (x, weight, y)
        build = self._build_for(x.numel())
        if current_device_index() == self._launch_device:
            self._builds[build][x.dim()](*tensors)
        else:
            self._launch_elsewhere(tensors, build)
        return y


class _LayerNorm(_TileLangNorm, LayerNormFwdInterface):
    kind = "layer_norm"
    outputs = 1

    def forward(self, x, weight, bias):
        y = torch.empty_like(x)
        if bias is None:
            tensors = (x, y) if weight is None else (x, weight, y)
        else:
            tensors = (x, bias, y) if weight is None else (x, weight, bias, y)
        build = self._build_for(x.numel())
        if current_device_index() == self._launch_device:
            self._builds[build][x.dim()](*tensors)
        else:
            self._launch_elsewhere(tensors, build)
        return y


class _FusedAddRMSNorm(_TileLangNorm, FusedAddRMSNormFwdInterface):
    kind = "add_rms_norm"
    outputs = 2

    def forward(self, x, residual, weight):
        y = torch.empty_like(x)
        total = torch.empty_like(x)
        tensors = (x, residual, y, total) if weight is None else (x, residual, weight, y, total)
        build = self._build_for(x.numel())
        if current_device_index() == self._launch_device:
            self._builds[build][x.dim()](*tensors)
        else:
            self._launch_elsewhere(tensors, build)
        return y, total


class _FusedAddLayerNorm(_TileLangNorm, FusedAddLayerNormFwdInterface):
    kind = "add_layer_norm"
    outputs = 2

    def forward(self, x, residual, weight, bias):
        y = torch.empty_like(x)
        total = torch.empty_like(x)
        if bias is None:
            tensors = (x, residual, y, total) if weight is None else (x, residual, weight, y, total)
        else:
            tensors = (x, residual, bias, y, total) if weight is None else (x, residual, weight, bias, y, total)
        build = self._build_for(x.numel())
        if current_device_index() == self._launch_device:
            self._builds[build][x.dim()](*tensors)
        else:
            self._launch_elsewhere(tensors, build)
        return y, total


# Keys: "<kind>" (registers), "<kind>_shared", "<kind>_streamed", "<kind>_scalar".
class RMSNormKernel(_RMSNorm):
    variant = "register"
    preferred_over = frozenset({"rms_norm_shared"})


class RMSNormSharedKernel(_RMSNorm):
    variant = "shared"
    preferred_over = frozenset({"rms_norm_streamed"})


class RMSNormStreamedKernel(_RMSNorm):
    variant = "streamed"


class RMSNormScalarKernel(_RMSNorm):
    variant = "scalar"
    general = True


class LayerNormKernel(_LayerNorm):
    variant = "register"
    preferred_over = frozenset({"layer_norm_shared"})


class LayerNormSharedKernel(_LayerNorm):
    variant = "shared"
    preferred_over = frozenset({"layer_norm_streamed"})


class LayerNormStreamedKernel(_LayerNorm):
    variant = "streamed"


class LayerNormScalarKernel(_LayerNorm):
    variant = "scalar"
    general = True


class FusedAddRMSNormKernel(_FusedAddRMSNorm):
    variant = "register"
    preferred_over = frozenset({"add_rms_norm_shared"})


class FusedAddRMSNormSharedKernel(_FusedAddRMSNorm):
    variant = "shared"
    preferred_over = frozenset({"add_rms_norm_streamed"})


class FusedAddRMSNormStreamedKernel(_FusedAddRMSNorm):
    variant = "streamed"


class FusedAddRMSNormScalarKernel(_FusedAddRMSNorm):
    variant = "scalar"
    general = True


class FusedAddLayerNormKernel(_FusedAddLayerNorm):
    variant = "register"
    preferred_over = frozenset({"add_layer_norm_shared"})


class FusedAddLayerNormSharedKernel(_FusedAddLayerNorm):
    variant = "shared"
    preferred_over = frozenset({"add_layer_norm_streamed"})


class FusedAddLayerNormStreamedKernel(_FusedAddLayerNorm):
    variant = "streamed"


class FusedAddLayerNormScalarKernel(_FusedAddLayerNorm):
    variant = "scalar"
    general = True
