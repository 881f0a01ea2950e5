"""Variable-length attention's kernel interfaces and call spec: the contract every implementation
of ``VarlenAttentionFwdOp`` and ``VarlenAttentionBwdOp`` (in-tree or a backend's) is written
against.

Kernels see the call's tensors as the call path hands them: contiguous, on one device. The B
sequences are packed: q (T_q, H, D), k and v (T_k, HK, D), and ``cu_seqlens_q``,
``cu_seqlens_k`` (B + 1,) int32 give each sequence's rows: sequence b is the query rows
``cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1`` and the key rows ``cu_seqlens_k[b] ..
cu_seqlens_k[b + 1] - 1``. Within a sequence of S_q queries and S_k keys, local query row i sees
local key j when ``j <= i + S_k - S_q`` (causal, bottom-right aligned) and
``j >= i + S_k - S_q - window`` (a window); query head h reads key/value head ``h // (H / HK)``.
lse is float32 (H, T_q). A row that sees no key has o = 0, lse = -inf and no gradient.

Implementations are called with B >= 1, T_q >= 1, T_k >= 1 and H >= 1 (the ops answer the rest).
On a GPU they must not read ``cu_seqlens_*`` on the host (a call may be captured in a CUDA graph
whose replays change the lengths), and offsets that break the rules (not starting at 0,
decreasing, not ending at the totals) may give any values but must never make a kernel read or
write outside the call's tensors.
"""

from __future__ import annotations

import abc
import dataclasses

import torch

from tileops.core import CallSpec, KernelInterface


@dataclasses.dataclass(frozen=True)
class VarlenAttentionCall(CallSpec):
    """The facts of one variable-length attention call that select and build its kernel.

    ``scale`` is the resolved softmax scale (1 / sqrt(D) where the op was given none);
    ``window`` is None for an unlimited one. The totals, the batch and the lengths are not part
    of the spec, so every packed batch reuses the kernel already built.
    """

    dtype: torch.dtype
    head_dim: int
    heads_q: int
    heads_kv: int
    causal: bool
    window: int | None
    scale: float


class VarlenAttentionFwdInterface(KernelInterface):
    call_spec = VarlenAttentionCall

    @abc.abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(o, lse)``: o shaped and typed as q, lse float32 (H, T_q), contiguous."""


class VarlenAttentionBwdInterface(KernelInterface):
    call_spec = VarlenAttentionCall

    @abc.abstractmethod
    def forward(
        self,
        do: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        o: torch.Tensor,
        lse: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        dlse: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)``: do and o shaped as q, lse (and dlse, the gradient of lse, None
        meaning zero) float32 (H, T_q). dk and dv are summed over the query heads that share a
        key/value head; all three in q's dtype."""
