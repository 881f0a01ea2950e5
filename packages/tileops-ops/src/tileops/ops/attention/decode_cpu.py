"""Decode attention in plain torch: the CPU implementation, and the fallback on CUDA for the calls
the TileLang kernels refuse (float32 and float64, head sizes they do not take).

On the CPU the scores go through torch's CPU flash kernel (``cpu.py`` says why); on CUDA the
math is the interface's (``decode_interfaces``), written as the manifest's reference writes
it: the pages of a paged cache gathered into each sequence's positions, the cache past each
length zeroed, the scores of every position computed and the positions a row does not see masked out, in float32 (float64 for
float64 inputs), rounded once. It reads no length on the host, so a CUDA call is captured in a
graph like the TileLang kernels' calls; its memory grows with the batch times the cache length,
which suits a reference and a fallback, not serving.
"""

from __future__ import annotations

import torch

from tileops.core import Kernel

from ..compute_dtypes import compute_dtype
from .cpu import TorchAttention, additive_mask, flash_forward
from .interfaces import AttentionCall
from .decode_interfaces import DecodeAttentionCall, DecodeAttentionFwdInterface


def sequence_caches(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor | None, batch: int, cache_layout: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's keys and values as (B, capacity, Hkv, D): the first B rows of contiguous
    caches, or the pages of a paged pool in the order of ``block_table`` (entries clamped to the
    pool); views of bhsd caches with their middle dimensions swapped first."""
    if cache_layout == "bhsd":
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    if block_table is None:
        return k_cache[:batch], v_cache[:batch]
    pages = block_table.long().clamp(0, max(k_cache.shape[0] - 1, 0))
    return k_cache[pages].flatten(1, 2), v_cache[pages].flatten(1, 2)


def _visible_caches(q, k_cache, v_cache, cache_seqlens, block_table, key_mask, causal, cache_layout, longest=None):
    """(keys, values, seen): each sequence's cache as (B, capacity, Hkv, D) with the positions no
    row sees zeroed, and which positions each new token sees, (B, S, capacity) bool. ``longest``
    (the longest length, where the caller read it) cuts the capacity to it."""
    batch, new = q.shape[:2]
    keys, values = sequence_caches(k_cache, v_cache, block_table, batch, cache_layout)
    if longest is not None:
        keys, values = keys[:, :longest], values[:, :longest]
    lengths = cache_seqlens.long().clamp(0, keys.shape[1])[:, None, None]  # (B, 1, 1)
    positions = torch.arange(keys.shape[1], device=q.device)
    seen = positions < lengths  # (B, 1, capacity)
    if key_mask is not None:  # positions past the mask's width are hidden
        capacity = keys.shape[1]
        shown = torch.zeros((batch, capacity), dtype=torch.bool, device=q.device)
        shown[:, : key_mask.shape[1]] = key_mask[:, :capacity]
        seen = seen & shown[:, None, :]
    # The cache past a sequence's length (or hidden by the mask) is not read: whatever it holds
    # (NaN from torch.empty) must not reach a score or the output through a zero weight.
    held = seen[:, 0, :, None, None]
    keys, values = torch.where(held, keys, 0), torch.where(held, values, 0)
    if causal:
        last = lengths - new + torch.arange(new, device=q.device)[:, None]  # (B, S, 1)
        seen = seen & (positions <= last)
    return keys, values, seen.expand(batch, new, keys.shape[1])


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    key_mask: torch.Tensor | None,
    scale: float,
    causal: bool,
    cache_layout: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)`` of the interface's math (see ``decode_interfaces``)."""
    wide = compute_dtype(q.dtype)
    heads_q = q.shape[2]
    keys, values, seen = _visible_caches(q, k_cache, v_cache, cache_seqlens, block_table, key_mask, causal, cache_layout)
    heads_kv = keys.shape[2]
    seen = seen[:, None, None]  # (B, 1, 1, S, capacity)
    grouped = q.to(wide).unflatten(2, (heads_kv, heads_q // heads_kv))  # (B, S, Hkv, G, D)
    scores = torch.einsum("bshgd,blhd->bhgsl", grouped, keys.to(wide)) * scale
    scores = scores.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    weights = torch.where(seen, torch.exp(scores - lse[..., None]), 0.0)
    o = torch.einsum("bhgsl,blhd->bshgd", weights, values.to(wide)).flatten(2, 3)
    return o.to(q.dtype), lse.flatten(1, 2).float()


def flash_decode_attention(q, k_cache, v_cache, cache_seqlens, block_table, key_mask, scale, causal, cache_layout):
    """``decode_attention`` by torch's CPU flash kernel (the one ``scaled_dot_product_attention``
    runs there, GQA as it is), what each token sees given as an additive mask; a row that sees
    nothing comes back with lse 0 and gets -inf. On the CPU the lengths are read on the host, so
    the positions past the longest one (most of a static cache) are not touched at all, and a
    batch whose sequences all hold the same length (no padding) is the dense attention over the
    caches cut to it, with no mask to build (a decode step of 2 x 8 heads over 40 positions:
    90 against 185 us)."""
    lengths = cache_seqlens.tolist()
    longest = max(0, *lengths) if lengths else 0
    if key_mask is None and block_table is None and longest and min(lengths) == longest:
        return _uniform_decode(q, k_cache, v_cache, longest, scale, causal, cache_layout)
    keys, values, seen = _visible_caches(
        q, k_cache, v_cache, cache_seqlens, block_table, key_mask, causal, cache_layout, longest
    )
    if keys.shape[1] == 0:  # the kernel divides by the key count
        return decode_attention(q, k_cache, v_cache, cache_seqlens, block_table, key_mask, scale, causal, cache_layout)
    mask = additive_mask(seen, q.dtype)[:, None]  # (B, 1, S, capacity)
    o, lse = flash_forward(
        q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), 0.0, False, attn_mask=mask, scale=scale
    )
    lse = torch.where(seen.any(-1)[:, None, :], lse, -torch.inf)
    return o.transpose(1, 2).contiguous(), lse.float().contiguous()


def _uniform_decode(q, k_cache, v_cache, length, scale, causal, cache_layout):
    """Decode attention of a batch whose sequences all hold ``length`` positions of contiguous
    caches: the dense CPU attention over the caches cut to that length (its causal mask is the
    decode one, bottom-right aligned)."""
    batch, new, heads_q, head_dim = q.shape
    keys, values = sequence_caches(k_cache, v_cache, None, batch, cache_layout)  # (B, capacity, Hkv, D)
    keys, values = keys[:, :length], values[:, :length]
    dense = TorchAttention(AttentionCall(q.device, q.dtype, head_dim, heads_q, keys.shape[2], causal, None, scale, "bshd"))
    return dense.forward(q, keys, values)


class TorchDecodeAttention(Kernel, DecodeAttentionFwdInterface):
    """Every CPU call; ``general``, so that any narrower implementation a backend adds beats it."""

    devices = frozenset({"cpu"})
    general = True

    def __init__(self, scale: float, causal: bool, cache_layout: str) -> None:
        super().__init__()
        self.scale, self.causal, self.cache_layout = scale, causal, cache_layout

    @classmethod
    def entry_for(cls, call: DecodeAttentionCall):
        settings = (call.scale, call.causal, call.cache_layout)
        return settings, lambda: cls(*settings)

    #: The computation: torch's CPU flash kernel here, the math reference on CUDA.
    attend = staticmethod(flash_decode_attention)

    @torch.no_grad()
    def forward(self, q, k_cache, v_cache, cache_seqlens, block_table, key_mask):
        return self.attend(
            q, k_cache, v_cache, cache_seqlens, block_table, key_mask, self.scale, self.causal, self.cache_layout
        )


class TorchDecodeAttentionCuda(TorchDecodeAttention):
    """The math reference on CUDA: ``general``, so it serves only the calls the TileLang kernels
    refuse."""

    devices = frozenset({"cuda"})
    attend = staticmethod(decode_attention)


#: Key -> class, the in-tree implementations of this package.
IMPLEMENTATIONS = {"torch_cpu": TorchDecodeAttention, "torch_cuda": TorchDecodeAttentionCuda}
