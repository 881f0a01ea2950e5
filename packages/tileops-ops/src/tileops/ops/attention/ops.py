"""``AttentionFwdOp`` and its backward op ``AttentionBwdOp``.

Each op reads the call's heads and head size from q and k in the layout its ``qkv_layout`` names,
builds the call spec (the scale resolved to 1 / sqrt(D) where none was given) and runs the
implementation selection picks, on contiguous tensors (the call path copies a strided q, k or v,
such as slices of a fused qkv projection) at 16-byte aligned addresses (``aligned_copies``). Calls with an empty sequence are answered here
without a kernel: S_k = 0 gives o = 0 and lse = -inf (and zero gradients), S_q = 0 gives
zero dk and dv. The forward is differentiable: its outputs o and lse are what the backward op
reads (``saves: []``), and the gradient of lse, when the caller uses it, reaches the backward as
``dlse``.
"""

from __future__ import annotations

import math
from importlib.resources import files

import torch

from tileops.core import Op

from ..vector_access import aligned_copies
from .cpu import IMPLEMENTATIONS
from .interfaces import AttentionBwdInterface, AttentionFwdInterface


class _AttentionOp(Op):
    """What the prefill attention ops share: the constructor, the call spec and what is saved."""

    manifest_file = files("tileops.ops") / "manifest" / "attention.yaml"
    # The TileLang kernels, key -> class per interface, imported when an op is first built.
    kernel_tables = ("tileops.kernels.cuda.attention:KERNELS",)

    def __init__(
        self,
        *,
        causal: bool = False,
        window: int | None = None,
        scale: float | None = None,
        qkv_layout: str = "bshd",
        target: str | None = None,
    ) -> None:
        super().__init__(causal=causal, window=window, scale=scale, qkv_layout=qkv_layout, target=target)
        #: The sequence and head dimensions of q, k and v in this op's layout.
        self._seq_dim, self._head_dim = (1, 2) if self.params["qkv_layout"] == "bshd" else (2, 1)

    def call_spec(self, interface, device, dtype, head_dim, heads_q, heads_kv):
        """The call spec of ``kernel_for(interface, device, dtype, head_dim, heads_q, heads_kv)``:
        the masking, scale and layout are the instance's."""
        p = self.params
        scale = p["scale"] if p["scale"] is not None else 1.0 / math.sqrt(head_dim)
        return interface.call_spec(device, dtype, head_dim, heads_q, heads_kv, p["causal"], p["window"], scale, p["qkv_layout"])

    def _facts(self, q, k) -> tuple:
        """(dtype, D, H_q, H_kv) of a call (tensors, or descriptions of them)."""
        return q.dtype, q.shape[3], q.shape[self._head_dim], k.shape[self._head_dim]

    def call_specs(self, device, inputs):
        """The call spec a call with ``inputs`` (descriptions) gets, built as ``forward`` builds it."""
        (interface,) = self.kernel_interfaces
        return {interface: self.call_spec(interface, device, *self._facts(inputs["q"], inputs["k"]))}

    def forward_saving(self, *inputs, **outs):
        # o and lse are outputs: the backward reads them, nothing else is saved.
        return self.forward(*inputs, **outs), ()


class AttentionFwdOp(_AttentionOp):
    """Scaled dot-product attention as an op: ``op(q, k, v) -> (o, lse)``, with
    ``causal``, ``window``, ``scale`` and ``qkv_layout`` given at construction."""

    kernel_interfaces = (AttentionFwdInterface,)
    in_tree_kernels = {AttentionFwdInterface: IMPLEMENTATIONS[AttentionFwdInterface]}

    def forward(self, q, k, v):
        if k.shape[self._seq_dim] == 0:  # no key to attend to: every row is empty
            lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), -torch.inf, dtype=torch.float32, device=q.device)
            return torch.zeros_like(q), lse
        kernel = self.kernel_for(AttentionFwdInterface, q.device, *self._facts(q, k))
        return kernel.forward(*aligned_copies(q.device, q, k, v))


class AttentionBwdOp(_AttentionOp):
    """Gradients of ``AttentionFwdOp``: ``op(do, q, k, v, o, lse, dlse=None) -> (dq, dk, dv)``."""

    kernel_interfaces = (AttentionBwdInterface,)
    in_tree_kernels = {AttentionBwdInterface: IMPLEMENTATIONS[AttentionBwdInterface]}

    def forward(self, do, q, k, v, o, lse, dlse):
        if q.shape[self._seq_dim] == 0 or k.shape[self._seq_dim] == 0:  # nothing attends: zero gradients
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        kernel = self.kernel_for(AttentionBwdInterface, q.device, *self._facts(q, k))
        return kernel.forward(*aligned_copies(q.device, do, q, k, v, o, lse, dlse))
