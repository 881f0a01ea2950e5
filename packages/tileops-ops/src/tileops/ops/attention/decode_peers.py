"""The peer libraries ``tileops bench`` times beside ``DecodeAttentionFwdOp`` (``command_line``
merges ``DECODE_PEERS`` into the family's ``PEERS``); each adapter calls its library as a user
would call it for the same decode step.

* torch's ``scaled_dot_product_attention``, pinned to its flash-attention backend, to its cuDNN
  backend, and to its memory-efficient one, the one that takes a boolean mask (a key mask
  becomes one, as transformers' sdpa path passes its static cache's decode mask; the other two
  refuse a key mask): it takes (B, H, S, D) tensors (transposed views of the op's: no copy),
  grouped-query heads through ``enable_gqa`` (flash, cuDNN; the memory-efficient backend takes
  none, so its calls repeat K and V to the query heads, as transformers' sdpa path does where it
  passes a mask), and no per-sequence length. Where every sequence
  of the call has the same length (the manifest's workloads fill the caches) one call reads the
  caches' first ``length`` positions; otherwise it is called once per sequence, as a user
  without a variable-length decode kernel would. A paged cache is gathered into contiguous
  caches once, outside the timed call. Its causal masking is aligned to the top left, so
  several causal new tokens are refused (the op's mask is bottom-right aligned). No backend
  returns lse.
* flash-attn's ``flash_attn_with_kvcache`` takes the op's call as it is (contiguous caches, or a
  paged pool with its block table, pages of a multiple of 256; positions before heads) and
  returns lse.
* FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` (one new token): its page table (indptr,
  page indices, last page lengths) is planned once outside the timed call from the block table
  and the lengths; contiguous caches are pages of the whole cache's length, one per sequence;
  heads-first caches are its ``HND`` layout.

The adapters read the lengths on the host while they set up, never inside the timed call.
"""

from __future__ import annotations

import torch

SDPA = "torch.nn.functional:scaled_dot_product_attention"
FLASH_ATTN_KVCACHE = "flash_attn:flash_attn_with_kvcache"
FLASHINFER_DECODE = "flashinfer:BatchDecodeWithPagedKVCacheWrapper"
#: FlashInfer's float workspace, the size its documentation allocates.
FLASHINFER_WORKSPACE_BYTES = 128 * 1024 * 1024


def _heads_first(params) -> bool:
    return params.get("cache_layout", "bshd") == "bhsd"


def _contiguous_caches(inputs, params):
    """(k, v) as (B, capacity, Hkv, D): the op's own (views of heads-first caches), or a paged
    pool gathered in table order (entries clamped to the pool, as the op reads them)."""
    k_cache, v_cache, table = inputs["k_cache"], inputs["v_cache"], inputs.get("block_table")
    if _heads_first(params):
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    if table is None:
        return k_cache[: inputs["q"].shape[0]], v_cache[: inputs["q"].shape[0]]
    pages = table.long().clamp(0, k_cache.shape[0] - 1)
    return k_cache[pages].flatten(1, 2), v_cache[pages].flatten(1, 2)


def _shown(key_mask, rows: slice, n: int):
    """The attention mask SDPA takes for ``rows`` of a key mask over n positions, (rows, 1, 1, n):
    positions past the mask's width hidden, as the op hides them."""
    shown = torch.zeros((rows.stop - rows.start, n), dtype=torch.bool, device=key_mask.device)
    width = min(n, key_mask.shape[1])
    shown[:, :width] = key_mask[rows, :width]
    return shown[:, None, None, :]


def _sdpa(backend: str, *, takes_masks: bool, groups_heads: bool):
    """The adapter that calls SDPA with only ``backend`` (a ``torch.nn.attention.SDPBackend``
    name) allowed; a key mask becomes its boolean attention mask where ``takes_masks``; grouped
    query heads are passed as they are (``enable_gqa``) where ``groups_heads``, else K and V are
    repeated to the query heads within the timed call."""

    def adapter(function, inputs, params):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q, key_mask = inputs["q"], inputs.get("key_mask")
        if params.get("causal", True) and q.shape[1] > 1:
            return "aligns causal masking to the top left; the op's new tokens are bottom-right aligned"
        if key_mask is not None and not takes_masks:
            return "takes no attention mask"
        keys, values = _contiguous_caches(inputs, params)
        lengths = inputs["cache_seqlens"].clamp(0, keys.shape[1]).tolist()
        chosen = getattr(SDPBackend, backend)
        group = q.shape[2] // keys.shape[2]
        options = {"scale": params.get("scale"), "enable_gqa": groups_heads and group > 1}
        heads_first = q.transpose(1, 2)

        def query_heads(t):  # (B, Hkv, n, D) as the backend takes it
            return t if groups_heads or group == 1 else t.repeat_interleave(group, dim=1)
        if len(set(lengths)) == 1:
            n = lengths[0]
            k, v = keys[:, :n].transpose(1, 2), values[:, :n].transpose(1, 2)
            mask = None if key_mask is None else _shown(key_mask, slice(0, q.shape[0]), n)

            def call():
                with sdpa_kernel(chosen):
                    return function(heads_first, query_heads(k), query_heads(v), attn_mask=mask, **options).transpose(1, 2)

            return call
        per_sequence = [
            (b, keys[b: b + 1, :n].transpose(1, 2), values[b: b + 1, :n].transpose(1, 2),
             None if key_mask is None else _shown(key_mask, slice(b, b + 1), n))
            for b, n in enumerate(lengths)
        ]

        def call_each():
            with sdpa_kernel(chosen):
                return torch.cat([
                    function(heads_first[b: b + 1], query_heads(k), query_heads(v), attn_mask=mask, **options)
                    for b, k, v, mask in per_sequence
                ]).transpose(1, 2)

        return call_each

    return adapter


def _flash_attn(function, inputs, params):
    if inputs.get("key_mask") is not None:
        return "takes no key mask"
    if _heads_first(params):
        return "takes caches with the positions before the heads (bshd) only"
    table = inputs.get("block_table")
    if table is not None and inputs["k_cache"].shape[1] % 256:
        return "takes paged caches with pages of a multiple of 256 positions only"
    options = {
        "cache_seqlens": inputs["cache_seqlens"], "block_table": table, "softmax_scale": params.get("scale"),
        "causal": bool(params.get("causal", True)), "return_softmax_lse": True,
    }
    q, k_cache, v_cache = inputs["q"], inputs["k_cache"], inputs["v_cache"]
    return lambda: function(q, k_cache, v_cache, **options)


def _flashinfer(wrapper_class, inputs, params):
    q, k_cache, v_cache, table = inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs.get("block_table")
    if inputs.get("key_mask") is not None:
        return "takes no key mask"
    if q.shape[1] != 1:
        return "decodes one new token per sequence (its prefill wrapper serves several)"
    layout, page_size = ("HND", k_cache.shape[2]) if _heads_first(params) else ("NHD", k_cache.shape[1])
    lengths = inputs["cache_seqlens"].clamp(0, page_size * (1 if table is None else table.shape[1])).tolist()
    if min(lengths) < 1:
        return "takes sequences of at least one position"
    counts = [-(-n // page_size) for n in lengths]
    rows = range(len(lengths))
    indices = list(rows) if table is None else [p for b in rows for p in table[b, : counts[b]].tolist()]
    indptr = [0]
    for count in counts:
        indptr.append(indptr[-1] + count)
    device = q.device

    def int32(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    workspace = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    heads_q, heads_kv, head_dim = q.shape[2], k_cache.shape[1 if layout == "HND" else 2], q.shape[3]
    wrapper = wrapper_class(workspace, layout, use_tensor_cores=heads_q // heads_kv >= 4)
    wrapper.plan(
        int32(indptr), int32(indices), int32([n - (c - 1) * page_size for n, c in zip(lengths, counts)]),
        heads_q, heads_kv, head_dim, page_size, q_data_type=q.dtype, kv_data_type=k_cache.dtype,
        sm_scale=params.get("scale"),
    )
    rows_q = q[:, 0]

    def call():
        o, lse = wrapper.run(rows_q, (k_cache, v_cache), return_lse=True)
        return o.unsqueeze(1), lse

    return call


DECODE_PEERS = {
    "DecodeAttentionFwdOp": {
        "SDPA flash": (SDPA, _sdpa("FLASH_ATTENTION", takes_masks=False, groups_heads=True)),
        "SDPA cuDNN": (SDPA, _sdpa("CUDNN_ATTENTION", takes_masks=False, groups_heads=True)),
        "SDPA efficient": (SDPA, _sdpa("EFFICIENT_ATTENTION", takes_masks=True, groups_heads=False)),
        "flash-attn": (FLASH_ATTN_KVCACHE, _flash_attn),
        "FlashInfer": (FLASHINFER_DECODE, _flashinfer),
    },
}
