"""The attention module of ``tileops.nn``: ``Attention``, scaled dot-product attention of queries
over keys and values on ``AttentionFwdOp`` (flash-attn's semantics: grouped-query heads, causal
masking aligned to the bottom right, sliding windows)."""

from __future__ import annotations

import torch

from tileops.ops import AttentionFwdOp

__all__ = ["Attention"]


class Attention(torch.nn.Module):
    """``softmax(q k^T * scale + mask) v``: ``Attention(*, causal=False, window=None, scale=None,
    qkv_layout="bshd", target=None)``; ``forward(q, k, v) -> o``.

    In the ``"bshd"`` layout q is (B, S_q, H_q, D) and k, v (B, S_k, H_kv, D), as flash-attn; in
    ``"bhsd"`` the heads come before the sequence, as torch's ``scaled_dot_product_attention``.
    H_q is a multiple of H_kv (MHA, GQA, MQA). ``causal`` lets query i see key j when ``j <= i +
    S_k - S_q`` (the last query sees the last key: a decode step's new tokens over a KV cache);
    ``window`` keeps only keys ``j >= i + S_k - S_q - window``; ``scale`` multiplies q . k (None:
    1 / sqrt(D)). It holds no parameters. The op's per-row log-sum-exp is dropped here; call
    ``AttentionFwdOp`` for it."""

    def __init__(self, *, causal: bool = False, window: int | None = None, scale: float | None = None,
                 qkv_layout: str = "bshd", target: str | None = None) -> None:
        super().__init__()
        self.op = AttentionFwdOp(causal=causal, window=window, scale=scale, qkv_layout=qkv_layout, target=target)
        self.causal, self.window, self.scale, self.qkv_layout = causal, window, scale, qkv_layout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.op(q, k, v)[0]

    def extra_repr(self) -> str:
        return (f"causal={self.causal}, window={self.window}, scale={self.scale}, qkv_layout={self.qkv_layout!r}, "
                f"target={self.op.requested_target}")
