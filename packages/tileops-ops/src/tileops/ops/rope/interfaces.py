"""The rope family's kernel interfaces and call spec: the contract every implementation of a
rotary position embedding, forward or backward (in-tree or a backend's), is written against.

Kernels see contiguous tensors with the token dimensions flattened: ``q`` (T, Hq, D), ``k``
(T, Hkv, D), the caches ``cos`` and ``sin`` (max_positions, rotary_dim) and ``position_ids`` (T,)
int64; the op reshapes the caller's (batch, seq, heads, D) or (tokens, heads, D) around them,
except for an implementation of the out-of-place interfaces that sets ``takes_any_shape =
True``: it receives q and k (..., heads, D) and position_ids (...) as the caller passed them and
returns results of q's and k's shapes.

The map, on the first ``rotary_dim`` = R columns of every head, with ``c = cos[position_ids[t]]``
and ``s = sin[position_ids[t]]`` and the columns paired as the style pairs them (``neox``:
column j with j + R/2, as Hugging Face's rotate_half; ``interleaved``: 2i with 2i + 1, as
GPT-J), is for a pair (x1, x2) at columns (j1, j2)::

    forward:  y1 = c[j1] x1 - s[j1] x2        y2 = c[j2] x2 + s[j2] x1
    backward: y1 = c[j1] x1 + s[j2] x2        y2 = c[j2] x2 - s[j1] x1

The backward is the forward's transpose: the rotation by -theta, with sin read at each column's
partner (the same value in a cache of real angles, cat(freqs, freqs) or repeat_interleave). The
columns from R on are copied. Math in float32 (float64 where q or the caches are float64),
rounded once to q's dtype; the caches may have any float dtype.
"""

from __future__ import annotations

import abc
import dataclasses

import torch

from tileops.core import CallSpec, KernelInterface

#: The styles, as the manifest's ``style`` param names them.
STYLES = ("neox", "interleaved")


@dataclasses.dataclass(frozen=True)
class RopeCall(CallSpec):
    """The facts of one rotary-embedding call that select and build its kernel.

    ``rotary_dim`` is the value used (the head size D where the op's param is None);
    ``cos_dtype`` is the caches' dtype; ``aligned`` says whether every tensor's data pointer
    is 16-byte aligned (vectorised kernels refuse unaligned calls; always True on the CPU, whose
    vector loads take any address; the token count and the cache's length are not part of the
    spec, so another batch reuses the kernel built).
    """

    dtype: torch.dtype
    cos_dtype: torch.dtype
    heads_q: int
    heads_k: int
    head_dim: int
    rotary_dim: int
    style: str
    aligned: bool


@dataclasses.dataclass(frozen=True)
class RopeBwdCall(RopeCall):
    """A call of ``RotaryEmbeddingBwdInterface``."""


@dataclasses.dataclass(frozen=True)
class RopeInplaceCall(RopeCall):
    """A call of ``RotaryEmbeddingInplaceInterface``."""


class RotaryEmbeddingFwdInterface(KernelInterface):
    call_spec = RopeCall

    @abc.abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(q_rot, k_rot)``: new tensors of q's and k's shapes and dtype, q and k
        rotated by the forward map of the module docstring."""


class RotaryEmbeddingBwdInterface(KernelInterface):
    call_spec = RopeBwdCall

    @abc.abstractmethod
    def forward(
        self, dq_rot: torch.Tensor, dk_rot: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(dq, dk)``: new tensors, the incoming gradients mapped by the backward map
        of the module docstring (the forward's transpose)."""


class RotaryEmbeddingInplaceInterface(KernelInterface):
    call_spec = RopeInplaceCall

    @abc.abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor
    ) -> None:
        """Write the forward map of the module docstring into q and k, which come as the caller
        passed them: (..., heads, D) with any strides (slices of a fused qkv tensor), and
        position_ids of their leading shape. Return nothing."""
