"""``VarlenAttentionFwdOp`` and its backward op ``VarlenAttentionBwdOp``: attention over a packed
batch of variable-length sequences, flash-attn's ``flash_attn_varlen_func``.

They are ops of their own rather than optional inputs of ``AttentionFwdOp``: a packed q is
(T_q, H, D), not (B, S_q, H_q, D), and lse is (H, T_q), so the signature, its generated checks,
the reference, the workloads and the roofline all differ from the dense op's.

Each op builds the call spec from q and k (the scale resolved to 1 / sqrt(D) where none was
given) and runs the implementation selection picks, on tensors at 16-byte aligned addresses
(``aligned_copies``). Offsets on the CPU (a CPU call) are checked
here, by name, before any kernel: int32 and B + 1 entries come from the manifest, and the rules
(0 first, never decreasing, T_q or T_k last) are checked in Python. Offsets on a GPU are never
read on the host (``varlen_interfaces`` says what the kernels do with bad ones). Calls without a
key are answered here: o = 0 and lse = -inf, zero gradients (the signature asks for a sequence).
"""

from __future__ import annotations

import math
from importlib.resources import files

import torch

from tileops.core import Op, OpArgumentError

from ..vector_access import aligned_copies
from .varlen_cpu import IMPLEMENTATIONS
from .varlen_interfaces import VarlenAttentionBwdInterface, VarlenAttentionFwdInterface


def check_offsets(op_name: str, name: str, cu_seqlens: torch.Tensor, total: int, rows_of: str) -> None:
    """Refuse offsets held on the CPU that do not start at 0, decrease, or end elsewhere than at
    ``total`` (the rows of ``rows_of``); offsets on another device are left to the kernels."""
    if not cu_seqlens.is_cpu:
        return
    offsets = cu_seqlens.tolist()
    problem = None
    if offsets[0] != 0:
        problem = f"starts at {offsets[0]}"
    elif any(later < earlier for earlier, later in zip(offsets, offsets[1:])):
        at = next(b for b in range(len(offsets) - 1) if offsets[b + 1] < offsets[b])
        problem = f"decreases from {offsets[at]} to {offsets[at + 1]} at entry {at + 1}"
    elif offsets[-1] != total:
        problem = f"ends at {offsets[-1]}"
    if problem is not None:
        shown = offsets if len(offsets) <= 8 else [*offsets[:4], "...", *offsets[-3:]]
        raise OpArgumentError(
            f"{op_name}: argument {name!r} must hold the cumulative sequence lengths: start at 0, never decrease "
            f"and end at {rows_of}'s {total} rows; it {problem} ({', '.join(map(str, shown))})"
        )


class _VarlenAttentionOp(Op):
    """What the packed-batch attention ops share: the constructor, the call spec and the offsets check."""

    manifest_file = files("tileops.ops") / "manifest" / "attention_varlen.yaml"
    # The TileLang kernels, key -> class per interface, imported when an op is first built.
    kernel_tables = ("tileops.kernels.cuda.attention.varlen:KERNELS",)

    def __init__(
        self, *, causal: bool = False, window: int | None = None, scale: float | None = None, target: str | None = None
    ) -> None:
        super().__init__(causal=causal, window=window, scale=scale, target=target)

    def call_spec(self, interface, device, dtype, head_dim, heads_q, heads_kv):
        """The call spec of ``kernel_for(interface, device, dtype, head_dim, heads_q, heads_kv)``:
        the masking and scale are the instance's."""
        p = self.params
        scale = p["scale"] if p["scale"] is not None else 1.0 / math.sqrt(head_dim)
        return interface.call_spec(device, dtype, head_dim, heads_q, heads_kv, p["causal"], p["window"], scale)

    def call_specs(self, device, inputs):
        """The call spec a call with ``inputs`` (descriptions) gets, built as ``forward`` builds it."""
        (interface,) = self.kernel_interfaces
        q, k = inputs["q"], inputs["k"]
        return {interface: self.call_spec(interface, device, q.dtype, q.shape[2], q.shape[1], k.shape[1])}

    def _check(self, q, k, cu_seqlens_q, cu_seqlens_k) -> None:
        name = type(self).__name__
        check_offsets(name, "cu_seqlens_q", cu_seqlens_q, q.shape[0], "q")
        check_offsets(name, "cu_seqlens_k", cu_seqlens_k, k.shape[0], "k")

    def forward_saving(self, *inputs, **outs):
        # o and lse are outputs: the backward reads them, nothing else is saved.
        return self.forward(*inputs, **outs), ()


class VarlenAttentionFwdOp(_VarlenAttentionOp):
    """Attention over packed variable-length sequences:
    ``op(q, k, v, cu_seqlens_q, cu_seqlens_k) -> (o, lse)``, with ``causal``, ``window`` and
    ``scale`` given at construction."""

    kernel_interfaces = (VarlenAttentionFwdInterface,)
    in_tree_kernels = {VarlenAttentionFwdInterface: IMPLEMENTATIONS[VarlenAttentionFwdInterface]}

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k):
        self._check(q, k, cu_seqlens_q, cu_seqlens_k)
        if k.shape[0] == 0:  # no key: every row is empty
            lse = torch.full((q.shape[1], q.shape[0]), -torch.inf, dtype=torch.float32, device=q.device)
            return torch.zeros_like(q), lse
        kernel = self.kernel_for(VarlenAttentionFwdInterface, q.device, q.dtype, q.shape[2], q.shape[1], k.shape[1])
        return kernel.forward(*aligned_copies(q.device, q, k, v), cu_seqlens_q, cu_seqlens_k)


class VarlenAttentionBwdOp(_VarlenAttentionOp):
    """Gradients of ``VarlenAttentionFwdOp``:
    ``op(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, dlse=None) -> (dq, dk, dv)``."""

    kernel_interfaces = (VarlenAttentionBwdInterface,)
    in_tree_kernels = {VarlenAttentionBwdInterface: IMPLEMENTATIONS[VarlenAttentionBwdInterface]}

    def forward(self, do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, dlse):
        self._check(q, k, cu_seqlens_q, cu_seqlens_k)
        if q.shape[0] == 0 or k.shape[0] == 0 or q.shape[1] == 0:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)  # nothing attends
        kernel = self.kernel_for(VarlenAttentionBwdInterface, q.device, q.dtype, q.shape[2], q.shape[1], k.shape[1])
        do, q, k, v, o, lse, dlse = aligned_copies(q.device, do, q, k, v, o, lse, dlse)
        return kernel.forward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, dlse)
