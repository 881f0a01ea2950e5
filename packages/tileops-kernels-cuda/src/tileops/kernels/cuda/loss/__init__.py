"""TileLang implementations of the loss family's kernel interfaces, and their key table.

``CrossEntropyRowsKernel`` (key ``tilelang``) runs the rows step as two programs (``programs``):
``partial`` reduces spans of rows, ``finish`` combines each row's spans into its loss and lse.
``CrossEntropyGradKernel`` (key ``tilelang_grad``: a key names one implementation across an op's
interfaces) writes the gradient into the tensor it is given. ``CrossEntropyFusedKernel``
(``tilelang_fused``) runs the ``fused`` program, the rows and grad steps in one pass over rows
that fill the GPU, and on fewer rows the split rows step and the grad step one after the other;
``CrossEntropyScaleKernel`` (``tilelang_scale``) scales a gradient in place. A kernel is built per (device,
dtype, V, target dtype, alignment, loss options); an aligned call gets the vectorised programs,
one whose rows are not whole accesses in aligned tensors the shifted ones (16-byte accesses over
each row's aligned middle), any other the scalar ones, so the kernels serve every call of their
dtypes. float64 is refused
(plain torch serves it). Importing this module does not import tilelang; building a kernel does.
"""

from __future__ import annotations

from typing import Any

import torch

from tileops.core import facts_for
from tileops.ops.loss import (
    CrossEntropyFusedInterface,
    CrossEntropyGradInterface,
    CrossEntropyRowsInterface,
    CrossEntropyScaleInterface,
    grad_coefficients,
)

from ..compile import entry_function
from ..device import current_device_index, sm_count
from ..kernel import BuildPlan, Output, TileLangKernel
from . import policy, programs


def _rows(arguments: tuple, call) -> tuple[int, ...]:
    return (arguments[0].shape[0],)


def _float32(arguments: tuple, call) -> torch.dtype:
    return torch.float32


def _rows_launch(call, target, config: dict[str, Any]):
    """The rows step's launch of one build: two programs, the split count of ``partial`` also
    ``finish``'s."""
    partial = programs.compile_program(
        "partial", call.dtype, call.vocab, call.target_dtype, call.softcap, target,
        sums_logits=call.label_smoothing != 0, **config,
    )
    finish = programs.compile_program(
        "finish", call.dtype, call.vocab, call.target_dtype, call.softcap, target,
        splits=config["splits"], ignore_index=call.ignore_index, smoothing=call.label_smoothing,
        z_scale=call.lse_square_scale,
    )
    run_partial, run_finish = entry_function(partial), entry_function(finish)
    splits = config["splits"]

    def launch(logits, target_ids, loss, lse):
        spans = torch.empty((logits.shape[0], splits, 3), dtype=torch.float32, device=logits.device)
        run_partial(logits, spans)
        run_finish(logits, target_ids, spans, loss, lse)

    return launch


class _TileLangLoss(TileLangKernel):
    family = "loss"
    general = True  # serves every call of its dtypes (scalar programs where not aligned)

    def __init__(self, call) -> None:
        self.facts = facts_for(call.device)
        self.sm_count = sm_count(self.facts)
        super().__init__(call.device, call)

    @classmethod
    def entry_for(cls, call):
        return call, lambda: cls(call)

    @classmethod
    def refusal(cls, call) -> str | None:
        return policy.refusal(call.dtype, call.target_dtype)

    def identity(self) -> tuple:
        call = self.params
        return (
            self.kind, call.dtype, call.vocab, call.target_dtype, call.aligned, call.pointers_aligned,
            call.ignore_index, call.label_smoothing, call.lse_square_scale, call.softcap,
        )

    def tuning_subject(self, sized) -> str:
        return f"{type(self).__name__} {str(self.params.dtype).removeprefix('torch.')} {tuple(sized.shape)}"


class CrossEntropyRowsKernel(_TileLangLoss, CrossEntropyRowsInterface):
    """Each row's loss and lse: the ``partial`` program over spans of rows, then ``finish``."""

    kind = "rows"
    outputs = (Output.computed(_rows, _float32), Output.computed(_rows, _float32))

    def default_config(self) -> dict[str, Any]:
        call = self.params
        return policy.rows_config(call.dtype, call.vocab, call.aligned, call.pointers_aligned)

    def tuning_candidates(self) -> list[dict[str, Any]]:
        call = self.params
        return policy.rows_candidates(call.dtype, call.vocab, call.aligned, call.pointers_aligned)

    def build_plan(self, config: dict[str, Any]) -> BuildPlan:
        vocab = self.params.vocab
        tiers = policy.row_tiers(config, vocab, self.sm_count)
        builds = {"main": config, **{f"rows<={rows}": tier for rows, tier in tiers}}
        choices = tuple((rows * vocab, f"rows<={rows}") for rows, _ in tiers)
        # A tuning request on a call of few rows times its split build's own neighbours.
        tunable = {f"rows<={rows}": policy.tier_candidates(tier, vocab) for rows, tier in tiers}
        shown = {**config, "split_builds": {f"rows<={rows}": tier["splits"] for rows, tier in tiers}}
        return BuildPlan(builds, choices, tunable=tunable, shown=shown)

    def _launch_function(self, config: dict[str, Any], rank: int):
        return _rows_launch(self.params, self.tilelang_target, config)


class CrossEntropyGradKernel(_TileLangLoss, CrossEntropyGradInterface):
    """The gradient of the logits, written into the tensor given (the logits themselves allowed)."""

    kind = "grad"
    outputs = ()

    def default_config(self) -> dict[str, Any]:
        call = self.params
        return policy.grad_config(call.dtype, call.vocab, call.aligned, call.pointers_aligned)

    def tuning_candidates(self) -> list[dict[str, Any]]:
        call = self.params
        return policy.grad_candidates(call.dtype, call.vocab, call.aligned, call.pointers_aligned)

    def build_plan(self, config: dict[str, Any]) -> BuildPlan:
        return BuildPlan({"main": config}, shown=dict(config))

    def compile(self, config: dict[str, Any], rank: int) -> Any:
        call = self.params
        return programs.compile_program(
            "grad", call.dtype, call.vocab, call.target_dtype, call.softcap, self.tilelang_target,
            smoothing=call.label_smoothing, **config,
        )

    def forward(self, logits, target_ids, lse, softmax_scale, target_scale, dlogits):
        tensors = [logits, target_ids, lse, softmax_scale, target_scale, dlogits]
        if current_device_index() == self._launch_device:
            self._builds[0][2](*tensors)
        else:
            self._launch_elsewhere(tensors, 0, logits)
        return dlogits


class CrossEntropyFusedKernel(_TileLangLoss, CrossEntropyFusedInterface):
    """Each row's loss and lse and the gradient of a unit loss: the ``fused`` program where the
    rows fill the GPU with one block each, else the rows step's split build and the grad step."""

    kind = "fused"
    outputs = (Output.computed(_rows, _float32), Output.computed(_rows, _float32))

    def default_config(self) -> dict[str, Any]:
        call = self.params
        return policy.fused_config(call.dtype, call.vocab, call.aligned, call.pointers_aligned, self.facts)

    def tuning_candidates(self) -> list[dict[str, Any]]:
        call = self.params
        return policy.fused_candidates(self.default_config(), call.dtype, call.vocab, call.aligned, call.pointers_aligned)

    def build_plan(self, config: dict[str, Any]) -> BuildPlan:
        # The rows step's split builds serve the calls of few rows, as they serve its own.
        call = self.params
        rows_main = policy.rows_config(call.dtype, call.vocab, call.aligned, call.pointers_aligned)
        tiers = policy.row_tiers(rows_main, call.vocab, self.sm_count)
        builds = {"main": config, **{f"rows<={rows}": tier for rows, tier in tiers}}
        choices = tuple((rows * call.vocab, f"rows<={rows}") for rows, _ in tiers)
        untuned = {f"rows<={rows}": "a call of this few rows takes the rows step's split build and the grad step" for rows, _ in tiers}
        return BuildPlan(builds, choices, untuned=untuned, shown=dict(config))

    def _launch_function(self, config: dict[str, Any], rank: int):
        call = self.params
        common = (call.dtype, call.vocab, call.target_dtype, call.softcap, self.tilelang_target)
        if "splits" not in config:
            fused = entry_function(programs.compile_program(
                "fused", *common, ignore_index=call.ignore_index, smoothing=call.label_smoothing,
                z_scale=call.lse_square_scale, **config,
            ))

            def launch(logits, target_ids, unit, grad, loss, lse):
                fused(logits, target_ids, unit.reshape(1), grad, loss, lse)

            return launch
        run_rows = _rows_launch(call, self.tilelang_target, config)
        run_grad = entry_function(programs.compile_program(
            "grad", *common, smoothing=call.label_smoothing,
            **policy.grad_config(call.dtype, call.vocab, call.aligned, call.pointers_aligned),
        ))

        def launch_apart(logits, target_ids, unit, grad, loss, lse):
            run_rows(logits, target_ids, loss, lse)
            coefficients = grad_coefficients(call.lse_square_scale, unit, target_ids != call.ignore_index, lse)
            run_grad(logits, target_ids, lse, *coefficients, grad)

        return launch_apart


class CrossEntropyScaleKernel(_TileLangLoss, CrossEntropyScaleInterface):
    """A gradient multiplied in place by a 0-dim factor, left unread where the factor is 1."""

    kind = "scale"
    outputs = ()

    def default_config(self) -> dict[str, Any]:
        return policy.scale_config(self.params.dtype, self.params.aligned, self.sm_count)

    def tuning_candidates(self) -> list[dict[str, Any]]:
        return [self.default_config()]

    def build_plan(self, config: dict[str, Any]) -> BuildPlan:
        return BuildPlan({"main": config}, shown=dict(config))

    def compile(self, config: dict[str, Any], rank: int) -> Any:
        # One program per dtype: the scale reads neither V, the targets nor the loss options.
        return programs.compile_program("scale", self.params.dtype, 0, torch.int64, None, self.tilelang_target, **config)

    def forward(self, grad, factor):
        tensors = [grad.reshape(-1), factor.reshape(1)]
        if current_device_index() == self._launch_device:
            self._builds[0][1](*tensors)
        else:
            self._launch_elsewhere(tensors, 0, tensors[0])
        return grad


KERNELS = {
    CrossEntropyRowsInterface: {"tilelang": CrossEntropyRowsKernel},
    CrossEntropyGradInterface: {"tilelang_grad": CrossEntropyGradKernel},
    CrossEntropyFusedInterface: {"tilelang_fused": CrossEntropyFusedKernel},
    CrossEntropyScaleInterface: {"tilelang_scale": CrossEntropyScaleKernel},
}
