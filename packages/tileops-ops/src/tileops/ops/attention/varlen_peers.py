"""The peer libraries ``tileops bench`` times beside ``VarlenAttentionFwdOp`` (the ``bench`` extra
installs them): flash-attn's ``flash_attn_varlen_func``, which takes the op's packed call as it is
(plus the longest lengths, read from the offsets before the timed call), and torch's
``scaled_dot_product_attention`` called once per sequence, the plain-torch way to attend over a
packed batch. SDPA aligns causal masking to the top left (the op's bottom-right alignment only
where a sequence has as many queries as keys) and has no sliding window without a materialised
mask: it refuses such calls, saying why.
"""

SDPA = "torch.nn.functional:scaled_dot_product_attention"
FLASH_ATTN_VARLEN = "flash_attn:flash_attn_varlen_func"


def _sdpa_per_sequence(function, inputs, params):
    if params.get("window") is not None:
        return "has no sliding window (only through a materialised mask)"
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    bounds_q, bounds_k = inputs["cu_seqlens_q"].tolist(), inputs["cu_seqlens_k"].tolist()
    spans = list(zip(zip(bounds_q, bounds_q[1:]), zip(bounds_k, bounds_k[1:])))
    causal = bool(params.get("causal"))
    if causal and any(q1 - q0 != k1 - k0 for (q0, q1), (k0, k1) in spans):
        return "aligns causal masking to the top left; the op's is bottom-right where S_q != S_k"
    options = {"is_causal": causal, "scale": params.get("scale"), "enable_gqa": q.shape[1] != k.shape[1]}
    # Each sequence as (H, S, D) views of the packed tensors; sequences without queries or keys skipped.
    views = [
        (q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1), v[k0:k1].transpose(0, 1))
        for (q0, q1), (k0, k1) in spans
        if q1 > q0 and k1 > k0
    ]
    return lambda: [function(*view, **options) for view in views]


def _flash_attn_varlen(function, inputs, params):
    cu_q, cu_k = inputs["cu_seqlens_q"], inputs["cu_seqlens_k"]
    longest_q, longest_k = int(cu_q.diff().max()), int(cu_k.diff().max())
    window = params.get("window")
    options = {"causal": bool(params.get("causal")), "softmax_scale": params.get("scale")}
    if window is not None:
        options["window_size"] = (window, -1)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    return lambda: function(q, k, v, cu_q, cu_k, longest_q, longest_k, **options)


VARLEN_PEERS = {
    "VarlenAttentionFwdOp": {
        "SDPA per sequence": (SDPA, _sdpa_per_sequence),
        "flash-attn": (FLASH_ATTN_VARLEN, _flash_attn_varlen),
    },
}
