"""The rope family's sugar for the ``tileops`` command: shorthand flags, and the peer library
``tileops bench`` times beside each op.

``--style`` sets the style ("neox" or "interleaved"); ``rotary_dim`` is set with
``--param rotary_dim=N``.
"""

#: Flag -> the param it sets; its value is read as the manifest declares the param.
PARAM_FLAGS = {"--style": "style"}

#: Flag -> the optional input it leaves out (the rope ops have none).
OMIT_FLAGS: dict[str, str] = {}


# -- peers: what ``tileops bench`` times beside each op (the ``bench`` extra installs them) ------
#
# Op -> {column: (the peer's callable as "module:attribute", adapter)}, as in the norm family's
# table. Liger-Kernel's LigerRopeFunction.apply(q, k, cos, sin) is Hugging Face's Llama rotation:
# q and k as (batch, heads, seq, D) views of (batch, seq, heads, D) memory (ours, transposed: no
# copy), cos and sin as the rows of each token, (batch, seq, D), of which it reads the first half.
# It takes those rows, not a cache and positions: the adapter gathers them once, outside the timed
# call (Liger is timed without the gather). It rotates q and k in place, and its backward the
# incoming gradients: the adapter hands it its own copies of q and k, so the other sides read
# theirs unchanged; the values it rotates again on each repetition change, not the bytes it moves.

LIGER_ROPE = "liger_kernel.ops.rope:LigerRopeFunction"


def _liger_rope(function, inputs, params):
    q, k, cos, sin, position_ids = (inputs[name] for name in ("q", "k", "cos", "sin", "position_ids"))
    if params.get("style", "neox") != "neox":
        return "rotates halves (the neox style) only"
    rotary_dim = params.get("rotary_dim")
    if rotary_dim is not None and rotary_dim != q.shape[-1]:
        return "rotates whole heads only, not a partial rotary_dim"
    if q.dim() != 4:
        return "takes (batch, seq, heads, D) q and k only"
    mine = [t.detach().clone().requires_grad_(t.requires_grad) for t in (q, k)]
    rows = cos[position_ids], sin[position_ids]

    def call():
        q_rot, k_rot = function.apply(mine[0].transpose(1, 2), mine[1].transpose(1, 2), *rows)
        return q_rot.transpose(1, 2), k_rot.transpose(1, 2)

    return call


PEERS = {"RotaryEmbeddingFwdOp": {"Liger": (LIGER_ROPE, _liger_rope)}}
