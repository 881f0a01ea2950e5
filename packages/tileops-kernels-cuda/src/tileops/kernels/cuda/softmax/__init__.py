"""TileLang implementations of the softmax family's kernel interfaces, and their key table.

Two variants per interface (``policy`` says which serves a row length): ``softmax`` /
``softmax_bwd`` hold each row in registers (rows of at most ``policy.REGISTER_MAX_N``), and
``softmax_streamed`` / ``softmax_bwd_streamed`` serve every length, ``general``, with a second
build for calls of fewer rows than SMs that splits each row over several blocks in two launches
(``policy.split_config``). A kernel is built per (device, n, dtype, out_dtype, log, alignment):
an aligned call gets 16-byte accesses, one whose rows are not whole accesses in aligned tensors
16-byte accesses over each row's aligned middle (the shifted programs), any other one element
per access. ``KERNELS`` (interface
-> key -> class) is the table the softmax ops name. Importing this module does not import
tilelang; building a kernel does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from tileops.core import facts_for
from tileops.ops.softmax import SoftmaxBwdInterface, SoftmaxCall, SoftmaxFwdInterface

from ..compile import entry_function
from ..device import sm_count
from ..kernel import BuildPlan, Output, TileLangKernel
from . import policy, programs


def _rows_shape(arguments: tuple, call: SoftmaxCall) -> tuple[int, ...]:
    return arguments[0].shape


def _out_dtype(arguments: tuple, call: SoftmaxCall) -> torch.dtype:
    return call.out_dtype


class _TileLangSoftmax(TileLangKernel):
    """One compiled softmax kernel of one variant for a call spec."""

    family = "softmax"
    variant: ClassVar[str]
    ranks_built_eagerly = (2,)  # the interfaces take (m, n) rows: compiled with the kernel

    def __init__(self, call: SoftmaxCall) -> None:
        self.facts = facts_for(call.device)
        self.sm_count = sm_count(self.facts)
        # y like x (allocated by the C++ launch path) where nothing differs but the values; the
        # streamed kernels' split build launches twice from Python, so they allocate in Python.
        if self.variant == "register" and call.out_dtype == call.dtype:
            self.outputs = (Output.like_argument(0),)
        else:
            self.outputs = (Output.computed(_rows_shape, _out_dtype),)
        super().__init__(call.device, call)

    @classmethod
    def entry_for(cls, call: SoftmaxCall):
        return call, lambda: cls(call)

    @classmethod
    def refusal(cls, call: SoftmaxCall) -> str | None:
        return policy.refusal(cls.variant, call.n, call.dtype, call.out_dtype)

    def identity(self) -> tuple:
        call = self.params
        return (self.variant, call.n, call.dtype, call.out_dtype, call.log, call.aligned, call.pointers_aligned)

    def default_config(self) -> dict[str, Any]:
        call = self.params
        return policy.launch_config(
            self.variant, call.n, call.dtype, call.aligned, pointers_aligned=call.pointers_aligned,
            softmax_forward=self._softmax_forward, facts=self.facts,
        )

    def tuning_candidates(self) -> list[dict[str, Any]]:
        call = self.params
        return policy.tuning_candidates(
            self.variant, call.n, call.dtype, call.aligned, pointers_aligned=call.pointers_aligned,
            softmax_forward=self._softmax_forward, facts=self.facts,
        )

    @property
    def _softmax_forward(self) -> bool:
        """Whether this is a softmax forward (its threads keep exponentials by default)."""
        return self.kind == "forward" and not self.params.log

    def build_plan(self, config: dict[str, Any]) -> BuildPlan:
        call = self.params
        split = None if self.variant == "register" else policy.split_config(call.n, call.dtype, config, self.sm_count)
        if split is None:
            return BuildPlan({"main": config}, shown=dict(config))
        rows = policy.split_rows(self.sm_count)
        shown = {**config, "split_build": {"max_rows": rows, **split}}
        # A tuning request on a call of few rows times the split build's own neighbours.
        tunable = {"split": policy.split_candidates(call.n, call.dtype, split)}
        return BuildPlan({"main": config, "split": split}, ((rows * call.n, "split"),), tunable=tunable, shown=shown)

    def compile(self, config: dict[str, Any], rank: int) -> Any:
        # The interfaces take (m, n) rows, so rank is always 2: one program serves it.
        call = self.params
        return programs.compile_program(self.kind, call.n, call.dtype, call.out_dtype, call.log, self.tilelang_target, **config)

    def _launch_function(self, config: dict[str, Any], rank: int) -> Callable[..., None]:
        if "chunks" not in config:
            return super()._launch_function(config, rank)
        partial = entry_function(self.compile({**config, "phase": "partial"}, rank))
        finish = entry_function(self.compile({**config, "phase": "finish"}, rank))
        chunks = config["chunks"]

        def launch(*tensors: torch.Tensor) -> None:
            # The row's inputs, then its output: each chunk's (max, sum) go through a workspace.
            inputs, output = tensors[:-1], tensors[-1]
            workspace = torch.empty((inputs[0].shape[0], chunks, 2), dtype=torch.float32, device=output.device)
            partial(*inputs, workspace)
            finish(*inputs, workspace, output)

        return launch

    def tuning_subject(self, sized: torch.Tensor) -> str:
        call = self.params
        function = "log_softmax" if call.log else "softmax"
        return f"{type(self).__name__} {function} n={call.n} {str(call.dtype).removeprefix('torch.')} on {sized.shape[0]} rows"


class _Forward(_TileLangSoftmax, SoftmaxFwdInterface):
    kind = "forward"


class _Backward(_TileLangSoftmax, SoftmaxBwdInterface):
    kind = "backward"


class SoftmaxKernel(_Forward):
    variant = "register"
    preferred_over = frozenset({"softmax_streamed"})


class SoftmaxStreamedKernel(_Forward):
    variant = "streamed"
    general = True  # serves every row length of its dtypes


class SoftmaxBwdKernel(_Backward):
    variant = "register"
    preferred_over = frozenset({"softmax_bwd_streamed"})


class SoftmaxBwdStreamedKernel(_Backward):
    variant = "streamed"
    general = True


#: The in-tree keys of each interface and their classes, the register variant first.
KERNELS = {
    SoftmaxFwdInterface: {"softmax": SoftmaxKernel, "softmax_streamed": SoftmaxStreamedKernel},
    SoftmaxBwdInterface: {"softmax_bwd": SoftmaxBwdKernel, "softmax_bwd_streamed": SoftmaxBwdStreamedKernel},
}
