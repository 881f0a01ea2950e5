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

from .interfaces import (
    RopeCall,
    RotaryEmbeddingBwdInterface,
    RotaryEmbeddingFwdInterface,
    RotaryEmbeddingInplaceInterface,
)


def _wide(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in the math ``dtype`` (no call into torch where it already has it)."""
    return tensor if tensor.dtype is dtype else tensor.to(dtype)


def _rotate(x: torch.Tensor, style: str) -> torch.Tensor:
    """The partner of every column, signed as the forward reads it: (-x2, x1) per pair."""
    if style == "neox":
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), -1)
    return torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)


def _rotate_transposed(x: torch.Tensor, style: str) -> torch.Tensor:
    """The transpose of ``_rotate``: (x2, -x1) per pair."""
    if style == "neox":
        half = x.shape[-1] // 2
        return torch.cat((x[..., half:], -x[..., :half]), -1)
    return torch.stack((x[..., 1::2], -x[..., 0::2]), -1).flatten(-2)


class _TorchRope(Kernel):
    devices = frozenset({"cpu"})
    general = True
    takes_any_shape = True  # cos[position_ids] and the last two dimensions: any leading shape
    #: True for the backward: the transposed map (rotation by -theta).
    inverse = False

    def __init__(self, rotary_dim: int, style: str) -> None:
        super().__init__()
        self.rotary_dim, self.style = rotary_dim, style

    @classmethod
    def entry_for(cls, call: RopeCall):
        return (call.rotary_dim, call.style), lambda: cls(call.rotary_dim, call.style)

    def _apply(self, x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        wide = _wide(x, c.dtype)
        rotated = wide[..., :r]
        if self.inverse:
            result = rotated * c + _rotate_transposed(rotated * s, self.style)
        else:
            result = rotated * c + _rotate(rotated, self.style) * s
        if r < x.shape[-1]:
            result = torch.cat((result, wide[..., r:]), -1)
        return result.to(x.dtype)

    @torch.no_grad()
    def _both(self, x, y, cos, sin, position_ids):
        dtype = torch.float64 if torch.float64 in (x.dtype, cos.dtype) else torch.float32
        c = cos[position_ids].to(dtype).unsqueeze(-2)  # (T, 1, R): one row per token, every head
        s = sin[position_ids].to(dtype).unsqueeze(-2)
        return self._apply(x, c, s), self._apply(y, c, s)


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


def _float64_on_cuda(cpu_class: type[_TorchRope]) -> type[_TorchRope]:
    """The same implementation for float64 calls on CUDA (the TileLang kernels refuse them)."""

    def refusal(cls, call: RopeCall) -> str | None:
        if torch.float64 not in (call.dtype, call.cos_dtype):
            return f"serves float64 only (the TileLang kernels serve {call.dtype} with {call.cos_dtype} caches)"
        return None

    name = cpu_class.__name__.replace("TorchCpu", "TorchFloat64")
    namespace = {"devices": frozenset({"cuda"}), "general": False, "refusal": classmethod(refusal), "__module__": __name__}
    return type(name, (cpu_class,), namespace)


#: key -> class per interface: the CPU implementations, and the float64 ones on CUDA.
IMPLEMENTATIONS = {
    interface: {"torch_cpu": cpu_class, "torch_float64": _float64_on_cuda(cpu_class)}
    for interface, cpu_class in (
        (RotaryEmbeddingFwdInterface, TorchCpuRotaryEmbedding),
        (RotaryEmbeddingBwdInterface, TorchCpuRotaryEmbeddingBwd),
        (RotaryEmbeddingInplaceInterface, TorchCpuRotaryEmbeddingInplace),
    )
}
