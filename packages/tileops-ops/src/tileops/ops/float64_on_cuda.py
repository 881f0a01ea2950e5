"""Float64 calls on CUDA: a family's plain-torch implementation made to serve them, since the
TileLang kernels take 16- and 32-bit types only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _float64_input(call: Any) -> bool:
    return call.dtype == torch.float64


def _input_dtype(call: Any) -> str:
    return str(call.dtype)


def float64_on_cuda(
    cpu_class: type,
    takes: Callable[[Any], bool] = _float64_input,
    kernels_serve: Callable[[Any], str] = _input_dtype,
) -> type:
    """``cpu_class`` (named ``TorchCpu...``) as ``TorchFloat64...``: on CUDA only, not general,
    serving the calls ``takes`` says have float64 in them (by default a float64 input) and
    refusing the others with what the TileLang kernels serve instead (``kernels_serve``)."""

    def refusal(cls, call) -> str | None:
        if takes(call):
            return None
        return f"serves float64 only (the TileLang kernels serve {kernels_serve(call)})"

    namespace = {"devices": frozenset({"cuda"}), "general": False, "refusal": classmethod(refusal),
                 "__module__": cpu_class.__module__}
    return type(cpu_class.__name__.replace("TorchCpu", "TorchFloat64"), (cpu_class,), namespace)
