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


# -- the shape sweep: the calls ``tileops bench --sweep`` draws (``tileops.cli.sweep`` says how) --
#
# q's last two dimensions (heads, head size) come with the key heads and the cos/sin tables of a
# model, so each call takes a manifest workload as its template (Llama 3 8B, Llama 2 70B, Qwen2 7B,
# multi-query, GPT-J's partial interleaved rotation, Phi-2's partial one, a small GQA shape) and
# draws the tokens before them: decode batches (1-64 tokens) for about a third of the calls and 65
# to 32768 otherwise, as (batch, seq) or flattened tokens; a quarter of the calls on q and k as
# row views (sliced from a fused qkv projection); q at most 256 MiB.

_FORWARD_TEMPLATES = ("llama3-8b-prefill-4x4096", "llama2-70b-prefill-4x4096", "qwen2-7b-prefill-4x4096", "mqa-1-head",
                      "partial-gptj-256-64", "partial-phi2-80-32", "tokens-3d")
_IN_PLACE_TEMPLATES = ("llama3-8b-prefill-4x4096", "partial-interleaved-10-6", "tokens-3d")

SWEEP = {
    "widths": {},
    "rows": {"low": 65, "high": 32768, "decode": 64, "decode_share": 0.35},
    "ranks": {4: 2, 3: 1},
    "dtypes": {"bfloat16": 2, "float16": 1, "float32": 1},
    "strided": {"share": 0.25, "inputs": ("q", "k")},
    "ops": {
        "RotaryEmbeddingFwdOp": {"templates": {name: 1 for name in _FORWARD_TEMPLATES}, "trailing": 2},
        "RotaryEmbeddingInplaceFwdOp": {"templates": {name: 1 for name in _IN_PLACE_TEMPLATES}, "trailing": 2},
    },
}
