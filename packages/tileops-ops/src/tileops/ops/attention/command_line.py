"""The attention family's sugar for the ``tileops`` command: shorthand flags, and the peer
libraries ``tileops bench`` times beside each op (``DecodeAttentionFwdOp``'s are in ``decode_peers``,
``VarlenAttentionFwdOp``'s in ``varlen_peers``).

``--causal`` and ``--qkv-layout`` set the params ``causal`` and ``qkv_layout``; ``--param`` sets
``window`` and ``scale``. ``tileops bench`` reports time and bytes; the throughput of an
attention call is its roofline flops (4 B H_q S_q S_k D forward, 10 backward, halved for causal)
over that time.
"""

from .decode_peers import DECODE_PEERS
from .varlen_peers import VARLEN_PEERS

#: Flag -> the param it sets; its value is read as the manifest declares the param.
PARAM_FLAGS = {"--causal": "causal", "--qkv-layout": "qkv_layout"}

#: Flag -> the optional input it leaves out (the forward has none).
OMIT_FLAGS: dict[str, str] = {}


# -- peers: what ``tileops bench`` times beside each op (the ``bench`` extra installs them) ------
#
# Op -> {column: (the peer's callable as "module:attribute", adapter)}, as in the norm family's
# table. torch's scaled_dot_product_attention is timed once per backend, pinned with
# torch.nn.attention.sdpa_kernel: its flash-attention backend and its cuDNN backend. It returns o
# only (no lse), takes (B, H, S, D) (a bshd call is given transposed views), aligns causal
# masking to the top left (the same as the op's bottom-right alignment only where S_q == S_k)
# and has no sliding window without a materialised mask. flash-attn's flash_attn_func takes the
# bshd layout and flash-attn's semantics (bottom-right causal, window_size=(window, -1)).

SDPA = "torch.nn.functional:scaled_dot_product_attention"
FLASH_ATTN = "flash_attn:flash_attn_func"


def _heads_first(inputs, params):
    """q, k, v as (B, H, S, D): the op's tensors in bhsd, transposed views of bshd ones."""
    if params.get("qkv_layout", "bshd") == "bhsd":
        return inputs["q"], inputs["k"], inputs["v"]
    return inputs["q"].transpose(1, 2), inputs["k"].transpose(1, 2), inputs["v"].transpose(1, 2)


def _sdpa(backend: str):
    """The adapter that calls SDPA with only ``backend`` (a ``torch.nn.attention.SDPBackend`` name) allowed."""

    def adapter(function, inputs, params):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if params.get("window") is not None:
            return "has no sliding window (only through a materialised mask)"
        q, k, v = _heads_first(inputs, params)
        if params.get("causal") and q.shape[2] != k.shape[2]:
            return "aligns causal masking to the top left; the op's is bottom-right where S_q != S_k"
        options = {"is_causal": bool(params.get("causal")), "scale": params.get("scale")}
        if q.shape[1] != k.shape[1]:
            options["enable_gqa"] = True
        chosen = getattr(SDPBackend, backend)
        bshd = params.get("qkv_layout", "bshd") == "bshd"

        def call():
            with sdpa_kernel(chosen):
                o = function(q, k, v, **options)
            return o.transpose(1, 2) if bshd else o

        return call

    return adapter


def _flash_attn(function, inputs, params):
    window = params.get("window")
    options = {"causal": bool(params.get("causal")), "softmax_scale": params.get("scale")}
    if window is not None:
        options["window_size"] = (window, -1)
    if params.get("qkv_layout", "bshd") == "bshd":
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        return lambda: function(q, k, v, **options)
    q, k, v = (t.transpose(1, 2) for t in (inputs["q"], inputs["k"], inputs["v"]))
    return lambda: function(q, k, v, **options).transpose(1, 2)


PEERS = {
    "AttentionFwdOp": {
        "SDPA flash": (SDPA, _sdpa("FLASH_ATTENTION")),
        "SDPA cuDNN": (SDPA, _sdpa("CUDNN_ATTENTION")),
        "flash-attn": (FLASH_ATTN, _flash_attn),
    },
    # DecodeAttentionFwdOp's peers (flash_attn_with_kvcache, FlashInfer, SDPA over the caches).
    **DECODE_PEERS,
    # VarlenAttentionFwdOp's peers (flash_attn_varlen_func, SDPA one sequence at a time).
    **VARLEN_PEERS,
}
