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
