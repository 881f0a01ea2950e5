"""Decode attention's kernel interface and call spec: the contract every implementation of
``DecodeAttentionFwdOp`` (in-tree or a backend's) is written against.

Kernels see the op's inputs as the call path hands them: contiguous ``q`` (B, S, Hq, D), caches
``k_cache`` and ``v_cache`` (N, L, Hkv, D), or (N, Hkv, L, D) where the call spec's
``cache_layout`` is ``"bhsd"``, ``cache_seqlens`` (B,) int32 and, for a paged cache,
``block_table`` (B, MP) int32 (None for a contiguous one), and ``key_mask`` (B, KP) bool or
None, all on the call's device. The math,
for sequence b, new token s and query head h reading kv head h // (Hq / Hkv)::

    n      = clamp(cache_seqlens[b], 0, capacity)      capacity: L, or MP * L when paged
    seen   = positions p < n, and p <= n - S + s when causal, and p < KP and key_mask[b, p]
             where a key_mask is given
    scores = scale * q[b, s, h] . k[b, p]              over the seen positions p
    lse    = log(sum(exp(scores)))                     -inf where nothing is seen
    o      = sum(exp(scores - lse) * v[b, p])          0 where nothing is seen

where k[b, p] is ``k_cache[b, p]`` contiguous, and ``k_cache[block_table[b, p // L], p % L]``
paged (the entry clamped to [0, N)), each a (Hkv, D) slice (``k_cache[b, :, p]`` and
``k_cache[page, :, p % L]`` in the bhsd layout). A position the key mask hides is not read
either: the cache may hold anything there. No implementation on a device with graphs may read
the lengths on the host: a CUDA call is captured in graphs whose replays change
``cache_seqlens``. (On the CPU, where reading them costs no synchronisation and no graph replays
the call, the in-tree implementation does.)
"""

from __future__ import annotations

import abc
import dataclasses

import torch

from tileops.core import CallSpec, KernelInterface


@dataclasses.dataclass(frozen=True)
class DecodeAttentionCall(CallSpec):
    """The facts of one decode-attention call that select and build its kernel.

    ``page_size`` is the positions of a page when the call is paged and 0 when it is not;
    ``scale`` is the value used (1 / sqrt(head_dim) where the op's param is None);
    ``cache_layout`` is ``"bshd"`` (caches (N, L, Hkv, D)) or ``"bhsd"`` ((N, Hkv, L, D));
    ``masked`` says whether the call passes a ``key_mask``; ``aligned`` whether q's and both
    caches' data pointers are 16-byte aligned (vector loads and bulk copies need it; always True
    on the CPU). The batch, the cache's length and the page count are not part of the spec, so
    that the next decode step, another batch or a longer cache reuses the kernel built.
    """

    dtype: torch.dtype
    heads_q: int
    heads_kv: int
    head_dim: int
    new_tokens: int
    page_size: int
    scale: float
    causal: bool
    cache_layout: str
    masked: bool
    aligned: bool


class DecodeAttentionFwdInterface(KernelInterface):
    call_spec = DecodeAttentionCall

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cache_seqlens: torch.Tensor,
        block_table: torch.Tensor | None,
        key_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(o, lse)``: o of q's shape and dtype, lse (B, Hq, S) float32, computed as the
        module docstring says; on CUDA without reading ``cache_seqlens``, ``block_table`` or
        ``key_mask`` on the host."""
