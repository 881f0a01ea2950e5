"""The activation family's sugar for the ``tileops`` command: shorthand flags, and the peer
libraries ``tileops bench`` times beside each op.

``--approximate`` sets GELU's and GeGLU's ``approximate`` ("none" or "tanh"); every other param
(the packed ops' ``d``) is set with ``--param NAME=VALUE``.
"""

#: Flag -> the param it sets; its value is read as the manifest declares the param.
PARAM_FLAGS = {"--approximate": "approximate"}

#: Flag -> the optional input it leaves out (the activations have none).
OMIT_FLAGS: dict[str, str] = {}


# -- peers: what ``tileops bench`` times beside each op (the ``bench`` extra installs them) ------
#
# Op -> {column: (the peer's callable as "module:attribute", adapter)}, as in the norm family's
# table. Liger-Kernel's gated functions compute in the inputs' dtype with their own kernels;
# its GeGLU is the tanh approximation only. Their backward writes the gradients into the saved
# inputs' memory (Liger's in-place design), which changes the values the peer reads on the next
# repetition but not the bytes it moves.

LIGER_SWIGLU = "liger_kernel.ops.swiglu:LigerSiLUMulFunction"
LIGER_PACKED_SWIGLU = "liger_kernel.ops.swiglu:LigerFusedGateUpSiLUMulFunction"
LIGER_GEGLU = "liger_kernel.ops.geglu:LigerGELUMulFunction"


def _liger_swiglu(function, inputs, params):
    gate, up = inputs["gate"], inputs["up"]
    return lambda: function.apply(gate, up)


def _liger_packed_swiglu(function, inputs, params):
    x = inputs["x"]
    return lambda: function.apply(x)


def _liger_geglu(function, inputs, params):
    if params.get("approximate", "none") != "tanh":
        return "computes the tanh approximation only"
    gate, up = inputs["gate"], inputs["up"]
    return lambda: function.apply(gate, up)


PEERS = {
    "SwiGLUFwdOp": {"Liger": (LIGER_SWIGLU, _liger_swiglu)},
    "PackedSwiGLUFwdOp": {"Liger": (LIGER_PACKED_SWIGLU, _liger_packed_swiglu)},
    "GeGLUFwdOp": {"Liger": (LIGER_GEGLU, _liger_geglu)},
    "PackedGeGLUFwdOp": {"Liger": (None, "has no packed GeGLU")},
}


# -- the shape sweep: the calls ``tileops bench --sweep`` draws (``tileops.cli.sweep`` says how) --
#
# The MLP activations of published models: the intermediate sizes of gated MLPs (Qwen2.5 0.5B
# to 72B, TinyLlama, Llama 2 and 3, Mistral, Gemma 1 and 2) and of GELU MLPs (BERT, GPT-J),
# none of them a power of two but a few; decode rows (1-64) for about a third of the calls and
# 65 to 16384 tokens otherwise, 2-D or (batch, sequence, width) inputs, the three dtypes, both
# GELU forms. A fifth of the calls take row views (gate and up sliced from a fused gate-up
# projection's output, as a model that keeps one weight for both computes them; the op copies
# such inputs). The packed forms take the fused output itself: [gate | up], twice as wide.

INTERMEDIATE_SIZES = (3072, 4096, 4864, 5632, 8192, 8960, 9216, 11008, 13824, 14336, 16384, 18944, 24576, 27648, 28672,
                      29568, 36864)

_GELU_FORMS = {"approximate": {"none": 1, "tanh": 1}}
_PACKED = {"widths": {2 * size: 1 for size in INTERMEDIATE_SIZES}, "width_params": {"d": 2}}

SWEEP = {
    "widths": {size: 1 for size in INTERMEDIATE_SIZES},
    "rows": {"low": 65, "high": 16384, "decode": 64, "decode_share": 0.35},
    "ranks": {2: 2, 3: 1},
    "dtypes": {"bfloat16": 2, "float16": 1, "float32": 1},
    "strided": {"share": 0.2, "inputs": ("x", "gate", "up")},
    "ops": {
        "SiLUFwdOp": {},
        "GELUFwdOp": {"params": _GELU_FORMS},
        "SwiGLUFwdOp": {},
        "GeGLUFwdOp": {"params": _GELU_FORMS},
        "PackedSwiGLUFwdOp": _PACKED,
        "PackedGeGLUFwdOp": {**_PACKED, "params": _GELU_FORMS},
    },
}
