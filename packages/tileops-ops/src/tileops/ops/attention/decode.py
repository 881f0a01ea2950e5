"""``DecodeAttentionFwdOp``: attention of one or a few new tokens per sequence over a KV cache,
contiguous or paged, as flash-attn's ``flash_attn_with_kvcache`` computes it (without writing
the new keys and values: the caller's cache update does that).

The op builds the call spec from the call's shapes and its params (the scale resolved to
1 / sqrt(D) where it is None) and hands the inputs to the implementation selection picks, as the
call path made them: contiguous, on one device. Nothing here reads ``cache_seqlens``,
``block_table`` or ``key_mask`` on the host, so a call can be captured in a CUDA graph and
replayed with other lengths and masks. Inference only: the manifest names no backward op.
"""

from __future__ import annotations

import math
from importlib.resources import files

from tileops.core import Op

from ..vector_access import vector_ready
from .decode_cpu import IMPLEMENTATIONS
from .decode_interfaces import DecodeAttentionFwdInterface


class DecodeAttentionFwdOp(Op):
    """Decode attention over a KV cache:
    ``op(q, k_cache, v_cache, cache_seqlens, block_table=None, key_mask=None) -> (o, lse)``;
    caches (N, L, Hkv, D), or (N, Hkv, L, D) with ``cache_layout="bhsd"``."""

    manifest_file = files("tileops.ops") / "manifest" / "attention_decode.yaml"
    kernel_interfaces = (DecodeAttentionFwdInterface,)
    in_tree_kernels = {DecodeAttentionFwdInterface: IMPLEMENTATIONS}
    # The TileLang kernels, imported when an op is first built (the table imports no tilelang).
    kernel_tables = ("tileops.kernels.cuda.attention.decode:KERNELS",)

    def __init__(
        self, scale: float | None = None, causal: bool = True, *, cache_layout: str = "bshd", target: str | None = None
    ) -> None:
        super().__init__(scale=scale, causal=causal, cache_layout=cache_layout, target=target)
        # Where the caches hold the positions and the kv heads: (N, L, Hkv, D) or (N, Hkv, L, D).
        self._positions_at, self._heads_at = (1, 2) if cache_layout == "bshd" else (2, 1)

    def call_spec(self, interface, device, dtype, heads_q, heads_kv, head_dim, new_tokens, page_size, masked, aligned):
        """The call spec of ``kernel_for(interface, device, dtype, heads_q, heads_kv, head_dim,
        new_tokens, page_size, masked, aligned)``: forward passes what varies between calls; the
        scale, the causal flag and the cache layout are the instance's."""
        p = self.params
        scale = 1.0 / math.sqrt(head_dim) if p["scale"] is None else p["scale"]
        return interface.call_spec(
            device, dtype, heads_q, heads_kv, head_dim, new_tokens, page_size, scale, p["causal"], p["cache_layout"],
            masked, aligned,
        )

    def _fields(self, device, q, k_cache, v_cache, paged: bool, masked: bool) -> tuple:
        """What ``kernel_for`` takes after the interface and the device, from the call's shapes
        and q's and the caches' addresses (tensors, or descriptions of them): vector loads and bulk
        (TMA) copies need 16-byte aligned sources."""
        page_size = k_cache.shape[self._positions_at] if paged else 0
        aligned = vector_ready(device, 0, q.dtype, q, k_cache, v_cache)
        return q.dtype, q.shape[2], k_cache.shape[self._heads_at], q.shape[3], q.shape[1], page_size, masked, aligned

    def call_specs(self, device, inputs):
        """The call spec a call with ``inputs`` (descriptions) gets, built as ``forward`` builds it."""
        fields = self._fields(device, inputs["q"], inputs["k_cache"], inputs["v_cache"], "block_table" in inputs, "key_mask" in inputs)
        return {DecodeAttentionFwdInterface: self.call_spec(DecodeAttentionFwdInterface, device, *fields)}

    def forward(self, q, k_cache, v_cache, cache_seqlens, block_table, key_mask):
        device = q.device
        fields = self._fields(device, q, k_cache, v_cache, block_table is not None, key_mask is not None)
        kernel = self.kernel_for(DecodeAttentionFwdInterface, device, *fields)
        return kernel.forward(q, k_cache, v_cache, cache_seqlens, block_table, key_mask)
