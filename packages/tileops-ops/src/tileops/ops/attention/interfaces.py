"""The attention family's kernel interfaces and call spec: the contract every implementation of
prefill/training attention, forward and backward (in-tree or a backend's), is written against.

Kernels see contiguous tensors in the call's layout (``AttentionCall.layout``): 'bshd' holds q
as (B, S_q, H_q, D) and k, v as (B, S_k, H_kv, D); 'bhsd' swaps the two middle dimensions.
Query head h reads key/value head ``h // (H_q // H_kv)``. The log-sum-exp ``lse`` is float32 and
holds q's two middle dimensions swapped: (B, H_q, S_q) in 'bshd' (flash-attn's), (B, S_q, H_q) in
'bhsd'. Causal masking is aligned to the bottom right:
query row i sees key j when ``j <= i + S_k - S_q``; a window adds ``j >= i + S_k - S_q - window``.
A row that sees no key has o = 0, lse = -inf and no gradient. Implementations are called with
S_q >= 1 and S_k >= 1: the ops answer empty sequences themselves.
"""

from __future__ import annotations

import abc
import dataclasses

import torch

from tileops.core import CallSpec, KernelInterface

#: The layouts an implementation is called with, as the ops' ``qkv_layout`` param names them.
LAYOUTS = ("bshd", "bhsd")


@dataclasses.dataclass(frozen=True)
class AttentionCall(CallSpec):
    """The facts of one attention call that select and build its kernel.

    ``scale`` is the resolved softmax scale (1 / sqrt(D) where the op was given none);
    ``window`` is None for an unlimited one. Batch and sequence lengths are not part of the
    spec, so a call of other lengths reuses the kernel already built.
    """

    dtype: torch.dtype
    head_dim: int
    heads_q: int
    heads_kv: int
    causal: bool
    window: int | None
    scale: float
    layout: str


class AttentionFwdInterface(KernelInterface):
    call_spec = AttentionCall

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(o, lse)`` for contiguous q, k, v in the call's layout: o shaped and typed as q,
        lse float32 and contiguous, of q's first three dimensions with the middle two swapped."""


class AttentionBwdInterface(KernelInterface):
    call_spec = AttentionCall

    @abc.abstractmethod
    def forward(
        self,
        do: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        o: torch.Tensor,
        lse: torch.Tensor,
        dlse: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` for contiguous tensors in the call's layout: do, o shaped as q, lse
        (and dlse, the gradient of lse, None meaning zero) float32, shaped as the forward's lse. dk and
        dv are summed over the query heads that share a key/value head; all three in q's dtype."""
