"""``DecodeAttentionFwdOp``: attention of one or a few new tokens per sequence over a KV cache,
contiguous or paged, as flash-attn's ``flash_attn_with_kvcache`` computes it (without writing
the new keys and values: the caller's cache update does that).

The op builds the call spec from the call's shapes and its params (the scale resolved to
1 / sqrt(D) where it is None) and hands the inputs to the implementation selection picks, as the
call path made them: contiguous, on one device. Nothing here reads ``cache_seqlens`` or
``block_table`` on the host, so a call can be captured in a CUDA graph and replayed with other
lengths. Inference only: the manifest names no backward op.
"""

from __future__ import annotations

import math
from importlib.resources import files

from tileops.core import Op

from .decode_cpu import IMPLEMENTATIONS
from .decode_interfaces import DecodeAttentionFwdInterface


class DecodeAttentionFwdOp(Op):
    """Decode attention over a KV cache:
    ``op(q, k_cache, v_cache, cache_seqlens, block_table=None) -> (o, lse)``."""

    manifest_file = files("tileops.ops") / "manifest" / "attention_decode.yaml"
    kernel_interfaces = (DecodeAttentionFwdInterface,)
    in_tree_kernels = {DecodeAttentionFwdInterface: IMPLEMENTATIONS}
    # The TileLang kernels, imported when an op is first built (the table imports no tilelang).
    kernel_tables = ("tileops.kernels.cuda.attention.decode:KERNELS",)

    def __init__(self, scale: float | None = None, causal: bool = True, *, target: str | None = None) -> None:
        super().__init__(scale=scale, causal=causal, target=target)

    def call_spec(self, interface, device, dtype, heads_q, heads_kv, head_dim, new_tokens, page_size):
        """The call spec of ``kernel_for(interface, device, dtype, heads_q, heads_kv, head_dim,
        new_tokens, page_size)``: forward passes what varies between calls; the scale and the
        causal flag are the instance's."""
        scale = self.params["scale"]
        scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
        return interface.call_spec(
            device, dtype, heads_q, heads_kv, head_dim, new_tokens, page_size, scale, self.params["causal"]
        )

    def call_specs(self, device, inputs):
        """The call spec a call with ``inputs`` (descriptions) gets, built as ``forward`` builds it."""
        q, k_cache = inputs["q"], inputs["k_cache"]
        page_size = k_cache.shape[1] if "block_table" in inputs else 0
        spec = self.call_spec(
            DecodeAttentionFwdInterface, device, q.dtype, q.shape[2], k_cache.shape[2], q.shape[3], q.shape[1], page_size
        )
        return {DecodeAttentionFwdInterface: spec}

    def forward(self, q, k_cache, v_cache, cache_seqlens, block_table):
        page_size = 0 if block_table is None else k_cache.shape[1]
        kernel = self.kernel_for(
            DecodeAttentionFwdInterface, q.device, q.dtype, q.shape[2], k_cache.shape[2], q.shape[3], q.shape[1], page_size
        )
        return kernel.forward(q, k_cache, v_cache, cache_seqlens, block_table)
