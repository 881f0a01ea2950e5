"""Plain-torch implementations of the rope interfaces, forward and backward.

They compute in float32 (float64 where q or the caches are float64) and round once, like the manifest's
reference. The ``torch_cpu`` ones are ``general``: they serve every CPU call, and any narrower
implementation a backend adds beats them. The ``torch_float64`` ones serve float64 calls on
CUDA (q or the caches), which the TileLang kernels do not take (float64 is there for ``gradcheck``). They record
no autograd history: the forward op's autograd node calls the backward op.
"""

from __future__ import annotations

import torch

from tileops.core import Kernel

from ..compute_dtypes import as_dtype
from ..float64_on_cuda import float64_on_cuda
from .interfaces import (
    RopeCall,
    RotaryEmbeddingBwdInterface,
    RotaryEmbeddingFwdInterface,
    RotaryEmbeddingInplaceInterface,
)


def _rows_at(cache: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """The rows of ``cache`` (P, R) at ``position_ids``, shaped (*position_ids.shape, R). On the
    CPU a position outside [0, P) raises IndexError, negative ones too (``torch.embedding`` does
    not count from the end, which would rotate by another position's angle; 0.8 us more than
    ``cache[position_ids]`` on a small call), which the op turns into an error naming the
    position. On CUDA (this is the float64 implementation there) such a position reads zeros, as
    the TileLang kernels' guarded loads do: refusing it would take a synchronisation, and
    indexing past the end stops the device with an assert."""
    if cache.device.type == "cpu":
        return torch.embedding(cache, position_ids)
    inside = ((position_ids >= 0) & (position_ids < cache.shape[0])).unsqueeze(-1)
    return torch.where(inside, cache[position_ids.clamp(0, cache.shape[0] - 1)], 0.0)


class _TorchRope(Kernel):
    """Both maps as ``x * c + partner(x) * t``, where ``partner(x)`` holds each column's partner
    (the other half's column for neox, the pair's other column for gptj) and ``t`` is sin, signed
    per column, made once a call for q and k. The map and its transpose (the backward) differ
    only in ``t``: the transpose reads each column's coefficient at its partner, since the
    partner map is its own inverse. Three torch calls a tensor where the formula's slices, negation
    and concatenation took seven (a (2, 8, 4, 64) float32 call 52 -> 29 us, against 38 us for torch's
    own expression)."""

    devices = frozenset({"cpu"})
    general = True
    takes_any_shape = True  # cos[position_ids] and the last two dimensions: any leading shape
    #: True for the backward: the transposed map (rotation by -theta).
    inverse = False

    def __init__(self, rotary_dim: int, style: str) -> None:
        super().__init__()
        self.rotary_dim, self.style = rotary_dim, style
        # The forward's sign of each column's partner term: (-x2, x1) per pair.
        if style == "neox":
            signs = torch.ones(rotary_dim).index_fill_(0, torch.arange(rotary_dim // 2), -1.0)
        else:
            signs = torch.ones(rotary_dim).index_fill_(0, torch.arange(0, rotary_dim, 2), -1.0)
        self._signs = {torch.float32: signs, torch.float64: signs.double()}

    @classmethod
    def entry_for(cls, call: RopeCall):
        return (call.rotary_dim, call.style), lambda: cls(call.rotary_dim, call.style)

    def _partner(self, x: torch.Tensor) -> torch.Tensor:
        """Each column's partner column: x2 | x1 (neox), or each pair swapped (gptj)."""
        if self.style == "neox":
            return x.roll(self.rotary_dim // 2, -1)
        return x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)

    def _apply(self, x: torch.Tensor, c: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        wide = as_dtype(x, c.dtype)
        whole = r == x.shape[-1]
        rotated = wide if whole else wide[..., :r]
        result = (rotated * c).addcmul_(self._partner(rotated), t)  # over its own temporary: no third tensor
        if not whole:
            result = torch.cat((result, wide[..., r:]), -1)
        return as_dtype(result, x.dtype)

    def _both(self, x, y, cos, sin, position_ids):
        # No autograd history to keep out: the op's autograd node runs this with grad off, and
        # an untracked call has no input that requires grad.
        dtype = torch.float64 if torch.float64 in (x.dtype, cos.dtype) else torch.float32
        c = as_dtype(_rows_at(cos, position_ids), dtype).unsqueeze(-2)  # (T, 1, R): one row per token, every head
        signs = self._signs[dtype]
        if signs.device != c.device:
            signs = self._signs[dtype] = signs.to(c.device)
        t = as_dtype(_rows_at(sin, position_ids), dtype).unsqueeze(-2) * signs
        if self.inverse:
            t = self._partner(t)
        return self._apply(x, c, t), self._apply(y, c, t)


class TorchCpuRotaryEmbedding(_TorchRope, RotaryEmbeddingFwdInterface):
    """The forward map in plain torch."""

    def forward(self, q, k, cos, sin, position_ids):
        return self._both(q, k, cos, sin, position_ids)


class TorchCpuRotaryEmbeddingBwd(_TorchRope, RotaryEmbeddingBwdInterface):
    """The backward (transposed) map in plain torch."""

    inverse = True

    def forward(self, dq_rot, dk_rot, cos, sin, position_ids):
        return self._both(dq_rot, dk_rot, cos, sin, position_ids)


class TorchCpuRotaryEmbeddingInplace(_TorchRope, RotaryEmbeddingInplaceInterface):
    """The forward map in plain torch, copied into q and k (any leading shape and strides)."""

    @torch.no_grad()
    def forward(self, q, k, cos, sin, position_ids):
        q_rot, k_rot = self._both(q, k, cos, sin, position_ids)
        q.copy_(q_rot)
        k.copy_(k_rot)


def _float64_in_x_or_caches(call: RopeCall) -> bool:
    return torch.float64 in (call.dtype, call.cos_dtype)


def _dtypes(call: RopeCall) -> str:
    return f"{call.dtype} with {call.cos_dtype} caches"


#: key -> class per interface: the CPU implementations, and the float64 ones on CUDA.
IMPLEMENTATIONS = {
    interface: {"torch_cpu": cpu_class, "torch_float64": float64_on_cuda(cpu_class, _float64_in_x_or_caches, _dtypes)}
    for interface, cpu_class in (
        (RotaryEmbeddingFwdInterface, TorchCpuRotaryEmbedding),
        (RotaryEmbeddingBwdInterface, TorchCpuRotaryEmbeddingBwd),
        (RotaryEmbeddingInplaceInterface, TorchCpuRotaryEmbeddingInplace),
    )
}
