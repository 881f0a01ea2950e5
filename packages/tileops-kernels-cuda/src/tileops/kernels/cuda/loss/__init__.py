"""TileLang implementations of the loss family's kernel interfaces, and their key table.

``CrossEntropyRowsKernel`` (key ``tilelang``) runs the rows step as two programs (``programs``):
``partial`` reduces spans of rows, ``finish`` combines each row's spans into its loss and lse.
``CrossEntropyGradKernel`` (key ``tilelang_grad``: a key names one implementation across an op's
interfaces) writes the gradient into the tensor it is given. A kernel is built per (device,
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
from tileops.ops.loss import CrossEntropyGradInterface, CrossEntropyRowsInterface

from ..compile import entry_function
from ..device import current_device_index, sm_count
from ..kernel import BuildPlan, Output, TileLangKernel
from . import policy, programs


def _rows(arguments: tuple, call) -> tuple[int, ...]:
    return (arguments[0].shape[0],)


def _float32(arguments: tuple, call) -> torch.dtype:
    return torch.float32


class _TileLangLoss(TileLangKernel):
    family = "loss"
    general = True  # serves every call of its dtypes (scalar programs where not aligned)

    def __init__(self, call) -> None:
        self.sm_count = sm_count(facts_for(call.device))
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
        # Two programs per build: the split count of ``partial`` is also ``finish``'s.
        call = self.params
        partial = programs.compile_program(
            "partial", call.dtype, call.vocab, call.target_dtype, call.softcap, self.tilelang_target,
            sums_logits=call.label_smoothing != 0, **config,
        )
        finish = programs.compile_program(
            "finish", call.dtype, call.vocab, call.target_dtype, call.softcap, self.tilelang_target,
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


KERNELS = {
    CrossEntropyRowsInterface: {"tilelang": CrossEntropyRowsKernel},
    CrossEntropyGradInterface: {"tilelang_grad": CrossEntropyGradKernel},
}
