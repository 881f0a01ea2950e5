"""The rotary position embedding module of ``tileops.nn``: ``RotaryEmbedding`` holds the cos and
sin caches of a RoPE and rotates queries and keys with ``RotaryEmbeddingFwdOp``."""

from __future__ import annotations

import torch

from tileops.ops import RotaryEmbeddingFwdOp

__all__ = ["RotaryEmbedding"]


class RotaryEmbedding(torch.nn.Module):
    """Rotary position embedding of queries and keys: ``RotaryEmbedding(dim, max_positions,
    base=10000.0, style="neox", device=None, *, target=None)``;
    ``forward(q, k, position_ids) -> (q_rot, k_rot)``.

    q is (batch, seq, Hq, head) and k (batch, seq, Hkv, head), or (tokens, heads, head) for both;
    ``position_ids`` (batch, seq) or (tokens,), int64, each token's position in [0,
    max_positions). ``dim`` is the rotated width: the head size, or fewer leading columns of each
    head (partial rotation, as GPT-NeoX and Phi; the rest pass through). The frequencies are
    ``base ** (-2i / dim)``, as Llama's default RoPE. ``style`` is ``"neox"`` (Llama's ``rotate_half``) or ``"interleaved"``
    (GPT-J's pairs). The caches are float32 buffers, not saved in the ``state_dict`` (they are
    computed from the arguments, as transformers' rotary modules do)."""

    def __init__(self, dim: int, max_positions: int, base: float = 10000.0, style: str = "neox", device=None, *,
                 target: str | None = None) -> None:
        super().__init__()
        if dim % 2:
            raise ValueError(f"RotaryEmbedding: dim must be even (the rotation pairs columns), got {dim}")
        if max_positions < 1:
            raise ValueError(f"RotaryEmbedding: max_positions must be positive, got {max_positions}")
        self.dim, self.max_positions, self.base, self.style = dim, max_positions, base, style
        self.op = RotaryEmbeddingFwdOp(rotary_dim=dim, style=style, target=target)
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
        freqs = torch.outer(torch.arange(max_positions, device=device, dtype=torch.float32), inv_freq)
        # neox pairs column j with j + dim/2, so each angle is written for both halves; interleaved
        # pairs 2i with 2i + 1, so each angle is written twice in a row.
        angles = torch.cat((freqs, freqs), -1) if style == "neox" else torch.repeat_interleave(freqs, 2, -1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.op(q, k, self.cos, self.sin, position_ids)

    def extra_repr(self) -> str:
        return f"{self.dim}, max_positions={self.max_positions}, base={self.base}, style={self.style!r}, target={self.op.requested_target}"
