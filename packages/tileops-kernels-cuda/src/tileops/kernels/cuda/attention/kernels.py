"""The TileLang attention kernels: the kernel classes of the forward and the backward.

``AttentionFwdKernel`` launches one program (``programs.make_forward``) writing o and lse.
``AttentionBwdKernel`` launches three per call: the delta/lse2 kernel, the main kernel and the
dQ cast, with float32 workspaces it allocates per call (delta and lse2 (B, H_q, S_pad), the dQ
accumulator (B, H_q, S_pad, D) zeroed, S_pad the query length rounded up to 64 rows so that no
tile of them is partial). Both need Hopper (``supported_archs``: wgmma, TMA) and take float16
and bfloat16 with head sizes 64, 128 and 256 (``policy``); plain torch serves the rest.
"""

from __future__ import annotations

from typing import Any

import torch

from tileops.ops.attention import AttentionBwdInterface, AttentionCall, AttentionFwdInterface

from ..compile import entry_function
from ..kernel import BuildPlan, Output, TileLangKernel
from . import policy, programs

#: Query rows S_pad is a multiple of: the largest query tile any kernel of the backward reads.
_PAD_ROWS = 64


def _like_first(arguments: tuple, call: AttentionCall) -> tuple[int, ...]:
    return tuple(arguments[0].shape)


def _first_dtype(arguments: tuple, call: AttentionCall) -> torch.dtype:
    return arguments[0].dtype


def _lse_shape(arguments: tuple, call: AttentionCall) -> tuple[int, ...]:
    q = arguments[0]
    return (q.shape[0], q.shape[2], q.shape[1])  # q's middle dimensions swapped, in either layout


def _float32(arguments: tuple, call: AttentionCall) -> torch.dtype:
    return torch.float32


def _like(position: int) -> Output:
    return Output.computed(lambda arguments, call: tuple(arguments[position].shape), _first_dtype)


class _TileLangAttention(TileLangKernel):
    family = "attention"
    supported_archs = frozenset({90})
    ranks_built_eagerly = (4,)  # q, k, v are always 4-D

    def __init__(self, call: AttentionCall) -> None:
        super().__init__(call.device, call)

    @classmethod
    def entry_for(cls, call: AttentionCall):
        return call, lambda: cls(call)

    @classmethod
    def refusal(cls, call: AttentionCall) -> str | None:
        if call.heads_q == 0:  # a call without query heads writes only zero dk and dv
            return "takes at least one query head"
        return policy.refusal(call.dtype, call.head_dim)

    def identity(self) -> tuple:
        c = self.params
        return (c.dtype, c.head_dim, c.heads_q, c.heads_kv, c.causal, c.window, c.scale, c.layout)

    def tuning_subject(self, sized: torch.Tensor) -> str:
        c = self.params
        return f"{type(self).__name__} D={c.head_dim} heads {c.heads_q}/{c.heads_kv} on {tuple(sized.shape)}"


class AttentionFwdKernel(_TileLangAttention, AttentionFwdInterface):
    """Flash attention forward: (o, lse) for q, k, v."""

    kind = "fwd"
    outputs = (Output.computed(_like_first, _first_dtype), Output.computed(_lse_shape, _float32))

    def default_config(self) -> dict[str, Any]:
        return policy.forward_config(self.params.head_dim)

    def tuning_candidates(self) -> list[dict[str, Any]]:
        return policy.forward_candidates(self.params.head_dim)

    def build_plan(self, config: dict[str, Any]) -> BuildPlan:
        return BuildPlan({"main": config}, shown=dict(config))

    def compile(self, config: dict[str, Any], rank: int) -> Any:
        return programs.compile_forward(self.params, self.tilelang_target, **config)


class AttentionBwdKernel(_TileLangAttention, AttentionBwdInterface):
    """Flash attention backward: (dq, dk, dv) from do, q, k, v, o, lse and dlse (None: zero)."""

    kind = "bwd"
    # dq like q, dk like k, dv like v (arguments 1, 2, 3), in q's dtype.
    outputs = (_like(1), _like(2), _like(3))

    def default_config(self) -> dict[str, Any]:
        return policy.dense_backward_config(self.params.head_dim)

    def tuning_candidates(self) -> list[dict[str, Any]]:
        return [self.default_config()]

    def build_plan(self, config: dict[str, Any]) -> BuildPlan:
        why = "the backward runs its rules' configuration"
        return BuildPlan({"main": config}, untuned={"main": why}, shown=dict(config))

    def compile(self, config: dict[str, Any], rank: int) -> Any:
        return programs.compile_bwd_main(self.params, self.tilelang_target, **config)

    def _launch_function(self, config: dict[str, Any], rank: int):
        call = self.params
        main = entry_function(self.compile(config, rank))
        pre = entry_function(programs.compile_bwd_pre(call, self.tilelang_target, **policy.ROWS_KERNEL))
        post = entry_function(programs.compile_bwd_post(call, self.tilelang_target, **policy.ROWS_KERNEL))
        seq_dim = 1 if call.layout == "bshd" else 2
        accumulate_kv = programs.accumulates_kv_in_float32(config.get("per_query_head", False), call.heads_q, call.heads_kv)

        def launch(*tensors: torch.Tensor) -> None:
            # (do, q, k, v, o, lse, [dlse], dq, dk, dv): an absent dlse is left out by the caller.
            do, q, k, v, o, lse = tensors[:6]
            dlse = tensors[6] if len(tensors) == 10 else torch.zeros_like(lse)
            dq, dk, dv = tensors[-3:]
            batch, s_q = q.shape[0], q.shape[seq_dim]
            s_pad = -(-s_q // _PAD_ROWS) * _PAD_ROWS
            delta = torch.empty(batch, call.heads_q, s_pad, dtype=torch.float32, device=q.device)
            lse2 = torch.empty_like(delta)
            dq_acc = torch.zeros(batch, call.heads_q, s_pad, call.head_dim, dtype=torch.float32, device=q.device)
            pre(do, o, lse, dlse, delta, lse2)
            if accumulate_kv:
                s_k = k.shape[seq_dim]
                padded = list(k.shape)
                padded[seq_dim] = -(-s_k // config["block_n"]) * config["block_n"]
                dk_acc = torch.zeros(padded, dtype=torch.float32, device=k.device)
                dv_acc = torch.zeros_like(dk_acc)
                main(do, q, k, v, delta, lse2, dq_acc, dk_acc, dv_acc)
                dk.copy_(dk_acc.narrow(seq_dim, 0, s_k))
                dv.copy_(dv_acc.narrow(seq_dim, 0, s_k))
            else:
                main(do, q, k, v, delta, lse2, dq_acc, dk, dv)
            post(dq_acc, dq)

        return launch
