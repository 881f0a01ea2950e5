"""The norm family's sugar for the ``tileops`` command: shorthand flags, the peer libraries
``tileops bench`` times beside each op, and the calls ``tileops bench --sweep`` draws.

``tileops.cli`` reads these tables and adds each flag to the subcommands that describe a call;
a flag means exactly the ``--param``/``--omit`` it stands for, and applies to this family's ops
only. Without ``--normalized-shape`` the dimensions normalized over follow from ``--shape`` as
the manifest's shape pattern of ``x`` binds them: the last one, as in the first workload.
"""

#: Flag -> the param it sets; its value is read as the manifest declares the param.
PARAM_FLAGS = {"--normalized-shape": "normalized_shape", "--eps": "eps"}

#: Flag -> the optional input it leaves out.
OMIT_FLAGS = {"--no-weight": "weight", "--no-bias": "bias"}


# -- peers: what ``tileops bench`` times beside each op (the ``bench`` extra installs them) ------
#
# Op -> {column: (the peer's callable as "module:attribute", adapter)}. The adapter takes the
# callable, the op's inputs by name and its params, and returns a function of no arguments that
# calls the peer as the op would be called (its outputs in the op's order, differentiable as the
# op is), or a short reason where the peer cannot take the call. A None callable says the
# library has no such op; the adapter is then the reason. Liger-Kernel's functions normalize
# over the last dimension only and take the statistics' dtype from their own casting mode.

# quack (``quack-kernels``, CuTe-DSL kernels for Hopper and Blackwell) exports ``rmsnorm``:
# differentiable, over the last dimension, the residual added first where given (``prenorm=True``
# returns the normalized sum and the sum); its LayerNorm is a forward function only.

LIGER_RMS_NORM = "liger_kernel.ops.rms_norm:LigerRMSNormFunction"
LIGER_LAYER_NORM = "liger_kernel.ops.layer_norm:LigerLayerNormFunction"
LIGER_FUSED_ADD_RMS_NORM = "liger_kernel.ops.fused_add_rms_norm:LigerFusedAddRMSNormFunction"
QUACK_RMS_NORM = "quack:rmsnorm"


def _last_dimension_only(normalized_shape) -> str | None:
    if len(normalized_shape) != 1:
        return f"normalizes over the last dimension only, not {len(normalized_shape)}"
    return None


def _rms_eps(x, eps):
    import torch

    return torch.finfo(x.dtype).eps if eps is None else eps


def _liger_rms_norm(function, inputs, params):
    x, weight = inputs["x"], inputs.get("weight")
    reason = _last_dimension_only(params["normalized_shape"])
    if reason:
        return reason
    eps = _rms_eps(x, params.get("eps"))
    # in_place=False: Liger's default writes dx into the incoming gradient, which the other
    # sides of the comparison read after it; the bytes moved are the same either way.
    return lambda: function.apply(x, weight, eps, 0.0, "llama", False)


def _liger_layer_norm(function, inputs, params):
    x, weight, bias = inputs["x"], inputs.get("weight"), inputs.get("bias")
    reason = _last_dimension_only(params["normalized_shape"])
    if reason:
        return reason
    if weight is None or bias is None:
        return "needs weight and bias"
    return lambda: function.apply(x, weight, bias, params["eps"])


def _liger_fused_add_rms_norm(function, inputs, params):
    x, residual, weight = inputs["x"], inputs["residual"], inputs.get("weight")
    reason = _last_dimension_only(params["normalized_shape"])
    if reason:
        return reason
    if weight is None:
        return "needs a weight"
    eps = _rms_eps(x, params.get("eps"))
    return lambda: function.apply(x, residual, weight, eps, 0.0, "llama", False)


def _quack_rms_norm(function, inputs, params):
    """quack's rmsnorm as RMSNormFwdOp, or (given a residual) as FusedAddRMSNormFwdOp."""
    reason = _last_dimension_only(params["normalized_shape"])
    if reason:
        return reason
    x, weight = inputs["x"], inputs.get("weight")
    keywords = {"eps": _rms_eps(x, params.get("eps"))}
    if "residual" in inputs:
        keywords.update(residual=inputs["residual"], prenorm=True)
    return lambda: function(x, weight, **keywords)


PEERS = {
    "RMSNormFwdOp": {"Liger": (LIGER_RMS_NORM, _liger_rms_norm), "quack": (QUACK_RMS_NORM, _quack_rms_norm)},
    "LayerNormFwdOp": {"Liger": (LIGER_LAYER_NORM, _liger_layer_norm), "quack": (None, "has no differentiable LayerNorm")},
    "FusedAddRMSNormFwdOp": {
        "Liger": (LIGER_FUSED_ADD_RMS_NORM, _liger_fused_add_rms_norm),
        "quack": (QUACK_RMS_NORM, _quack_rms_norm),
    },
    "FusedAddLayerNormFwdOp": {"Liger": (None, "has no fused add+LayerNorm"), "quack": (None, "has no fused add+LayerNorm")},
}


# -- the shape sweep: the calls ``tileops bench --sweep`` draws (``tileops.cli.sweep`` says how) --
#
# The distribution of the calls users make of these ops: the hidden sizes of published models
# (BERT-base 768 to the 18432 of the largest dense ones, many not powers of two) and per-head
# norms of 64, 128 and 256 (query/key norms, for which RMSNorm and LayerNorm run over each head),
# decode rows (1-64) for about a third of the calls and 65 to 65536 rows otherwise, odd or not,
# 2-D inputs mostly and 3-D/4-D (batch, sequence, heads) besides, a quarter of the calls on row
# views of a wider tensor (a slice of a fused projection's output), the three training and
# serving dtypes, and every combination of weight and bias. eps takes its default and another
# common value. Each call's x is capped at 256 MiB, so that every side's buffers fit and the
# sweep runs in minutes.

HIDDEN_SIZES = (768, 1024, 1536, 2048, 2560, 3072, 3584, 4096, 5120, 6144, 7168, 8192, 12288, 14336, 16384, 18432)
HEAD_SIZES = (64, 128, 256)

_HIDDEN = {size: 1 for size in HIDDEN_SIZES}
_HIDDEN_AND_HEADS = {**_HIDDEN, **{size: 1 for size in HEAD_SIZES}}
_WEIGHT = {(): 1, ("weight",): 1}
_WEIGHT_AND_BIAS = {(): 1, ("bias",): 1, ("weight",): 1, ("weight", "bias"): 1}
_RMS_EPS = {"eps": {None: 1, 1e-6: 1}}
_LAYER_EPS = {"eps": {1e-5: 1, 1e-6: 1}}

SWEEP = {
    "widths": _HIDDEN,
    "rows": {"low": 65, "high": 65536, "decode": 64, "decode_share": 0.35},
    "ranks": {2: 2, 3: 1, 4: 1},
    "dtypes": {"bfloat16": 1, "float16": 1, "float32": 1},
    "strided": {"share": 0.25, "inputs": ("x", "residual")},
    "max_bytes": 256 << 20,
    "ops": {
        "RMSNormFwdOp": {"widths": _HIDDEN_AND_HEADS, "omit": _WEIGHT, "params": _RMS_EPS},
        "LayerNormFwdOp": {"widths": _HIDDEN_AND_HEADS, "omit": _WEIGHT_AND_BIAS, "params": _LAYER_EPS},
        "FusedAddRMSNormFwdOp": {"omit": _WEIGHT, "params": _RMS_EPS},
        "FusedAddLayerNormFwdOp": {"omit": _WEIGHT_AND_BIAS, "params": _LAYER_EPS},
    },
}
